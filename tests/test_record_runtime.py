"""The in-process runtime: unwritable run directory, range backends, collector fallback."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from teller.record import ranges, runtime
from teller.rundir import RunDir


@pytest.fixture()
def rt(tmp_path: Path):
    ranges.RECORDER.drain(final=True)  # start from an empty recorder
    r = runtime.Runtime({"TELLER_RUN_DIR": str(tmp_path / "run"), "TELLER_COLLECTOR": "cpu",
                         "TELLER_FLUSH_S": "3600"})
    yield r
    r._stopped = True
    r._stop_evt.set()
    runtime.reset_range_backend()
    ranges.RECORDER.drain(final=True)


def test_unwritable_run_dir_degrades_and_recovers(rt, tmp_path: Path, capsys):
    rt.ensure_started()
    run = RunDir(tmp_path / "run")
    runtime.push("STEP id=0 reqs=a")
    runtime.pop()
    assert rt.flush()
    assert len(run.event_files()) == 1
    # the next chunk cannot be written (as on a full disk): its temporary path is taken by a folder
    blocker = run.events_dir / f"{rt.pid}-00001.parquet.tmp"
    blocker.mkdir()
    runtime.push("STEP id=1 reqs=b")
    runtime.pop()
    assert rt.flush()  # no exception reaches the caller
    assert rt.sink.dropped_rows == 1 and rt.sink.errors
    err = capsys.readouterr().err
    assert err.count("[teller] cannot write events") == 1
    # recording goes on, and writes again once there is room
    blocker.rmdir()
    runtime.push("STEP id=2 reqs=c")
    runtime.pop()
    rt.flush()
    names = run.read_events().column("name").to_pylist()
    assert names == ["STEP id=0 reqs=a", "STEP id=2 reqs=c"]
    proc = json.loads((tmp_path / "run" / "proc" / f"{rt.pid}.json").read_text())
    assert proc["sink"]["dropped_rows"] == 1 and proc["sink"]["rows_written"] == 2


def test_range_backend_can_be_replaced(rt):
    rt.ensure_started()
    seen = []
    runtime.set_range_backend(lambda m: seen.append(("push", m)), lambda: seen.append(("pop",)), name="nvtx")
    with runtime.range("FE X"):
        pass
    assert seen == [("push", "FE X"), ("pop",)]
    assert ranges.RECORDER.drain() is None  # the CPU recorder got nothing
    runtime.set_range_backend(lambda m: seen.append(("push", m)), lambda: seen.append(("pop",)),
                              keep_cpu=True, name="nvtx")
    with runtime.range("FE Y"):
        pass
    assert runtime.range_backend() == "nvtx+cpu"
    assert ranges.RECORDER.drain()["name"].to_pylist() == ["FE Y"]
    runtime.reset_range_backend()
    assert runtime.push is ranges.push


def test_unknown_or_failing_collector_falls_back_to_cpu(tmp_path: Path, capsys):
    r = runtime.Runtime({"TELLER_RUN_DIR": str(tmp_path / "run"), "TELLER_COLLECTOR": "nosuch",
                         "TELLER_FLUSH_S": "3600"})
    try:
        r.ensure_started()
        r._start_collector()
        assert r.collector_name == "cpu" and "nosuch" in r.fallback_reason
        assert "[teller] collector nosuch unavailable" in capsys.readouterr().err
        info = r.proc_info("running")
        assert info["collector"]["active"] == "cpu" and info["collector"]["requested"] == "nosuch"
    finally:
        r._stopped = True
        r._stop_evt.set()


def test_step_ids_and_hook_failures_are_counted(capsys):
    a, b = runtime.next_step_id(), runtime.next_step_id()
    assert b == a + 1
    for _ in range(3):
        runtime.hook_failed("unit.test", ValueError("boom"))
    assert runtime._hook_errors["unit.test"] == 3
    assert capsys.readouterr().err.count("hook unit.test failed (ValueError: boom)") == 1


def test_flusher_thread_is_named_and_reported(rt):
    import sys
    import threading

    rt.ensure_started()
    t = rt._flusher
    for _ in range(3000):  # the thread notes its id as it starts (no time asserted: up to 30 s)
        if rt.flusher_tid is not None:
            break
        threading.Event().wait(0.01)
    assert rt.flusher_tid is not None and rt.flusher_tid != threading.get_native_id()
    assert rt.proc_info("running")["threads"] == {"flush": rt.flusher_tid}
    if sys.platform.startswith("linux") and t.is_alive():
        comm = Path(f"/proc/self/task/{rt.flusher_tid}/comm").read_text().strip()
        assert comm == "teller-flush"


class _SwitchLog:
    """A collector that notes when the detail gate switches it (``set_detail``)."""

    def __init__(self, fail_on: bool = False) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.fail_on = fail_on
        self.seq = lambda: -1

    def set_detail(self, on: bool) -> None:
        self.calls.append((self.seq(), on))
        if on and self.fail_on:
            raise RuntimeError("cannot attach")


def test_detail_windows_mark_steps_and_switch_the_collector_around_them(monkeypatch):
    """Windows of 2 detailed steps every 5: the other STEP messages end ``detail=0``, no BE
    backend runs in them, and the collector goes off when the first step after a window opens
    and on when the step before the next window closes (its update phase belongs to the window's
    first iteration); a collector that fails to switch is counted, and the steps go on."""
    log = _SwitchLog()
    fake = type("R", (), {"collector": log, "be_depth": 1})()
    monkeypatch.setattr(runtime, "RUNTIME", fake)
    gate = runtime.DetailGate(5, 2)
    monkeypatch.setattr(runtime, "DETAIL", gate)
    log.seq = lambda: gate.seq
    pushed, be = [], []
    monkeypatch.setattr(runtime, "push", pushed.append)
    monkeypatch.setattr(runtime, "pop", lambda: None)
    monkeypatch.setattr(runtime, "_be_functions", lambda: (lambda d: be.append(("in", d)), lambda: be.append(("out",))))
    if "torch" not in sys.modules:  # the BE backend runs once the engine has imported torch
        monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    for i in range(12):
        runtime.push_step(f"STEP id={i} reqs=r")
        runtime.pop_step()
    steps = [m for m in pushed if m.startswith("STEP")]
    assert [m.endswith(" detail=0") for m in steps] == [i % 5 >= 2 for i in range(12)]
    # each switch inside a range of its own, between the steps
    assert pushed.count(runtime.SWITCH_RANGE) == 4 and pushed[2] == runtime.SWITCH_RANGE  # before step 2
    assert be == [("in", 1), ("out",)] * 6  # steps 0, 1, 5, 6, 10, 11
    # off as step 2 opens (seq 3 once counted), on as step 4 closes (the next is 5), ...
    assert log.calls == [(3, False), (5, True), (8, False), (10, True)]
    info = gate.info()
    assert info["steps"] == 12 and info["detailed"] == 6 and info["switches"] == 4 and info["failures"] == 0
    # every step in detail: nothing switches
    every = runtime.DetailGate(1, 1)
    monkeypatch.setattr(runtime, "DETAIL", every)
    log.calls.clear()
    for i in range(4):
        runtime.push_step(f"STEP id={i} reqs=r")
        runtime.pop_step()
    assert log.calls == [] and every.info()["detailed"] == 4
    # a collector attached lazily (CUPTI first touched at the first window): on as step 0 opens
    lazy = runtime.DetailGate(5, 2)
    lazy.on = False
    monkeypatch.setattr(runtime, "DETAIL", lazy)
    log.calls.clear()
    log.seq = lambda: lazy.seq
    for i in range(4):
        runtime.push_step(f"STEP id={i} reqs=r")
        runtime.pop_step()
    assert log.calls == [(1, True), (3, False)]
    # a collector that cannot attach again: counted, and recording goes on
    bad = _SwitchLog(fail_on=True)
    monkeypatch.setattr(runtime, "RUNTIME", type("R", (), {"collector": bad, "be_depth": 1})())
    gate = runtime.DetailGate(3, 1)
    monkeypatch.setattr(runtime, "DETAIL", gate)
    for i in range(6):
        runtime.push_step(f"STEP id={i} reqs=r")
        runtime.pop_step()
    assert gate.info()["failures"] >= 1 and gate.info()["steps"] == 6
