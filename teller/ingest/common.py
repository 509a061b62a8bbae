"""What every reader shares when it writes a run directory."""

from __future__ import annotations

from pathlib import Path

from teller.errors import TellerError
from teller.rundir import RunDir


def prepare_out(out: Path) -> None:
    """Replace the events of an earlier ``teller ingest`` into ``out``; refuse to mix into a
    run that ingest did not write (a recording), so nothing of the user's is overwritten."""
    rd = RunDir(out)
    old = rd.event_files()
    if not old:
        return
    try:
        reader = rd.read_info().collector.get("reader")
    except TellerError:
        reader = None
    if not reader:
        raise TellerError(
            f"{out}: already holds a run ({len(old)} event files) not written by `teller ingest`; "
            "choose another -o directory"
        )
    for p in old:
        p.unlink()
