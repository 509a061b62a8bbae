"""The CPU range recorder: nesting, draining, unbalanced input, threads, truncation at exit."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from teller.record.collectors.cpu import CpuCollector
from teller.record.ranges import FLAG_TRUNCATED, RangeRecorder
from teller.record.sink import EventSink
from teller.rundir import FLAG_TRUNCATED as RUNDIR_TRUNCATED
from teller.rundir import RunDir


def rows(cols):
    names = cols["name"].to_pylist()
    layers = cols["layer"].to_pylist()
    return [dict(name=n, layer=la, start=int(s), end=int(e), flags=int(f), tid=int(t))
            for n, la, s, e, f, t in zip(names, layers, cols["start_ns"], cols["end_ns"], cols["flags"], cols["tid"], strict=True)]


def test_nested_ranges_and_layers():
    rec = RangeRecorder()
    rec.push("STEP id=0 reqs=req_0,req_3")
    with rec.range("FE LlamaAttention"):
        rec.push("BE aten::mm")
        rec.pop()
    rec.pop()
    out = rows(rec.drain())
    by = {r["name"]: r for r in out}
    assert set(by) == {"STEP id=0 reqs=req_0,req_3", "FE LlamaAttention", "BE aten::mm"}
    step, fe, be = by["STEP id=0 reqs=req_0,req_3"], by["FE LlamaAttention"], by["BE aten::mm"]
    assert step["start"] <= fe["start"] <= be["start"] <= be["end"] <= fe["end"] <= step["end"]
    assert [step["layer"], fe["layer"], be["layer"]] == ["STEP", "FE", "BE"]
    assert {r["tid"] for r in out} == {threading.get_native_id()}
    assert rec.drain() is None  # drained exactly once


def test_unbalanced_pop_is_counted_and_ignored():
    rec = RangeRecorder()
    rec.pop()
    rec.push("OTHER a")
    rec.pop()
    rec.pop()
    assert rec.info()["unbalanced_pops"] == 2
    assert [r["name"] for r in rows(rec.drain())] == ["OTHER a"]


def test_open_ranges_survive_flush_and_are_truncated_at_exit():
    rec = RangeRecorder()
    rec.push("STEP id=1 reqs=a")
    rec.push("FE X")
    rec.pop()
    first = rows(rec.drain())
    assert [r["name"] for r in first] == ["FE X"]
    assert rec.info()["open_ranges"] == 1
    rec.push("FE Y")
    rec.pop()
    second = rows(rec.drain())
    assert [r["name"] for r in second] == ["FE Y"]
    final = rows(rec.drain(final=True))
    assert [r["name"] for r in final] == ["STEP id=1 reqs=a"]
    assert final[0]["flags"] & FLAG_TRUNCATED and FLAG_TRUNCATED == RUNDIR_TRUNCATED
    assert final[0]["start"] <= second[0]["start"] and final[0]["end"] >= second[0]["end"]
    assert rec.info()["ranges_truncated"] == 1 and rec.info()["open_ranges"] == 0


def test_threads_get_their_own_stacks_and_tids():
    rec = RangeRecorder()
    tids = []
    barrier = threading.Barrier(3)

    def work(i):
        tids.append(threading.get_native_id())
        rec.push(f"STEP id={i} reqs=r{i}")
        barrier.wait()  # all three open at once: stacks must not mix
        rec.push("FE M")
        rec.pop()
        rec.pop()

    ts = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out = rows(rec.drain())
    assert len(out) == 6 and rec.info()["unbalanced_pops"] == 0
    for tid in tids:
        mine = [r for r in out if r["tid"] == tid]
        step = next(r for r in mine if r["layer"] == "STEP")
        fe = next(r for r in mine if r["layer"] == "FE")
        assert step["start"] <= fe["start"] <= fe["end"] <= step["end"]


def test_drain_while_another_thread_records_loses_nothing():
    rec = RangeRecorder()
    n = 20000
    stop = threading.Event()
    got = []

    def drainer():
        while not stop.is_set():
            c = rec.drain()
            if c is not None:
                got.append(len(c["start_ns"]))

    d = threading.Thread(target=drainer)
    d.start()
    for _ in range(n):
        rec.push("BE aten::add")
        rec.pop()
    stop.set()
    d.join()
    c = rec.drain()
    total = sum(got) + (len(c["start_ns"]) if c is not None else 0)
    assert total == n == rec.info()["ranges_emitted"]


def test_cpu_collector_writes_canonical_events(tmp_path):
    rec = RangeRecorder()
    sink = EventSink(tmp_path, pid=4242)
    col = CpuCollector(rec)
    col.start(sink)
    rec.push("STEP id=0 reqs=x")
    rec.push("COMM all_reduce bytes=8192 group=tp seq=0")
    rec.pop()
    col.flush()
    sink.flush()
    col.stop()  # the open STEP, truncated
    sink.flush()
    t = RunDir(tmp_path).read_events()
    assert t.num_rows == 2
    assert set(t.column("kind").to_pylist()) == {"RANGE"}
    assert t.column("pid").to_pylist() == [4242, 4242]
    assert sorted(t.column("layer").to_pylist()) == ["COMM", "STEP"]
    flags = dict(zip(t.column("name").to_pylist(), t.column("flags").to_pylist(), strict=True))
    assert flags["STEP id=0 reqs=x"] == RUNDIR_TRUNCATED and flags["COMM all_reduce bytes=8192 group=tp seq=0"] == 0
    assert pa.types.is_dictionary(t.schema.field("name").type)
    assert col.info()["ranges_emitted"] == 2


ops = st.lists(st.one_of(st.just(None), st.sampled_from(["STEP a", "FE b", "BE c", "COMM d"])), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=ops, drain_every=st.integers(1, 10))
def test_counts_reconcile_and_ranges_nest(ops, drain_every):
    """pushes = emitted + still open; pops without push are counted; emitted ranges nest."""
    rec = RangeRecorder()
    out, depth, unbalanced = [], 0, 0
    for i, op in enumerate(ops):
        if op is None:
            if depth == 0:
                unbalanced += 1
            else:
                depth -= 1
            rec.pop()
        else:
            depth += 1
            rec.push(op)
        if i % drain_every == 0:
            c = rec.drain()
            out += rows(c) if c is not None else []
    c = rec.drain(final=True)
    out += rows(c) if c is not None else []
    pushes = sum(op is not None for op in ops)
    assert len(out) == pushes
    assert sum(bool(r["flags"] & FLAG_TRUNCATED) for r in out) == depth
    assert rec.info()["unbalanced_pops"] == unbalanced
    # any two ranges of one thread are disjoint or nested
    s = np.array([r["start"] for r in out])
    e = np.array([r["end"] for r in out])
    for i in range(len(out)):
        inside = (s >= s[i]) & (e <= e[i])
        disjoint = (s >= e[i]) | (e <= s[i])
        contains = (s <= s[i]) & (e >= e[i])
        assert np.all(inside | disjoint | contains)


def test_unique_messages_are_not_interned_forever():
    rec = RangeRecorder()
    rec.push("STEP id=0 reqs=open")  # stays open across drains
    for i in range(1000):
        rec.push(f"STEP id={i + 1} reqs=req_{i}")
        rec.push("BE aten::mm")
        rec.pop()
        rec.push(f"COMM all_reduce bytes=8 group=tp seq={i}")
        rec.pop()
        rec.pop()
    out = rows(rec.drain())
    assert len(out) == 3000 and rec.info()["distinct_names"] == 1
    assert rec.info()["transient_names"] == 1  # only the open STEP's message is still held
    assert {r["name"] for r in out if r["layer"] == "STEP"} == {f"STEP id={i + 1} reqs=req_{i}" for i in range(1000)}
    assert [r["name"] for r in rows(rec.drain(final=True))] == ["STEP id=0 reqs=open"]
    assert rec.info()["transient_names"] == 0


def test_add_records_a_closed_range_without_touching_the_stack():
    """RangeRecorder.add (for callbacks that may interrupt a push or a pop): nothing on a thread
    that never opened a range, unless create; the open stack stays as it was."""
    rec = RangeRecorder()
    code = rec.code("OTHER gc gen=0")
    assert rec.code("OTHER gc gen=0") == code  # interned once
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(rec.add(code, 5, 9)))
    t.start()
    t.join()
    assert got == [False] and rec.drain() is None
    rec.push("STEP id=1")
    assert rec.add(code, 10, 20) and rec.depth() == 1
    rec.pop()
    r = rows(rec.drain())
    assert [x["name"] for x in r] == ["OTHER gc gen=0", "STEP id=1"] and r[0]["layer"] == "OTHER"
    t = threading.Thread(target=lambda: got.append(rec.add(code, 5, 9, create=True)))
    t.start()
    t.join()
    assert got[-1] is True and len(rows(rec.drain())) == 1


def test_pause_marks_record_garbage_collections_on_the_collecting_thread():
    """TELLER_MARK_PAUSES: each collection becomes an ``OTHER gc gen=N`` range on the thread that
    ran it, nested in that thread's open range by time; a collection on a thread without a buffer
    is counted, not recorded."""
    import gc

    from teller.record import ranges as _ranges
    from teller.record.runtime import PauseMarks

    _ranges.RECORDER.drain()
    pm = PauseMarks()
    gc.callbacks.append(pm)
    try:
        t = threading.Thread(target=lambda: gc.collect(1))  # no range opened there
        t.start()
        t.join()
        _ranges.RECORDER.push("FE Outer")
        gc.collect(2)
        gc.collect(0)
        _ranges.RECORDER.pop()
    finally:
        gc.callbacks.remove(pm)
    r = rows(_ranges.RECORDER.drain())
    outer = [x for x in r if x["name"] == "FE Outer"][0]
    marks = [x for x in r if x["name"].startswith("OTHER gc gen=")]
    assert {x["name"] for x in marks} >= {"OTHER gc gen=2", "OTHER gc gen=0"}
    assert all(outer["start"] <= x["start"] <= x["end"] <= outer["end"] and x["tid"] == outer["tid"] for x in marks)
    assert pm.skipped >= 1 and pm.errors == 0 and pm.marked[2] >= 1 and pm.info()["gc_marked"] == pm.marked
