"""Can this machine delay network traffic for a fault (netem), and how? (issue 12, dataset v2)

    python3 scripts/gpu/netem_probe.py OUT.json

(On the GPU machine, which has no network: carry ``wheels/`` with pyroute2's wheel, ``pip download
pyroute2 --no-deps -d wheels``, and ``pip install --no-index wheels/pyroute2-*.whl`` first.)

Reports the tools and rights a netem fault needs (``ip``/``tc`` on PATH, the effective
capabilities, the ``sch_netem`` module), then tries, in a child process, a private network
namespace (``os.unshare(CLONE_NEWNET)``), loopback up and a netem delay on it through netlink
(pyroute2, when importable), and measures TCP round trips on loopback without and with the delay.
Nothing here changes the machine outside the child's own namespace.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any


def _cap_eff() -> dict[str, Any]:
    try:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("CapEff"))
        v = int(line.split()[1], 16)
        return {"hex": hex(v), "net_admin": bool(v >> 12 & 1), "sys_admin": bool(v >> 21 & 1)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _rtt_us(n: int = 200) -> float:
    """Median TCP round trip on loopback (one byte each way), in µs."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def echo() -> None:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            b = c.recv(1)
            if not b:
                break
            c.sendall(b)
        c.close()

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    cl = socket.create_connection(("127.0.0.1", port))
    cl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        cl.sendall(b"x")
        cl.recv(1)
        out.append((time.perf_counter() - t0) * 1e6)
    cl.close()
    srv.close()
    out.sort()
    return out[len(out) // 2]


def _bulk_mb_s(nbytes: int = 16 * 2**20) -> float:
    """Throughput of one TCP transfer of ``nbytes`` on loopback, MB/s."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = [0]

    def sink() -> None:
        c, _ = srv.accept()
        while got[0] < nbytes:
            b = c.recv(1 << 20)
            if not b:
                break
            got[0] += len(b)
        c.close()

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    cl = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    cl.sendall(b"\0" * nbytes)
    t.join(60)
    dt = time.perf_counter() - t0
    cl.close()
    srv.close()
    return got[0] / dt / 1e6


def _child(res_path: str) -> None:
    res: dict[str, Any] = {}
    try:
        if hasattr(os, "unshare"):  # Python 3.12+
            os.unshare(os.CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        res["unshare_newnet"] = "ok"
    except Exception as e:
        res["unshare_newnet"] = f"{type(e).__name__}: {e}"
        Path(res_path).write_text(json.dumps(res))
        return
    try:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            lo = ipr.link_lookup(ifname="lo")[0]
            ipr.link("set", index=lo, state="up")
            res["lo_up"] = "ok"
            res["rtt_us_plain"] = _rtt_us()
            res["bulk_mb_s_plain"] = _bulk_mb_s()
            try:
                ipr.tc("add", "netem", index=lo, handle="1:", delay=2000)  # 2 ms each way
                res["netem_add"] = "ok"
                res["rtt_us_netem_2ms"] = _rtt_us(50)
                ipr.tc("del", index=lo, handle="1:")
            except Exception as e:
                res["netem_add"] = f"{type(e).__name__}: {e}"
            try:  # a token bucket: the link's bandwidth, not its delay
                ipr.tc("add", "tbf", index=lo, handle="1:", rate="200mbit", burst=256 * 1024, latency="50ms")
                res["tbf_add"] = "ok"
                res["bulk_mb_s_tbf_200mbit"] = _bulk_mb_s()
                res["rtt_us_tbf"] = _rtt_us(50)
            except Exception as e:
                res["tbf_add"] = f"{type(e).__name__}: {e}"
    except Exception as e:
        res["pyroute2"] = f"{type(e).__name__}: {e}"
    Path(res_path).write_text(json.dumps(res))


def main() -> int:
    out = Path(sys.argv[1])
    rep: dict[str, Any] = {
        "kernel": platform.release(),
        "uid": os.getuid(),
        "ip": shutil.which("ip"),
        "tc": shutil.which("tc"),
        "cap_eff": _cap_eff(),
        "sch_netem_module": Path("/sys/module/sch_netem").exists(),
        "netem_in_proc_modules": "sch_netem" in (Path("/proc/modules").read_text() if Path("/proc/modules").exists() else ""),
    }
    try:
        import pyroute2  # noqa: F401

        rep["pyroute2"] = getattr(pyroute2, "__version__", "importable")
    except Exception as e:
        rep["pyroute2"] = f"{type(e).__name__}: {e}"
    res_path = str(out) + ".child"
    pid = os.fork()
    if pid == 0:
        try:
            _child(res_path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    try:
        rep["namespace"] = json.loads(Path(res_path).read_text())
    except Exception as e:
        rep["namespace"] = {"error": f"{type(e).__name__}: {e}"}
    out.write_text(json.dumps(rep, indent=1))
    print(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
