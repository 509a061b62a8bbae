"""The `teller` command: a thin layer over the stage packages (each importable from Python).

Stage modules are imported inside the commands so `teller --help` stays fast and a stage's heavy
dependencies (torch, sklearn) load only when that stage runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional  # noqa: UP035 (typer reads these annotations)

import typer

from teller.cliutil import run_app

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="TELLER: find the root cause of slow or failing LLM inference steps from traces and logs.",
)


@app.command()
def ingest(
    src: Path = typer.Argument(..., help="A Kineto JSON(.gz) file or folder of per-rank files, an Nsight Systems .sqlite export, or a canonical run/events directory."),
    out: Path = typer.Option(..., "-o", "--out", help="Run directory to write."),
    fmt: str = typer.Option("auto", "--format", help="auto | kineto | nsys | canonical"),
) -> None:
    """Turn a trace you already have into a TELLER run directory."""
    from teller.ingest import ingest as do_ingest

    summary = do_ingest(src, out, fmt=fmt)
    _print_summary("ingested", summary)
    _print_warnings(summary.get("warnings") or [], out)


@app.command()
def reconstruct(
    run: Path = typer.Argument(..., help="Run directory."),
    step_pattern: Optional[List[str]] = typer.Option(None, "--step-pattern", help="Extra regex naming STEP ranges in foreign traces (group 'id' = step number, optional group 'reqs')."),
    no_logs: bool = typer.Option(False, "--no-logs", help="Skip log alignment."),
    window_ms: Optional[float] = typer.Option(None, "--window-ms", help="Window length of the fixed-window steps of runs without STEP ranges or profiler steps (default 100 ms, a tenth of shorter runs)."),
) -> None:
    """Rebuild call-chain trees: forest.parquet, steps.parquet, requests.parquet, comm_edges.parquet, log_alignment.parquet."""
    from teller.reconstruct import reconstruct as do_reconstruct

    window = {} if window_ms is None else {"window_ns": max(int(window_ms * 1e6), 1)}
    summary = do_reconstruct(run, step_patterns=step_pattern or None, **window)
    _print_summary("reconstructed", summary)
    _print_warnings(summary.get("warnings") or [], run)
    if not no_logs:
        from teller.logs import align_run

        lsum = align_run(run)
        if lsum.get("lines", 0):
            _print_summary("logs aligned", lsum)


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

    do_show(run, step=step, request=request, depth=depth, max_children=max_children)


@app.command()
def stats(run: Path = typer.Argument(..., help="Run directory.")) -> None:
    """Counts per layer and kind, binding coverage, repairs."""
    from teller.inspect.stats import stats as do_stats

    do_stats(run)


def _print_summary(what: str, summary: dict) -> None:
    from rich.console import Console

    parts = ", ".join(f"{k}={v}" for k, v in summary.items() if not isinstance(v, (dict, list)))
    Console(stderr=True).print(f"[green]{what}[/]: {parts}")


def _print_warnings(warnings: list[str], run: Path, limit: int = 6) -> None:
    """What was damaged, repaired or dropped, in a few plain lines (all of it is in run.json)."""
    if not warnings:
        return
    from rich.console import Console
    from rich.markup import escape

    con = Console(stderr=True, highlight=False, soft_wrap=True)
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
