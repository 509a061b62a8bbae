"""Per-process event sink: buffers canonical columns and writes them as Parquet chunks.

Each flush writes ``events/<pid>-<seq>.parquet`` atomically (write to a temporary name, then
rename), so a crash loses at most what was appended since the last flush and never leaves a
half-written file that readers would choke on. The sink never raises into the recorded process:
a failing write (disk full, directory gone) is counted in ``errors`` and the buffer is dropped,
with the number of lost rows counted in ``dropped_rows``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from teller.rundir import EVENT_COLUMNS, RunDir, events_table


class EventSink:
    """Collects canonical event columns from collectors and the range recorder of one process."""

    def __init__(self, run_dir: str | os.PathLike, pid: int | None = None, node: int = 0, rank: int = 0,
                 flush_rows: int = 200_000):
        self.run = RunDir(run_dir)
        self.pid = os.getpid() if pid is None else pid
        self.node, self.rank = node, rank
        self.flush_rows = flush_rows
        self._lock = threading.Lock()
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._seq = 0
        self.rows_written = 0
        self.dropped_rows = 0
        self.files: list[str] = []
        self.errors: list[str] = []

    def append(self, columns: dict[str, Any]) -> None:
        """Append a batch of events given as canonical columns (numpy arrays or lists).

        ``node``/``rank``/``pid`` default to this process's; times must already be τ ns.
        """
        try:
            n = len(columns["start_ns"])
            if n == 0:
                return
            cols = dict(columns)
            for k, v in (("node", self.node), ("rank", self.rank), ("pid", self.pid)):
                cols.setdefault(k, np.full(n, v, dtype=np.int64))
            table = events_table(cols, n)
        except Exception as e:  # a collector bug must not reach the engine
            self.dropped_rows += len(columns.get("start_ns", ()))
            self._error(f"append: {type(e).__name__}: {e}")
            return
        with self._lock:
            self._pending.append(table)
            self._pending_rows += n
            full = self._pending_rows >= self.flush_rows
        if full:
            self.flush()

    def flush(self) -> None:
        """Write what is pending as one chunk file."""
        with self._lock:
            pending, self._pending, self._pending_rows = self._pending, [], 0
            if not pending:
                return
            seq = self._seq
            self._seq += 1
        try:
            table = pa.concat_tables(pending).unify_dictionaries().combine_chunks()
            path = self.run.write_events(table.select(EVENT_COLUMNS), name=f"{self.pid}-{seq:05d}")
            self.rows_written += table.num_rows
            self.files.append(path.name)
        except Exception as e:
            self.dropped_rows += sum(t.num_rows for t in pending)
            self._error(f"flush: {type(e).__name__}: {e}")

    def close(self) -> None:
        self.flush()

    def _error(self, msg: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(msg)

    def info(self) -> dict[str, Any]:
        return {"rows_written": self.rows_written, "dropped_rows": self.dropped_rows,
                "files": len(self.files), "errors": list(self.errors)}


def sink_dir(run_dir: str | os.PathLike) -> Path:
    return RunDir(run_dir).events_dir
