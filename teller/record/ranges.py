"""The CPU range recorder: NVTX-style push/pop ranges kept in per-thread integer buffers.

The hooks (``teller.record.instrument``) call :func:`push` and :func:`pop` on the engine's own
threads, so the hot path is a few list/array operations: the message is interned to an integer
code once, ``time.perf_counter_ns`` is read, and a closed range is appended to the thread's
``array('q')`` as four int64 (start, end, code, flags). No dict or object is created per range.
Messages that name one range only (``STEP ...``, ``COMM ... seq=N``, anything with ``reqs=``) get
a code of their own that is forgotten once the range is drained, so a long run does not grow the
intern table by one entry per step.

Draining (:meth:`RangeRecorder.drain`) happens on the flusher thread: it copies what each
thread has closed so far and removes exactly that many records, which is safe under the GIL
because appends only ever add at the end. Ranges still open stay on their thread's stack and
are emitted when they close; at process exit (``final=True``) they are emitted with the end time
of the exit and :data:`~teller.rundir.FLAG_TRUNCATED`. A pop without a matching push is ignored
and counted (``unbalanced_pops``).

Only the standard library (and :mod:`teller.record.clock`, which is standard library only) is
imported here; numpy/pyarrow load when the first drain happens, so this module is safe to import
from ``sitecustomize``.
"""

from __future__ import annotations

import itertools
import threading
import time
from array import array
from contextlib import contextmanager
from typing import Any, Iterator

from teller.record import clock

_perf = time.perf_counter_ns

#: codes from here on name one range each (STEP/COMM messages carry ids and sequence numbers, so
#: interning them would grow the table by one entry per step forever); see RangeRecorder._intern
_TRANSIENT_BASE = 1 << 40
_UNIQUE_PREFIXES = ("STEP ", "COMM ")

#: record layout in a thread buffer
_FIELDS = 4  # start_ns (perf), end_ns (perf), code, flags
FLAG_TRUNCATED = 2  # same bit as teller.rundir.FLAG_TRUNCATED (not imported: rundir loads pyarrow)


class _ThreadBuf:
    """One thread's open-range stack and closed-range buffer."""

    __slots__ = ("tid", "name", "stack", "data", "unbalanced", "closed")

    def __init__(self, tid: int, name: str):
        self.tid = tid
        self.name = name
        self.stack: list[int] = []  # code, start, code, start, ...
        self.data = array("q")
        self.unbalanced = 0
        self.closed = 0


class RangeRecorder:
    """Per-process recorder of nested ranges on every thread that pushes one."""

    def __init__(self) -> None:
        self._codes: dict[str, int] = {}
        self._names: list[str] = []
        self._transient: dict[int, str] = {}
        self._transient_ids = itertools.count(_TRANSIENT_BASE)
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._threads: list[_ThreadBuf] = []
        self.emitted = 0
        self.truncated = 0

    # ---- hot path --------------------------------------------------------------------------
    def push(self, msg: str) -> None:
        """Open a range named ``msg`` on the calling thread."""
        try:
            t = self._tls.buf
        except AttributeError:
            t = self._new_thread()
        code = self._codes.get(msg)
        if code is None:
            code = self._intern(msg)
        st = t.stack
        st.append(code)
        st.append(_perf())

    def pop(self) -> None:
        """Close the innermost open range of the calling thread (ignored and counted if none)."""
        end = _perf()
        try:
            t = self._tls.buf
        except AttributeError:
            t = self._new_thread()
        st = t.stack
        if not st:
            t.unbalanced += 1
            return
        start = st.pop()
        code = st.pop()
        t.data.extend((start, end, code, 0))

    def code(self, msg: str) -> int:
        """The code of ``msg`` (interned once), for :meth:`add`."""
        code = self._codes.get(msg)
        return self._intern(msg) if code is None else code

    def add(self, code: int, start: int, end: int, create: bool = False) -> bool:
        """Record a closed range (``time.perf_counter_ns`` times) on the calling thread without
        touching its open-range stack: for callbacks that may interrupt a push or a pop (the
        interpreter's garbage collections). On a thread that never opened a range nothing is
        recorded and False returned (its buffer would be created under a lock the interrupted
        code may hold), unless ``create`` (never from a callback)."""
        t = getattr(self._tls, "buf", None)
        if t is None:
            if not create:
                return False
            t = self._new_thread()
        t.data.extend((start, end, code, 0))
        return True

    @contextmanager
    def range(self, msg: str) -> Iterator[None]:
        """``with recorder.range("FE LlamaMLP"): ...``"""
        self.push(msg)
        try:
            yield
        finally:
            self.pop()

    def depth(self) -> int:
        """Number of ranges open on the calling thread."""
        t = getattr(self._tls, "buf", None)
        return 0 if t is None else len(t.stack) // 2

    # ---- bookkeeping -----------------------------------------------------------------------
    def _new_thread(self) -> _ThreadBuf:
        cur = threading.current_thread()
        t = _ThreadBuf(threading.get_native_id(), cur.name)
        self._tls.buf = t
        with self._lock:
            self._threads.append(t)
        return t

    def _intern(self, msg: str) -> int:
        if msg.startswith(_UNIQUE_PREFIXES) or " reqs=" in msg:
            code = next(self._transient_ids)  # kept until the range is drained, then forgotten
            self._transient[code] = msg
            return code
        with self._lock:
            code = self._codes.get(msg)
            if code is None:
                code = len(self._names)
                self._names.append(msg)
                self._codes[msg] = code
            return code

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's threads and buffers (they belong to the parent)."""
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._threads = []
        self._transient = {}
        self.emitted = 0
        self.truncated = 0

    # ---- draining --------------------------------------------------------------------------
    def drain(self, final: bool = False) -> dict[str, Any] | None:
        """Take the closed ranges of all threads as canonical event columns (τ ns), or None.

        With ``final`` the ranges still open are emitted too, ending now, flagged truncated, and
        removed from their stacks (used at process exit only).
        """
        import numpy as np  # at the first drain, not at interpreter start (module docstring)

        with self._lock:
            threads = list(self._threads)
        parts, tids = [], []
        now = _perf()
        for t in threads:
            d = t.data
            n = len(d)
            if n:
                chunk = d[:n]
                del d[:n]
                arr = np.frombuffer(chunk, dtype=np.int64).reshape(-1, _FIELDS)
                parts.append(arr)
                tids.append(np.full(len(arr), t.tid, dtype=np.int64))
                t.closed += len(arr)
            if final and t.stack:
                st = list(t.stack)
                t.stack.clear()
                opened = np.array(st, dtype=np.int64).reshape(-1, 2)  # (code, start)
                k = len(opened)
                arr = np.column_stack([opened[:, 1], np.full(k, now, np.int64), opened[:, 0],
                                       np.full(k, FLAG_TRUNCATED, np.int64)])
                parts.append(arr)
                tids.append(np.full(k, t.tid, dtype=np.int64))
                self.truncated += k
        if not parts:
            return None
        rec = np.concatenate(parts)
        tid = np.concatenate(tids)
        self.emitted += len(rec)
        codes = rec[:, 2]
        uniq, inv = np.unique(codes, return_inverse=True)
        names, transient = self._names, self._transient  # every code in a buffer is known here
        dictionary = [names[c] if c < _TRANSIENT_BASE else transient.pop(c, "?") for c in uniq.tolist()]
        return {
            "kind": np.full(len(rec), 2, dtype=np.int8),  # KINDS.index("RANGE")
            "name": _dict_array(inv, dictionary),
            "layer": _dict_array(inv, [_layer_of(s) for s in dictionary]),
            "tid": tid,
            "start_ns": clock.perf_to_tau(rec[:, 0]),
            "end_ns": clock.perf_to_tau(rec[:, 1]),
            "flags": rec[:, 3].astype(np.int32),
        }

    def info(self) -> dict[str, Any]:
        """Counts for run.json: ranges emitted, truncated at exit, unbalanced pops, still open."""
        with self._lock:
            threads = list(self._threads)
        return {
            "ranges_emitted": self.emitted,
            "ranges_truncated": self.truncated,
            "unbalanced_pops": sum(t.unbalanced for t in threads),
            "open_ranges": sum(len(t.stack) // 2 for t in threads),
            "pending_ranges": sum(len(t.data) // _FIELDS for t in threads),
            "threads": len(threads),
            "distinct_names": len(self._names),
            "transient_names": len(self._transient),
        }


_LAYER_TAGS = ("STEP", "FE", "BE", "COMM", "RT", "DRV", "K", "MEM", "SYNC", "OTHER")


def _layer_of(msg: str) -> str:
    head = msg.split(" ", 1)[0]
    return head if head in _LAYER_TAGS else ""


def _dict_array(indices, dictionary: list[str]):
    import numpy as np
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(pa.array(np.asarray(indices, dtype=np.int32)),
                                          pa.array(dictionary, pa.string()))


#: the process-wide recorder and its bound hot-path methods
RECORDER = RangeRecorder()
push = RECORDER.push
pop = RECORDER.pop
range = RECORDER.range  # noqa: A001 - mirrors nvtx.range
