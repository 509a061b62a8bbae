"""memory/resource: host CPU contention, GPU memory-bandwidth hog, KV-cache pressure."""

from __future__ import annotations

import os
from typing import Any

from teller.inject.mechanisms import Mechanism


class HostCpuContention(Mechanism):
    name = "host_cpu_contention"
    category = "memory"
    knob = "busy processes per engine core (count)"
    default_magnitude = 2.0
    targets = ()  # everything on the host slows: the locator is measured
    evidence = "step"
    where = "co_located"
    cause = "co-located busy processes pinned to the engine's cores take CPU time from its host threads"
    action = "check for other processes on the engine's CPU cores and pin the engine to cores of its own"

    def start(self, agent: Any, fault: dict[str, Any]) -> None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        n = max(1, int(round(float(fault["magnitude"]) * max(1, len(cpus)))))
        agent.spawn(fault, ["cpu", "--procs", str(n), "--cpus", ",".join(map(str, cpus))])
        agent.windows[fault["id"]]["extra"].update(cpus=cpus, procs=n)


class GpuMemBandwidthHog(Mechanism):
    name = "gpu_membw_hog"
    category = "memory"
    knob = "buffer copied back and forth on the engine's GPU (MiB)"
    default_magnitude = 2048.0
    targets = ()
    evidence = "step"
    where = "co_located"
    machine_wide = True
    needs = ("gpu",)
    cause = "a co-located process saturates the GPU's memory bandwidth with device-to-device copies"
    action = "check nvidia-smi for co-located processes copying on the engine's GPU and move them to another device"

    def start(self, agent: Any, fault: dict[str, Any]) -> None:
        dev = int((fault.get("params") or {}).get("device", 0))
        agent.spawn(fault, ["gpu-membw", "--mb", str(int(fault["magnitude"])), "--device", str(dev)])


class KvCachePressure(Mechanism):
    name = "kv_cache_pressure"
    category = "memory"
    knob = "KV-cache blocks given to the engine (fewer = more pressure; requests get offloaded/re-prefilled)"
    default_magnitude = 2.0
    targets = ("OTHER schedule", "OTHER update_batch")
    evidence = "step"
    where = "workload"
    needs = ("transformers_cb",)
    cause = "too few KV-cache blocks: the scheduler offloads (soft-resets) requests and prefills them again"
    action = "increase the KV-cache blocks (the engine's GPU memory share) or reduce the maximum number of running sequences"
    #: the engine's own record of the effect: a step with an aligned offload/preemption line shows it
    #: even when it is not slow (the pressure makes many small steps rather than slow ones)
    log_pattern = r"(?i)\boffload(ed|ing)?\b.*\brequests?\b|\bpreempt"

    def workload_args(self, fault: dict[str, Any]) -> list[str]:
        return ["--num-blocks", str(max(1, int(fault["magnitude"])))]


MECHANISMS = (HostCpuContention, GpuMemBandwidthHog, KvCachePressure)
