"""``teller diagnose`` and ``teller localize fit``: the numeric stage from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional  # noqa: UP035 (typer reads these annotations)

import typer


def _window_ns(window_ms: Optional[float]) -> Optional[int]:
    return None if window_ms is None else max(int(window_ms * 1e6), 1)


def register(app: typer.Typer) -> None:
    """Add ``diagnose`` and the ``localize`` group to the ``teller`` app."""

    @app.command("diagnose")
    def diagnose_cmd(
        run: Path = typer.Argument(..., help="Run directory to diagnose (reconstructed first if needed)."),
        reference: Optional[List[Path]] = typer.Option(None, "--reference", "-r", help="Run(s) of normal operation to compare with (repeat the option for several)."),
        localizer: Optional[Path] = typer.Option(None, "--localizer", help="A fitted localizer from `teller localize fit` (instead of --reference)."),
        out: Optional[Path] = typer.Option(None, "-o", "--out", help="Folder for diagnosis.json and report.html (default: RUN), or a .json file path."),
        html: bool = typer.Option(False, "--html", help="Also write the self-contained report page report.html."),
        window_ms: Optional[float] = typer.Option(None, "--window-ms", help="Window length for runs without STEP ranges or profiler steps (default 100 ms, a tenth of shorter runs)."),
        top: int = typer.Option(10, "--top", help="Steps listed in the summary."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the paths written."),
    ) -> None:
        """Find abnormal steps and the operators behind them: diagnosis.json (+ --html report)."""
        from rich.console import Console

        from teller.report.diagnose import diagnose, print_summary

        err = Console(stderr=True)
        diag = diagnose(run, reference=list(reference or []), localizer=localizer, out=out, html=html,
                        window_ns=_window_ns(window_ms), note=lambda m: err.print(f"[yellow]note[/]: {m}"))
        if not quiet:
            print_summary(diag, Console(), top=top)
        for kind, p in diag["paths"].items():
            err.print(f"[green]wrote[/] {kind}: {p}")

    loc_app = typer.Typer(no_args_is_help=True, help="The numeric localizer: fit it once on reference runs and reuse it.")

    @loc_app.command("fit")
    def fit_cmd(
        reference: List[Path] = typer.Argument(..., help="Run(s) of normal operation (reconstructed first if needed)."),
        out: Path = typer.Option(..., "-o", "--out", help="Artefact to write (.npz)."),
        window_ms: Optional[float] = typer.Option(None, "--window-ms", help="Window length for runs without STEP ranges or profiler steps."),
        max_components: int = typer.Option(4, "--max-components", help="Most Gaussian components per operator family (chosen by BIC)."),
        tail: float = typer.Option(1e-4, "--tail", help="Share of normal instances allowed beyond the outlier radius."),
    ) -> None:
        """Fit the per-family Gaussian mixtures on reference runs and save them as one artefact."""
        from rich.console import Console

        from teller.localize import fit_localizer
        from teller.report.diagnose import ensure_reconstructed

        err = Console(stderr=True)
        for r in reference:
            ensure_reconstructed(r, lambda m: err.print(f"[yellow]note[/]: {m}"), _window_ns(window_ms))
        est = fit_localizer(list(reference), window_ns=_window_ns(window_ms), max_components=max_components, tail=tail)
        out.parent.mkdir(parents=True, exist_ok=True)
        est.save(out)
        x = est.extra_
        err.print(f"[green]localizer[/]: {len(est.families_)} families from {x['reference_instances']} instances in "
                  f"{x['reference_steps']} steps ({', '.join(x['step_rules'])}); reference steps it flags: "
                  f"{x['reference_steps_flagged']}; wrote {out}")

    app.add_typer(loc_app, name="localize")
