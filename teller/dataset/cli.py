"""``teller dataset build RUNS... -o DS``, ``teller dataset recode SRC -o DST``."""

from __future__ import annotations

from pathlib import Path
from typing import List  # noqa: UP035 (typer reads these annotations)

import typer

dataset_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="The labelled step dataset: records, splits, datasheet.")


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
) -> None:
    """Write step records (vertical and horizontal views), splits and a datasheet."""
    from rich.console import Console

    from teller.dataset.build import build_dataset

    s = build_dataset(list(runs), out, seed=seed, normal_every=normal_every, max_normal=max_normal)
    Console(stderr=True).print(f"[green]dataset[/]: records={s['records']}, abnormal={s['abnormal']}, "
                               f"prior={s['fault_prior']:.3f}, views={s['by_view']}, steps={s['steps']} of {s['steps_recorded']} "
                               f"({s['abnormal_steps']} abnormal)", highlight=False)


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


def register(app: typer.Typer) -> None:
    """Add the ``dataset`` group to the ``teller`` app."""
    app.add_typer(dataset_app, name="dataset")
