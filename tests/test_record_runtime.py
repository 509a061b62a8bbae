"""The in-process runtime: unwritable run directory, range backends, collector fallback."""

from __future__ import annotations

import json
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
