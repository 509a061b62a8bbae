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
        cupti_decode: Optional[str] = typer.Option(None, "--cupti-decode", help="When the CUPTI collector decodes its activity buffers (TELLER_CUPTI_DECODE). inline (default): in CUPTI's buffer-completed callback, about 2 µs of CPU per record under the engine's GIL, written at every flush. deferred: the callback only copies the buffer; decoding runs when the process stops (exit, SIGTERM, SIGINT), or for the oldest copies once more than TELLER_CUPTI_PENDING_MB (256) are held. A SIGKILLed process then loses every CUPTI record still held, up to the whole recording (hook ranges and logs are kept). objects: cupti-python's record objects, slower."),
        detail_every: Optional[int] = typer.Option(None, "--detail-every", help="Record engine steps in detail (aten-level BE ranges and GPU activity through CUPTI, detached in between with CUDA 12.6 or later) in windows, one starting every K steps. The other steps keep their STEP, FE, COMM and OTHER ranges (iteration, gap, batch context) and are marked detail=0. Default 512 (docs/overhead.md); 1 records every step in detail, which cost 32-44% of a host-bound engine's throughput on the H200."),
        detail_window: Optional[int] = typer.Option(None, "--detail-window", help="Consecutive steps in each detail window (default 8; 1 with --detail-every 1)."),
        flush_interval: float = typer.Option(2.0, "--flush-interval", help="Seconds between buffer flushes in each recorded process (a crash loses at most this much)."),
        force: bool = typer.Option(False, "--force", help="Replace the run directory RUN if it already exists."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print every counter of the summary (all of them are in RUN/run.json)."),
        command: Optional[List[str]] = typer.Argument(None, help="The command to run, after --, e.g. -- python serve.py --port 8000"),
    ) -> None:
        """Run CMD unchanged and record it: hook ranges, GPU activity, logs → RUN."""
        from teller.cliutil import console, fresh_dir
        from teller.record.launcher import record as do_record
        from teller.summary import counter_lines, record_lines

        with fresh_dir(out, force):
            summary = do_record(out, command or [], engine=engine, collector=collector, hooks=hooks,
                                be_depth=be_depth, flush_s=flush_interval, force=force,
                                be_backend=be_backend, cupti_decode=cupti_decode,
                                detail_every=detail_every, detail_window=detail_window)
        err = console(stderr=True)
        for line in record_lines(summary):
            err.print(line)
        if verbose:
            for line in counter_lines("record", summary):
                err.print(line, markup=False)
        sys.exit(summary["exit_code"])
