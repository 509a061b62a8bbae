"""communication/network: straggler rank, throttled (chunked) collectives, tc netem link faults."""

from __future__ import annotations

import time
from typing import Any

from teller.inject.mechanisms import Mechanism, netns_unavailable


def _wrap_all_reduce(agent: Any, fault: dict[str, Any], body: Any) -> None:
    """Wrap ``torch.distributed.all_reduce`` outside the recorder's COMM wrapper."""

    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if not agent.active(fault):
            return wrapped(*args, **kwargs)
        return body(wrapped, args, kwargs)

    agent.wrap("torch.distributed", "all_reduce", wrapper)


class StragglerRank(Mechanism):
    name = "straggler_rank"
    category = "communication"
    knob = "delay before each all_reduce on the straggling rank (ms)"
    default_magnitude = 5.0
    targets = ("COMM all_reduce",)
    evidence = "comm"
    needs = ("tp",)
    cause = "one rank reaches every collective late, so the other ranks wait inside all_reduce"
    action = "check the late rank's host and GPU (load, clocks, placement) against the other ranks, then rebalance or replace it"

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        delay = float(fault["magnitude"]) / 1e3

        def body(wrapped: Any, args: Any, kwargs: Any) -> Any:
            time.sleep(delay)
            agent.count(fault, 1, "COMM all_reduce")
            return wrapped(*args, **kwargs)

        _wrap_all_reduce(agent, fault, body)


class ThrottledCollective(Mechanism):
    name = "throttled_collective"
    category = "communication"
    knob = "chunks each all_reduce is split into (a 0.2 ms gap after each chunk; windows by step so ranks agree)"
    default_magnitude = 16.0
    targets = ("COMM all_reduce",)
    evidence = "comm"
    needs = ("tp",)
    cause = "transfers are throttled: each collective is sent in many small chunks with gaps"
    action = "check the collective's transport settings (NCCL chunk, buffer and channel variables) and the link's utilisation"

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        chunks = max(1, int(fault["magnitude"]))
        gap = float((fault.get("params") or {}).get("gap_ms", 0.2)) / 1e3

        def body(wrapped: Any, args: Any, kwargs: Any) -> Any:
            tensor = args[0] if args else kwargs.get("tensor")
            flat = tensor.view(-1) if tensor is not None and tensor.is_contiguous() else None
            if flat is None or flat.numel() < chunks:
                return wrapped(*args, **kwargs)
            rest = dict(kwargs)
            rest.pop("tensor", None)
            out = None
            for piece in flat.chunk(chunks):
                out = wrapped(piece, *args[1:], **rest)
                time.sleep(gap)
            agent.count(fault, 1, "COMM all_reduce")
            return out

        _wrap_all_reduce(agent, fault, body)


class NetemLink(Mechanism):
    name = "netem_link"
    category = "communication"
    knob = "added link latency between the ranks' network namespaces (ms, tc netem delay)"
    default_magnitude = 2.0
    targets = ("COMM all_reduce",)
    evidence = "comm"
    where = "co_located"
    machine_wide = True
    needs = ("root", "tp")
    cause = "the link between ranks is slow (netem delay/loss), so every collective takes longer"
    action = "check the link between the ranks (errors, congestion, tc/netem rules) and move the ranks onto a faster one"

    def unavailable(self, ctx: dict[str, Any]) -> str | None:
        reason = super().unavailable(ctx) or netns_unavailable()
        if reason:
            return reason
        return ("netem needs each rank in its own network namespace joined by a veth pair; the "
                "tensor-parallel workload runs its ranks in one namespace over loopback, so there is "
                "no link to shape (multi-node/netns launcher not built yet)")


MECHANISMS = (StragglerRank, ThrottledCollective, NetemLink)
