"""The ``teller record`` command (attached by ``teller.cli._register_optional``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    """Add ``record`` to the ``teller`` app."""

    @app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
    def record(
        out: Path = typer.Option(..., "-o", "--out", help="Run directory to write."),
        engine: str = typer.Option("auto", "--engine", help="auto | transformers | vllm | sglang | generic: which engine hooks to install (auto: every engine, each when imported)."),
        collector: str = typer.Option("auto", "--collector", help="auto | cupti | kineto | cpu | none. auto: cupti when a CUPTI library and a GPU are found, else cpu. cpu: the hooks' ranges only. none: logs and run.json only, nothing in-process."),
        hooks: Optional[Path] = typer.Option(None, "--hooks", help="TOML file of extra hooks: \"module:Qualname.method\" = \"STEP|FE|BE|COMM|OTHER\" (see examples/hooks_example.toml)."),
        be_depth: int = typer.Option(1, "--be-depth", help="Depth of aten-op (BE) ranges inside steps: 0 off, 1 the ops the framework calls, N also their decompositions. See --be-backend for the cost."),
        be_backend: Optional[str] = typer.Option(None, "--be-backend", help="How BE ranges are recorded. dispatch (default): a Python TorchDispatchMode per step, about 5 µs per op, nothing deferred. profiler: PyTorch's profiler, C++ callbacks on every thread, about 0.3 µs per op while serving; its session is stopped and exported every TELLER_BE_PERIOD_S (10 s) of steps and at exit (3-5 µs per op, stalling the step that ends a period) and converted after the run: for bounded recordings (benchmarks, fault campaigns)."),
        flush_interval: float = typer.Option(2.0, "--flush-interval", help="Seconds between buffer flushes in each recorded process (a crash loses at most this much)."),
        force: bool = typer.Option(False, "--force", help="Replace an existing recording in RUN."),
        command: Optional[List[str]] = typer.Argument(None, help="The command to run, after --, e.g. -- python serve.py --port 8000"),
    ) -> None:
        """Run CMD unchanged and record it: hook ranges, GPU activity, logs → RUN."""
        from teller.record.launcher import record as do_record

        summary = do_record(out, command or [], engine=engine, collector=collector, hooks=hooks,
                            be_depth=be_depth, flush_s=flush_interval, force=force,
                            be_backend=be_backend)
        from rich.console import Console

        parts = ", ".join(f"{k}={v}" for k, v in summary.items() if not isinstance(v, (dict, list)))
        Console(stderr=True).print(f"[green]recorded[/]: {parts}", highlight=False)
        sys.exit(summary["exit_code"])
