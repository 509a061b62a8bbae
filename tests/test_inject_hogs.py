"""Co-located hogs (teller.inject.hogs) never outlive the engine that started them: a killed or
crashed engine cannot close its window, so each hog process watches the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

LAUNCHER = """
import os, subprocess, sys, time
p = subprocess.Popen([sys.executable, "-m", "teller.inject.hogs", "cpu", "--procs", "2", "--parent", str(os.getpid())])
print(p.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_hogs_exit_when_the_engine_is_killed():
    engine = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    hog = int(engine.stdout.readline())
    deadline = time.monotonic() + 120  # a loaded machine: the hog and its fork need time to start
    while len(_children(hog)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = [hog, *_children(hog)]
    assert len(procs) == 2 and all(_alive(p) for p in procs)  # --procs 2: the hog and one fork
    engine.send_signal(signal.SIGKILL)  # no atexit, no window close: nobody sends the hogs SIGTERM
    engine.wait()
    deadline = time.monotonic() + 120
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in procs if _alive(p)]
    for p in left:  # never leave a busy process behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"hog processes {left} outlived the engine"
