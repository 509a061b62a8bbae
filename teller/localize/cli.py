"""``teller localize fit``: the numeric localizer, fitted once on reference runs and reused."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional  # noqa: UP035 (typer reads these annotations)

import typer

from teller.cliutil import new_app

localize_app = new_app("The numeric localizer: fit it once on reference runs and reuse it.")


def window_ns(window_ms: Optional[float]) -> Optional[int]:
    """``--window-ms`` as ns (None: the default window); shared with ``teller diagnose``."""
    return None if window_ms is None else max(int(window_ms * 1e6), 1)


@localize_app.command("fit")
def fit_cmd(
    reference: List[Path] = typer.Argument(..., help="Run(s) of normal operation (reconstructed first if needed)."),
    out: Path = typer.Option(..., "-o", "--out", help="Artefact to write (.npz)."),
    window_ms: Optional[float] = typer.Option(None, "--window-ms", help="Window length for runs without STEP ranges or profiler steps, used when a run must be reconstructed first (default 100 ms, a tenth of shorter runs); a reconstructed run keeps its steps: re-run `teller reconstruct RUN --window-ms`."),
    max_components: int = typer.Option(4, "--max-components", help="Most Gaussian components per operator family (chosen by BIC)."),
    tail: float = typer.Option(1e-4, "--tail", help="Share of normal instances allowed beyond the outlier radius."),
    keep_warmup: bool = typer.Option(False, "--keep-warmup", help="Keep the warm-up steps (warm-up requests only, or a process's first 2 steps) in the reference; by default they are left out."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Fit on this many reference steps drawn at random (seeded), every part of the fit then costs what they cost; default: every step (a family of more than 50,000 instances is calibrated on a sample of whole steps either way)."),
) -> None:
    """Fit the per-family Gaussian mixtures on reference runs and save them as one artefact."""
    # imported when the command runs, so `teller --help` does not load sklearn and pyarrow
    from rich.markup import escape

    from teller.cliutil import console
    from teller.localize import fit_localizer
    from teller.reconstruct.ensure import ensure_reconstructed

    err = console(stderr=True)
    for r in reference:
        ensure_reconstructed(r, lambda m: err.print(f"[yellow]note[/]: {escape(str(m))}"))
    est = fit_localizer(list(reference), window_ns=window_ns(window_ms), keep_warmup=keep_warmup,
                        max_steps=max_steps, max_components=max_components, tail=tail)
    out.parent.mkdir(parents=True, exist_ok=True)
    est.save(out)
    x = est.extra_
    err.print(f"[green]localizer[/]: {len(est.families_)} families from {x['reference_instances']} instances in "
              f"{x['reference_steps']} steps ({', '.join(x['step_rules'])}"
              + (f"; {x['reference_warmup_steps']} warm-up steps left out" if x.get("reference_warmup_steps") else "")
              + "); reference steps it flags: "
              f"{x['reference_steps_flagged']}; wrote {escape(str(out))}")


def register(app: typer.Typer) -> None:
    """Add the ``localize`` group to the ``teller`` app."""
    app.add_typer(localize_app, name="localize")
