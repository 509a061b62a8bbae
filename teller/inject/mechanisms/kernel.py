"""CUDA/kernel: a targeted operator slowed by extra device work; co-located compute contention."""

from __future__ import annotations

import time
from typing import Any

from teller.inject.mechanisms import Mechanism


def busy_wait_us(us: float) -> None:
    """Spin on the calling thread for ``us`` µs (holds the GIL, like host-side kernel work)."""
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


class TargetedOpDelay(Mechanism):
    name = "targeted_op_delay"
    category = "kernel"
    knob = "extra work per call of the targeted operator (µs)"
    default_magnitude = 2000.0
    targets = ("MLP",)
    evidence = "targets"
    cpu_analogue = "busy-wait of the same length on the host inside the targeted operator"
    cause = "extra device work inside the targeted operator (torch.cuda._sleep) lengthens its kernels"
    action = "check the named operator's kernels against a fault-free run and the recent changes to that operator"

    def unavailable(self, ctx: dict[str, Any]) -> str | None:
        return None  # GPU: torch.cuda._sleep; CPU: the busy-wait analogue

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        us = float(fault["magnitude"])
        gpu = agent.gpu_device
        cycles_per_us = [0.0]

        def inject(module: Any, cls: str) -> None:
            if not agent.active(fault):
                return
            if gpu:
                import torch

                if not cycles_per_us[0]:
                    props = torch.cuda.get_device_properties(torch.cuda.current_device())
                    cycles_per_us[0] = float(getattr(props, "clock_rate", 1_500_000)) / 1e3  # kHz → cycles/µs
                torch.cuda._sleep(int(us * cycles_per_us[0]))
            else:
                busy_wait_us(us)
            agent.count(fault, 1, f"FE {cls}")

        agent.on_module(tuple(fault.get("targets") or self.targets), inject)


class GpuComputeContention(Mechanism):
    name = "gpu_compute_contention"
    category = "kernel"
    knob = "matrix size N of back-to-back N×N bf16 matmuls in a co-located process"
    default_magnitude = 8192.0
    targets = ()
    evidence = "step"
    where = "co_located"
    machine_wide = True
    needs = ("gpu",)
    cause = "a co-located process keeps the GPU's SMs busy with matmuls, so the engine's kernels queue"
    action = "check nvidia-smi for other processes on the engine's GPU and give the engine a GPU (or MIG/MPS share) of its own"

    def start(self, agent: Any, fault: dict[str, Any]) -> None:
        dev = int((fault.get("params") or {}).get("device", 0))
        agent.spawn(fault, ["gpu-compute", "--n", str(int(fault["magnitude"])), "--device", str(dev)])


MECHANISMS = (TargetedOpDelay, GpuComputeContention)
