"""Reconstruct a run once, when a later stage is handed one that was not reconstructed yet."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq

from teller.reconstruct import reconstruct
from teller.rundir import RunDir


def ensure_reconstructed(run: str | os.PathLike, note: Callable[[str], None] | None = None,
                         window_ns: int | None = None) -> Path:
    """The directory of ``run``, reconstructed first when it has no forest yet, or one written
    before reconstruction decided the steps (no ``step_idx`` column) or the engine iterations
    (no ``iterations.parquet``, hence no GAP rows); ``note`` is told so.

    Reconstruction is the public call behind ``teller reconstruct RUN`` (with ``window_ns`` for
    the fixed-window steps), made once per run: a run already reconstructed is used as it is, so
    its steps are those ``teller reconstruct`` decided (re-run it to change them)."""
    rd = RunDir(run).require()
    forest = rd.path / "forest.parquet"
    stale = forest.is_file() and "step_idx" not in pq.read_schema(forest).names
    no_iter = forest.is_file() and not stale and not rd.has_table("iterations")
    if not forest.is_file() or stale or no_iter or not rd.has_table("steps"):
        if note is not None:
            why = ("its forest.parquet predates steps decided in reconstruction" if stale else
                   "its forest.parquet predates engine iterations (no iterations.parquet)" if no_iter else "no forest.parquet yet")
            note(f"{rd.path}: {why}; running `teller reconstruct {rd.path}` first")
        reconstruct(rd.path, window_ns=window_ns)
    return rd.path
