"""``teller tpe train`` and ``teller tpe encode``."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional  # noqa: UP035 (typer reads these annotations)

import typer


def register(app: typer.Typer) -> None:
    """Add the ``tpe`` command group to the ``teller`` app."""
    from teller.cliutil import new_app

    tpe = new_app("Trace Pair Encoding: a structure-preserving tokenizer for call trees.")

    @tpe.command("train")
    def train_cmd(
        corpus: List[Path] = typer.Argument(..., help="Reconstructed run directories (their steps are the training corpus)."),
        out: Path = typer.Option(..., "-o", "--out", help="Directory for vocab.json, merges.json, tokenizer_config.json."),
        vocab_size: int = typer.Option(..., "--vocab-size", help="Target vocabulary size (base symbols and special tokens included)."),
        min_frequency: int = typer.Option(2, "--min-frequency", help="Stop when no pair occurs this often."),
        seed: int = typer.Option(0, "--seed", help="Seed for --max-steps sampling."),
        max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Train on a random sample of this many steps."),
        duration: str = typer.Option("self", "--duration", help="Duration side channel: self (span minus host children) or total (span)."),
        max_token_nodes: Optional[int] = typer.Option(None, "--max-token-nodes", help="No token stands for more nodes than this (default: no limit)."),
    ) -> None:
        """Learn TPE merges from the steps of reconstructed runs."""
        from rich.markup import escape

        from teller.cliutil import console, progress
        from teller.tpe.trainer import train

        con = console(stderr=True)
        with progress(con) as bar:
            task = bar.add_task("merges", total=None)

            def progress(done: int, total: int) -> None:
                if done % 64 == 0 or done == total:
                    bar.update(task, completed=done, total=total)

            tok = train([Path(c) for c in corpus], vocab_size, min_frequency=min_frequency, seed=seed,
                        max_sequences=max_steps, duration=duration, max_token_nodes=max_token_nodes, progress=progress)
        tok.save(out)
        t = tok.meta["training"]
        red = 1 - t["tokens_after"] / t["symbols"] if t["symbols"] and t["sequences_used"] == t["sequences"] else None
        con.print(f"[green]trained[/] {escape(str(out))}: {len(tok):,} tokens ({tok.n_base:,} base symbols, {t['merges']:,} merges) "
                  f"from {t['sequences']:,} steps ({t['distinct_sequences']:,} distinct, {t['symbols']:,} symbols) in {t['seconds']} s")
        con.print((f"the corpus shrinks by {red:.1%}; " if red is not None else "") + f"stopped: {escape(str(t['stop']))}")

    @tpe.command("encode")
    def encode_cmd(
        tokenizer: Path = typer.Argument(..., help="Tokenizer directory (from `teller tpe train`)."),
        run: Path = typer.Argument(..., help="Reconstructed run directory."),
        out: Optional[Path] = typer.Option(None, "-o", "--out", help="Parquet file to write (default RUN/tpe.parquet)."),
    ) -> None:
        """Encode every step of a run: one row per step with input_ids, parent_idx, duration, depth."""
        import numpy as np
        import pyarrow.parquet as pq
        from rich.markup import escape

        from teller.cliutil import console
        from teller.errors import TellerError
        from teller.rundir import RunDir
        from teller.tpe.tokenizer import TraceTokenizer

        tok = TraceTokenizer.load(tokenizer)
        enc = tok.encode_run(run)
        table = enc.to_arrow().rename_columns(["step_id", *enc.to_arrow().column_names[1:]])
        rd = RunDir(run)
        if rd.has_table("steps"):
            # one sequence per row of steps.parquet, in its order (serialize_run); a window step has
            # no node of its own (step_id -1 there), so rows are matched by position, not by id
            steps = rd.read_table("steps").select(["step_id", "step_num"])
            if steps.num_rows != table.num_rows:
                raise TellerError(f"{rd.path / 'steps.parquet'}: {steps.num_rows} steps but {table.num_rows} encoded "
                                  f"sequences; re-run `teller reconstruct {run}`")
            table = table.add_column(1, "step_num", steps.column("step_num"))
        dest = Path(out) if out else rd.path / "tpe.parquet"
        dest.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, dest, compression="zstd")
        n_nodes, n_tok = int(enc.n_nodes.sum()), int(enc.lengths().sum())
        per_step = 1 - enc.lengths() / np.maximum(enc.n_nodes, 1)
        console(stderr=True).print(
            f"[green]encoded[/] {len(enc):,} steps of {escape(str(run))} into {escape(str(dest))}: {n_nodes:,} nodes → {n_tok:,} tokens "
            f"({float(per_step.mean()) if len(enc) else 0:.1%} fewer per step on average, {int(enc.n_unknown.sum()):,} unknown)")

    app.add_typer(tpe, name="tpe")
