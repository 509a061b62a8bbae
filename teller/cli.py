"""The `teller` command: a thin layer over the stage packages (each importable from Python).

Stage modules are imported inside the commands so `teller --help` stays fast and a stage's heavy
dependencies (torch, sklearn) load only when that stage runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional  # noqa: UP035 (typer reads these annotations)

import typer

from teller.errors import TellerError

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


@app.command()
def reconstruct(
    run: Path = typer.Argument(..., help="Run directory."),
    step_pattern: Optional[List[str]] = typer.Option(None, "--step-pattern", help="Extra regex naming STEP ranges in foreign traces (group 'id' = step number, optional group 'reqs')."),
    no_logs: bool = typer.Option(False, "--no-logs", help="Skip log alignment."),
) -> None:
    """Rebuild call-chain trees: forest.parquet, requests.parquet, comm_edges.parquet, log_alignment.parquet."""
    from teller.reconstruct import reconstruct as do_reconstruct

    summary = do_reconstruct(run, step_patterns=step_pattern or None)
    _print_summary("reconstructed", summary)
    if not no_logs:
        from teller.logs import align_run

        lsum = align_run(run)
        if lsum.get("lines", 0):
            _print_summary("logs aligned", lsum)


@app.command()
def show(
    run: Path = typer.Argument(..., help="Run directory (reconstructed)."),
    step: Optional[int] = typer.Option(None, "--step", help="Step number (the id= of the STEP range) or step node id."),
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


def _register_optional() -> None:
    """Attach the command groups that live in their stage packages (record, workload, logs)."""
    import importlib

    for mod in ("teller.record.cli", "teller.workload.cli", "teller.logs.cli", "teller.inject.cli",
                "teller.dataset.cli", "teller.tpe.cli", "teller.report.cli", "teller.evaluate.cli"):
        importlib.import_module(mod).register(app)


_register_optional()


def run_app(typer_app: typer.Typer, argv: list[str] | None = None) -> int:
    """Run a typer app the way every TELLER entry point does: the command's exit code passes
    through, a :class:`TellerError` is one line on stderr (exit 2), a usage error is click's own
    message (never a traceback)."""
    try:
        rc = typer_app(args=argv, standalone_mode=False)
    except TellerError as e:
        print(f"teller: error: {e}", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        print("teller: aborted", file=sys.stderr)
        return 130
    except SystemExit as e:  # a command calling sys.exit (teller record passes the child's code on)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except Exception as e:
        # usage errors: typer ships its own copy of click, so match click's exception by shape
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            return e.exit_code
        raise
    # without standalone mode, `raise typer.Exit(n)` comes back as the return value
    return rc if isinstance(rc, int) else 0


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv)


if __name__ == "__main__":
    sys.exit(main())
