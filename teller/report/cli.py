"""``teller diagnose``: the numeric stage end to end from the command line (``teller localize fit``,
which fits the localizer it can reuse, is :mod:`teller.localize.cli`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional  # noqa: UP035 (typer reads these annotations)

import typer

from teller.localize.cli import window_ns


def register(app: typer.Typer) -> None:
    """Add ``diagnose`` to the ``teller`` app."""

    @app.command("diagnose")
    def diagnose_cmd(
        run: Path = typer.Argument(..., help="Run directory to diagnose (reconstructed first if needed)."),
        reference: Optional[List[Path]] = typer.Option(None, "--reference", "-r", help="Run(s) of normal operation to compare with (repeat the option for several). Without --reference or --localizer the run is compared with its own steps (the half the other departs from more, or the whole run when short): a fault present in both halves then goes unseen by the numeric stage."),
        localizer: Optional[Path] = typer.Option(None, "--localizer", help="A fitted localizer from `teller localize fit` (instead of --reference)."),
        out: Optional[Path] = typer.Option(None, "-o", "--out", help="Folder for diagnosis.json and report.html (default: RUN), or a .json file path."),
        html: bool = typer.Option(False, "--html", help="Also write the self-contained report page report.html."),
        window_ms: Optional[float] = typer.Option(None, "--window-ms", help="Window length for runs without STEP ranges or profiler steps, used when a run must be reconstructed first (default 100 ms, a tenth of shorter runs); a reconstructed run keeps its steps: re-run `teller reconstruct RUN --window-ms`."),
        top: int = typer.Option(10, "--top", help="Steps listed in the summary."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the paths written."),
        model: Optional[Path] = typer.Option(None, "--model", help="Root-cause model directory (`teller rca train -o DIR`); default: the one shipped with teller."),
        no_model: bool = typer.Option(False, "--no-model", help="The numeric stage alone: no fault type or explanation."),
        model_reads: str = typer.Option("every", "--model-reads", help="every: the root-cause model reads every step and is read over time (a fault lasts), the numeric stage's lasting departures kept where it flags nothing; flagged: it reads only the steps the numeric stage flags and screens them."),
        model_steps: Optional[int] = typer.Option(None, "--model-steps", min=0, help="At most this many steps get the model's explanation, the most probable (default 48; 0: all); with --model-reads flagged, the model reads at most this many flagged steps, the highest-scored, and the others keep the numeric stage's verdict."),
        full_explanation: bool = typer.Option(False, "--full-explanation", help="Decode the model's explanations to their end (kept in explanation_model), not only until the mechanism the diagnosis uses is written."),
        keep_warmup: bool = typer.Option(False, "--keep-warmup", help="Keep the reference runs' warm-up steps (warm-up requests only, or a process's first 2 steps) in the reference; by default they are left out."),
    ) -> None:
        """Find abnormal steps and the operators behind them: diagnosis.json (+ --html report)."""
        # imported when the command runs, so `teller --help` does not load sklearn and pyarrow
        from rich.markup import escape

        from teller.cliutil import console, status
        from teller.report.diagnose import diagnose, print_summary

        err = console(stderr=True)
        with status(err, f"diagnosing {escape(str(run))} …"):
            diag = diagnose(run, reference=list(reference or []), localizer=localizer, out=out, html=html,
                            window_ns=window_ns(window_ms), note=lambda m: err.print(f"[yellow]note[/]: {escape(str(m))}"),
                            model=False if no_model else model, keep_warmup=keep_warmup, model_steps=model_steps,
                            model_explain="full" if full_explanation else "mechanism", model_reads=model_reads)
        if not quiet:
            print_summary(diag, console(), top=top)
        for kind, p in diag["paths"].items():
            err.print(f"[green]wrote[/] {kind}: {escape(str(p))}")

    @app.command("export")
    def export_cmd(
        run: Path = typer.Argument(..., help="Run directory (reconstructed)."),
        out: Path = typer.Option(..., "-o", "--out", help="Trace file to write (.pftrace for perfetto, .json for chrome)."),
        fmt: str = typer.Option("perfetto", "--format", help="perfetto (protobuf, for the Perfetto UI) | chrome (JSON, for chrome://tracing and Perfetto)."),
        diagnosis: Optional[Path] = typer.Option(None, "--diagnosis", help="A diagnosis.json to mark on the trace (default: RUN/diagnosis.json when it exists)."),
    ) -> None:
        """Write the run as a trace the Perfetto UI or chrome://tracing opens: threads, GPU streams, launch flows, steps, diagnosis."""
        from rich.markup import escape

        from teller.cliutil import console
        from teller.report.export import export_trace

        s = export_trace(run, out, fmt=fmt, diagnosis=diagnosis)
        extra = f", {s['annotated_steps']} flagged steps marked" if s["annotated_steps"] else ""
        console(stderr=True).print(f"[green]wrote[/] {escape(str(s['output']))} ({s['format']}, {s['bytes'] / 1e6:.1f} MB): "
                                   f"{s['slices']} slices on {s['tracks']} tracks, {s['flows']} launch flows{extra}")
