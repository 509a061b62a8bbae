"""``teller evaluate DATASET --split ... -o RESULTS``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional  # noqa: UP035 (typer reads these annotations)

import typer


def register(app: typer.Typer) -> None:
    """Add the ``evaluate`` command to the ``teller`` app."""

    @app.command("evaluate")
    def evaluate_cmd(
        dataset: Path = typer.Argument(..., help="Dataset folder (from `teller dataset build`)."),
        split: str = typer.Option("request", "--split", help="request | run | mechanism | workload (or several, comma-separated)."),
        view: str = typer.Option("vertical", "--view", help="vertical | horizontal (or both, comma-separated)."),
        methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated method names (default: the TELLER rows (root-cause model, numeric stage, and the two together: either, the stage screened by the model, the model's flags and the stage's it does not rule out; the stage on each deployment's fault-free runs, and with it the model's flags, the stage's it does not rule out and its episodes, and the rule `teller diagnose --reference` reports) and the classical baselines)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the methods, the step sample and the low-prior repeats."),
        limit_steps: Optional[int] = typer.Option(None, "--limit-steps", help="Evaluate a random sample of this many steps per view."),
        out: Path = typer.Option(..., "-o", "--out", help="Folder for results.json, results.md and the PNG plots."),
        models: Optional[Path] = typer.Option(None, "--models", help="Folder of trained root-cause models (one per sub-folder): each model row takes the one of its variant, inputs and unit trained on the split evaluated (teller_mot_family: the MoT reading engine iterations with the family operator head, default the shipped model, request split of runs/h200_v2_all; teller_mot: the same with the token operator head; teller_mot_step: the MoT reading STEP subtrees)."),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda: where the root-cause model rows predict (bfloat16 on cuda)."),
        part: str = typer.Option("test", "--part", help="test | val: the part of each split scored (val: to choose a rule's setting on held-out steps before the test part is read; its predictions name the split SPLIT/val)."),
        reuse: Optional[list[Path]] = typer.Option(None, "--reuse", help="predictions.parquet of an earlier run on this dataset (repeatable): each method it holds for a split and view is taken from it instead of fitted (e.g. model rows scored on a GPU, the other methods here)."),
    ) -> None:
        """Run every method on the same split and seed; write every metric (JSON, markdown, PNG)."""
        from teller.cliutil import console
        from teller.evaluate.run import evaluate

        con = console(stderr=True)
        cmd = "teller evaluate " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "evaluate" else \
            f"teller evaluate {dataset} --split {split} --view {view}" + (f" --methods {methods}" if methods else "") + \
            f" --seed {seed}" + (f" --limit-steps {limit_steps}" if limit_steps else "") + f" -o {out}" + (f" --models {models}" if models else "") + \
            (f" --device {device}" if device != "cpu" else "") + (f" --part {part}" if part != "test" else "") + \
            "".join(f" --reuse {r}" for r in reuse or [])
        res = evaluate(dataset, [s.strip() for s in split.split(",") if s.strip()], [v.strip() for v in view.split(",") if v.strip()],
                       [m.strip() for m in methods.split(",") if m.strip()] if methods else None, seed=seed,
                       limit_steps=limit_steps, out=out, command=cmd, log=lambda s: con.print(s, highlight=False), models=models,
                       device=device, reuse=reuse, part=part)
        con.print(f"[green]evaluated[/]: {sum('skipped' not in b for b in res['results'])} split×view blocks, "
                  f"{res['seconds']} s, peak RSS {res['peak_rss_mib']} MiB → {out}/results.json, results.md", highlight=False)
