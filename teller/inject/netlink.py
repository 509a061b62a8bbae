"""Network faults without ``ip`` or ``tc``: a private network namespace and queueing disciplines on
its loopback, through rtnetlink from the standard library.

The tensor-parallel workload's ranks talk over ``127.0.0.1`` (gloo over TCP, or NCCL's socket
transport); run inside a private namespace (``python -m teller.inject.netns -- CMD``), that
loopback carries only their traffic, so shaping it shapes the link between the ranks and nothing
else on the machine. Two disciplines are used: ``tbf`` (a token bucket: the link's bandwidth) and
``netem`` (a delay; absent from kernels built without ``sch_netem``). Messages are built by hand
(``struct``): a link change (``RTM_NEWLINK``) to bring the loopback up, and ``RTM_NEWQDISC`` /
``RTM_DELQDISC`` on its root. Every call waits for the kernel's acknowledgement and raises
:class:`NetlinkError` with the errno and what was asked.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_NEWQDISC, RTM_DELQDISC = 16, 36, 37
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_ERROR = 2
IFF_UP = 0x1
TC_H_ROOT = 0xFFFFFFFF
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_TBF_PARMS, TCA_TBF_RATE64, TCA_TBF_BURST = 1, 4, 6
TC_LINKLAYER_ETHERNET = 1
#: the kernel's packet-scheduler time unit: PSCHED_TICKS2NS(x) = x << 6
PSCHED_SHIFT = 6
CLONE_NEWNET = 0x40000000
LOOPBACK = 1  # the loopback's interface index in a fresh namespace


class NetlinkError(OSError):
    """The kernel refused a request (``errno`` set), or its answer could not be read."""


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def _request(kind: int, flags: int, body: bytes, what: str) -> None:
    """Send one rtnetlink request and wait for its acknowledgement."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as s:
        s.bind((0, 0))
        msg = struct.pack("=IHHII", 16 + len(body), kind, flags | NLM_F_REQUEST | NLM_F_ACK, 1, 0) + body
        s.send(msg)
        data = s.recv(65536)
    if len(data) < 20:
        raise NetlinkError(errno.EPROTO, f"{what}: short netlink answer ({len(data)} bytes)")
    _, mtype, _, _, _ = struct.unpack_from("=IHHII", data)
    if mtype != NLMSG_ERROR:
        raise NetlinkError(errno.EPROTO, f"{what}: unexpected netlink answer type {mtype}")
    (code,) = struct.unpack_from("=i", data, 16)
    if code:
        raise NetlinkError(-code, f"{what}: {os.strerror(-code)}")


def unshare_net() -> None:
    """Move this process into a new, private network namespace (its children follow)."""
    if hasattr(os, "unshare"):
        os.unshare(CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise NetlinkError(e, f"unshare(CLONE_NEWNET): {os.strerror(e)}")


def link_up(index: int = LOOPBACK) -> None:
    """Bring interface ``index`` up (a fresh namespace's loopback starts down)."""
    body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP)
    _request(RTM_NEWLINK, 0, body, f"bringing interface {index} up")


def _tcmsg(index: int, handle: int = 0x10000, parent: int = TC_H_ROOT) -> bytes:
    return struct.pack("=BxxxiIII", socket.AF_UNSPEC, index, handle, parent, 0)


def _ticks(ns: float) -> int:
    return min(int(ns) >> PSCHED_SHIFT, 0xFFFFFFFF)


def tbf_add(rate_bytes_s: int, burst_bytes: int, latency_s: float = 0.05, index: int = LOOPBACK) -> None:
    """A token bucket as the root discipline of ``index``: ``rate_bytes_s`` sustained, bursts of
    ``burst_bytes`` (at least the interface's MTU, 64 KiB on a loopback, or larger packets are
    dropped), packets queued up to ``latency_s`` of the rate."""
    if rate_bytes_s <= 0 or burst_bytes <= 0:
        raise ValueError("tbf: rate and burst must be > 0")
    rate32 = min(rate_bytes_s, 0xFFFFFFFF)
    ratespec = struct.pack("=BBHhHI", 0, TC_LINKLAYER_ETHERNET, 0, 0, 0, rate32)
    limit = min(int(rate_bytes_s * latency_s) + burst_bytes, 0xFFFFFFFF)
    buffer = _ticks(burst_bytes / rate_bytes_s * 1e9)
    qopt = ratespec + b"\0" * 12 + struct.pack("=III", limit, buffer, 0)
    opts = _attr(TCA_TBF_PARMS, qopt) + _attr(TCA_TBF_BURST, struct.pack("=I", burst_bytes))
    if rate_bytes_s > 0xFFFFFFFF:
        opts += _attr(TCA_TBF_RATE64, struct.pack("=Q", rate_bytes_s))
    body = _tcmsg(index) + _attr(TCA_KIND, b"tbf\0") + _attr(TCA_OPTIONS, opts)
    _request(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, body, f"adding tbf ({rate_bytes_s} B/s, burst {burst_bytes} B) on interface {index}")


def netem_add(delay_s: float, limit_packets: int = 10000, index: int = LOOPBACK) -> None:
    """A netem delay of ``delay_s`` on every packet as the root discipline of ``index``
    (``ENOENT`` where the kernel has no ``sch_netem``)."""
    qopt = struct.pack("=IIIIII", _ticks(delay_s * 1e9), limit_packets, 0, 0, 0, 0)
    body = _tcmsg(index) + _attr(TCA_KIND, b"netem\0") + _attr(TCA_OPTIONS, qopt)
    _request(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, body, f"adding netem ({delay_s * 1e3:g} ms) on interface {index}")


def root_qdisc_del(index: int = LOOPBACK) -> None:
    """Remove the root discipline of ``index`` (back to the default)."""
    _request(RTM_DELQDISC, 0, _tcmsg(index, handle=0), f"removing the root qdisc of interface {index}")
