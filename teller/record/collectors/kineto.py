"""Kineto collector: ``torch.profiler`` as the alternative to the CUPTI collector.

``start()`` starts a ``torch.profiler.profile`` (CPU and, when CUDA is present, CUDA activity;
shapes, stacks and memory off, to keep its cost down); ``stop()`` stops it, exports the Chrome
trace to ``RUN/kineto/<pid>.json`` and converts it with the Kineto reader
(:func:`teller.ingest.kineto.read_kineto`) into canonical events on τ.

Time base: a Kineto event's absolute time is ``ts·1000 + baseTimeNanoseconds`` ns on the wall
clock (checked: the recorded window contains the events). Wall-clock/τ anchor pairs taken at start
and stop map it onto τ (:class:`~teller.record.clock.ClockMap`).

Blind spot: the profiler's CPU-op callbacks are thread-local to the thread that started it. The
transformers continuous-batching loop runs on a background thread, where it records no ``cpu_op``
rows (docs/design.md §12); the CUDA runtime calls and kernels of that thread are still captured (CUPTI
underneath is process-wide), and the STEP/FE/BE ranges come from TELLER's own CPU range recorder,
so trees still form — but the aten-level detail is whatever the hooks record, not Kineto's. The
CUPTI collector has no such blind spot.

Thread ids: Kineto writes the CUDA runtime/driver rows of threads other than the profiling
one with CUPTI's default thread id (``pthread_self()`` cut to 32 bits, seen on the H200), not the
kernel's tid the range recorder uses, so those calls would not nest under the hooks' ranges. The
collector notes ``pthread id → native tid`` for every thread (at start, at each flush and, through
``threading.setprofile``, when a new thread starts) and rewrites those tids after conversion.

If the reader is not importable, or fails, the raw JSON stays in the run directory
(``info()["raw_trace"]``) so ``teller ingest`` can convert it later.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from teller.record.clock import ClockMap, take_anchor
from teller.rundir import EVENT_COLUMNS


class KinetoCollector:
    """Collector over ``torch.profiler`` (see module docstring)."""

    name = "kineto"

    def __init__(self, cuda: bool | None = None, keep_raw: bool | None = None) -> None:
        self.cuda = cuda
        env_keep = os.environ.get("TELLER_KINETO_KEEP_RAW", "")
        self.keep_raw = keep_raw if keep_raw is not None else env_keep not in ("", "0")
        self.sink = None
        self.prof: Any = None
        self.clockmap = ClockMap()
        self.available = False
        self.reason = ""
        self.errors: list[str] = []
        self.raw_trace: str | None = None
        self.summary: dict[str, Any] = {}
        self.events = 0
        self.time_base = ""
        self.activities: list[str] = []
        self._stopped = False
        self._wall0 = self._wall1 = 0
        self.tidmap: dict[int, int] = {}
        self.tids_remapped = 0
        self._profile_hook = False

    def start(self, sink) -> None:
        """Start the profiler now (no schedule: it records until stop())."""
        self.sink = sink
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            cuda = torch.cuda.is_available() if self.cuda is None else self.cuda
            if cuda:
                acts.append(ProfilerActivity.CUDA)
            self.activities = [a.name for a in acts]
            self.prof = profile(activities=acts, record_shapes=False, with_stack=False,
                                profile_memory=False, with_flops=False, with_modules=False)
            self._anchor()
            self._note_threads()
            self._watch_new_threads()
            self._wall0 = time.time_ns()
            self.prof.start()
            self.available = True
        except Exception as e:
            self.reason = f"torch.profiler could not start ({type(e).__name__}: {e})"
            self._error(self.reason)
            self.prof = None

    def flush(self) -> None:
        """Kineto holds everything until stop(); only a clock anchor is taken here."""
        if self.prof is not None and not self._stopped:
            self._anchor()
            self._note_threads()

    def stop(self) -> None:
        """Stop the profiler, export the trace, convert it onto τ; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._profile_hook and threading.getprofile() == self._on_new_thread:
            threading.setprofile(None)
        if self.prof is None:
            return
        self._note_threads()
        try:
            self.prof.stop()
        except Exception as e:
            self._error(f"profiler stop: {type(e).__name__}: {e}")
            return
        self._wall1 = time.time_ns()
        self._anchor()
        path = self._trace_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(path))
            self.raw_trace = str(path)
        except Exception as e:
            self._error(f"export_chrome_trace: {type(e).__name__}: {e}")
            return
        try:
            self._convert(path)
        except Exception as e:
            self._error(f"conversion: {type(e).__name__}: {e}; the raw trace stays at {path} (convert it with `teller ingest`)")
            return
        if not self.keep_raw:
            try:
                path.unlink()
                self.raw_trace = None
            except OSError:
                pass

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "available": self.available, "reason": self.reason,
                "activities": self.activities, "events": self.events, "time_base": self.time_base,
                "threads_noted": len(self.tidmap) // 2, "tids_remapped": self.tids_remapped,
                "raw_trace": self.raw_trace, "reader": self.summary,
                "clock_anchors": self.clockmap.summary(),
                "blind_spot": "CPU ops are recorded only on the thread that started the profiler",
                "errors": list(self.errors)}

    # -- conversion -----------------------------------------------------------------------------

    def _trace_path(self) -> Path:
        base = Path(getattr(getattr(self.sink, "run", None), "path", "."))
        pid = getattr(self.sink, "pid", os.getpid())
        return base / "kineto" / f"{pid}.json"

    def _convert(self, path: Path) -> None:
        try:  # at stop only; when the reader cannot load, the raw trace is kept for `teller ingest`
            from teller.ingest.kineto import read_kineto
        except ImportError as e:
            self.keep_raw = True
            raise RuntimeError(f"Kineto reader unavailable ({e})") from e
        table = read_kineto(path)
        meta = json.loads((table.schema.metadata or {}).get(b"teller.kineto", b"{}"))
        self.summary = {k: meta.get(k) for k in ("counts", "warnings", "clock") if k in meta}
        table = self._to_tau(table, path, int(meta.get("t0_unix_ns") or 0))
        tid, self.tids_remapped = remap_tids(table.column("tid").to_numpy().astype(np.int64), self.tidmap)
        table = table.set_column(table.schema.get_field_index("tid"), "tid", pa.array(tid, pa.int64()))
        cols = {c: table.column(c).combine_chunks() for c in table.column_names if c in EVENT_COLUMNS}
        self.events = table.num_rows
        if self.sink is not None and table.num_rows:
            self.sink.append(cols)

    def _to_tau(self, table: pa.Table, path: Path, t0_unix_ns: int = 0) -> pa.Table:
        """Move the reader's start/end onto τ (it reports them relative to ``t0_unix_ns``)."""
        if table.num_rows == 0:
            self.time_base = "empty"
            return table
        start = table.column("start_ns").to_numpy().astype(np.int64) + t0_unix_ns
        end = table.column("end_ns").to_numpy().astype(np.int64) + t0_unix_ns
        lo, hi = int(start.min()), int(end.max())
        slack = 60_000_000_000
        tau0, tau1 = self.clockmap.tau[0], self.clockmap.tau[-1]
        if self._wall0 - slack <= lo and hi <= self._wall1 + slack:
            self.time_base = "wall"
            start, end = self.clockmap.map(start), self.clockmap.map(end)
        elif tau0 - slack <= lo and hi <= tau1 + slack:
            self.time_base = "tau"  # the reader already mapped onto τ
        else:
            base = _base_time_ns(path)
            if base and self._wall0 - slack <= lo + base <= self._wall1 + slack:
                self.time_base = "relative to baseTimeNanoseconds"
                start, end = self.clockmap.map(start + base), self.clockmap.map(end + base)
            else:
                self.time_base = "unknown (kept as read)"
                self._error(f"Kineto times [{lo}, {hi}] fit neither the wall-clock nor the τ window; kept as read")
        table = table.set_column(table.schema.get_field_index("start_ns"), "start_ns", pa.array(start, pa.int64()))
        return table.set_column(table.schema.get_field_index("end_ns"), "end_ns", pa.array(end, pa.int64()))

    # -- thread ids -----------------------------------------------------------------------------

    def _note_threads(self) -> None:
        try:
            for t in threading.enumerate():
                if t.ident is not None and t.native_id is not None:
                    self.tidmap[t.ident] = t.native_id
                    self.tidmap[t.ident & 0xFFFFFFFF] = t.native_id
        except Exception as e:
            self._error(f"thread ids: {type(e).__name__}: {e}")

    def _on_new_thread(self, frame, event, arg) -> None:
        """Profile hook of threads started while recording: note the ids once, then step aside."""
        sys.setprofile(None)
        ident = threading.get_ident()
        nid = threading.get_native_id()
        self.tidmap[ident] = nid
        self.tidmap[ident & 0xFFFFFFFF] = nid

    def _watch_new_threads(self) -> None:
        if threading.getprofile() is None:  # never displace an engine's own profile hook
            threading.setprofile(self._on_new_thread)
            self._profile_hook = True

    def _anchor(self) -> None:
        try:
            s, t, e = take_anchor(time.time_ns)
            self.clockmap.add(s, t, e)
        except Exception as e:
            self._error(f"clock anchor: {type(e).__name__}: {e}")

    def _error(self, msg: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(msg)


def remap_tids(tid: np.ndarray, mapping: dict[int, int]) -> tuple[np.ndarray, int]:
    """Replace pthread-derived thread ids by native tids; ids that already are native stay."""
    if not mapping or len(tid) == 0:
        return tid, 0
    native = set(mapping.values())
    keys = np.array([k for k in mapping if k not in native], dtype=np.int64)
    if len(keys) == 0:
        return tid, 0
    vals = np.array([mapping[k] for k in keys.tolist()], dtype=np.int64)
    order = np.argsort(keys)
    keys, vals = keys[order], vals[order]
    pos = np.clip(np.searchsorted(keys, tid), 0, len(keys) - 1)
    hit = keys[pos] == tid
    return np.where(hit, vals[pos], tid), int(hit.sum())


def _base_time_ns(path: Path) -> int:
    """``baseTimeNanoseconds`` of a Chrome trace (it sits at the end of torch's exports)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            tail = f.read().decode("utf-8", "replace")
        key = '"baseTimeNanoseconds":'
        i = tail.rfind(key)
        if i >= 0:
            return int(json.loads(tail[i + len(key):].split(",")[0].split("}")[0]))
    except (OSError, ValueError):
        pass
    return 0

