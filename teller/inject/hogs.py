"""Co-located contention processes, started beside the engine by the fault agent.

``python -m teller.inject.hogs KIND [options]`` runs until SIGTERM:

- ``cpu --procs N --cpus 0,1``: N busy processes pinned to the given cores (the engine's);
- ``membw --mb M``: host memory-bandwidth hog (numpy copies of an M MiB buffer);
- ``gpu-membw --mb M --device D``: device-to-device copies of an M MiB buffer on GPU D;
- ``gpu-compute --n N --device D``: back-to-back N×N matmuls on GPU D.

They are separate processes, never recorded (the agent strips ``TELLER_*`` from their
environment), and write nothing: their windows are recorded by the agent that started them.
Every hog process exits by itself once the process that started it is gone (``--parent PID``,
the engine, for the first; the first hog for the processes it forks): an engine killed or
crashed inside a window, which never closes it, leaves no busy process behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _orphaned(parent: int) -> bool:
    """The process that started this one is gone (this one was re-parented)."""
    return parent > 0 and os.getppid() != parent


def _spin(cpus: list[int] | None, parent: int, on_orphan=lambda: os._exit(0)) -> None:
    """Busy pure-Python work pinned to ``cpus``; ``on_orphan()`` once ``parent`` is gone."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError):
            pass
    x = 0
    while True:
        for _ in range(200_000):  # a few tens of ms between looks at the parent
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        if _orphaned(parent):
            on_orphan()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m teller.inject.hogs")
    ap.add_argument("kind", choices=["cpu", "membw", "gpu-membw", "gpu-compute"])
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--cpus", default="")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--parent", type=int, default=0,
                    help="exit once this process (the engine that started the hog) is gone; 0: never")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    parent = a.parent
    if _orphaned(parent):  # the engine died before this process got here
        return 0
    if a.kind == "cpu":
        cpus = [int(c) for c in a.cpus.split(",") if c.strip()] or None
        kids = []
        me = os.getpid()
        for _ in range(max(1, a.procs) - 1):
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
                _spin(cpus, me)
            kids.append(pid)

        def term(*_: object) -> None:
            for k in kids:
                try:
                    os.kill(k, signal.SIGTERM)
                except OSError:
                    pass
            os._exit(0)

        signal.signal(signal.SIGTERM, term)
        _spin(cpus, parent, term)  # the forked processes are stopped too when the engine is gone
    elif a.kind == "membw":
        import numpy as np

        src = np.ones(a.mb << 18, np.float32)
        dst = np.empty_like(src)
        while not _orphaned(parent):
            np.copyto(dst, src)
    else:
        import torch

        dev = torch.device("cuda", a.device)
        if a.kind == "gpu-membw":
            src = torch.ones(a.mb << 18, device=dev)
            dst = torch.empty_like(src)
            while not _orphaned(parent):
                dst.copy_(src)
                src.copy_(dst)
        else:
            m = torch.randn(a.n, a.n, device=dev, dtype=torch.bfloat16)
            while not _orphaned(parent):
                m = torch.mm(m, m).clamp_(-1, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
