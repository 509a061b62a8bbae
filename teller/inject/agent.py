"""The fault agent inside a recorded engine process (the plan comes in ``TELLER_FAULTS``).

The campaign names :func:`install` in ``TELLER_EXTENSIONS``; the recording bootstrap
(``teller/record/bootstrap/sitecustomize.py``) calls it with the runtime right after the
recorder's own hooks are registered, so the agent's wrappers sit outside the recorder's (a delay
added "before a collective" is then outside that collective's COMM range, as a straggler's is).
The plan is JSON::

    {"run_id": "...", "faults": [{"id": "f0", "mechanism": "targeted_op_delay", "category": "kernel",
      "magnitude": 2000, "start_s": 0.2, "duration_s": 1.0, "targets": ["MLP"], "rank": null}, ...]}

Windows start ``start_s`` seconds after the first engine STEP of this process (model loading
time varies, the step loop is what the faults are about) and last ``duration_s`` (``null``:
until exit). The agent records each window's actual τ edges (:mod:`teller.record.clock`), the
steps begun by each edge (``steps_at_start``/``steps_at_end``), the number of injections made
and the operators actually hit into ``RUN/inject/<pid>.json``, written at each edge, so a
crashed run keeps what happened until then.

A window is reached however fast the machine runs: the agent hooks the workload's
:func:`teller.workload.serve.keep_serving`, which then holds while a window of this process has
not reached its planned end (:meth:`Agent.windows_pending`), so the workload keeps admitting
requests until then. An engine without that hook ends when it ends; the windows it never
reached stay ``pending`` and the campaign reports them (``labels.json`` ``unapplied``).

Like the recorder, the agent imports nothing heavy at load, never raises into the engine (a
failing hook is counted in the file and the engine carries on).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import wrapt

from teller.inject import ENV_FAULTS
from teller.inject.mechanisms import registry
from teller.record import clock
from teller.record.instrument.base import register_post_import

AGENT: "Agent | None" = None


class Agent:
    """Applies one process's share of a fault plan."""

    def __init__(self, plan: dict[str, Any], runtime_mod: Any):
        self.rt = runtime_mod
        self.plan = plan
        self.run_dir = os.environ.get("TELLER_RUN_DIR", "")
        self.rank = _int(os.environ.get("RANK"), 0)
        self.pid = os.getpid()
        self.gpu_device = bool(plan.get("gpu_device"))
        reg = registry()
        self.faults: list[dict[str, Any]] = []
        for f in plan.get("faults", []):
            if f.get("rank") is not None and int(f["rank"]) != self.rank:
                continue
            if f.get("mechanism") not in reg:
                continue
            self.faults.append(dict(f))
        self.mechs = {f["id"]: reg[f["mechanism"]] for f in self.faults}
        self._active: dict[str, bool] = {f["id"]: False for f in self.faults}
        self.windows: dict[str, dict[str, Any]] = {
            f["id"]: {"id": f["id"], "mechanism": f["mechanism"], "category": f.get("category"),
                      "magnitude": f.get("magnitude"), "targets": list(f.get("targets") or []),
                      "pid": self.pid, "rank": self.rank, "start_tau_ns": None, "end_tau_ns": None,
                      "injections": 0, "targets_hit": [], "errors": [], "state": "pending",
                      "steps_at_start": None, "steps_at_end": None, "implementation": None, "extra": {}}
            for f in self.faults}
        self.first_step_tau: int | None = None
        self.last_step_end_tau: int | None = None
        self.steps_seen = 0
        self._first_step = threading.Event()
        self._lock = threading.Lock()
        self._step_begin: list[Callable[[], None]] = []
        self._module_hooks: list[tuple[tuple[str, ...], Callable[[Any, str], None]]] = []
        self._module_hook_installed = False
        self._children: dict[str, list[subprocess.Popen]] = {}
        self._stopped = False
        #: faults whose window is given in steps (start_step, steps): ranks in lockstep agree on it
        self._by_step = [f for f in self.faults if f.get("start_step") is not None]

    def _step_edges(self) -> None:
        n = self.steps_seen - 1  # index of the step that just opened
        for f in self._by_step:
            start = int(f["start_step"])
            if n == start:
                self._start(f)
            elif f.get("steps") is not None and n == start + int(f["steps"]):
                self._stop(f)

    def windows_pending(self) -> bool:
        """Whether a window of this process has yet to reach its planned end: not opened yet, or
        open with a length (``steps`` or ``duration_s``) still running. A window without a
        length lasts until exit and keeps nothing waiting."""
        for f in self.faults:
            state = self.windows[f["id"]]["state"]
            if state == "pending" or (state == "open" and (f.get("steps") is not None
                                                           or f.get("duration_s") is not None)):
                return True
        return False

    def arrivals_wanted(self) -> bool:
        """Whether an open window's mechanism acts on request arrivals (``Mechanism.on_arrivals``)."""
        return any(self.windows[f["id"]]["state"] == "open" and getattr(self.mechs[f["id"]], "on_arrivals", False)
                   for f in self.faults)

    def _or_workload(self, what: str, own: Callable[[], bool], wrapped: Callable, args: Any, kwargs: Any) -> bool:
        """A workload question hooked by the agent: the workload's own answer, or the agent's ``own()``."""
        try:
            return bool(wrapped(*args, **kwargs)) or own()
        except Exception as e:  # never into the engine
            self.rt.hook_failed(f"fault agent {what}", e)
            return False

    def _wants_arrivals(self, wrapped: Callable, instance: Any, args: Any, kwargs: Any) -> bool:
        return self._or_workload("wants_arrivals", self.arrivals_wanted, wrapped, args, kwargs)

    def _keep_serving(self, wrapped: Callable, instance: Any, args: Any, kwargs: Any) -> bool:
        return self._or_workload("keep_serving", self.windows_pending, wrapped, args, kwargs)

    # ---- helpers for mechanisms ------------------------------------------------------------
    def active(self, fault: dict[str, Any]) -> bool:
        return self._active.get(fault["id"], False)

    def tau(self) -> int:
        return clock.tau_now()

    def count(self, fault: dict[str, Any], n: int = 1, target: str | None = None) -> None:
        w = self.windows[fault["id"]]
        w["injections"] += n
        if target and target not in w["targets_hit"]:
            w["targets_hit"].append(target)

    def error(self, fault: dict[str, Any], where: str, exc: BaseException) -> None:
        errs = self.windows[fault["id"]]["errors"]
        if len(errs) < 5:
            errs.append(f"{where}: {type(exc).__name__}: {exc}")

    def on_step_begin(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the step's thread right after each STEP range opens."""
        self._step_begin.append(fn)

    def on_module(self, suffixes: tuple[str, ...], fn: Callable[[Any, str], None]) -> None:
        """Run ``fn(module, class_name)`` inside every forward of modules whose class name ends
        with one of ``suffixes`` (from a pre-hook on the module's first child, so inside the
        module's FE range whichever way it was recorded)."""
        self._module_hooks.append((tuple(suffixes), fn))
        if not self._module_hook_installed:
            self._module_hook_installed = True
            register_post_import("torch.nn.modules.module", self._install_global_hook, self.rt.hook_failed)

    def wrap(self, module_name: str, path: str, wrapper: Callable) -> None:
        """wrapt-wrap ``module_name:path`` when the module is imported."""

        def patch(mod: Any) -> None:
            wrapt.wrap_function_wrapper(mod, path, wrapper)

        register_post_import(module_name, patch, self.rt.hook_failed)

    def spawn(self, fault: dict[str, Any], argv: list[str]) -> None:
        """Start a co-located process beside the engine (not recorded; killed at window end)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TELLER_", "NVTX_INJECTION"))}
        boot = os.path.join(os.environ.get("TELLER_HOME", ""), "teller", "record", "bootstrap")
        env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                            if p and os.path.abspath(p) != os.path.abspath(boot))
        home = os.environ.get("TELLER_HOME")
        if home:
            env["PYTHONPATH"] = os.pathsep.join([home] + ([env["PYTHONPATH"]] if env["PYTHONPATH"] else []))
        p = subprocess.Popen([sys.executable, "-m", "teller.inject.hogs", *argv, "--parent", str(os.getpid())], env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._children.setdefault(fault["id"], []).append(p)
        self.windows[fault["id"]]["extra"].setdefault("pids", []).append(p.pid)

    def kill_children(self, fault: dict[str, Any]) -> None:
        for p in self._children.pop(fault["id"], []):
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=2)
            except Exception:
                try:
                    p.kill()
                except Exception:
                    pass

    # ---- installation ----------------------------------------------------------------------
    def install(self) -> None:
        self._wrap_runtime()
        for f in self.faults:
            m = self.mechs[f["id"]]
            self.windows[f["id"]]["implementation"] = m.implementation({"gpu_device": self.gpu_device})
            try:
                m.install(self, f)
            except Exception as e:
                self.error(f, "install", e)
        self.write()
        if self.faults:
            self.wrap("teller.workload.serve", "keep_serving", self._keep_serving)
            self.wrap("teller.workload.serve", "wants_arrivals", self._wants_arrivals)
            threading.Thread(target=self._schedule, name="teller-faults", daemon=True).start()
        atexit.register(self.at_exit)

    def _wrap_runtime(self) -> None:
        rt = self.rt
        orig_push, orig_pop = rt.push_step, rt.pop_step
        agent = self

        def push_step(msg: str) -> None:
            orig_push(msg)
            try:
                agent.steps_seen += 1
                if agent.first_step_tau is None:
                    agent.first_step_tau = agent.tau()
                    agent._first_step.set()
                if agent._by_step:
                    agent._step_edges()
                for fn in agent._step_begin:
                    fn()
            except Exception as e:  # never into the engine
                rt.hook_failed("fault agent step begin", e)

        def pop_step() -> None:
            orig_pop()
            try:
                agent.last_step_end_tau = agent.tau()
            except Exception:
                pass

        rt.push_step, rt.pop_step = push_step, pop_step

    def _install_global_hook(self, module_mod: Any) -> None:
        seen: dict[type, str | None] = {}
        hooked: set[int] = set()
        agent = self

        def match(cls: type) -> str | None:
            if cls not in seen:
                name = cls.__name__
                seen[cls] = name if any(name.endswith(s) for hs, _ in agent._module_hooks for s in hs) else None
            return seen[cls]

        def global_pre(module: Any, args: Any) -> None:
            try:
                name = match(type(module))
                if name is None or id(module) in hooked:
                    return
                hooked.add(id(module))
                fns = [fn for hs, fn in agent._module_hooks if name.endswith(hs)]
                child = next(iter(module.children()), None)

                def inner(_m: Any, _a: Any) -> None:
                    for fn in fns:
                        try:
                            fn(module, name)
                        except Exception as e:
                            rt_hook_failed(e)

                if child is not None:
                    child.register_forward_pre_hook(inner)
                else:  # a leaf: the work lands just before it, in its parent's time
                    module.register_forward_pre_hook(inner)
            except Exception as e:
                rt_hook_failed(e)

        def rt_hook_failed(e: BaseException) -> None:
            self.rt.hook_failed("fault agent module hook", e)

        module_mod.register_module_forward_pre_hook(global_pre)

    # ---- scheduling ------------------------------------------------------------------------
    def _schedule(self) -> None:
        self._first_step.wait()
        base = time.perf_counter() - (self.tau() - (self.first_step_tau or self.tau())) / 1e9
        events: list[tuple[float, int, dict[str, Any]]] = []
        for f in self.faults:
            if f.get("start_step") is not None:
                continue
            events.append((float(f.get("start_s") or 0.0), 1, f))
            if f.get("duration_s") is not None:
                events.append((float(f["start_s"] or 0.0) + float(f["duration_s"]), 0, f))
        events.sort(key=lambda e: (e[0], e[1]))
        for at, is_start, f in events:
            delay = base + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if self._stopped:
                return
            if is_start:
                self._start(f)
            else:
                self._stop(f)

    def _start(self, f: dict[str, Any]) -> None:
        w = self.windows[f["id"]]
        if w["state"] != "pending":
            return
        w["start_tau_ns"] = self.tau()
        w["steps_at_start"] = self.steps_seen
        w["state"] = "open"
        self._active[f["id"]] = True
        try:
            self.mechs[f["id"]].start(self, f)
        except Exception as e:
            self.error(f, "start", e)
        self.write()

    def _stop(self, f: dict[str, Any], at_exit: bool = False) -> None:
        w = self.windows[f["id"]]
        if w["state"] != "open":
            return
        self._active[f["id"]] = False
        try:
            self.mechs[f["id"]].stop(self, f)
        except Exception as e:
            self.error(f, "stop", e)
        self.kill_children(f)
        end = self.tau()
        if at_exit and f.get("duration_s") is None and self.last_step_end_tau is not None:
            end = min(end, self.last_step_end_tau)
        w["end_tau_ns"] = end
        w["steps_at_end"] = self.steps_seen
        w["state"] = "closed-at-exit" if at_exit else "closed"
        self.write()

    def at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        self._stopped = True
        for f in self.faults:
            self._stop(f, at_exit=True)
        self.write()

    def write(self) -> None:
        if not self.run_dir:
            return
        try:
            d = os.path.join(self.run_dir, "inject")
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"{self.pid}.json")
            with self._lock:
                doc = {"pid": self.pid, "rank": self.rank, "first_step_tau_ns": self.first_step_tau,
                       "last_step_end_tau_ns": self.last_step_end_tau, "steps_seen": self.steps_seen,
                       "windows": list(self.windows.values())}
                with open(path + ".tmp", "w") as fh:
                    json.dump(doc, fh, default=str)
                os.replace(path + ".tmp", path)
        except Exception as e:
            self.rt.log(f"fault agent cannot write its windows ({type(e).__name__}: {e})", key="inject-write")


def _int(v: str | None, default: int) -> int:
    try:
        return int(v) if v not in (None, "") else default
    except ValueError:
        return default


def install(runtime_mod: Any) -> "Agent | None":
    """Read ``TELLER_FAULTS`` and apply this process's share of the plan through the recording
    runtime ``runtime_mod`` (idempotent per pid; nothing without a plan)."""
    global AGENT
    if AGENT is not None and AGENT.pid == os.getpid():
        return AGENT
    raw = os.environ.get(ENV_FAULTS)
    if not raw:
        return None
    plan = json.loads(raw)
    AGENT = Agent(plan, runtime_mod)
    AGENT.install()
    return AGENT
