"""BE backend over ``torch.profiler``: aten ops recorded by PyTorch's C++ RecordFunction callbacks.

The dispatch backend (:mod:`teller.record.instrument.torch_ops`) sends every aten op of a step
through a Python ``TorchDispatchMode`` (about 4 µs per op). This backend lets PyTorch's own
profiler record the ops instead: a CPU-only ``torch.profiler.profile`` with
``profile_all_threads=True`` (global RecordFunction callbacks, so the engine's background
batching thread is covered) and ``trace_only=True`` where the installed torch has it. Recording
costs about 0.2 µs per op on the recording thread (measured on the CPU machine, torch 2.13); the
price is paid when a profiling session ends: stopping it and exporting its Chrome trace cost
about 2–4 µs per recorded op (C++, holding the GIL), and converting the trace with the Kineto
reader about 6 µs per event (done by ``teller record`` after the process exits).

How it fits the runtime (``runtime.set_be_backend``):

- :meth:`ProfilerBE.enter` runs on the step's thread right after its STEP range opens. The first
  call starts the profiler (not at torch import: the profiler asks CUDA for its device count,
  which must not happen before an engine forks its workers). Each step is bracketed by a
  ``_RecordFunctionFast("teller.step#<n>")`` whose profiler timestamps, paired with τ readings
  taken around it, give per-step clock anchors and the step's window on its thread.
- :meth:`ProfilerBE.exit` closes the bracket. Once the period (``TELLER_BE_PERIOD_S``, default
  10 s; 0 = one session until exit) has passed, the session is cycled there — stopped, exported
  to ``RUN/be/<pid>-<seq>.json``, restarted — which bounds the profiler's memory (about 200
  bytes per op while recording, about 1.4 kB per op while stopping). A cycle stalls the step
  that ends it for the stop and export of everything recorded since the last one.
- :meth:`ProfilerBE.stop` (final flush) exports the last session; the segments are converted
  into canonical RANGE events (:func:`convert_segment`): ``aten::`` cpu_ops inside a step window
  on the step's thread, at most ``depth`` levels of aten ops deep (depth 1 = ops not nested in
  another aten op), named ``BE aten::<op>`` like the dispatch backend's, times mapped onto τ
  through the step anchors. Conversion happens in-process at the final stop, or, when the
  launcher sets ``TELLER_BE_DEFER=1``, in the launcher after the process has exited
  (:func:`convert_run`); counts in and out are reported either way. The launcher's conversion
  also has the process's host ranges (FE, STEP) from its events files: an op the mapping put
  across one of their boundaries, by no more than the mapping's error bound, is moved back with
  its window (:func:`repair_host_nesting`, counted).

CUDA: on a machine with a GPU, Kineto enables CUPTI's RUNTIME, DRIVER and EXTERNAL_CORRELATION
activity and registers its own CUPTI buffer callbacks even for a CPU-only session. With the CUPTI
collector running, the backend hands CUPTI back to it right after each profiler start (its buffer
callbacks registered again, its kinds and API filter re-applied, EXTERNAL_CORRELATION switched
off) and re-enables the collector's kinds right after each profiler stop. Without the CUPTI
collector it switches Kineto's three kinds off again (nothing would read their records). With the
Kineto collector (one profiler per process) the dispatch backend is used.

Failure: when the profiler cannot start (old torch without ``profile_all_threads``, another
profiler already running, any error), one ``[teller]`` line says so and the step falls back to
the dispatch backend (``TELLER_BE_FALLBACK=dispatch``, the default) or to no BE ranges
(``TELLER_BE_FALLBACK=none``). An engine that starts a ``torch.profiler`` of its own while this
backend records will find the profiler busy.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from teller.record import clock
from teller.record.instrument import torch_ops
from teller.record.instrument.base import RecordingRuntime

#: name prefix of the per-step RecordFunction bracket (followed by the window number)
STEP_MARK = "teller.step#"
ENV_PERIOD = "TELLER_BE_PERIOD_S"
ENV_FALLBACK = "TELLER_BE_FALLBACK"
ENV_DEFER = "TELLER_BE_DEFER"
SEGMENT_DIR = "be"
#: seconds between session cycles (0: one session until exit); bounds the profiler's memory
DEFAULT_PERIOD_S = 10.0

# CUpti_ActivityKind values Kineto switches on for a CPU-only session on a CUDA machine
_CUPTI_DRIVER, _CUPTI_RUNTIME, _CUPTI_EXTERNAL_CORRELATION = 4, 5, 39


def experimental_config() -> tuple[Any, dict[str, bool]]:
    """``_ExperimentalConfig(profile_all_threads=True[, trace_only=True])`` for this torch.

    Raises RuntimeError when the installed torch has no ``profile_all_threads`` (the ops of the
    engine's batching thread would then be missed).
    """
    from torch._C._profiler import _ExperimentalConfig

    doc = _ExperimentalConfig.__init__.__doc__ or ""
    if "profile_all_threads" not in doc:
        raise RuntimeError("this torch's profiler has no profile_all_threads option")
    opts = {"profile_all_threads": True}
    if "trace_only" in doc:
        opts["trace_only"] = True
    try:
        cfg = _ExperimentalConfig(**opts)
    except TypeError:
        opts.pop("trace_only", None)
        cfg = _ExperimentalConfig(**opts)
    return cfg, opts


class _Window:
    """One open step bracket on a thread (or a fallback marker)."""

    __slots__ = ("n", "rf", "a", "b", "depth", "fallback")

    def __init__(self, n: int, rf: Any, a: int, b: int, depth: int, fallback: str | None = None):
        self.n, self.rf, self.a, self.b, self.depth, self.fallback = n, rf, a, b, depth, fallback


class ProfilerBE:
    """The profiler BE backend of one process (see module docstring)."""

    name = "profiler"

    def __init__(self, run_dir: str | os.PathLike | None, period_s: float | None = None,
                 defer: bool | None = None, fallback: str | None = None, sink: Any = None,
                 pid: int | None = None, *, runtime: RecordingRuntime) -> None:
        env = os.environ
        #: the recording runtime: messages, torch.compile check, the dispatch fallback's ranges,
        #: and (``runtime.RUNTIME``) the process's CUPTI collector to hand CUPTI back to
        self.rt = runtime
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.period_s = float(env.get(ENV_PERIOD) or DEFAULT_PERIOD_S) if period_s is None else float(period_s)
        self.defer = (env.get(ENV_DEFER, "") not in ("", "0")) if defer is None else defer
        self.fallback = (env.get(ENV_FALLBACK) or "dispatch").lower() if fallback is None else fallback
        self.sink = sink
        self.pid = os.getpid() if pid is None else pid
        self.prof: Any = None
        self.options: dict[str, bool] = {}
        self.started = False
        self.failed = False
        self.stopped = False
        self.reason = ""
        self.errors: list[str] = []
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.steps = 0
        self._rff: Any = None
        self.windows: list[tuple[int, int, int, int, int, int, int]] = []
        self.open_windows = 0
        self.seg_seq = 0
        self.seg_tau0 = 0
        self.segments: list[str] = []
        self.cycles = 0
        self.start_s = self.stop_s = self.export_s = 0.0
        self.cupti: dict[str, Any] = {}
        self.summary: dict[str, Any] = {}

    # ---- the backend pair (runtime.set_be_backend) ----------------------------------------------
    def enter(self, depth: int) -> None:
        """Open a step bracket on this thread (starting the profiler on the first call)."""
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        if depth <= 0 or self.rt.is_compiling():
            stack.append(_Window(-1, None, 0, 0, depth, fallback="off"))
            return
        if not self.started and not self.failed:
            self._start()
        if self.failed or self.stopped:
            stack.append(self._fallback_enter(depth))
            return
        n = next(self._ids)
        self.steps = n + 1
        rf = self._rff(f"{STEP_MARK}{n}")  # built outside the τ bracket: it only widens it
        a = clock.tau_now()
        rf.__enter__()
        b = clock.tau_now()
        with self._lock:
            self.open_windows += 1
        stack.append(_Window(n, rf, a, b, depth))

    def exit(self) -> None:
        """Close the bracket :meth:`enter` opened; cycle the session when the period is over."""
        stack = getattr(self._tls, "stack", None)
        if not stack:
            return
        w = stack.pop()
        if w.fallback is not None:
            if w.fallback == "dispatch":
                torch_ops.be_exit()
            return
        c = clock.tau_now()
        w.rf.__exit__(None, None, None)
        d = clock.tau_now()
        with self._lock:
            self.open_windows -= 1
            self.windows.append((w.n, threading.get_native_id(), w.a, w.b, c, d, w.depth))
            due = (self.period_s > 0 and self.open_windows == 0 and not self.stopped
                   and d - self.seg_tau0 >= self.period_s * 1e9)
        if due:
            self._cycle()

    # ---- lifecycle --------------------------------------------------------------------------------
    def _start(self) -> None:
        with self._lock:
            if self.started or self.failed:
                return
            try:
                from torch._C._profiler import _RecordFunctionFast

                self._rff = _RecordFunctionFast
                self._begin_session()
                self.started = True
            except Exception as e:
                self._fail(f"{type(e).__name__}: {e}")

    def _begin_session(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        cfg, self.options = experimental_config()
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False,
                       profile_memory=False, with_flops=False, with_modules=False,
                       experimental_config=cfg)
        t0 = time.perf_counter()
        prof.start()
        warm = self._rff("teller.warmup")  # the first bracket of a session would be slow
        warm.__enter__()
        warm.__exit__(None, None, None)
        self.start_s += time.perf_counter() - t0
        self.prof = prof
        self.seg_tau0 = clock.tau_now()
        self._after_profiler_start()

    def _end_session(self) -> str | None:
        """Stop the running session and export it; returns the trace path (None on failure)."""
        prof, self.prof = self.prof, None
        if prof is None:
            return None
        t0 = time.perf_counter()
        try:
            prof.stop()
        except Exception as e:
            self._error(f"profiler stop: {type(e).__name__}: {e}")
            return None
        finally:
            self.stop_s += time.perf_counter() - t0
            self._after_profiler_stop()
        windows, self.windows = self.windows, []
        seq, self.seg_seq = self.seg_seq, self.seg_seq + 1
        base = self._segment_base(seq)
        t1 = time.perf_counter()
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
            trace = str(base) + ".json"
            prof.export_chrome_trace(trace)
            side = {"pid": self.pid, "seq": seq, "options": self.options, "windows": windows,
                    "tau0": self.seg_tau0, "tau1": clock.tau_now()}
            tmp = str(base) + ".windows.json.tmp"
            with open(tmp, "w") as f:
                json.dump(side, f)
            os.replace(tmp, str(base) + ".windows.json")
        except Exception as e:
            self._error(f"export: {type(e).__name__}: {e}")
            return None
        finally:
            self.export_s += time.perf_counter() - t1
        self.segments.append(trace)
        return trace

    def _cycle(self) -> None:
        """Stop, export and restart the session (at a step boundary, on the step's thread)."""
        with self._lock:
            if self.stopped or self.prof is None:
                return
            self._end_session()
            self.cycles += 1
            try:
                self._begin_session()
            except Exception as e:
                self._fail(f"restart: {type(e).__name__}: {e}")

    def stop(self) -> None:
        """Final: end the session and convert what was exported (unless the launcher will)."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            if self.prof is not None:
                self._end_session()
        if self.defer or not self.segments:
            return
        try:
            total: dict[str, int] = {}
            for trace in list(self.segments):
                cols, summ = convert_segment(trace)
                merge_counts(total, summ)
                if self.sink is not None and cols is not None:
                    self.sink.append(cols)
                _remove_segment(trace)
            self.summary = total
        except Exception as e:
            self._error(f"conversion: {type(e).__name__}: {e}; segments stay in {SEGMENT_DIR}/ "
                        "(teller record converts them after the process exits)")

    def flush(self) -> None:
        """Periodic flush: nothing to do (cycles happen at step ends)."""

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "started": self.started, "failed": self.failed, "reason": self.reason,
                "fallback": self.fallback, "options": self.options, "period_s": self.period_s,
                "deferred_conversion": self.defer, "segments": len(self.segments), "cycles": self.cycles,
                "steps": self.steps, "start_s": self.start_s, "stop_s": self.stop_s,
                "export_s": self.export_s, "cupti": self.cupti, "conversion": self.summary,
                "errors": list(self.errors)}

    # ---- failure and fallback -------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        self.failed = True
        self.reason = reason
        self.prof = None
        to = "the dispatch backend" if self.fallback == "dispatch" else "no BE ranges"
        self.rt.log(f"BE backend profiler unavailable ({reason}); recording aten ops with {to}", key="be-profiler")

    def _fallback_enter(self, depth: int) -> _Window:
        if self.fallback == "dispatch":
            torch_ops.be_enter(self.rt, depth)
            return _Window(-1, None, 0, 0, depth, fallback="dispatch")
        return _Window(-1, None, 0, 0, depth, fallback="off")

    def _error(self, msg: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(msg)

    def _segment_base(self, seq: int) -> Path:
        base = self.run_dir if self.run_dir is not None else Path(".")
        return base / SEGMENT_DIR / f"{self.pid}-{seq:04d}"

    # ---- CUPTI coordination ---------------------------------------------------------------------
    def _cupti_collector(self) -> Any:
        r = getattr(self.rt, "RUNTIME", None)
        c = getattr(r, "collector", None) if r is not None else None
        if getattr(c, "name", "") == "cupti" and getattr(c, "_active", False):
            return c
        return None

    def _after_profiler_start(self) -> None:
        """Give CUPTI back to the CUPTI collector, or switch Kineto's CUPTI kinds off again."""
        if "torch.cuda" not in sys.modules:
            return
        try:
            import torch

            if not torch.cuda.is_available():
                return
        except Exception:
            return
        coll = self._cupti_collector()
        try:
            if coll is not None:
                reassert_cupti_collector(coll)
                self.cupti["reasserted"] = self.cupti.get("reasserted", 0) + 1
            else:
                n = disable_kineto_cupti_kinds()
                self.cupti["kinds_switched_off"] = n
        except Exception as e:
            self._error(f"CUPTI after profiler start: {type(e).__name__}: {e}")

    def _after_profiler_stop(self) -> None:
        """Kineto's stop switches RUNTIME/DRIVER off: switch the collector's kinds back on."""
        coll = self._cupti_collector()
        if coll is None or self.stopped:
            return
        try:
            cupti = coll._cupti
            for kind in list(getattr(coll, "_enabled", [])):
                cupti.activity_enable(kind)
            self.cupti["reenabled_after_stop"] = self.cupti.get("reenabled_after_stop", 0) + 1
        except Exception as e:
            self._error(f"CUPTI after profiler stop: {type(e).__name__}: {e}")


def reassert_cupti_collector(coll: Any) -> None:
    """Register the CUPTI collector's buffer callbacks again and re-apply its kinds and filter.

    Kineto registers its own buffer callbacks and enables RUNTIME, DRIVER and
    EXTERNAL_CORRELATION when a profiler session starts, even a CPU-only one.
    """
    cupti = coll._cupti
    raw = getattr(coll, "_raw", None)
    if raw is not None:
        raw.register()
    else:
        cupti.activity_register_callbacks(coll._buffer_requested, coll._buffer_completed)
    for kind in list(getattr(coll, "_enabled", [])):
        cupti.activity_enable(kind)
    if getattr(coll, "api_filter", False):
        before = coll.quiet_apis
        coll._quiet(cupti)
        coll.quiet_apis = before
    ext = getattr(cupti.ActivityKind, "EXTERNAL_CORRELATION", None)
    if ext is not None and ext not in getattr(coll, "_enabled", []):
        cupti.activity_disable(ext)


def disable_kineto_cupti_kinds() -> int:
    """Switch off the CUPTI kinds a CPU-only Kineto session enabled (no collector reads them)."""
    path = ""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                i = line.find("/")
                if i >= 0 and "libcupti.so" in line:
                    path = line[i:].strip()
                    break
    except OSError:
        return 0
    if not path:
        return 0
    lib = ctypes.CDLL(path)
    n = 0
    for kind in (_CUPTI_RUNTIME, _CUPTI_DRIVER, _CUPTI_EXTERNAL_CORRELATION):
        if lib.cuptiActivityDisable(ctypes.c_int(kind)) == 0:
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# conversion: exported trace + step windows → canonical BE RANGE events on τ


def _remove_segment(trace: str) -> None:
    for p in (trace, trace[: -len(".json")] + ".windows.json"):
        try:
            os.unlink(p)
        except OSError:
            pass


def convert_segment(trace: str | os.PathLike, host: dict[str, Any] | None = None
                    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Canonical BE RANGE columns of one exported segment, and its counts.

    Keeps ``aten::`` cpu_ops that lie inside a step window on the window's thread, at most the
    window's depth of aten ops deep; maps their times onto τ with the windows' anchors. The
    summary reconciles: ``cpu_ops = kept + outside_steps + too_deep`` over the aten rows, plus
    the non-aten rows and the step brackets seen/matched. The anchors' τ are the midpoints of
    their brackets narrowed by :func:`teller.record.clock.tighten_brackets`; the summary says by
    how much that moved them (``anchor_shift_max_ns``, ``anchors_narrowed``), the half-widths
    before and after (``anchor_err_raw_max_ns``, ``anchor_err_max_ns``: the mapping's error
    bound) and the drift bound used (``anchor_drift_bound_ppm``; None and
    ``anchor_sets_inconsistent`` = 1 when no bound reconciles the brackets, which then stay as
    they are).

    ``host``: the process's own host ranges on τ (``tid``, ``start_ns``, ``end_ns`` arrays: FE,
    STEP, ... as the range recorder wrote them). With them, the ops of a window that straddle a
    host range's boundary by no more than the mapping's error bound are moved back into place
    (:func:`repair_host_nesting`; counted as ``host_ranges``, ``straddles``,
    ``straddles_unrepaired``, ``windows_shifted``, ``nesting_shift_max_ns``).
    """
    # numpy, pyarrow and the Kineto reader load here, at conversion, never in the recorded
    # process's start-up (this module is imported when the runtime installs the BE backend)
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from teller.ingest.kineto import read_kineto

    t_conv = time.perf_counter()
    trace = str(trace)
    side_path = trace[: -len(".json")] + ".windows.json"
    with open(side_path) as f:
        side = json.load(f)
    win = np.array(side["windows"], dtype=np.int64).reshape(-1, 7)  # n, tid, a, b, c, d, depth
    table = read_kineto(trace)
    meta = json.loads((table.schema.metadata or {}).get(b"teller.kineto", b"{}"))
    t0 = int(meta.get("t0_unix_ns") or 0)
    summ: dict[str, Any] = {"rows_in": table.num_rows, "windows": len(win)}
    table = table.filter(pc.equal(table.column("kind").cast(pa.string()), "RANGE"))
    names = table.column("name").combine_chunks()
    if not isinstance(names, pa.DictionaryArray):
        names = names.dictionary_encode()
    dvals = names.dictionary.to_pylist()
    idx = names.indices.to_numpy(zero_copy_only=False)
    is_aten_d = np.array([v.startswith("aten::") for v in dvals], dtype=bool)
    mark_n = np.array([int(v[len(STEP_MARK):]) if v.startswith(STEP_MARK) and v[len(STEP_MARK):].isdigit()
                       else -1 for v in dvals], dtype=np.int64)
    start = table.column("start_ns").to_numpy().astype(np.int64) + t0
    end = table.column("end_ns").to_numpy().astype(np.int64) + t0
    tid = table.column("tid").to_numpy().astype(np.int64)
    aten = is_aten_d[idx] if len(idx) else np.zeros(0, bool)
    marks = np.flatnonzero(mark_n[idx] >= 0) if len(idx) else np.zeros(0, np.int64)
    summ["aten_rows"] = int(aten.sum())
    summ["other_rows"] = int(len(idx) - aten.sum() - len(marks))
    summ["step_marks"] = int(len(marks))
    # match step marks to windows by their number
    pos = {int(n): i for i, n in enumerate(win[:, 0].tolist())}
    mk = [(int(mark_n[idx[i]]), i) for i in marks.tolist()]
    pairs = [(pos[n], i) for n, i in mk if n in pos]
    summ["windows_matched"] = len(pairs)
    empty = {k: 0 for k in ("kept", "outside_steps", "too_deep")}
    if not pairs or not aten.any():
        summ.update(empty)
        summ["outside_steps"] = summ["aten_rows"]
        return None, summ
    wi = np.array([p[0] for p in pairs], np.int64)
    mi = np.array([p[1] for p in pairs], np.int64)
    # clock anchors: (profiler ns, τ) at each bracket's start and end. The profiler's timestamp
    # lies somewhere in its τ bracket, not necessarily in the middle (the work before it in
    # RecordFunction's enter is not the work after it, and a thread can be held up on either
    # side): the midpoint of a bracket alone can be off by half its width, several µs, more than
    # an aten op's distance to the FE range around it. The brackets are narrowed first with what
    # the others allow (the two clocks' offset changes slowly), then their midpoints are used.
    src = np.concatenate([start[mi], end[mi]])
    lo = np.concatenate([win[wi, 2], win[wi, 4]])
    hi = np.concatenate([win[wi, 3], win[wi, 5]])
    lo_t, hi_t, drift_bound = clock.tighten_brackets(src, lo, hi)
    mid_raw = (lo + hi) // 2
    tau = (lo_t + hi_t) // 2
    err = (hi_t - lo_t + 1) // 2
    summ["anchor_err_raw_max_ns"] = int(((hi - lo + 1) // 2).max())
    summ["anchor_shift_max_ns"] = int(np.abs(tau - mid_raw).max())
    summ["anchors_narrowed"] = int(((hi_t - lo_t) < (hi - lo)).sum())
    summ["anchor_drift_bound_ppm"] = drift_bound
    # segments whose brackets no drift bound reconciles (their midpoints are used as they are)
    summ["anchor_sets_inconsistent"] = int(drift_bound is None and len(src) >= 2)
    # consistency of the two clocks: a bracket's length on the profiler's clock vs on τ
    k_len = end[mi] - start[mi]
    t_len = tau[len(wi):] - tau[: len(wi)]
    summ["bracket_len_diff_max_ns"] = int(np.abs(k_len - t_len).max())
    # brackets still loose after narrowing (a lone slow call) would bend the map: keep the tight ones
    tight = err <= max(5_000, 4 * int(np.median(err)))
    if tight.sum() >= 2:
        src, tau, err = src[tight], tau[tight], err[tight]
    summ["anchors_dropped"] = int(len(tight) - len(src))
    order = np.argsort(src, kind="stable")
    cm = clock.ClockMap()
    for s, t, e in zip(src[order].tolist(), tau[order].tolist(), err[order].tolist(), strict=True):
        cm.add(s, t, e)
    summ["anchor_err_max_ns"] = int(err.max())
    summ["clock_drift_ppm"] = cm.drift_ppm()
    # aten rows inside a matched window on the same thread
    ai = np.flatnonzero(aten)
    keep = np.zeros(len(ai), dtype=bool)
    depth_cap = np.zeros(len(ai), dtype=np.int64)
    win_of = np.full(len(ai), -1, dtype=np.int64)  # the matched window each kept op lies in
    w_start, w_end, w_tid, w_depth = start[mi], end[mi], tid[mi], win[wi, 6]
    for t in np.unique(w_tid).tolist():  # per thread (few)
        sel = np.flatnonzero(tid[ai] == t)
        ws = np.flatnonzero(w_tid == t)
        ws = ws[np.argsort(w_start[ws], kind="stable")]
        k = np.searchsorted(w_start[ws], start[ai[sel]], side="right") - 1
        ok = k >= 0
        kk = np.where(ok, k, 0)
        ok &= end[ai[sel]] <= w_end[ws[kk]]
        keep[sel] = ok
        depth_cap[sel] = np.where(ok, w_depth[ws[kk]], 0)
        win_of[sel] = np.where(ok, ws[kk], -1)
    inside = ai[keep]
    lvl = nesting_depth(tid[inside], start[inside], end[inside])
    deep_ok = lvl < depth_cap[keep]
    final = inside[deep_ok]
    summ["kept"] = int(len(final))
    summ["outside_steps"] = int(len(ai) - keep.sum())
    summ["too_deep"] = int(len(inside) - len(final))
    if not len(final):
        return None, summ
    # the profiler's thread ids → the native tids the range recorder uses (noted per window)
    out_tid = tid[final]
    k_tid, w_native = w_tid, win[wi, 1]
    remap = {int(a): int(b) for a, b in zip(k_tid.tolist(), w_native.tolist(), strict=True) if a != b}
    if remap:
        keys = np.array(sorted(remap), np.int64)
        vals = np.array([remap[k] for k in keys.tolist()], np.int64)
        p = np.clip(np.searchsorted(keys, out_tid), 0, len(keys) - 1)
        hit = keys[p] == out_tid
        out_tid = np.where(hit, vals[p], out_tid)
        summ["tids_remapped"] = int(hit.sum())
    out_start, out_end = cm.map(start[final]), cm.map(end[final])
    if host is not None:
        h_tid = np.asarray(host["tid"], np.int64)
        summ["host_ranges"] = int(len(h_tid))
        out_start, out_end, fix = repair_host_nesting(
            out_tid, out_start, out_end, win_of[keep][deep_ok], h_tid,
            np.asarray(host["start_ns"], np.int64), np.asarray(host["end_ns"], np.int64), summ["anchor_err_max_ns"])
        summ.update(fix)
    summ["convert_us"] = int((time.perf_counter() - t_conv) * 1e6)
    d_codes, d_inv = np.unique(idx[final], return_inverse=True)
    dictionary = ["BE " + dvals[c] for c in d_codes.tolist()]
    n = len(final)
    cols = {
        "kind": np.full(n, 2, dtype=np.int8),  # RANGE
        "name": pa.DictionaryArray.from_arrays(pa.array(d_inv.astype(np.int32)), pa.array(dictionary, pa.string())),
        "layer": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["BE"], pa.string())),
        "pid": np.full(n, int(side.get("pid", -1)), dtype=np.int64),
        "tid": out_tid,
        "start_ns": out_start,
        "end_ns": out_end,
        "flags": np.zeros(n, dtype=np.int32),
    }
    return cols, summ


_FAR = 1 << 62


def repair_host_nesting(tid: Any, start: Any, end: Any, group: Any, host_tid: Any, host_start: Any,
                        host_end: Any, tol_ns: int) -> tuple[Any, Any, dict[str, int]]:
    """Move converted ops that straddle a host range's boundary by at most ``tol_ns`` back into place.

    On one thread an aten op and a host range (an FE module, the step) nest: a host range's
    push or pop never happens inside an aten op unless the whole range does (a Python op
    running a module). A boundary found inside a converted op with the range's other end
    outside it is therefore the clock mapping's error, at most its error bound ``tol_ns``. The
    op goes to the nearer side of the boundary (inside the range or clear of it). All ops of one
    ``group`` (a step window: one set of anchors, one error) move by the same shift, the smallest
    that clears every straddle of the group without making a new one or pulling an op across
    any other host boundary, so durations and the ops' nesting among themselves are kept. A
    group with no such shift within ``tol_ns``, or a straddle deeper than ``tol_ns``, stays as
    it is and is counted in ``straddles_unrepaired``.

    Returns the new start and end arrays and the counts ``straddles``, ``straddles_unrepaired``,
    ``windows_shifted`` and ``nesting_shift_max_ns``.
    """
    import numpy as np

    tid = np.asarray(tid, np.int64)
    start = np.asarray(start, np.int64)
    end = np.asarray(end, np.int64)
    group = np.asarray(group, np.int64)
    host_tid = np.asarray(host_tid, np.int64)
    out = {"straddles": 0, "straddles_unrepaired": 0, "windows_shifted": 0, "nesting_shift_max_ns": 0}
    shift = np.zeros(len(start), np.int64)
    for t in np.intersect1d(np.unique(tid), np.unique(host_tid)).tolist():
        sel = np.flatnonzero(tid == t)
        hm = host_tid == t
        hs = np.asarray(host_start, np.int64)[hm]
        he = np.asarray(host_end, np.int64)[hm]
        bounds = np.sort(np.concatenate([hs, he]))
        by_s, by_e = np.argsort(hs, kind="stable"), np.argsort(he, kind="stable")
        hs_sorted, he_sorted = hs[by_s], he[by_e]
        s, e = start[sel], end[sel]
        i0 = np.searchsorted(bounds, s, side="right")  # boundaries ≤ start: [0, i0)
        i1 = np.searchsorted(bounds, e, side="left")  # boundaries ≥ end: [i1, n)
        # the shift each op allows: not past the nearest host boundary on either side
        lo = np.where(i0 > 0, bounds[np.maximum(i0 - 1, 0)] - s, -_FAR)
        hi = np.where(i1 < len(bounds), bounds[np.minimum(i1, len(bounds) - 1)] - e, _FAR)
        need = np.zeros(len(sel), np.int64)  # straddles each op has (within tol_ns)
        for k in np.flatnonzero(i1 > i0).tolist():  # the few ops with a host boundary inside
            a, b = int(s[k]), int(e[k])
            st_in = by_s[np.searchsorted(hs_sorted, a, "right"):np.searchsorted(hs_sorted, b, "left")]
            en_in = by_e[np.searchsorted(he_sorted, a, "right"):np.searchsorted(he_sorted, b, "left")]
            both = np.intersect1d(st_in, en_in)  # ranges wholly inside the op stay inside it
            if len(both):
                lo[k] = max(int(lo[k]), int(he[both].max()) - b)
                hi[k] = min(int(hi[k]), int(hs[both].min()) - a)
            cut = np.concatenate([hs[np.setdiff1d(st_in, en_in)], he[np.setdiff1d(en_in, st_in)]])
            for p in cut.tolist():
                right, left = p - a, b - p  # start at the boundary, or end there
                out["straddles"] += 1
                if min(right, left) > tol_ns:
                    out["straddles_unrepaired"] += 1
                    continue
                need[k] += 1
                if right <= left:
                    lo[k] = max(int(lo[k]), right)
                else:
                    hi[k] = min(int(hi[k]), -left)
        g = group[sel]
        for w in np.unique(g[need > 0]).tolist():  # the groups with something to repair
            m = g == w
            g_lo, g_hi = int(lo[m].max()), int(hi[m].min())
            d = min(max(0, g_lo), g_hi)
            if g_lo > g_hi or abs(d) > tol_ns:
                out["straddles_unrepaired"] += int(need[m].sum())
                continue
            shift[sel[m]] = d
            out["windows_shifted"] += 1
            out["nesting_shift_max_ns"] = max(out["nesting_shift_max_ns"], abs(d))
    return start + shift, end + shift, out


def nesting_depth(tid: Any, start: Any, end: Any) -> Any:
    """How many of the given intervals enclose each one on the same thread (0 = outermost).

    A sweep over start (+1) and end (−1) events sorted by (thread, time), ends before starts at
    the same instant except an interval's own end, and a parent before its child when both start
    together; the running sum just before an interval's start is its depth.
    """
    import numpy as np

    tid = np.asarray(tid, np.int64)
    start = np.asarray(start, np.int64)
    end = np.asarray(end, np.int64)
    n = len(start)
    if n == 0:
        return np.zeros(0, np.int64)
    ev_tid = np.concatenate([tid, tid])
    ev_t = np.concatenate([start, end])
    # 0: end of an earlier interval, 1: start, 2: end of a zero-length interval (after its start)
    ev_type = np.concatenate([np.ones(n, np.int64), np.where(end == start, 2, 0)])
    ev_tie = np.concatenate([-end, np.zeros(n, np.int64)])  # longer first among equal starts
    delta = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    order = np.lexsort((ev_tie, ev_type, ev_t, ev_tid))
    run = np.cumsum(delta[order])
    depth = np.empty(2 * n, np.int64)
    depth[order] = run
    return depth[:n] - 1


def merge_counts(total: dict[str, Any], summ: dict[str, Any]) -> None:
    """Add one segment's counts to ``total`` (``*_max_ns`` keys keep the maximum)."""
    for k, v in summ.items():
        if isinstance(v, bool) or not isinstance(v, int):
            continue
        total[k] = max(total.get(k, 0), v) if k.endswith("_max_ns") else total.get(k, 0) + v


def _segment_pid(side: Path) -> int:
    try:
        return int(json.loads(side.read_text()).get("pid", -1))
    except (OSError, ValueError, AttributeError):
        return -1


def host_ranges(run: Any, pid: int) -> dict[str, Any] | None:
    """The host RANGE events (every layer but BE) a process wrote to the run's events files.

    Only the process's own files (``<pid>-*.parquet``, as its sink names them) are read, only
    the columns needed; None when there are none (or they cannot be read: the conversion then
    relies on the anchors alone).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq


    parts = []
    for f in run.event_files(skip_copies=True):
        if not f.name.startswith(f"{pid}-") or f.name.endswith("-be.parquet"):
            continue
        try:
            t = pq.read_table(f, columns=["kind", "layer", "tid", "start_ns", "end_ns"])
        except (pa.ArrowInvalid, OSError):  # an unreadable file: the run's reader reports it
            continue
        t = t.filter(pc.and_(pc.equal(t.column("kind").cast(pa.string()), "RANGE"),
                             pc.not_equal(t.column("layer").cast(pa.string()), "BE")))
        if t.num_rows:
            parts.append(t)
    if not parts:
        return None
    return {c: np.concatenate([p.column(c).to_numpy() for p in parts]).astype(np.int64)
            for c in ("tid", "start_ns", "end_ns")}


def convert_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Convert the segments left in ``RUN/be/`` into events files (the launcher, after the run).

    Returns counts summed over segments, plus ``segments`` and ``failed`` (segments whose
    conversion raised stay on disk and are named in ``errors``).
    """
    from teller.rundir import RunDir, events_table  # pyarrow: only in the launcher, after the run

    run = RunDir(run_dir)
    d = run.path / SEGMENT_DIR
    out: dict[str, Any] = {"segments": 0, "failed": 0, "errors": []}
    if not d.is_dir():
        return out
    hosts: dict[int, Any] = {}  # per process, read before its first BE file is written
    for side in sorted(d.glob("*.windows.json")):
        trace = str(side)[: -len(".windows.json")] + ".json"
        if not os.path.isfile(trace):
            out["failed"] += 1
            out["errors"].append(f"{side.name}: trace file missing (the process died while exporting)")
            continue
        try:
            pid = _segment_pid(side)
            if pid not in hosts:
                hosts[pid] = host_ranges(run, pid)
            cols, summ = convert_segment(trace, host=hosts[pid])
            if cols is not None:
                n = len(cols["start_ns"])
                cols.setdefault("node", [0] * n)
                cols.setdefault("rank", [0] * n)
                run.write_events(events_table(cols, n), name=f"{side.name.split('.')[0]}-be")
            merge_counts(out, summ)
            out["segments"] += 1
            _remove_segment(trace)
        except Exception as e:
            out["failed"] += 1
            out["errors"].append(f"{Path(trace).name}: {type(e).__name__}: {e}")
    try:
        if not any(d.iterdir()):
            d.rmdir()
    except OSError:
        pass
    return out
