"""The `teller` command: a thin layer over the stage packages (each importable from Python).

Stage modules are imported inside the commands so `teller --help` stays fast and a stage's heavy
dependencies (torch, sklearn) load only when that stage runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional  # noqa: UP035 (typer reads these annotations)

import typer

from teller.cliutil import console, fresh_dir, new_app, run_app, status

app = new_app("TELLER: find the root cause of slow or failing LLM inference steps from traces and logs.")


@app.command()
def ingest(
    src: Path = typer.Argument(..., help="A Kineto JSON(.gz) file or folder of per-rank files, an Nsight Systems .sqlite export, or a canonical run/events directory."),
    out: Path = typer.Option(..., "-o", "--out", help="Run directory to write."),
    fmt: str = typer.Option("auto", "--format", help="auto | kineto | nsys | canonical"),
    force: bool = typer.Option(False, "--force", help="Replace the run directory OUT if it already exists."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print every counter of the summary (all of them are in OUT/run.json)."),
) -> None:
    """Turn a trace you already have into a TELLER run directory."""
    from teller.ingest import ingest as do_ingest
    from teller.summary import ingest_lines

    with fresh_dir(out, force, sources=[src]):
        summary = do_ingest(src, out, fmt=fmt)
    _print_summary("ingest", summary, ingest_lines(summary, str(src), str(out)), verbose)
    _print_warnings(summary.get("warnings") or [], out)


@app.command()
def reconstruct(
    run: Path = typer.Argument(..., help="Run directory."),
    step_pattern: Optional[List[str]] = typer.Option(None, "--step-pattern", help="Extra regex naming STEP ranges in foreign traces (group 'id' = step number, optional group 'reqs')."),
    no_logs: bool = typer.Option(False, "--no-logs", help="Skip log alignment."),
    window_ms: Optional[float] = typer.Option(None, "--window-ms", help="Window length of the fixed-window steps of runs without STEP ranges or profiler steps (default 100 ms, a tenth of shorter runs)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print every counter of the summary (all of them are in RUN/reconstruct.json)."),
) -> None:
    """Rebuild call-chain trees: forest.parquet, steps.parquet, requests.parquet, comm_edges.parquet, log_alignment.parquet."""
    from rich.markup import escape

    from teller.reconstruct import reconstruct as do_reconstruct
    from teller.summary import logs_lines, reconstruct_lines

    window = {} if window_ms is None else {"window_ns": max(int(window_ms * 1e6), 1)}
    err = console(stderr=True)
    with status(err, f"reconstructing {escape(str(run))} …"):
        summary = do_reconstruct(run, step_patterns=step_pattern or None, **window)
    _print_summary("reconstruct", summary, reconstruct_lines(summary, str(run)), verbose)
    _print_warnings(summary.get("warnings") or [], run)
    if not no_logs:
        from teller.logs import align_run

        lsum = align_run(run)
        if lsum.get("lines", 0):
            _print_summary("logs", lsum, logs_lines(lsum), verbose)
            for note in lsum.get("notes") or []:
                err.print(f"[yellow]note[/]: {escape(str(note))}")


@app.command()
def show(
    run: Path = typer.Argument(..., help="Run directory (reconstructed)."),
    step: Optional[int] = typer.Option(None, "--step", help="Step number (the id= of the STEP range, a profiler step's number, a fixed window's index) or STEP node id."),
    request: Optional[str] = typer.Option(None, "--request", help="Show the steps that served this request id."),
    depth: int = typer.Option(6, "--depth", help="Maximum tree depth to print."),
    max_children: int = typer.Option(12, "--max-children", help="Children printed per node before eliding."),
) -> None:
    """Print the call-chain tree of a step or of a request."""
    from teller.inspect.show import show as do_show

    do_show(run, step=step, request=request, depth=depth, max_children=max_children, console=console())


@app.command()
def stats(run: Path = typer.Argument(..., help="Run directory.")) -> None:
    """Counts per layer and kind, binding coverage, repairs."""
    from teller.inspect.stats import stats as do_stats

    do_stats(run, console=console())


def _print_summary(what: str, summary: dict, lines: list[str], verbose: bool = False) -> None:
    """A stage's closing lines in words on stderr; with ``verbose`` every counter after them."""
    from teller.summary import counter_lines

    err = console(stderr=True)
    for i, line in enumerate(lines):
        err.print(("[green]" + line.split(" ", 1)[0] + "[/] " + line.split(" ", 1)[1]) if i == 0 and " " in line else line)
    if verbose:
        for line in counter_lines(what, summary):
            err.print(line, markup=False)


def _print_warnings(warnings: list[str], run: Path, limit: int = 6) -> None:
    """What was damaged, repaired or dropped, in a few plain lines (all of it is in run.json)."""
    if not warnings:
        return
    from rich.markup import escape

    con = console(stderr=True)
    for w in warnings[:limit]:
        con.print(f"[yellow]warning[/]: {escape(str(w))}")
    if len(warnings) > limit:
        con.print(f"[yellow]warning[/]: ... {len(warnings) - limit} more in {escape(str(run / 'run.json'))} (warnings)")


def _register_optional() -> None:
    """Attach the commands that live in their stage packages (record, workload, logs, inject,
    dataset, tpe, localize, diagnose)."""
    import importlib

    for mod in ("teller.record.cli", "teller.workload.cli", "teller.logs.cli", "teller.inject.cli",
                "teller.dataset.cli", "teller.tpe.cli", "teller.localize.cli", "teller.report.cli", "teller.rca.cli",
                "teller.evaluate.cli"):
        importlib.import_module(mod).register(app)


_register_optional()


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv)


if __name__ == "__main__":
    sys.exit(main())
