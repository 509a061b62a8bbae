"""``teller logs RUN``: parse and align a run's logs on their own (also run by ``teller reconstruct``)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    """Add the ``logs`` command to the ``teller`` app."""

    @app.command("logs")
    def logs(
        run: Path = typer.Argument(..., help="Run directory (reconstructed, for steps.parquet/requests.parquet)."),
        fmt: Optional[str] = typer.Option(None, "--format", help="Force a format preset for the plain log files: vllm, python, transformers, transformers_detail, sglang, iso8601, transformers_default (default: detected per file)."),
        regex: Optional[str] = typer.Option(None, "--regex", help="Your own line regex with named groups ts, level, logger, msg and optionally pid."),
        time_format: Optional[str] = typer.Option(None, "--time-format", help="strptime format of the ts group (e.g. '%Y-%m-%d %H:%M:%S,%f'), or ISO8601 or EPOCH."),
        tolerance_ms: float = typer.Option(5.0, "--tolerance-ms", help="Widen step intervals by this much when aligning by time (raised to 1 s for second-resolution timestamps)."),
        file: Optional[List[Path]] = typer.Option(None, "--file", help="Extra plain log file(s) to read besides RUN/logs/."),
        utc_offset_s: Optional[int] = typer.Option(None, "--utc-offset-s", help="UTC offset (s) of timestamps that carry none (default: run.json clock.utc_offset_s, else this machine's zone)."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print every counter of the summary."),
    ) -> None:
        """Parse logs, mine templates and align each line to (request, step): log_alignment.parquet."""
        from rich.markup import escape

        from teller.cliutil import console
        from teller.logs import align_run
        from teller.summary import counter_lines, logs_lines

        summary = align_run(run, fmt=fmt, regex=regex, time_format=time_format, tolerance_ms=tolerance_ms,
                            files=file or None, utc_offset_s=utc_offset_s)
        con = console(stderr=True)
        for i, line in enumerate(logs_lines(summary)):
            con.print(("[green]logs[/]" + line[4:]) if i == 0 else line)
        for name, f in summary.get("formats", {}).items():
            con.print(f"  {escape(name)}: format {escape(str(f))}")
        for note in summary.get("notes", []):
            con.print(f"  [yellow]note[/]: {escape(str(note))}")
        con.print(f"wrote {escape(str(summary['output']))}")
        if verbose:
            for line in counter_lines("logs", summary):
                con.print(line, markup=False)
