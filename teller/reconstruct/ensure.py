"""Reconstruct a run once, when a later stage is handed one that has events but no forest yet."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from teller.reconstruct import reconstruct
from teller.rundir import RunDir


def ensure_reconstructed(run: str | os.PathLike, note: Callable[[str], None] | None = None) -> Path:
    """Reconstruct ``run`` first when it has events but no forest yet (``note`` is told so)."""
    rd = RunDir(run).require()
    if not rd.has_table("forest"):
        if note is not None:
            note(f"{rd.path}: no forest.parquet yet; running `teller reconstruct {rd.path}` first")
        reconstruct(rd.path)
    return rd.path
