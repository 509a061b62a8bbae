"""The mechanism registry: one class per mechanism, grouped by category in one file each.

A mechanism states its ``category`` (one of :data:`teller.inject.CATEGORIES`), its magnitude
knob (``knob``: what the number means, with its unit, and ``default_magnitude``), the operators
it targets (``targets``: the operator locator written into the labels; ``*MLP`` style suffixes
are resolved to the classes actually hit), how its effect is measured (``evidence``), where it
acts (``where``: ``in_process`` through hooks in the engine process, ``co_located`` as separate
processes beside the engine, ``workload`` through the workload's own configuration) and what it
needs (:meth:`Mechanism.unavailable` says why it cannot run here, or None).

The agent (:mod:`teller.inject.agent`) calls :meth:`install` once per engine process, then
:meth:`start` / :meth:`stop` at the window's edges. Per-call mechanisms check
``agent.active(fault)`` inside their hooks, so outside their window they cost one dict lookup.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

#: evidence kinds: which part of a step the labeller measures
EVIDENCE = ("targets", "step", "comm", "admission")
WHERE = ("in_process", "co_located", "workload")


class Mechanism:
    """Base class; subclasses set the class attributes and override the hooks they need."""

    name = "base"
    category = ""
    knob = ""
    default_magnitude: float = 1.0
    targets: tuple[str, ...] = ()
    evidence = "step"
    #: a regex over the step's aligned log lines that also shows the effect (the engine logging it)
    log_pattern: str | None = None
    where = "in_process"
    #: acts on the whole machine (a shared GPU, the network): runs with it are recorded alone when a
    #: campaign records several runs at once (host CPU contention is pinned to the engine's cores)
    machine_wide = False
    needs: tuple[str, ...] = ()  # subset of: gpu, root, tp, transformers_cb
    #: acts on request arrivals: while its window is open the workload's extra requests arrive
    #: on time, even where the engine fell behind (teller.workload.serve.wants_arrivals)
    on_arrivals = False
    #: the rank a fault of a tensor-parallel run targets when its spec names none (None: every rank)
    default_rank: int | None = None
    #: what the CPU run does instead when the GPU original cannot run (None: GPU only)
    cpu_analogue: str | None = None
    cause = ""
    #: the next step an operator can take when this is the cause (``teller diagnose``'s explanation)
    action = ""

    # ---- where it can run --------------------------------------------------------------------
    def unavailable(self, ctx: dict[str, Any]) -> str | None:
        """Why this mechanism cannot run in ``ctx`` (device, gpu, tp, workload, root), or None."""
        if "gpu" in self.needs and not ctx.get("gpu"):
            return f"{self.name} needs a CUDA GPU (none visible here)" + (
                f"; on the CPU it runs as: {self.cpu_analogue}" if self.cpu_analogue else "")
        if "tp" in self.needs and int(ctx.get("tp", 1)) < 2:
            return f"{self.name} needs the tensor-parallel workload (workload.tp >= 2)"
        if "transformers_cb" in self.needs and ctx.get("workload") not in ("serve", None):
            return f"{self.name} hooks transformers continuous batching; the {ctx.get('workload')} workload has none"
        if "root" in self.needs and os.geteuid() != 0:
            return f"{self.name} needs root (network namespaces, tc)"
        return None

    def implementation(self, ctx: dict[str, Any]) -> str:
        """Which variant runs in ``ctx`` (the GPU original or the CPU analogue)."""
        if self.cpu_analogue and not ctx.get("gpu_device"):
            return "cpu-analogue: " + self.cpu_analogue
        return "native"

    def workload_args(self, fault: dict[str, Any]) -> list[str]:
        """Extra workload command-line arguments (``where == "workload"``)."""
        return []

    def launch_prefix(self, fault: dict[str, Any]) -> list[str]:
        """A command the workload is started through (e.g. into a private network namespace)."""
        return []

    # ---- in the engine process (agent side) -------------------------------------------------
    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        """Register hooks (post-import); called once when the agent loads."""

    def start(self, agent: Any, fault: dict[str, Any]) -> None:
        """The window opens."""

    def stop(self, agent: Any, fault: dict[str, Any]) -> None:
        """The window closes (also at exit when still open)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "category": self.category, "knob": self.knob,
                "default_magnitude": self.default_magnitude, "targets": list(self.targets),
                "evidence": self.evidence, "where": self.where, "machine_wide": self.machine_wide,
                "log_pattern": self.log_pattern, "needs": list(self.needs),
                "cpu_analogue": self.cpu_analogue, "cause": self.cause, "action": self.action}


_MODULES = ("memory", "kernel", "runtime_driver", "communication", "scheduling")
_REGISTRY: dict[str, Mechanism] | None = None


def registry() -> dict[str, Mechanism]:
    """name → mechanism instance, for every mechanism of every category."""
    global _REGISTRY
    if _REGISTRY is None:
        reg: dict[str, Mechanism] = {}
        for m in _MODULES:
            mod = importlib.import_module(f"teller.inject.mechanisms.{m}")
            for cls in getattr(mod, "MECHANISMS", ()):
                inst = cls()
                reg[inst.name] = inst
        _REGISTRY = reg
    return _REGISTRY


def get(name: str) -> Mechanism:
    return registry()[name]
