"""Co-located contention processes, started beside the engine by the fault agent.

``python -m teller.inject.hogs KIND [options]`` runs until SIGTERM:

- ``cpu --procs N --cpus 0,1``: N busy processes pinned to the given cores (the engine's);
- ``membw --mb M``: host memory-bandwidth hog (numpy copies of an M MiB buffer);
- ``gpu-membw --mb M --device D``: device-to-device copies of an M MiB buffer on GPU D;
- ``gpu-compute --n N --device D``: back-to-back N×N matmuls on GPU D.

They are separate processes, never recorded (the agent strips ``TELLER_*`` from their
environment), and write nothing: their windows are recorded by the agent that started them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _spin(cpus: list[int] | None) -> None:
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError):
            pass
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m teller.inject.hogs")
    ap.add_argument("kind", choices=["cpu", "membw", "gpu-membw", "gpu-compute"])
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--cpus", default="")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--device", type=int, default=0)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if a.kind == "cpu":
        cpus = [int(c) for c in a.cpus.split(",") if c.strip()] or None
        kids = []
        for _ in range(max(1, a.procs) - 1):
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
                _spin(cpus)
            kids.append(pid)

        def term(*_: object) -> None:
            for k in kids:
                try:
                    os.kill(k, signal.SIGTERM)
                except OSError:
                    pass
            os._exit(0)

        signal.signal(signal.SIGTERM, term)
        _spin(cpus)
    elif a.kind == "membw":
        import numpy as np

        src = np.ones(a.mb << 18, np.float32)
        dst = np.empty_like(src)
        while True:
            np.copyto(dst, src)
    else:
        import torch

        dev = torch.device("cuda", a.device)
        if a.kind == "gpu-membw":
            src = torch.ones(a.mb << 18, device=dev)
            dst = torch.empty_like(src)
            while True:
                dst.copy_(src)
                src.copy_(dst)
        else:
            m = torch.randn(a.n, a.n, device=dev, dtype=torch.bfloat16)
            while True:
                m = torch.mm(m, m).clamp_(-1, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
