"""``teller dataset build RUNS... -o DS``, ``teller dataset merge DS... -o DS``, ``teller dataset resample SRC -o DST``,
``teller dataset recode SRC -o DST``, ``teller dataset nest SRC -o DST --fold K``."""

from __future__ import annotations

from pathlib import Path
from typing import List  # noqa: UP035 (typer reads these annotations)

import typer

from teller.cliutil import new_app

dataset_app = new_app("The labelled step dataset: records, splits, datasheet.")


@dataset_app.callback()
def _group() -> None:
    """The labelled step dataset: records, splits, datasheet."""


@dataset_app.command("build")
def build_cmd(
    runs: List[Path] = typer.Argument(..., help="Run directories, or folders of runs from `teller inject run`."),
    out: Path = typer.Option(..., "-o", "--out", help="Dataset folder to write."),
    seed: int = typer.Option(0, "--seed", help="Seed of the splits."),
    normal_every: int = typer.Option(1, "--normal-every", help="Keep every abnormal step and one other step number in N (1: all)."),
    max_normal: int = typer.Option(None, "--max-normal", help="Keep at most about N other step numbers per run (a larger stride)."),
    force: bool = typer.Option(False, "--force", help="Replace the dataset folder DS if it already exists."),
) -> None:
    """Write step records (vertical and horizontal views), splits and a datasheet."""
    from rich.markup import escape

    from teller.cliutil import console, fresh_dir, progress
    from teller.dataset.build import build_dataset
    from teller.summary import n

    err = console(stderr=True)
    with fresh_dir(out, force, kind="dataset", is_ours=lambda p: (p / "datasheet.json").is_file() or (p / "records.parquet").is_file(),
                   sources=list(runs)), progress(err) as bar:
        task = bar.add_task("runs", total=None)
        s = build_dataset(list(runs), out, seed=seed, normal_every=normal_every, max_normal=max_normal,
                          progress=lambda done, total: bar.update(task, completed=done, total=total))
    views = ", ".join(f"{k} {v:,}" for k, v in sorted(s["by_view"].items(), key=lambda kv: -kv[1]))
    runs_n = len(s["runs"]) if isinstance(s.get("runs"), list) else None
    err.print(f"[green]built[/] {escape(str(out))}: {n(s['records'], 'step record')} ({views})"
              + (f" from {n(runs_n, 'run')}" if runs_n is not None else "")
              + f", {s['abnormal']:,} abnormal (fault prior {s['fault_prior']:.3f})")
    err.print(f"steps: {s['steps']:,} of the {s['steps_recorded']:,} recorded kept ({s['abnormal_steps']:,} abnormal); "
              f"{escape(s['sampling']['rule'])}" if s.get("sampling") else
              f"steps: {s['steps']:,} of the {s['steps_recorded']:,} recorded kept ({s['abnormal_steps']:,} abnormal)")


@dataset_app.command("merge")
def merge_cmd(
    parts: List[Path] = typer.Argument(..., help="Datasets written by `teller dataset build` from disjoint runs, in order."),
    out: Path = typer.Option(..., "-o", "--out", help="Dataset folder to write (not one of the parts)."),
    seed: int = typer.Option(None, "--seed", help="Seed of the splits (default: the parts' seed; needed when they differ)."),
    force: bool = typer.Option(False, "--force", help="Replace the dataset folder DS if it already exists."),
) -> None:
    """Merge datasets built from parts of a campaign into the one a single build over all their runs writes."""
    from rich.markup import escape

    from teller.cliutil import console, fresh_dir, progress
    from teller.dataset.merge import check_parts, merge_datasets
    from teller.summary import n

    err = console(stderr=True)
    check_parts(list(parts), out)  # before fresh_dir: -o naming a part is refused, never replaced
    with fresh_dir(out, force, kind="dataset", is_ours=lambda p: (p / "datasheet.json").is_file() or (p / "records.parquet").is_file()), \
            progress(err) as bar:
        task = bar.add_task("datasets", total=None)
        s = merge_datasets(list(parts), out, seed=seed, progress=lambda done, total: bar.update(task, completed=done, total=total))
    views = ", ".join(f"{k} {v:,}" for k, v in sorted(s["by_view"].items(), key=lambda kv: -kv[1]))
    err.print(f"[green]merged[/] {n(len(parts), 'dataset')} into {escape(str(out))}: {n(s['records'], 'step record')} ({views}) "
              f"from {n(len(s['runs']), 'run')}, {s['abnormal']:,} abnormal (fault prior {s['fault_prior']:.3f}); "
              f"splits recomputed with seed {s['seed']}")


@dataset_app.command("resample")
def resample_cmd(
    src: Path = typer.Argument(..., help="Dataset folder built with every step (no --normal-every/--max-normal)."),
    out: Path = typer.Option(..., "-o", "--out", help="Dataset folder to write (not SRC)."),
    normal_every: int = typer.Option(1, "--normal-every", help="Keep every abnormal step and one other step number in N."),
    max_normal: int = typer.Option(None, "--max-normal", help="Keep at most about N other step numbers per run (a larger stride)."),
    force: bool = typer.Option(False, "--force", help="Replace the dataset folder DST if it already exists."),
) -> None:
    """Thin a dataset that kept every step into the one `teller dataset build` with this sampling writes."""
    from rich.markup import escape

    from teller.cliutil import console, fresh_dir, progress
    from teller.dataset.merge import check_parts
    from teller.dataset.resample import resample_dataset
    from teller.summary import n

    err = console(stderr=True)
    check_parts([src], out)  # before fresh_dir: -o naming SRC is refused, never replaced
    with fresh_dir(out, force, kind="dataset", is_ours=lambda p: (p / "datasheet.json").is_file() or (p / "records.parquet").is_file()), \
            progress(err) as bar:
        task = bar.add_task("runs", total=None)
        s = resample_dataset(src, out, normal_every=normal_every, max_normal=max_normal,
                             progress=lambda done, total: bar.update(task, completed=done, total=total))
    err.print(f"[green]resampled[/] {escape(str(src))} into {escape(str(out))}: {n(s['records'], 'step record')}, "
              f"steps: {s['steps']:,} of the {s['steps_recorded']:,} recorded kept ({s['abnormal_steps']:,} abnormal); "
              f"{escape(s['sampling']['rule'])}")


@dataset_app.command("recode")
def recode_cmd(
    src: Path = typer.Argument(..., help="Dataset folder (written by `teller dataset build`, any subtree format)."),
    out: Path = typer.Option(..., "-o", "--out", help="Dataset folder to write (not SRC)."),
) -> None:
    """Copy a dataset with its subtrees rewritten in the current compact format (checked to read back equal)."""
    from rich.console import Console

    from teller.dataset.codec import CODEC, recode_dataset

    s = recode_dataset(src, out)
    Console(stderr=True).print(f"[green]recoded[/]: {s['rows']} rows in {s['parts']} parts ({CODEC}), "
                               f"subtrees {s['bytes_before'] / 2**20:.1f} MiB -> {s['bytes_after'] / 2**20:.1f} MiB "
                               f"({s['bytes_before'] / max(s['bytes_after'], 1):.2f}x smaller)", highlight=False)


@dataset_app.command("nest")
def nest_cmd(
    src: Path = typer.Argument(..., help="Dataset folder whose mechanism split holds mechanisms out."),
    out: Path = typer.Option(..., "-o", "--out", help="Dataset folder to write (not SRC)."),
    fold: int = typer.Option(0, "--fold", help="Hold out the K-th mechanism (name order) of every category with more than K."),
    force: bool = typer.Option(False, "--force", help="Replace the dataset folder DST if it already exists."),
) -> None:
    """The mechanism split's training part as a dataset, one more mechanism per category held out
    as its test part: a part of faults unseen in training on which to choose a rule's setting."""
    from rich.markup import escape

    from teller.cliutil import console, fresh_dir
    from teller.dataset.merge import check_parts
    from teller.dataset.nest import nest_dataset
    from teller.summary import n

    err = console(stderr=True)
    check_parts([src], out)
    with fresh_dir(out, force, kind="dataset", is_ours=lambda p: (p / "datasheet.json").is_file() or (p / "records.parquet").is_file()):
        s = nest_dataset(src, out, fold=fold)
    err.print(f"[green]nested[/] {escape(str(src))} (fold {fold}) into {escape(str(out))}: {n(s['records'], 'step record')} "
              f"({s['nested']['records_left_out']:,} of the held-out mechanisms left out); held out now: "
              f"{escape(', '.join(s['held_out_mechanisms']))}")


def register(app: typer.Typer) -> None:
    """Add the ``dataset`` group to the ``teller`` app."""
    app.add_typer(dataset_app, name="dataset")
