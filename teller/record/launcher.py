"""``teller record``: run a command unchanged and record it into a run directory.

The launcher fixes the run's time base (τ = 0 now; ``TELLER_T0_NS``), puts the bootstrap
(``teller/record/bootstrap/sitecustomize.py``) first on ``PYTHONPATH`` and passes the settings
by environment, so the command and every Python process it spawns are recorded by
:mod:`teller.record.runtime` without a code change. It then

- captures the child's stdout and stderr as bytes, passes every chunk through to the terminal
  unchanged and as it arrives, and writes one JSON line per text line to
  ``RUN/logs/<stream>.jsonl`` (``{ts_ns, node, pid, stream, text}``; ``ts_ns`` is the wall-clock
  arrival of the line's first byte; bytes are decoded as UTF-8 with replacement, ``\\r`` counts
  as a line end so progress bars become lines);
- forwards SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the child (a SIGINT or
  SIGQUIT typed at the terminal already reached the child, which shares our process group, so
  it is not sent twice);
- returns the child's exit code (128 + signal number when it was killed) and writes
  ``run.json``: command, settings, clock, the processes that recorded (from the
  ``RUN/proc/<pid>.json`` files the runtime writes), per-collector info and dropped counts.

The child's stdout becomes a pipe, which would make Python block-buffer it; ``PYTHONUNBUFFERED``
is set (unless the user set it) so log lines arrive, and get timestamps, when they are written.

Limits, by construction: a Python started with ``-I``, ``-E`` or ``-S`` ignores ``PYTHONPATH``
or site customisation and runs unrecorded (its output is still captured); a child that builds
its own environment from scratch drops the ``TELLER_*`` settings; programs that check
``isatty()`` see pipes, not a terminal.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Sequence

from teller.errors import TellerError
from teller.record.instrument import ENGINE_CHOICES
from teller.record.instrument.generic import load_hooks
from teller.record.instrument.torch_profiler_ops import convert_run
from teller.record.runtime import (
    BE_BACKENDS,
    DEFAULT_BE_BACKEND,
    DEFAULT_DETAIL_EVERY,
    DEFAULT_DETAIL_WINDOW,
    ENV_DETAIL_EVERY,
    ENV_DETAIL_WINDOW,
    ENV_EXTENSIONS,
)
from teller.rundir import RunDir, RunInfo

COLLECTOR_CHOICES = ("auto", "cupti", "kineto", "cpu", "none")
BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
TELLER_HOME = Path(__file__).resolve().parents[2]
FORWARDED_SIGNALS = tuple(
    getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2") if hasattr(signal, s)
)
_TERMINAL_SIGNALS = {signal.SIGINT, getattr(signal, "SIGQUIT", signal.SIGINT)}
_MAX_LINE = 1 << 20


# ---------------------------------------------------------------------------------------------
# environment discovery


def find_cupti() -> str | None:
    """The CUPTI library to inject NVTX with: pip wheels first, then CUDA_HOME's extras."""
    import site

    roots: list[str] = []
    try:
        roots += site.getsitepackages()
    except Exception:
        pass
    try:
        roots.append(site.getusersitepackages())
    except Exception:
        pass
    roots += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    patterns = []
    for r in dict.fromkeys(roots):
        patterns += [os.path.join(r, "nvidia", "cu13", "lib", "libcupti.so.13"),
                     os.path.join(r, "nvidia", "cu13", "lib", "libcupti.so*"),
                     os.path.join(r, "nvidia", "cuda_cupti", "lib", "libcupti.so*")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            patterns.append(os.path.join(home, "extras", "CUPTI", "lib64", "libcupti.so*"))
    for pat in patterns:
        hits = sorted(glob.glob(pat), key=len)
        if hits:
            return hits[0]
    return None


def gpu_present() -> bool:
    """An NVIDIA GPU is visible (driver device node or nvidia-smi), without touching CUDA."""
    if os.path.exists("/dev/nvidia0") or glob.glob("/proc/driver/nvidia/gpus/*"):
        return True
    return shutil.which("nvidia-smi") is not None


def resolve_collector(requested: str) -> tuple[str, str | None, list[str]]:
    """(collector to use, CUPTI library or None, notes for run.json)."""
    notes: list[str] = []
    lib = find_cupti() if requested in ("auto", "cupti") else None
    if requested == "auto":
        gpu = gpu_present()
        if lib and gpu:
            return "cupti", lib, notes
        notes.append("auto: " + ("no GPU found" if not gpu else "no CUPTI library found") + "; using cpu")
        return "cpu", None, notes
    if requested == "cupti" and lib is None:
        notes.append("no CUPTI library found in site-packages (nvidia/cu13, nvidia/cuda_cupti) or "
                     "CUDA_HOME/extras/CUPTI; NVTX injection is off and the cupti collector may fall back to cpu")
    return requested, lib, notes


# ---------------------------------------------------------------------------------------------
# log capture


class _StreamCapture(threading.Thread):
    """Reads one pipe: passes bytes through, writes one JSON line per text line."""

    _SEP = re.compile(rb"\r\n|\n|\r")

    def __init__(self, pipe: IO[bytes], stream: str, out_path: Path, passthrough: IO[bytes] | None,
                 pid: int, node: int):
        super().__init__(name=f"teller-{stream}", daemon=True)
        self.pipe, self.stream, self.passthrough = pipe, stream, passthrough
        self.pid, self.node = pid, node
        self.out = open(out_path, "w", encoding="utf-8", buffering=1)
        self.lines = 0
        self.bytes = 0
        self.errors: list[str] = []
        self._pending = b""
        self._pending_ts = 0

    def run(self) -> None:
        fd = self.pipe.fileno()
        try:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                ts = time.time_ns()
                self.bytes += len(chunk)
                self._pass(chunk)
                self._feed(chunk, ts)
            if self._pending:
                self._emit(self._pending.rstrip(b"\r"), self._pending_ts)
                self._pending = b""
        finally:
            try:
                self.out.close()
            except Exception:
                pass

    def _pass(self, chunk: bytes) -> None:
        if self.passthrough is None:
            return
        try:
            self.passthrough.write(chunk)
            self.passthrough.flush()
        except Exception as e:  # a closed terminal must not stop the capture
            if len(self.errors) < 5:
                self.errors.append(f"passthrough: {type(e).__name__}: {e}")

    def _feed(self, chunk: bytes, ts: int) -> None:
        first_ts = self._pending_ts if self._pending else ts
        data = self._pending + chunk
        hold = b""
        if data.endswith(b"\r"):  # maybe the first half of \r\n: wait for the next chunk
            data, hold = data[:-1], b"\r"
        pos = 0
        for m in self._SEP.finditer(data):
            seg = data[pos:m.start()]
            if seg or m.group() != b"\r":
                self._emit(seg, first_ts)
            first_ts = ts
            pos = m.end()
        rest = data[pos:] + hold
        if len(rest) > _MAX_LINE:
            self._emit(rest, first_ts)
            rest = b""
        self._pending = rest
        if rest and pos:
            self._pending_ts = ts
        elif rest and not pos:
            self._pending_ts = first_ts

    def _emit(self, seg: bytes, ts: int) -> None:
        text = seg.decode("utf-8", errors="replace")
        try:
            self.out.write(json.dumps({"ts_ns": ts, "node": self.node, "pid": self.pid,
                                       "stream": self.stream, "text": text}, ensure_ascii=False) + "\n")
            self.lines += 1
        except Exception as e:
            if len(self.errors) < 5:
                self.errors.append(f"log write: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------------------
# the launcher


def _terminal_sent(signum: int) -> bool:
    """Was this signal most likely typed at our controlling terminal (so the child got it too)?"""
    if signum not in _TERMINAL_SIGNALS:
        return False
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _prepare_run_dir(run: RunDir, force: bool) -> None:
    if run.path.exists() and not run.path.is_dir():
        raise TellerError(f"{run.path}: exists and is not a directory; choose another -o")
    if run.exists():
        if not force:
            raise TellerError(f"{run.path}: already holds a recording; pass --force to replace it or choose another -o")
        for sub in ("events", "logs", "proc"):
            shutil.rmtree(run.path / sub, ignore_errors=True)
        for f in [run.path / "run.json", *run.path.glob("*.parquet")]:
            f.unlink(missing_ok=True)
    run.path.mkdir(parents=True, exist_ok=True)
    (run.path / "logs").mkdir(exist_ok=True)
    (run.path / "proc").mkdir(exist_ok=True)


#: seconds between SIGTERM and SIGKILL when a recorded command outlives its deadline
KILL_GRACE_S = 10.0


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, grandchildren, ...), from /proc; [] elsewhere."""
    parent: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            parent[int(d.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _die_with_launcher(launcher_pid: int) -> None:
    """In the child, before it runs the command: SIGTERM it when the launcher dies (Linux
    ``PR_SET_PDEATHSIG``). A SIGKILLed launcher can neither capture logs nor finish ``run.json``,
    so the command it recorded is ended with it (its runtime flushes on SIGTERM) instead of
    serving on unlogged; docs/design.md §12."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher_pid:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _end_tree(proc: subprocess.Popen) -> int:
    """SIGTERM the command and every process below it, SIGKILL what is left after the grace;
    returns the command's return code."""
    tree = [proc.pid] + _descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in tree:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            return proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            tree = [proc.pid] + _descendants(proc.pid)
    return proc.wait()


def record(
    out: str | os.PathLike,
    command: Sequence[str],
    engine: str = "auto",
    collector: str = "auto",
    hooks: str | os.PathLike | None = None,
    be_depth: int = 1,
    flush_s: float = 2.0,
    be_backend: str | None = None,
    force: bool = False,
    node: int = 0,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
    drain_timeout_s: float = 5.0,
    extensions: Sequence[str] = (),
    deadline_s: float | None = None,
    cupti_decode: str | None = None,
    detail_every: int | None = None,
    detail_window: int | None = None,
) -> dict[str, Any]:
    """Run ``command`` under recording into ``out``; returns a summary with ``exit_code``.

    ``stdout``/``stderr`` are where the child's output is passed through (default: this
    process's own, as bytes). ``extensions``: ``module:function`` entries each recorded process
    calls with its runtime once recording is active (``TELLER_EXTENSIONS``; e.g. the fault
    campaign's ``teller.inject.agent:install``). ``deadline_s``: a command still running after
    this many seconds is ended with its whole process tree (SIGTERM, then SIGKILL after
    :data:`KILL_GRACE_S`); what it recorded is kept and ``run.json`` says ``killed_by: deadline``.
    ``cupti_decode``: when the CUPTI collector decodes its buffers (``inline``, the default, or
    ``deferred``; ``objects``: cupti-python's record objects), passed as ``TELLER_CUPTI_DECODE``;
    None leaves that variable as the environment has it. ``detail_every``, ``detail_window``:
    record windows of ``detail_window`` consecutive STEPs in detail (BE ranges and GPU activity),
    one starting every ``detail_every`` steps (``TELLER_DETAIL_EVERY``/``_WINDOW``; defaults
    :data:`~teller.record.runtime.DEFAULT_DETAIL_EVERY` and ``DEFAULT_DETAIL_WINDOW``;
    ``detail_every`` 1: every step, as fault campaigns do); the other steps keep their STEP, FE,
    COMM and OTHER ranges.
    """
    command = list(command)
    if not command:
        raise TellerError("no command to record; usage: teller record -o RUN -- CMD ARGS...")
    engine, collector = engine.lower(), collector.lower()
    if engine not in ENGINE_CHOICES:
        raise TellerError(f"--engine {engine!r}: expected one of {', '.join(ENGINE_CHOICES)}")
    if collector not in COLLECTOR_CHOICES:
        raise TellerError(f"--collector {collector!r}: expected one of {', '.join(COLLECTOR_CHOICES)}")
    if be_depth < 0:
        raise TellerError(f"--be-depth {be_depth}: expected 0 (off) or a positive depth")
    detail_every = DEFAULT_DETAIL_EVERY if detail_every is None else int(detail_every)
    if detail_every < 1:
        raise TellerError(f"--detail-every {detail_every}: expected 1 (every step in detail) or more")
    detail_window = (DEFAULT_DETAIL_WINDOW if detail_every > 1 else 1) if detail_window is None else int(detail_window)
    if not 1 <= detail_window <= detail_every:
        raise TellerError(f"--detail-window {detail_window}: expected 1 to --detail-every ({detail_every})")
    be_backend = (be_backend or DEFAULT_BE_BACKEND).lower()
    if be_backend not in BE_BACKENDS:
        raise TellerError(f"--be-backend {be_backend!r}: expected one of {', '.join(BE_BACKENDS)}")
    if cupti_decode is not None:
        from teller.record.collectors.cupti import parse_decode  # numpy/pyarrow: only when asked

        try:
            parse_decode(cupti_decode)
        except ValueError as e:
            raise TellerError(f"--cupti-decode: {e}") from None
        cupti_decode = cupti_decode.strip().lower()
    hooks_path = None
    if hooks is not None:
        hooks_path = str(Path(hooks).resolve())
        load_hooks(hooks_path)  # bad hooks files fail here, before anything runs
    elif engine == "generic":
        raise TellerError("--engine generic needs --hooks FILE (see examples/hooks_example.toml)")

    run = RunDir(out)
    _prepare_run_dir(run, force)
    resolved, cupti_lib, notes = resolve_collector(collector)
    for n in notes:
        print(f"[teller] {n}", file=sys.stderr)

    t0 = time.time_ns()
    env = dict(os.environ)
    if resolved != "none":
        env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update({
            "TELLER_RUN_DIR": str(run.path.resolve()),
            "TELLER_T0_NS": str(t0),
            "TELLER_COLLECTOR": resolved,
            "TELLER_ENGINE": engine,
            "TELLER_BE_DEPTH": str(be_depth),
            "TELLER_BE_BACKEND": be_backend,
            "TELLER_BE_DEFER": "1",  # profiler BE segments are converted here, after the run
            ENV_DETAIL_EVERY: str(detail_every),
            ENV_DETAIL_WINDOW: str(detail_window),
            "TELLER_FLUSH_S": str(flush_s),
            "TELLER_NODE": str(node),
            "TELLER_HOME": str(TELLER_HOME),
        })
        if hooks_path:
            env["TELLER_HOOKS"] = hooks_path
        if cupti_decode is not None:
            env["TELLER_CUPTI_DECODE"] = cupti_decode
        if extensions:
            env[ENV_EXTENSIONS] = ",".join(extensions)
        # NVTX ranges of the engine's libraries as MARKER records (TELLER_NVTX_INJECTION=0: not
        # injected, an overhead study's configuration; the hooks' ranges never need it by default)
        if (resolved == "cupti" and cupti_lib and not env.get("NVTX_INJECTION64_PATH")
                and env.get("TELLER_NVTX_INJECTION", "1") not in ("0", "false", "no")):
            env["NVTX_INJECTION64_PATH"] = cupti_lib
    env.setdefault("PYTHONUNBUFFERED", "1")

    settings = {"requested": collector, "resolved": resolved, "cupti_library": cupti_lib,
                "nvtx_injection": env.get("NVTX_INJECTION64_PATH") if resolved == "cupti" else None,
                "gpu": gpu_present(), "be_depth": be_depth, "be_backend": be_backend, "flush_s": flush_s,
                "detail_every": detail_every, "detail_window": detail_window,
                "cupti_decode": env.get("TELLER_CUPTI_DECODE") if resolved == "cupti" else None,
                "notes": notes}
    info = RunInfo(source="teller record", command=command,
                   engine={"requested": engine, "hooks_file": hooks_path},
                   # the zone the engine's plain log timestamps are written in (they carry no offset)
                   clock={"t0_unix_ns": t0, "time_base": "tau = wall ns - t0_unix_ns",
                          "utc_offset_s": int(time.localtime(t0 / 1e9).tm_gmtoff)},
                   collector=settings, start_wall=t0 / 1e9)
    info.extra["status"] = "running"
    # a later command tells a live recording from one whose launcher was killed by this pid
    info.extra["launcher"] = {"pid": os.getpid(), "host": socket.gethostname()}
    run.write_info(info)

    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                preexec_fn=functools.partial(_die_with_launcher, os.getpid()) if sys.platform == "linux" else None)
    except (FileNotFoundError, PermissionError) as e:
        info.extra["status"] = "failed to start"
        info.exit_code = 127
        info.end_wall = time.time()
        run.write_info(info)
        raise TellerError(f"cannot run {command[0]!r} ({e.strerror or e}); check the command after --") from e

    out_bin = stdout if stdout is not None else getattr(sys.stdout, "buffer", None)
    err_bin = stderr if stderr is not None else getattr(sys.stderr, "buffer", None)
    readers = [_StreamCapture(proc.stdout, "stdout", run.logs_dir / "stdout.jsonl", out_bin, proc.pid, node),
               _StreamCapture(proc.stderr, "stderr", run.logs_dir / "stderr.jsonl", err_bin, proc.pid, node)]
    for r in readers:
        r.start()

    forwarded: list[str] = []

    def forward(signum: int, frame: Any) -> None:
        if _terminal_sent(signum):
            return
        try:
            proc.send_signal(signum)
            forwarded.append(signal.Signals(signum).name)
        except ProcessLookupError:
            pass

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in FORWARDED_SIGNALS:
            try:
                previous[s] = signal.signal(s, forward)
            except (ValueError, OSError):
                pass
    timed_out = False
    try:
        if deadline_s is None:
            rc = proc.wait()
        else:
            try:
                rc = proc.wait(timeout=max(0.0, deadline_s))
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = _end_tree(proc)
    finally:
        for s, h in previous.items():
            try:
                signal.signal(s, h)
            except (ValueError, OSError):
                pass
    end = time.time_ns()
    for r in readers:
        r.join(timeout=drain_timeout_s)  # a grandchild may still hold the pipes open

    exit_code = rc if rc >= 0 else 128 - rc
    be_conv = _convert_be_segments(run)
    _finish_info(info, run, rc, exit_code, end, readers, forwarded)
    if timed_out:
        info.extra["killed_by"] = "deadline"
        info.extra["deadline_s"] = deadline_s
    if be_conv is not None:
        info.extra["be_conversion"] = be_conv
        info.counts["event_rows"] = info.counts.get("event_rows", 0) + be_conv.get("kept", 0)
        info.counts["event_files"] = len(run.event_files())
    notes = _engine_notes(engine, hooks_path, resolved, info)
    for n in notes:
        print(f"[teller] {n}", file=sys.stderr)
    info.extra["notes"] = notes
    run.write_info(info)
    active = ",".join(a for a in info.collector.get("active", []) if a != "none") or resolved
    return {"exit_code": exit_code, "run": str(run.path), "collector": active,
            "processes": info.counts.get("processes", 0), "event_rows": info.counts.get("event_rows", 0),
            "log_lines": info.counts.get("log_lines", {}), "dropped_rows": info.dropped_records.get("sink_rows", 0)}


def _convert_be_segments(run: RunDir) -> dict[str, Any] | None:
    """Turn the profiler BE backend's exported segments (``RUN/be/``) into events files."""
    if not (run.path / "be").is_dir():
        return None
    try:
        out = convert_run(run.path)
    except Exception as e:
        out = {"failed": 1, "errors": [f"{type(e).__name__}: {e}"]}
    for err in out.get("errors", [])[:5]:
        print(f"[teller] BE segment not converted: {err}", file=sys.stderr)
    return out


def _finish_info(info: RunInfo, run: RunDir, rc: int, exit_code: int, end_ns: int,
                 readers: list[_StreamCapture], forwarded: list[str]) -> None:
    procs = read_proc_infos(run)
    info.exit_code = exit_code
    info.end_wall = end_ns / 1e9
    info.extra["status"] = "finished"
    if rc < 0:
        try:
            info.extra["killed_by"] = signal.Signals(-rc).name
        except ValueError:
            info.extra["killed_by"] = f"signal {-rc}"
    info.extra["signals_forwarded"] = forwarded
    info.extra["processes"] = procs
    info.ranks = [{"node": p.get("node", 0), "rank": p.get("rank", 0), "pid": p.get("pid"),
                   "ppid": p.get("ppid"), "argv": p.get("argv"), "status": p.get("status")} for p in procs]
    instrumentors: dict[str, dict[str, Any]] = {}
    dropped: dict[str, int] = {"sink_rows": 0}
    counts = {"processes": len(procs), "event_rows": 0, "hook_errors": 0, "unbalanced_pops": 0,
              "truncated_ranges": 0, "processes_unfinished": 0}
    for p in procs:
        sink = p.get("sink") or {}
        dropped["sink_rows"] += int(sink.get("dropped_rows", 0) or 0)
        counts["event_rows"] += int(sink.get("rows_written", 0) or 0)
        counts["hook_errors"] += sum((p.get("hook_errors") or {}).values())
        counts["processes_unfinished"] += p.get("status") != "exited"
        for name, ci in (p.get("collectors") or {}).items():
            counts["unbalanced_pops"] += int(ci.get("unbalanced_pops", 0) or 0)
            counts["truncated_ranges"] += int(ci.get("ranges_truncated", 0) or 0)
            d = ci.get("dropped_records", 0)
            if isinstance(d, dict):
                for k, v in d.items():
                    if isinstance(v, (int, float)):
                        dropped[f"{name}.{k}"] = dropped.get(f"{name}.{k}", 0) + int(v)
            elif isinstance(d, (int, float)):
                dropped[name] = dropped.get(name, 0) + int(d)
        for i in p.get("instrumentors") or []:
            e = instrumentors.setdefault(i.get("name", "?"), {"status": set(), "version": set(), "reasons": set()})
            e["status"].add(i.get("status"))
            if i.get("version"):
                e["version"].add(i["version"])
            if i.get("reason"):
                e["reasons"].add(i["reason"])
    info.engine["instrumentors"] = {k: {kk: sorted(str(x) for x in v) for kk, v in e.items()}
                                    for k, e in instrumentors.items()}
    info.engine["detected"] = sorted(k for k, e in instrumentors.items() if "patched" in e["status"]
                                     and k not in ("torch.distributed",))
    info.collector["active"] = sorted({(p.get("collector") or {}).get("active") or "none" for p in procs})
    fallbacks = {(p.get("collector") or {}).get("fallback_reason") for p in procs} - {None}
    if fallbacks:
        info.collector["fallback_reasons"] = sorted(fallbacks)
    info.dropped_records = dropped
    info.model_config = next((p["model_config"] for p in procs if p.get("model_config")), {})
    counts["log_lines"] = {r.stream: r.lines for r in readers}
    counts["log_bytes"] = {r.stream: r.bytes for r in readers}
    counts["event_files"] = len(run.event_files())
    errs = [e for r in readers for e in r.errors]
    if errs:
        info.extra["log_capture_errors"] = errs
    info.counts = counts


def _engine_notes(engine: str, hooks: str | None, collector: str, info: RunInfo) -> list[str]:
    """Say plainly when the requested recording did not happen (engine absent, wrong version)."""
    if collector == "none":
        return []
    notes = []
    insts = info.engine.get("instrumentors", {})
    detected = info.engine.get("detected", [])
    for name, e in insts.items():
        if "version-mismatch" in e["status"]:
            notes.append(f"{name} hooks stayed off: {'; '.join(e['reasons'])}")
    if engine not in ("auto", "generic") and engine not in detected:
        notes.append(f"--engine {engine}: no recorded process imported its modules; no {engine} ranges were recorded")
    elif engine == "auto" and not detected and info.counts.get("processes", 0):
        notes.append("no engine hooks fired (no transformers continuous batching, vLLM or SGLang module was "
                     "imported); use --hooks FILE for other engines")
    if info.counts.get("processes", 0) == 0:
        notes.append("no process started recording (none imported torch or a hooked module); "
                     "run.json and the logs are all there is")
    return notes


def read_proc_infos(run: RunDir) -> list[dict[str, Any]]:
    """The per-process files the runtime wrote (unreadable ones are reported, not fatal)."""
    out = []
    for f in sorted((run.path / "proc").glob("*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            out.append({"pid": f.stem, "status": "unreadable", "error": f"{type(e).__name__}: {e}"})
    return out
