"""The recording runtime inside a recorded process (docs/design.md §12–13).

``sitecustomize`` (``teller/record/bootstrap``) calls :func:`activate` at interpreter start when
``TELLER_RUN_DIR`` is set. Activation only registers post-import hooks and exit/signal/fork
handlers; it imports nothing heavy and never touches torch or CUDA. Later:

- when the engine imports ``torch``, the runtime creates the per-process
  :class:`~teller.record.sink.EventSink`, the CPU collector for the hooks' ranges and the
  requested activity collector (``cpu``, ``cupti`` or ``kineto``; created by name, falling back
  to ``cpu`` with one ``[teller]`` line when it cannot start), installs the BE backend
  (``TELLER_BE_BACKEND``: ``profiler``, whose profiler starts at the first STEP, or ``dispatch``),
  and hooks ``torch.distributed``;
- when the engine imports one of its modules, the matching instrumentor patches it
  (:mod:`teller.record.instrument`).

Buffers are flushed every ``TELLER_FLUSH_S`` seconds (default 2) by a daemon thread, at exit
(``atexit``, and the ``multiprocessing`` finalizers of forked workers, which skip ``atexit``)
and on SIGTERM (and SIGINT where it is not Python's KeyboardInterrupt handler, which reaches
``atexit`` by itself), after which the signal's default action runs: a crash loses at most one
flush interval. Nothing here raises into the engine; failures are logged
once with a ``[teller]`` prefix and written to ``RUN/proc/<pid>.json``, which the launcher
gathers into ``run.json``.

Hook code calls :func:`push` / :func:`pop` (module attributes, so a collector can swap the
backend with :func:`set_range_backend`, e.g. to emit NVTX instead of CPU buffers).

This module is the handle everything recording in the process is given (the instrumentors'
``instrument(runtime)``, the CUPTI collector, the BE backends, the extensions the bootstrap
loads): they read its attributes at call time and never import it, so imports flow one way,
from here down to :mod:`~teller.record.instrument`, :mod:`~teller.record.collectors`,
:mod:`~teller.record.ranges` and :mod:`~teller.record.clock`.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from teller.record import ranges as _ranges
from teller.record.instrument import instrumentors_for, torch_ops
from teller.record.instrument.base import register_post_import

#: this module, the runtime handle passed to what records through it
_HANDLE = sys.modules[__name__]

ENV_RUN_DIR = "TELLER_RUN_DIR"
ENV_COLLECTOR = "TELLER_COLLECTOR"
ENV_ENGINE = "TELLER_ENGINE"
ENV_HOOKS = "TELLER_HOOKS"
ENV_BE_DEPTH = "TELLER_BE_DEPTH"
ENV_BE_BACKEND = "TELLER_BE_BACKEND"
ENV_FLUSH_S = "TELLER_FLUSH_S"
ENV_NODE = "TELLER_NODE"
ENV_COMM = "TELLER_COMM"
#: record one STEP in every k in detail (BE ranges, GPU activity); 1: every step (:class:`DetailGate`)
ENV_DETAIL_EVERY = "TELLER_DETAIL_EVERY"
#: consecutive steps recorded in detail from each ``TELLER_DETAIL_EVERY``-th one
ENV_DETAIL_WINDOW = "TELLER_DETAIL_WINDOW"
#: "1": steps outside the detail windows record their STEP range and nothing inside it (no FE,
#: COMM or OTHER ranges under it): a benchmark setting, so that one run holds detailed steps and
#: nearly unrecorded ones side by side (``benchmarks/detail_sampling.py --pace``; docs/overhead.md);
#: "alternate": only every other block of ``TELLER_DETAIL_WINDOW`` steps between the windows is
#: quiet, the others keep the light recording, so light and quiet blocks lie side by side (their
#: STEP messages carry ``quiet=1`` when quiet)
ENV_DETAIL_QUIET = "TELLER_DETAIL_QUIET"
#: ``teller record``'s defaults: windows of 8 detailed steps, one every 512 steps (docs/overhead.md)
DEFAULT_DETAIL_EVERY = 512
DEFAULT_DETAIL_WINDOW = 8
#: ``module:function`` entries, comma-separated, that the bootstrap calls with this module once
#: recording is active (the fault campaign names its in-engine applier here)
ENV_EXTENSIONS = "TELLER_EXTENSIONS"
#: "1": record the interpreter's garbage collections (``OTHER gc gen=N``, on the thread that ran
#: each), the flusher's work (``OTHER teller_flush``, on its own thread) and the CUPTI collector's
#: buffer callbacks (``OTHER teller_cupti_buffer``, on CUPTI's thread) as ranges, to see what
#: pauses the engine's threads (a measurement setting, docs/overhead.md; off by default: the ranges
#: land inside the steps' subtrees, which the models were not trained with)
ENV_MARK_PAUSES = "TELLER_MARK_PAUSES"

COLLECTORS = ("cpu", "cupti", "kineto")
#: how aten ops (BE ranges) are recorded: PyTorch's profiler (C++ RecordFunction callbacks) or a
#: Python TorchDispatchMode (teller.record.instrument.torch_profiler_ops / torch_ops)
BE_BACKENDS = ("profiler", "dispatch")
# dispatch by default: its cost is steady. The profiler backend is cheaper while serving but stops
# and exports its session every period, stalling one step for about a second on a busy engine:
# right for bounded recordings (benchmarks, fault campaigns, incident windows), not for a live service.
DEFAULT_BE_BACKEND = "dispatch"

# ---------------------------------------------------------------------------------------------
# the range API used by the hooks

#: open a range on the calling thread (rebound by :func:`set_range_backend`)
push: Callable[[str], None] = _ranges.push
#: close the innermost range on the calling thread
pop: Callable[[], None] = _ranges.pop

_backend_name = "cpu"


def set_range_backend(push_fn: Callable[[str], None], pop_fn: Callable[[], None],
                      keep_cpu: bool = False, name: str = "custom") -> None:
    """Send the hooks' ranges to ``push_fn``/``pop_fn`` (e.g. NVTX for the CUPTI collector).

    With ``keep_cpu`` the CPU recorder gets every range as well. Call it from a collector's
    ``start()``; ranges opened before the switch are closed on the backend that opened them only
    if it is kept, otherwise their pops are counted as unbalanced.
    """
    global push, pop, _backend_name
    if keep_cpu:
        cpu_push, cpu_pop = _ranges.push, _ranges.pop

        def both_push(msg: str) -> None:
            cpu_push(msg)
            push_fn(msg)

        def both_pop() -> None:
            pop_fn()
            cpu_pop()

        push, pop = both_push, both_pop
        _backend_name = f"{name}+cpu"
    else:
        push, pop = push_fn, pop_fn
        _backend_name = name
    if DETAIL.quiet:
        push, pop = _quieted(push, pop)


def reset_range_backend() -> None:
    """Back to the CPU recorder."""
    global push, pop, _backend_name
    push, pop, _backend_name = _ranges.push, _ranges.pop, "cpu"
    if DETAIL.quiet:
        push, pop = _quieted(push, pop)


#: per thread: 0 outside a quiet STEP; inside one, 1 + the ranges opened in it and not yet closed
_QUIET = threading.local()


def _quieted(push_fn: Callable[[str], None], pop_fn: Callable[[], None]) -> tuple[Callable[[str], None], Callable[[], None]]:
    """``push_fn``/``pop_fn`` that drop the ranges a thread opens inside a quiet STEP (:data:`ENV_DETAIL_QUIET`),
    and their pops; everywhere else they pass through."""

    def quiet_push(msg: str) -> None:
        q = getattr(_QUIET, "q", 0)
        if q:
            _QUIET.q = q + 1
            return
        push_fn(msg)

    def quiet_pop() -> None:
        q = getattr(_QUIET, "q", 0)
        if q > 1:
            _QUIET.q = q - 1
            return
        pop_fn()

    return quiet_push, quiet_pop


def quiet_ranges() -> None:
    """Make steps outside the detail windows quiet (:data:`ENV_DETAIL_QUIET`), on the current backend."""
    global push, pop
    if not DETAIL.quiet:
        DETAIL.quiet = True
        push, pop = _quieted(push, pop)


def range_backend() -> str:
    return _backend_name


@contextmanager
def range(msg: str) -> Iterator[None]:  # noqa: A001 - mirrors nvtx.range
    """``with runtime.range("OTHER load_model"): ...`` on the current backend."""
    push(msg)
    try:
        yield
    finally:
        pop()


class PauseMarks:
    """``gc.callbacks`` entry recording each collection as an ``OTHER gc gen=N`` range on the
    thread that ran it (:data:`ENV_MARK_PAUSES`). Collections do not nest and run under the GIL,
    so one start time serves every thread; a collection on a thread that never opened a range is
    counted, not recorded (:meth:`~teller.record.ranges.RangeRecorder.add`)."""

    def __init__(self) -> None:
        rec = _ranges.RECORDER
        self.codes = [rec.code(f"OTHER gc gen={g}") for g in (0, 1, 2)]  # (range is the context manager here)
        self.flush_code = rec.code("OTHER teller_flush")
        self.cupti_code = rec.code("OTHER teller_cupti_buffer")
        self.t0 = 0
        self.marked = [0, 0, 0]
        self.skipped = 0
        self.errors = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        try:
            if phase == "start":
                self.t0 = time.perf_counter_ns()
                return
            t0, self.t0 = self.t0, 0
            if not t0:
                return
            g = min(max(int(info.get("generation", 2)), 0), 2)
            if _ranges.RECORDER.add(self.codes[g], t0, time.perf_counter_ns()):
                self.marked[g] += 1
            else:
                self.skipped += 1
        except Exception:
            self.errors += 1

    def mark(self, code: int, t0: int) -> None:
        """A range from ``t0`` to now on the calling thread (TELLER's own threads and callbacks)."""
        try:
            _ranges.RECORDER.add(code, t0, time.perf_counter_ns(), create=True)
        except Exception:
            self.errors += 1

    def info(self) -> dict[str, Any]:
        return {"gc_marked": list(self.marked), "gc_skipped": self.skipped, "errors": self.errors}


_step_ids = itertools.count()


def next_step_id() -> int:
    """Process-wide STEP counter shared by the instrumentors."""
    return next(_step_ids)


_be_backend: tuple[Callable[[int], None], Callable[[], None]] | None = None


def set_be_backend(enter_fn: Callable[[int], None] | None, exit_fn: Callable[[], None] | None = None) -> None:
    """Replace how aten ops are recorded during a step (default: a TorchDispatchMode per thread).

    ``enter_fn(depth)`` runs on the step's thread after its STEP range opens, ``exit_fn()``
    before it closes; the profiler BE backend (``torch_profiler_ops.ProfilerBE``) is installed
    this way when ``TELLER_BE_BACKEND`` is ``profiler``. ``None`` restores the dispatch mode.
    """
    global _be_backend
    _be_backend = None if enter_fn is None else (enter_fn, exit_fn or (lambda: None))


def _dispatch_be_enter(depth: int) -> None:
    torch_ops.be_enter(_HANDLE, depth)


def _be_functions() -> tuple[Callable[[int], None], Callable[[], None]]:
    if _be_backend is not None:
        return _be_backend
    return _dispatch_be_enter, torch_ops.be_exit


class DetailGate:
    """Which STEPs of the process are recorded in detail: windows of ``window`` consecutive
    steps, one starting every ``every`` steps (steps 0..w-1, k..k+w-1, ...; ``every`` 1: all).

    A detailed step gets the aten-level BE ranges and the activity collector's GPU records
    (:meth:`set_detail` of a collector that has it: CUPTI's detaches between windows); the
    others keep their STEP, FE, COMM and OTHER ranges (the iteration, its gap and batch
    context) and say so in their message (``... detail=0``), which the numeric stage reads to
    leave the missing features out. The collector is switched on when the step *before* a
    window closes, and off when the first step after it opens, so each detailed step's whole
    iteration (scheduling before it, update after it) is recorded. Ranks of one deployment
    count their own steps and, stepping in lockstep, detail the same ones.
    """

    def __init__(self, every: int = 1, window: int = 1) -> None:
        self.reset(every, window)

    def reset(self, every: int = 1, window: int = 1) -> None:
        """Start counting again with these settings (the runtime's start, a forked child)."""
        self.every = max(1, int(every))
        self.window = min(max(1, int(window)), self.every)
        self.seq = 0
        self.detailed = 0
        self.switches = 0
        self.switch_ns = 0
        self.failures = 0
        self.quiet = getattr(self, "quiet", False)  # kept across resets (a forked child keeps its ranges' wrappers)
        # quiet only every other block of ``window`` steps outside the detail windows (ENV_DETAIL_QUIET
        # "alternate"): light and quiet blocks side by side in one run
        self.alternate = getattr(self, "alternate", False)
        self.on = True  # the collector starts recording (start-up and the first window), unless lazy
        self._lock = threading.Lock()
        self._tls = threading.local()

    def is_detailed(self, seq: int) -> bool:
        return seq % self.every < self.window

    def begin(self) -> bool:
        """A STEP opens: whether it is detailed (switching the collector off if it is not)."""
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            detailed = self.is_detailed(seq)
            self._tls.quiet = self.quiet and not detailed and (not self.alternate or (seq // self.window) % 2 == 1)
            self.detailed += detailed
            if not detailed and self.on:
                self._switch(False)
            elif detailed and not self.on:  # a collector attached lazily, at its first window
                self._switch(True)
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        stack.append(detailed)
        return detailed

    def end(self) -> bool:
        """The STEP opened last on this thread closes: whether it was detailed (switching the
        collector on when the next step is)."""
        stack = getattr(self._tls, "stack", None)
        detailed = stack.pop() if stack else True
        if self.every > 1:
            with self._lock:
                if not self.on and self.is_detailed(self.seq):
                    self._switch(True)
        return detailed

    def _switch(self, on: bool) -> None:
        self.on = on
        rt = RUNTIME
        fn = getattr(rt.collector, "set_detail", None) if rt is not None else None
        if fn is None:
            return
        t0 = time.perf_counter_ns()
        # a range of its own: the switch's time (a CUPTI detach flushes) is TELLER's, not the
        # engine's, and the numeric stage leaves the iteration that holds it out of time features
        push(SWITCH_RANGE)
        try:
            fn(on)
        except Exception as e:
            self.failures += 1
            hook_failed("detail switch", e)
        finally:
            pop()
        self.switch_ns += time.perf_counter_ns() - t0
        self.switches += 1

    def info(self) -> dict[str, Any]:
        return {"every": self.every, "window": self.window, "steps": self.seq, "detailed": self.detailed,
                "switches": self.switches, "switch_ms": round(self.switch_ns / 1e6, 3), "failures": self.failures,
                **({"quiet": "alternate" if self.alternate else True} if self.quiet else {})}


#: the range around a switch of the collector (teller.reconstruct.steps.SWITCH_FAMILY)
SWITCH_RANGE = "OTHER detail_switch"
#: the process's detail gate (:class:`DetailGate`; its ``every`` from ``TELLER_DETAIL_EVERY``)
DETAIL = DetailGate(1)
#: what a STEP message carries when its step is not recorded in detail
NOT_DETAILED = " detail=0"
#: what it carries besides when nothing was recorded inside it (ENV_DETAIL_QUIET)
QUIET_MARK = " quiet=1"


def push_step(msg: str) -> None:
    """Open a STEP range and, on a detailed step (:data:`DETAIL`) with BE depth > 0, start
    recording aten ops on this thread."""
    detailed = DETAIL.begin()
    quiet = bool(getattr(DETAIL._tls, "quiet", False))
    push(msg if detailed else msg + NOT_DETAILED + (QUIET_MARK if quiet else ""))
    if not detailed:
        if quiet:
            _QUIET.q = 1  # nothing more is recorded on this thread until the STEP closes
        return
    rt = RUNTIME
    depth = rt.be_depth if rt is not None else _default_be_depth()
    if "torch" in sys.modules:
        try:
            _be_functions()[0](depth)
        except Exception as e:
            hook_failed("BE aten ops", e)


def pop_step() -> None:
    """Close the STEP range opened by :func:`push_step` on this thread."""
    if DETAIL.quiet:
        _QUIET.q = 0
    if DETAIL.end() and "torch" in sys.modules:
        try:
            _be_functions()[1]()
        except Exception as e:
            hook_failed("BE aten ops", e)
    pop()


def _default_be_depth() -> int:
    try:
        return int(os.environ.get(ENV_BE_DEPTH, "1"))
    except ValueError:
        return 1


# ---------------------------------------------------------------------------------------------
# messages: one [teller] line per distinct problem

_logged: set[str] = set()
_messages: list[str] = []
_hook_errors: dict[str, int] = {}


def log(msg: str, key: str | None = None) -> None:
    """Print ``[teller] msg`` to stderr once per ``key`` (default: the message) and keep it."""
    k = key or msg
    if k in _logged:
        return
    _logged.add(k)
    if len(_messages) < 200:
        _messages.append(msg)
    try:
        sys.stderr.write(f"[teller] {msg}\n")
        sys.stderr.flush()
    except Exception:
        pass


def hook_failed(where: str, exc: BaseException) -> None:
    """A hook raised: count it, log it once, and let the engine carry on."""
    _hook_errors[where] = _hook_errors.get(where, 0) + 1
    log(f"hook {where} failed ({type(exc).__name__}: {exc}); it keeps running, the failure is counted",
        key=f"hook:{where}")


def is_compiling() -> bool:
    """True while torch.compile traces (hooks must then do nothing)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def _name_os_thread(name: str) -> None:
    """Give the calling thread a kernel-visible name (Linux ``PR_SET_NAME``, 15 bytes); no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------
# the per-process runtime


class Runtime:
    """State of recording in this process: settings, sink, collectors, flusher, handlers."""

    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.run_dir = env[ENV_RUN_DIR]
        self.collector_requested = (env.get(ENV_COLLECTOR) or "cpu").lower()
        self.engine = (env.get(ENV_ENGINE) or "auto").lower()
        self.hooks_file = env.get(ENV_HOOKS) or None
        self.be_depth = _int(env.get(ENV_BE_DEPTH), 1)
        self.detail_every = max(1, _int(env.get(ENV_DETAIL_EVERY), 1))
        self.detail_window = max(1, _int(env.get(ENV_DETAIL_WINDOW), 1))
        DETAIL.reset(self.detail_every, self.detail_window)
        if env.get(ENV_DETAIL_QUIET) in ("1", "alternate") and self.detail_every > 1:
            DETAIL.alternate = env.get(ENV_DETAIL_QUIET) == "alternate"
            quiet_ranges()
        self.be_backend_requested = (env.get(ENV_BE_BACKEND) or DEFAULT_BE_BACKEND).lower()
        self.be_backend = "dispatch"
        self.be: Any = None
        self.be_note: str | None = None
        self.flush_s = max(0.05, _float(env.get(ENV_FLUSH_S), 2.0))
        self.node = _int(env.get(ENV_NODE), 0)
        self.rank = _int(env.get("RANK"), 0)
        self.comm = env.get(ENV_COMM, "1") != "0"
        self.pid = os.getpid()
        self.start_wall_ns = time.time_ns()
        self.sink = None
        self.cpu = None
        self.collector = None
        self.collector_name: str | None = None
        self.fallback_reason: str | None = None
        self.failed_collector: dict[str, Any] | None = None
        self.model_config: dict[str, Any] = {}
        self.instrumentors: list[Any] = []
        self.forked_from: int | None = None
        self._started = False
        self._stopped = False
        self._state_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._flusher: threading.Thread | None = None
        self._prev_handlers: dict[int, Any] = {}
        self.flushes = 0
        self.flusher_tid: int | None = None
        self.pause_marks: PauseMarks | None = PauseMarks() if env.get(ENV_MARK_PAUSES) == "1" else None

    # ---- activation (sitecustomize time: light) -------------------------------------------
    def install(self) -> None:
        """Register post-import hooks and exit/signal/fork handlers."""
        register_post_import("torch", self._on_torch, hook_failed)
        insts = []
        if self.comm:
            insts.append(torch_ops.TorchDistributedInstrumentor())
        try:
            insts += instrumentors_for(self.engine, self.hooks_file, log)
        except Exception as e:
            log(f"engine hooks could not be loaded ({type(e).__name__}: {e}); recording without them")
        for inst in insts:
            self.instrumentors.append(inst)
            try:
                inst.instrument(_HANDLE)
            except Exception as e:
                log(f"instrumentor {inst.name} could not be installed ({type(e).__name__}: {e})")
        atexit.register(self.at_exit)
        self._install_signal_handlers()
        try:
            os.register_at_fork(after_in_child=self._after_fork_child)
        except Exception:
            pass

    # ---- start (first torch import or first instrumented module) --------------------------
    def ensure_started(self) -> None:
        """Create the sink, the CPU collector and the flusher (idempotent)."""
        if self._started or self._stopped:
            return
        with self._state_lock:
            if self._started:
                return
            try:
                # the sink writes Parquet: pyarrow and numpy load here, once the engine imports
                # torch, never at interpreter start
                from teller.record.collectors.cpu import CpuCollector
                from teller.record.sink import EventSink

                self.sink = EventSink(self.run_dir, node=self.node, rank=self.rank)
                self.cpu = CpuCollector()
                self.cpu.start(self.sink)
                self.collector, self.collector_name = self.cpu, "cpu"
            except Exception as e:
                log(f"recording disabled in pid {os.getpid()}: cannot create the event sink ({type(e).__name__}: {e})")
                self._stopped = True
                return
            self._started = True
        if self.pause_marks is not None:
            import gc

            gc.callbacks.append(self.pause_marks)
        self._start_flusher()
        self.write_proc_info("running")

    def _on_torch(self, torch_module: Any) -> None:
        try:
            self.ensure_started()
            if self._started and self.collector_name == "cpu" and self.collector_requested != "cpu":
                self._start_collector()
            if self._started:
                self._setup_be_backend()
        except Exception as e:
            hook_failed("torch import", e)

    def _setup_be_backend(self) -> None:
        """Install the requested BE backend (the profiler one starts at the first STEP)."""
        want = self.be_backend_requested
        if self.be is not None or self.be_depth <= 0 or want == "dispatch":
            return
        if want not in BE_BACKENDS:
            self.be_note = f"unknown BE backend {want!r} (expected one of {', '.join(BE_BACKENDS)}); using dispatch"
            log(self.be_note)
            return
        if self.collector_name == "kineto":
            self.be_note = "the kineto collector holds the profiler; BE ranges use the dispatch backend"
            return
        # only with --be-backend profiler (it loads ctypes and, at conversion, pyarrow)
        from teller.record.instrument.torch_profiler_ops import ProfilerBE

        self.be = ProfilerBE(self.run_dir, sink=self.sink, pid=self.pid, runtime=_HANDLE)
        self.be_backend = "profiler"
        set_be_backend(self.be.enter, self.be.exit)

    def _start_collector(self) -> None:
        name = self.collector_requested
        if name in ("cpu", "auto", ""):
            return
        c = None
        try:
            # GPU collectors load numpy, pyarrow and CUPTI or torch.profiler: only when asked for
            if name == "cupti":
                from teller.record.collectors.cupti import CuptiCollector

                c = CuptiCollector(runtime=_HANDLE)
            elif name == "kineto":
                from teller.record.collectors.kineto import KinetoCollector

                c = KinetoCollector()
            else:
                raise ValueError(f"unknown collector {name!r} (expected one of {', '.join(COLLECTORS)})")
            c.start(self.sink)
            if getattr(c, "available", True) is False:  # collectors degrade instead of raising
                raise RuntimeError(getattr(c, "reason", "") or "collector reports itself unavailable")
        except Exception as e:
            reset_range_backend()
            self.fallback_reason = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
            log(f"collector {name} unavailable ({self.fallback_reason}); recording hook ranges with the cpu collector")
            try:
                if c is not None:
                    self.failed_collector = {"name": name, **c.info()}
                    c.stop()
            except Exception:
                pass
            return
        self.collector, self.collector_name = c, name
        DETAIL.on = bool(getattr(c, "detail_on", True))  # False: CUPTI waits for the first detail window

    # ---- flushing ---------------------------------------------------------------------------
    def _start_flusher(self) -> None:
        self._stop_evt = threading.Event()
        t = threading.Thread(target=self._flush_loop, name="teller-flush", daemon=True)
        self._flusher = t
        t.start()

    def _flush_loop(self) -> None:
        _name_os_thread("teller-flush")  # so top -H and /proc/PID/task/*/comm tell it apart
        self.flusher_tid = threading.get_native_id()  # after the name: whoever sees the id sees the name
        marks = self.pause_marks
        while not self._stop_evt.wait(self.flush_s):
            t0 = time.perf_counter_ns()
            self.flush()
            if marks is not None:  # drained at the next flush
                marks.mark(marks.flush_code, t0)

    def collectors(self) -> list[Any]:
        out = []
        for c in (self.collector, self.cpu):
            if c is not None and c not in out:
                out.append(c)
        return out

    def flush(self, final: bool = False, timeout: float = 5.0) -> bool:
        """Move every buffer to disk; returns False when another flush held the lock too long."""
        if not self._started:
            return True
        if not self._flush_lock.acquire(timeout=timeout):
            return False
        try:
            self._refresh_rank()
            for c in self.collectors():
                try:
                    if final:
                        c.stop()
                    else:
                        c.flush()
                except Exception as e:
                    hook_failed(f"collector {getattr(c, 'name', '?')} flush", e)
            if final and self.be is not None:  # after the collectors: CUPTI is done by then
                try:
                    self.be.stop()
                except Exception as e:
                    hook_failed("BE backend stop", e)
            if self.sink is not None:
                before = len(self.sink.errors)
                self.sink.flush()
                if len(self.sink.errors) > before:
                    log(f"cannot write events to {self.sink.run.events_dir} ({self.sink.errors[-1]}); "
                        f"{self.sink.dropped_rows} rows lost so far, recording continues", key="sink-write")
            self.flushes += 1
            self.write_proc_info("exited" if final else "running")
        finally:
            self._flush_lock.release()
        return True

    def _refresh_rank(self) -> None:
        td = sys.modules.get("torch.distributed")
        if td is None or self.sink is None:
            return
        try:
            if td.is_available() and td.is_initialized():
                r = int(td.get_rank())
                if r != self.sink.rank:
                    self.sink.rank = r
                    self.rank = r
        except Exception:
            pass

    # ---- exit, signals, fork ----------------------------------------------------------------
    def at_exit(self) -> None:
        """Final flush: open ranges emitted truncated, collectors stopped, proc info written."""
        if self._stopped or os.getpid() != self.pid:
            return
        self._stopped = True
        self._stop_evt.set()
        t = self._flusher
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout=5.0)
        try:
            self.flush(final=True)
        except Exception as e:
            log(f"final flush failed ({type(e).__name__}: {e})")
        _exit_like_keyboard_interrupt()

    def _install_signal_handlers(self) -> None:
        """Catch SIGTERM/SIGINT only where their action would skip ``atexit`` (SIG_DFL).

        Python's own SIGINT handler raises KeyboardInterrupt, which runs ``atexit``; replacing it
        would change what ``signal.getsignal`` reports (asyncio, for one, installs its Ctrl-C
        handling only when it sees the default). So that one, ignored signals and handlers the
        engine installs later are left alone; a handler installed here flushes, then lets the
        signal do what it would have done.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                prev = signal.getsignal(sig)
                if prev != signal.SIG_DFL:
                    continue
                signal.signal(sig, self._on_signal)
                self._prev_handlers[sig] = prev
            except (ValueError, OSError):
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Flush, then do what would have happened without TELLER."""
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        mine = os.getpid() == self.pid and self._started
        if callable(prev) or prev == signal.SIG_IGN:
            try:
                if mine:
                    self.flush(timeout=2.0)
            except Exception:
                pass
            if callable(prev):
                prev(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt here
            return
        # SIG_DFL (or None: installed from C): final flush, then die of the same signal
        try:
            if mine:
                self.at_exit()
        except Exception:
            pass
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _after_fork_child(self) -> None:
        """A forked worker records on its own: new pid, new sink, fresh buffers, own flusher."""
        try:
            parent = self.pid
            self.pid = os.getpid()
            self.forked_from = parent
            self.start_wall_ns = time.time_ns()
            _ranges.RECORDER.reset_after_fork()
            DETAIL.reset(self.detail_every, self.detail_window)  # the child counts its own steps
            self._state_lock = threading.Lock()
            self._flush_lock = threading.Lock()
            self._flusher = None
            if not self._started or self._stopped:
                return
            self._started = False
            if self.collector_name != "cpu":
                # GPU collectors are per-process native state; a forked child cannot reuse them
                reset_range_backend()
                self.fallback_reason = f"forked from pid {parent}: {self.collector_name} not restarted"
            self.sink = self.cpu = self.collector = None
            parent_profiling = self.be is not None and self.be.started
            if self.be is not None:  # the parent's profiler session is not this process's
                self.be = None
                self.be_backend = "dispatch"
                set_be_backend(None)
            self.ensure_started()
            if parent_profiling:  # its global callbacks came along; a second session cannot start
                self.be_note = f"forked from pid {parent} while its profiler ran: BE ranges use the dispatch backend"
            elif "torch" in sys.modules:
                self._setup_be_backend()
            self._register_mp_finalizer()
        except Exception as e:
            log(f"recording in forked pid {os.getpid()} failed to restart ({type(e).__name__}: {e})")

    def _register_mp_finalizer(self) -> None:
        """multiprocessing's forked workers end with os._exit (no atexit): flush in its finalizers."""
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is None:
            return
        try:
            mp_util.register_after_fork(self, Runtime._mp_after_fork)
            Runtime._mp_after_fork(self)
        except Exception:
            pass

    @staticmethod
    def _mp_after_fork(rt: "Runtime") -> None:
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            mp_util.Finalize(None, rt.at_exit, exitpriority=-100)

    # ---- run.json material ------------------------------------------------------------------
    def proc_info(self, status: str) -> dict[str, Any]:
        coll = {}
        for c in self.collectors():
            try:
                coll[getattr(c, "name", type(c).__name__)] = c.info()
            except Exception as e:
                coll[getattr(c, "name", type(c).__name__)] = {"errors": [f"info: {type(e).__name__}: {e}"]}
        return {
            "pid": self.pid,
            "ppid": os.getppid(),
            "forked_from": self.forked_from,
            "argv": list(sys.argv),
            "executable": sys.executable,
            "node": self.node,
            "rank": self.rank,
            "thread_count": threading.active_count(),
            "threads": {"flush": self.flusher_tid},
            "status": status,
            "start_wall_ns": self.start_wall_ns,
            "update_wall_ns": time.time_ns(),
            "engine": self.engine,
            "collector": {
                "requested": self.collector_requested,
                "active": self.collector_name,
                "fallback_reason": self.fallback_reason,
                "range_backend": _backend_name,
                "be_depth": self.be_depth,
                "be_backend": self._be_backend_now(),
                "be_backend_requested": self.be_backend_requested,
                "be_note": self.be_note,
                "flush_s": self.flush_s,
                "detail": DETAIL.info(),
            },
            "be": self.be.info() if self.be is not None else None,
            "collectors": coll,
            "failed_collector": self.failed_collector,
            "model_config": self.model_config,
            "sink": self.sink.info() if self.sink is not None else None,
            "instrumentors": [i.info() for i in self.instrumentors],
            "hook_errors": dict(_hook_errors),
            "messages": list(_messages),
            "flushes": self.flushes,
            "pause_marks": self.pause_marks.info() if self.pause_marks is not None else None,
        }

    def _be_backend_now(self) -> str:
        be = self.be
        if be is not None and be.failed:
            return "dispatch" if be.fallback == "dispatch" else "none"
        return self.be_backend if self.be_depth > 0 else "off"

    def write_proc_info(self, status: str) -> None:
        try:
            d = os.path.join(self.run_dir, "proc")
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"{self.pid}.json")
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.proc_info(status), f, default=str)
            os.replace(tmp, path)
        except Exception as e:
            log(f"cannot write {self.run_dir}/proc/{self.pid}.json ({type(e).__name__}: {e})", key="proc-write")


def _exit_like_keyboard_interrupt() -> None:
    """Keep "an uncaught KeyboardInterrupt exits by SIGINT" (exit status 130 in a shell).

    CPython remembers an uncaught KeyboardInterrupt of the main program in a flag and kills
    itself with SIGINT at the very end of finalization; any ``exec`` of a string after that
    (pyarrow's compute layer and dataclass creation do it, e.g. in the final flush) clears the
    flag and the process exits 1 instead. So when the main program did end that way, the last
    ``atexit`` handler (this one: registered first) does what CPython would have done.
    """
    tb = getattr(sys, "last_traceback", None)
    if tb is None or not isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        return
    g = tb.tb_frame.f_globals.get("__name__")
    if not (g in ("__main__", "runpy") and tb.tb_frame.f_code.co_name in ("<module>", "_run_module_as_main")):
        return  # a KeyboardInterrupt shown by an interactive shell, not the program's end
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except Exception:
        pass


def _int(v: str | None, default: int) -> int:
    try:
        return int(v) if v not in (None, "") else default
    except ValueError:
        return default


def _float(v: str | None, default: float) -> float:
    try:
        return float(v) if v not in (None, "") else default
    except ValueError:
        return default


#: the runtime of this process (None until :func:`activate`)
RUNTIME: Runtime | None = None


def activate() -> Runtime | None:
    """Start recording this process if ``TELLER_RUN_DIR`` is set (idempotent per pid)."""
    global RUNTIME
    if RUNTIME is not None and RUNTIME.pid == os.getpid():
        return RUNTIME
    if not os.environ.get(ENV_RUN_DIR):
        return None
    rt = Runtime()
    RUNTIME = rt
    rt.install()
    return rt


def note_model(model: Any) -> None:
    """Keep the served model's shape for run.json (``model_config``); cheap, never raises."""
    rt = RUNTIME
    if rt is None or model is None:
        return
    try:
        cfg = getattr(model, "config", None)
        keys = ("model_type", "architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "_attn_implementation")
        d = {k: getattr(cfg, k) for k in keys if isinstance(getattr(cfg, k, None), (int, str, list))}
        for k in ("device", "dtype"):
            v = getattr(model, k, None)
            if v is not None:
                d[k] = str(v)
        d["class"] = type(model).__name__
        rt.model_config = d
    except Exception as e:
        hook_failed("model config", e)


def ensure_started() -> None:
    """Called by instrumentors when they patch something: recording must be on from then on."""
    rt = RUNTIME
    if rt is not None:
        rt.ensure_started()
