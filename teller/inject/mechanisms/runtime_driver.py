"""runtime/driver: allocator churn, hidden host syncs, pageable instead of pinned copies."""

from __future__ import annotations

from typing import Any

from teller.inject.mechanisms import Mechanism


class AllocatorChurn(Mechanism):
    name = "allocator_churn"
    category = "runtime"
    knob = "memory allocated, touched and freed at the start of every step (MiB)"
    default_magnitude = 64.0
    targets = ("BE aten::empty", "BE aten::fill_")
    evidence = "step"
    cpu_analogue = "host allocation touched and freed each step (page faults, mmap/munmap)"
    cause = "the caching allocator is emptied every step, so memory is returned and re-allocated (cudaFree/cudaMalloc)"
    action = "remove the per-step cache emptying (torch.cuda.empty_cache or allocator resets) so the caching allocator stays warm"

    def unavailable(self, ctx: dict[str, Any]) -> str | None:
        return None

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        mib = float(fault["magnitude"])
        gpu = agent.gpu_device

        def churn() -> None:
            if not agent.active(fault):
                return
            import torch

            if gpu:
                torch.cuda.empty_cache()
                x = torch.empty(int(mib * (1 << 20)), dtype=torch.uint8, device="cuda")
                x.fill_(1)
                del x
                torch.cuda.empty_cache()
            else:
                x = torch.empty(int(mib * (1 << 20)), dtype=torch.uint8)
                x.fill_(1)
                del x
            agent.count(fault, 1, "STEP")

        agent.on_step_begin(churn)


class HiddenHostSync(Mechanism):
    name = "hidden_host_sync"
    category = "runtime"
    knob = "forced host syncs (.item() / synchronize) per call of the targeted operator"
    default_magnitude = 200.0
    targets = ("Attention",)
    evidence = "targets"
    cpu_analogue = "forced .item() on a reduction of the operator's input (a host read-back per call)"
    cause = "host synchronizations hidden inside the operator (.item(), torch.cuda.synchronize) stall the launch queue"
    action = "remove the host synchronizations (.item(), torch.cuda.synchronize) from the named operator's path"

    def unavailable(self, ctx: dict[str, Any]) -> str | None:
        return None

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        n = max(1, int(fault["magnitude"]))
        gpu = agent.gpu_device

        def sync(module: Any, cls: str) -> None:
            if not agent.active(fault):
                return
            import torch

            w = next(iter(module.parameters()), None)
            if w is None:
                return
            for _ in range(n):
                w.view(-1)[:1].sum().item()
                if gpu:
                    torch.cuda.synchronize()
            agent.count(fault, 1, f"FE {cls}")

        agent.on_module(tuple(fault.get("targets") or self.targets), sync)


class PageableCopies(Mechanism):
    name = "pageable_copies"
    category = "runtime"
    knob = "host→device copy from pageable memory per call of the targeted operator (MiB)"
    default_magnitude = 64.0
    targets = ("DecoderLayer",)
    evidence = "targets"
    needs = ("gpu",)
    cause = "copies from pageable (unpinned) host memory are staged and synchronous, blocking the host"
    action = "pin the host buffers (pin_memory=True) so host-to-device copies run asynchronously"

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        nbytes = int(float(fault["magnitude"]) * (1 << 20))
        buf: list[Any] = []

        def copy(module: Any, cls: str) -> None:
            if not agent.active(fault):
                return
            import torch

            if not buf:
                buf.append(torch.ones(nbytes, dtype=torch.uint8))  # pageable on purpose
            buf[0].to("cuda", non_blocking=True)
            agent.count(fault, 1, f"FE {cls}")

        agent.on_module(tuple(fault.get("targets") or self.targets), copy)


MECHANISMS = (AllocatorChurn, HiddenHostSync, PageableCopies)
