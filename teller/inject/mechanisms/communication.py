"""communication/network: straggler rank, throttled (chunked) collectives, and link faults on the
ranks' own network (a private namespace's loopback: a token-bucket bandwidth limit, a netem delay)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from teller.inject.mechanisms import Mechanism


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
    default_rank = 1
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


class _LinkFault(Mechanism):
    """A queueing discipline on the link between the ranks: the workload runs in a private network
    namespace (``teller.inject.netns``), whose loopback carries the ranks' traffic and nothing
    else; the targeted rank's agent (rank 0 by default) adds the discipline when the window opens
    and removes it when it closes (rtnetlink, :mod:`teller.inject.netlink`). Every all_reduce in
    the window is counted as an injection on that rank."""

    category = "communication"
    targets = ("COMM all_reduce",)
    evidence = "comm"
    needs = ("root", "tp")
    default_rank = 0  # one agent shapes the ranks' shared loopback
    qdisc = ""

    def unavailable(self, ctx: dict[str, Any]) -> str | None:
        from teller.inject.netns import unavailable

        return super().unavailable(ctx) or unavailable(self.qdisc)

    def launch_prefix(self, fault: dict[str, Any]) -> list[str]:
        return [sys.executable, "-m", "teller.inject.netns", "--"]

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        def body(wrapped: Any, args: Any, kwargs: Any) -> Any:
            agent.count(fault, 1, "COMM all_reduce")
            return wrapped(*args, **kwargs)

        _wrap_all_reduce(agent, fault, body)

    @staticmethod
    def check_private() -> None:
        """Refuse to shape a loopback that is not the workload's own: this process must be in the
        namespace ``teller.inject.netns`` made for it (its inode in ``TELLER_NETNS``), not in the
        one it was started from."""
        from teller.inject.netns import ENV_NETNS, namespace_inode

        made = os.environ.get(ENV_NETNS, "")
        try:
            own = namespace_inode()
        except OSError as e:
            raise RuntimeError(f"cannot read this process's network namespace ({e}); no qdisc added") from None
        if not made or made.split(":")[1:] != [str(own)] or made.split(":")[0] == str(own):
            raise RuntimeError("this process is not in the network namespace `python -m teller.inject.netns --` makes, so "
                               "a link fault would shape a loopback it does not own; start the workload through it "
                               "(`teller inject run` does)")

    def start(self, agent: Any, fault: dict[str, Any]) -> None:
        from teller.inject import netlink

        self.check_private()
        self.add_qdisc(netlink, fault)

    def add_qdisc(self, netlink: Any, fault: dict[str, Any]) -> None:
        raise NotImplementedError

    def stop(self, agent: Any, fault: dict[str, Any]) -> None:
        from teller.inject import netlink

        netlink.root_qdisc_del()


class LinkThrottle(_LinkFault):
    name = "link_throttle"
    knob = "bandwidth of the link between the ranks (Mbit/s; a tbf token bucket on their private loopback, bursts of params.burst_kib, default 256 KiB)"
    default_magnitude = 200.0
    qdisc = "tbf"
    cause = "the link between the ranks has too little bandwidth, so the transfer of every collective takes longer"
    action = "check the link between the ranks (its rate, shaping rules, congestion, a degraded port) and move the ranks onto a faster one"

    def add_qdisc(self, netlink: Any, fault: dict[str, Any]) -> None:
        burst = int(float((fault.get("params") or {}).get("burst_kib", 256)) * 1024)
        netlink.tbf_add(int(float(fault["magnitude"]) * 1e6 / 8), burst)


class NetemLink(_LinkFault):
    name = "netem_link"
    knob = "added latency on the link between the ranks (ms; a netem delay on their private loopback)"
    default_magnitude = 2.0
    qdisc = "netem"
    cause = "the link between ranks is slow (netem delay/loss), so every collective takes longer"
    action = "check the link between the ranks (errors, congestion, tc/netem rules) and move the ranks onto a faster one"

    def add_qdisc(self, netlink: Any, fault: dict[str, Any]) -> None:
        netlink.netem_add(float(fault["magnitude"]) / 1e3)


MECHANISMS = (StragglerRank, ThrottledCollective, LinkThrottle, NetemLink)
