"""CUPTI and Kineto collectors, tested without a GPU.

The CUPTI decode (names, times, pairing of NVTX markers, clock mapping) runs on synthetic records
that carry the attributes real ``cupti-python`` records carry; the collector's lifecycle runs
against a fake ``cupti`` module; the Kineto collector records a small torch program on the CPU.
"""

from __future__ import annotations

import enum
import json
import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from teller.record import clock
from teller.record.clock import ClockMap, take_anchor
from teller.record.collectors.base import Collector
from teller.record.collectors.cupti import (
    DEFAULT_KIND_VALUES,
    CuptiCollector,
    RecordDecoder,
    demangle,
    strip_version,
)
from teller.record.sink import EventSink
from teller.rundir import FLAG_REPAIRED, FLAG_TRUNCATED, RunDir

K = DEFAULT_KIND_VALUES
CUPTI_T0 = 1_790_000_000_000_000_000  # epoch-sized, like real CUPTI timestamps


# ------------------------------------------------------------------ synthetic records


def api(kind: str, cbid: int, start: int, end: int, corr: int, tid: int = 77, pid: int = 1234, ret: int = 0):
    return NS(kind=K[kind], cbid=cbid, start=start, end=end, process_id=pid, thread_id=tid,
              correlation_id=corr, return_value=ret)


def kernel(name: str, start: int, end: int, corr: int, graph: int = 0, stream: int = 7, grid=(1, 1, 1)):
    return NS(kind=K["CONCURRENT_KERNEL"], name=name, start=start, end=end, device_id=0,
              stream_id=stream, correlation_id=corr, graph_id=graph, grid_x=grid[0], grid_y=grid[1],
              grid_z=grid[2], block_x=128, block_y=1, block_z=1, registers_per_thread=32,
              static_shared_memory=0, dynamic_shared_memory=1024)


def memcpy(start, end, corr, nbytes=4096, copy_kind=1):
    return NS(kind=K["MEMCPY"], start=start, end=end, device_id=0, stream_id=7, correlation_id=corr,
              graph_id=0, bytes=nbytes, copy_kind=copy_kind, src_kind=1, dst_kind=3)


def memset(start, end, corr, nbytes=512):
    return NS(kind=K["MEMSET"], start=start, end=end, device_id=0, stream_id=7, correlation_id=corr,
              graph_id=0, bytes=nbytes, value=0, memory_kind=3)


def sync(start, end, corr, stream=0xFFFFFFFF, typ=4):
    return NS(kind=K["SYNCHRONIZATION"], start=start, end=end, stream_id=stream, correlation_id=corr,
              type=typ, cuda_event_id=0xFFFFFFFF, context_id=1)


def marker(flags: int, ts: int, mid: int, name: str = "", tid: int = 77, pid: int = 1234):
    return NS(kind=K["MARKER"], flags_=flags, timestamp=ts, id=mid, name=name, domain="",
              object_kind=2, object_id=NS(pt=NS(process_id=pid, thread_id=tid)))


RT_NAMES = {211: "cudaLaunchKernel_v7000", 31: "cudaMemcpyAsync_v3020", 165: "cudaDeviceSynchronize_v3020"}


def identity_decoder(calls: list | None = None) -> RecordDecoder:
    cm = ClockMap()
    cm.add(CUPTI_T0, 0)

    def name(kind, cbid):
        if calls is not None:
            calls.append((kind, cbid))
        return RT_NAMES.get(cbid, f"cuFunc{cbid}_v2")

    return RecordDecoder(K, name, cm)


def table(groups: list[dict]) -> pa.Table:
    from teller.rundir import concat_events, events_table

    return concat_events([events_table(g) for g in groups])


def col(t: pa.Table, name: str) -> list:
    return t.column(name).to_pylist()


# ------------------------------------------------------------------ names


def test_strip_version_removes_one_trailing_suffix():
    assert strip_version("cudaLaunchKernel_v7000") == "cudaLaunchKernel"
    assert strip_version("cudaStreamGetCaptureInfo_v2_v11030") == "cudaStreamGetCaptureInfo_v2"
    assert strip_version("cuLaunchKernel") == "cuLaunchKernel"


def test_demangle_kernel_names():
    assert demangle("_Z6vecAddPfS_S_i") == "vecAdd(float*, float*, float*, int)"
    assert demangle("ampere_sgemm_128x64_tn") == "ampere_sgemm_128x64_tn"


# ------------------------------------------------------------------ clock mapping


def test_clockmap_single_anchor_is_an_offset():
    cm = ClockMap()
    cm.add(CUPTI_T0 + 1000, 50)
    got = cm.map(np.array([CUPTI_T0 + 1000, CUPTI_T0 + 2000, CUPTI_T0]))
    assert got.tolist() == [50, 1050, -950]


def test_clockmap_corrects_drift_between_anchors():
    # the other clock runs 100 ppm fast: after 1 s it is 100 µs ahead of τ
    cm = ClockMap()
    cm.add(CUPTI_T0, 0)
    cm.add(CUPTI_T0 + 1_000_100_000, 1_000_000_000)
    mid = cm.map(np.array([CUPTI_T0 + 500_050_000]))
    assert mid.tolist() == [500_000_000]
    assert abs(cm.drift_ppm() + 100) < 0.01
    # beyond the last anchor the last offset holds (no extrapolated slope)
    assert cm.map(np.array([CUPTI_T0 + 2_000_100_000])).tolist() == [2_000_000_000]


def test_clockmap_rejects_out_of_order_anchor():
    cm = ClockMap()
    assert cm.add(CUPTI_T0 + 10, 0)
    assert not cm.add(CUPTI_T0 + 10, 5)
    assert len(cm) == 1
    with pytest.raises(ValueError):
        ClockMap().map(np.array([1]))


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.integers(1_000, 10**10), min_size=1, max_size=8),
    drifts=st.lists(st.integers(-10**5, 10**5), min_size=8, max_size=8),
    probes=st.lists(st.integers(0, 10**11), min_size=1, max_size=20),
)
def test_clockmap_exact_at_anchors_and_monotone(gaps, drifts, probes):
    cm = ClockMap()
    src, tau = CUPTI_T0, 123
    cm.add(src, tau)
    anchors = [(src, tau)]
    for g, d in zip(gaps, drifts, strict=False):
        src += g
        tau += max(1, g + d)
        cm.add(src, tau)
        anchors.append((src, tau))
    got = cm.map(np.array([s for s, _ in anchors]))
    assert got.tolist() == [t for _, t in anchors]
    xs = np.sort(np.array(probes, dtype=np.int64) + CUPTI_T0)
    assert np.all(np.diff(cm.map(xs)) >= 0)


def test_take_anchor_brackets_the_reading():
    seen = []

    def read():
        seen.append(clock.tau_now())
        return CUPTI_T0

    s, t, err = take_anchor(read, tries=2)
    assert s == CUPTI_T0 and err >= 0
    assert min(seen) - err <= t + err


# ------------------------------------------------------------------ decode


def test_api_records_named_through_cbid_cache():
    calls = []
    dec = identity_decoder(calls)
    recs = [api("RUNTIME", 211, CUPTI_T0 + 10 * i, CUPTI_T0 + 10 * i + 5, corr=i + 1) for i in range(50)]
    recs += [api("RUNTIME", 165, CUPTI_T0 + 900, CUPTI_T0 + 990, corr=100, ret=700)]
    recs += [api("DRIVER", 307, CUPTI_T0 + 1000, CUPTI_T0 + 1010, corr=101, tid=88)]
    t = table(dec.decode(recs))
    assert sorted(calls) == [("DRIVER", 307), ("RUNTIME", 165), ("RUNTIME", 211)]  # once per cbid
    rt = t.filter(pa.compute.equal(t["kind"].cast(pa.string()), "RUNTIME"))
    assert set(col(rt, "name")) == {"cudaLaunchKernel", "cudaDeviceSynchronize"}
    assert col(rt, "corr_id")[:3] == [1, 2, 3]
    assert col(rt, "start_ns")[:2] == [0, 10] and col(rt, "end_ns")[:2] == [5, 15]
    assert set(col(rt, "tid")) == {77} and set(col(rt, "pid")) == {1234}
    args = [a for a in col(rt, "args") if a]
    assert args == [json.dumps({"ret": 700})]
    drv = t.filter(pa.compute.equal(t["kind"].cast(pa.string()), "DRIVER"))
    assert col(drv, "name") == ["cuFunc307"] and col(drv, "tid") == [88]
    assert dec.counts()["records_in"] == {"RUNTIME": 51, "DRIVER": 1}
    # a second buffer with known cbids does not call the name function again
    dec.decode([api("RUNTIME", 211, CUPTI_T0 + 2000, CUPTI_T0 + 2001, corr=200)])
    assert len(calls) == 3


def test_kernel_memcpy_memset_sync_columns():
    dec = identity_decoder()
    recs = [
        kernel("_Z6vecAddPfS_S_i", CUPTI_T0 + 100, CUPTI_T0 + 200, corr=1, grid=(4, 1, 1)),
        kernel("_Z6vecAddPfS_S_i", CUPTI_T0 + 300, CUPTI_T0 + 400, corr=2, graph=9, grid=(8, 2, 1)),
        memcpy(CUPTI_T0 + 500, CUPTI_T0 + 600, corr=3, nbytes=1 << 20, copy_kind=1),
        memcpy(CUPTI_T0 + 700, CUPTI_T0 + 800, corr=4, copy_kind=2),
        memset(CUPTI_T0 + 900, CUPTI_T0 + 950, corr=5),
        sync(CUPTI_T0 + 1000, CUPTI_T0 + 2000, corr=6),
    ]
    t = table(dec.decode(recs)).sort_by("start_ns")
    assert col(t, "kind") == ["KERNEL", "KERNEL", "MEMCPY", "MEMCPY", "MEMSET", "SYNC"]
    assert col(t, "name")[:2] == ["vecAdd(float*, float*, float*, int)"] * 2
    assert col(t, "name")[2:] == ["Memcpy HtoD", "Memcpy DtoH", "Memset", "Context Synchronize"]
    assert col(t, "graph_id") == [-1, 9, -1, -1, -1, -1]
    assert col(t, "bytes")[2] == 1 << 20 and col(t, "bytes")[4] == 512
    assert col(t, "tid") == [-1] * 6
    assert col(t, "stream") == [7, 7, 7, 7, 7, -1]
    assert col(t, "device")[:5] == [0] * 5
    a0, a1 = (json.loads(a) for a in col(t, "args")[:2])
    assert a0["grid"] == [4, 1, 1] and a1["grid"] == [8, 2, 1] and a0["block"] == [128, 1, 1]
    assert json.loads(col(t, "args")[2]) == {"copy_kind": "HtoD", "src_kind": "Pageable", "dst_kind": "Device"}
    assert col(t, "corr_id") == [1, 2, 3, 4, 5, 6]


def test_incomplete_record_is_repaired_and_flagged():
    dec = identity_decoder()
    t = table(dec.decode([kernel("k", CUPTI_T0 + 100, 0, corr=1), kernel("k", CUPTI_T0 + 300, CUPTI_T0 + 200, corr=2)]))
    assert col(t, "flags") == [FLAG_REPAIRED, FLAG_REPAIRED]
    assert col(t, "end_ns") == col(t, "start_ns")
    assert dec.repaired == 2


def test_markers_pair_across_buffers_and_keep_thread():
    dec = identity_decoder()
    b1 = [marker(2, CUPTI_T0 + 10, 1, "STEP id=0 reqs=req_0", tid=5),
          marker(2, CUPTI_T0 + 20, 2, "FE LlamaAttention", tid=5),
          marker(4, CUPTI_T0 + 30, 2, tid=5),
          marker(1, CUPTI_T0 + 35, 3, "mark")]
    b2 = [marker(4, CUPTI_T0 + 90, 1, tid=5), marker(4, CUPTI_T0 + 95, 42, tid=6)]
    t1 = table(dec.decode(b1))
    assert dec.open_ranges == 1
    t2 = table(dec.decode(b2))
    t = pa.concat_tables([t1, t2]).sort_by("start_ns")
    rows = t.select(["kind", "name", "tid", "start_ns", "end_ns", "range_id", "flags"]).to_pylist()
    assert rows[0] == {"kind": "RANGE", "name": "STEP id=0 reqs=req_0", "tid": 5, "start_ns": 10,
                       "end_ns": 90, "range_id": 1, "flags": 0}
    assert rows[1]["name"] == "FE LlamaAttention" and (rows[1]["start_ns"], rows[1]["end_ns"]) == (20, 30)
    assert rows[2]["kind"] == "MARKER" and rows[2]["name"] == "mark"
    assert rows[3]["kind"] == "MARKER" and rows[3]["flags"] == FLAG_REPAIRED and rows[3]["tid"] == 6
    assert dec.open_ranges == 0


def test_open_ranges_are_truncated_at_close():
    dec = identity_decoder()
    dec.decode([marker(2, CUPTI_T0 + 10, 1, "STEP id=3"), api("RUNTIME", 211, CUPTI_T0 + 20, CUPTI_T0 + 500, corr=1)])
    t = table([dec.close_open_ranges()])
    assert col(t, "kind") == ["RANGE"] and col(t, "name") == ["STEP id=3"]
    assert col(t, "end_ns") == [500] and col(t, "flags") == [FLAG_TRUNCATED]
    assert dec.close_open_ranges() is None


def test_unknown_kinds_are_counted_not_emitted():
    dec = identity_decoder()
    out = dec.decode([NS(kind=17, start=1, end=2), api("RUNTIME", 211, CUPTI_T0, CUPTI_T0 + 1, corr=1)])
    assert sum(len(g["start_ns"]) for g in out) == 1
    assert dec.counts()["skipped_records"] == {"kind_17": 1}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["rt", "k", "cp", "ms", "sy", "push"]), st.integers(0, 10**6)),
                max_size=60))
def test_counts_reconcile(spec):
    """Every record in is an event out (a start/end marker pair is one range)."""
    dec = identity_decoder()
    recs = []
    for i, (what, t) in enumerate(spec):
        s = CUPTI_T0 + t
        if what == "rt":
            recs.append(api("RUNTIME", 211, s, s + 5, corr=i))
        elif what == "k":
            recs.append(kernel("k", s, s + 5, corr=i))
        elif what == "cp":
            recs.append(memcpy(s, s + 5, corr=i))
        elif what == "ms":
            recs.append(memset(s, s + 5, corr=i))
        elif what == "sy":
            recs.append(sync(s, s + 5, corr=i))
        else:
            recs += [marker(2, s, 10_000 + i, f"r{i}"), marker(4, s + 3, 10_000 + i)]
    half = len(recs) // 2
    out = dec.decode(recs[:half]) + dec.decode(recs[half:])
    closed = dec.close_open_ranges()
    out += [closed] if closed else []
    n_out = sum(len(g["start_ns"]) for g in out)
    n_markers = sum(1 for r in recs if r.kind == K["MARKER"])
    assert n_out == len(recs) - n_markers // 2
    assert sum(dec.counts()["records_in"].values()) == len(recs)


# ------------------------------------------------------------------ collector lifecycle (fake cupti)


class _Kind(enum.IntEnum):
    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    MARKER = 12
    SYNCHRONIZATION = 38


def fake_cupti(pending: list, fail_enable: tuple = ()) -> types.ModuleType:
    """A stand-in for ``cupti.cupti``: records queue up until a flush delivers them."""
    m = types.ModuleType("cupti.cupti")
    m.ActivityKind = _Kind
    m.CallbackDomain = NS(RUNTIME_API=2, DRIVER_API=1)
    m.ActivityThreadIdType = NS(SYSTEM=2)
    m.state = {"enabled": set(), "tid_type": None, "ts": CUPTI_T0, "flushes": []}

    def get_timestamp():
        m.state["ts"] += 1000
        return m.state["ts"]

    def register(req, done):
        m.state["req"], m.state["done"] = req, done

    def enable(kind):
        if _Kind(kind).name in fail_enable:
            raise RuntimeError("CUPTI_ERROR_NOT_SUPPORTED")
        m.state["enabled"].add(_Kind(kind).name)

    def flush_all(flag):
        m.state["flushes"].append(flag)
        if pending:
            batch = list(pending)
            pending.clear()
            m.state["done"](batch)

    def dropped(ctx, stream, ptr):
        import ctypes

        ctypes.c_size_t.from_address(ptr).value = 3

    m.get_timestamp = get_timestamp
    m.activity_register_callbacks = register
    m.activity_enable = enable
    m.activity_disable = lambda kind: m.state["enabled"].discard(_Kind(kind).name)
    m.activity_flush_all = flush_all
    m.activity_get_num_dropped_records = dropped
    m.set_thread_id_type = lambda t: m.state.__setitem__("tid_type", t)
    m.get_callback_name = lambda domain, cbid: RT_NAMES.get(cbid, f"api{cbid}_v1")
    return m


@pytest.fixture
def install_fake(monkeypatch):
    def install(mod):
        pkg = types.ModuleType("cupti")
        pkg.cupti = mod
        monkeypatch.setitem(sys.modules, "cupti", pkg)
        monkeypatch.setitem(sys.modules, "cupti.cupti", mod)
        return mod

    return install


def test_collector_records_through_fake_cupti(tmp_path, install_fake):
    pending: list = []
    fake = install_fake(fake_cupti(pending))
    sink = EventSink(tmp_path, pid=1234)
    c = CuptiCollector(decode="objects", api_filter=False)
    assert isinstance(c, Collector)
    c.start(sink)
    assert c.available and fake.state["tid_type"] == 2
    assert fake.state["enabled"] == {"RUNTIME", "DRIVER", "CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "SYNCHRONIZATION", "MARKER"}
    t_cupti = fake.state["ts"]
    pending += [marker(2, t_cupti + 1, 1, "STEP id=0 reqs=req_0"),
                api("RUNTIME", 211, t_cupti + 10, t_cupti + 20, corr=1),
                kernel("_Z1kv", t_cupti + 30, t_cupti + 40, corr=1)]
    c.flush()
    pending += [memcpy(t_cupti + 50, t_cupti + 60, corr=2)]
    c.stop()
    c.stop()  # idempotent
    sink.close()
    assert fake.state["flushes"] == [0, 1] and fake.state["enabled"] == set()
    t = RunDir(tmp_path).read_events().sort_by("start_ns")
    assert col(t, "kind") == ["RANGE", "RUNTIME", "KERNEL", "MEMCPY"]
    assert col(t, "name")[:3] == ["STEP id=0 reqs=req_0", "cudaLaunchKernel", "k()"]
    assert col(t, "flags")[0] == FLAG_TRUNCATED  # its end never came
    assert set(col(t, "pid")) == {1234}
    info = c.info()
    assert info["records"] == 4 and info["buffers"] == 2 and info["dropped_records"] == 3
    assert info["events_out"] == {"RANGE": 1, "RUNTIME": 1, "KERNEL": 1, "MEMCPY": 1}
    assert info["clock_anchors"]["count"] >= 3 and info["errors"] == []
    json.dumps(info)


def test_collector_times_follow_anchors(tmp_path, install_fake):
    """A record taken between two anchors lands between their τ values."""
    pending: list = []
    fake = install_fake(fake_cupti(pending))
    sink = EventSink(tmp_path, pid=1)
    c = CuptiCollector(kinds=["RUNTIME"], decode="objects")
    c.start(sink)
    lo_src, lo_tau = c.clockmap.src[-1], c.clockmap.tau[-1]
    c.flush()
    hi_src, hi_tau = c.clockmap.src[-1], c.clockmap.tau[-1]
    mid = (lo_src + hi_src) // 2
    pending.append(api("RUNTIME", 211, mid, mid, corr=1))
    c.stop()
    sink.close()
    (t0,) = col(RunDir(tmp_path).read_events(), "start_ns")
    assert lo_tau <= t0 <= hi_tau
    assert fake.state["enabled"] == set()


def test_collector_degrades_without_cupti(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupti", None)  # import fails like on a machine without it
    sink = EventSink(tmp_path)
    c = CuptiCollector()
    c.start(sink)
    c.flush()
    c.stop()
    sink.close()
    info = c.info()
    assert info["available"] is False
    assert "cupti-python not importable" in info["reason"] and info["errors"]
    assert RunDir(tmp_path).event_files() == []


def test_collector_survives_failures(tmp_path, install_fake):
    pending: list = []
    install_fake(fake_cupti(pending, fail_enable=("MARKER",)))
    sink = EventSink(tmp_path, pid=1)
    c = CuptiCollector(decode="objects", api_filter=False)
    c.start(sink)
    assert c.available and any("MARKER" in e for e in c.errors)
    pending += [NS(kind=K["RUNTIME"], start=1)]  # a broken record: attributes missing
    pending += [api("RUNTIME", 211, CUPTI_T0, CUPTI_T0 + 1, corr=1)]
    c.flush()  # must not raise
    c.stop()
    info = c.info()
    assert info["lost_records"] == 2 and any("decode" in e for e in info["errors"])


def test_collector_callback_is_thread_safe(tmp_path, install_fake):
    pending: list = []
    fake = install_fake(fake_cupti(pending))
    sink = EventSink(tmp_path, pid=1)
    c = CuptiCollector(kinds=["RUNTIME"], decode="objects", api_filter=False)
    c.start(sink)
    done = fake.state["done"]
    base = fake.state["ts"]

    def deliver(k):
        done([api("RUNTIME", 211, base + 10 * i, base + 10 * i + 1, corr=k * 1000 + i) for i in range(200)])

    threads = [threading.Thread(target=deliver, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    c.stop()
    sink.close()
    t = RunDir(tmp_path).read_events()
    assert t.num_rows == 800 and len(set(col(t, "corr_id"))) == 800
    assert c.info()["records"] == 800


# ------------------------------------------------------------------ Kineto on the CPU


def _small_torch_program():
    import torch

    a = torch.randn(32, 32)
    for _ in range(3):
        a = torch.relu(a @ a)
    return a


def test_kineto_collector_records_cpu_ops(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("teller.ingest.kineto")
    from teller.record.collectors.kineto import KinetoCollector

    sink = EventSink(tmp_path)
    c = KinetoCollector(cuda=False)
    c.start(sink)
    before = clock.tau_now()
    _small_torch_program()
    after = clock.tau_now()
    c.flush()
    c.stop()
    sink.close()
    info = c.info()
    assert info["available"] and info["errors"] == [], info
    t = RunDir(tmp_path).read_events()
    names = col(t, "name")
    assert names.count("aten::mm") == 3 and names.count("aten::relu") >= 3
    mm = t.filter(pa.compute.equal(t["name"].cast(pa.string()), "aten::mm"))
    # mapped onto τ: the ops ran between the two τ readings
    assert all(before <= s <= e <= after for s, e in zip(col(mm, "start_ns"), col(mm, "end_ns"), strict=True))
    assert info["time_base"] in ("wall", "tau", "relative to baseTimeNanoseconds")
    assert info["raw_trace"] is None  # converted, so the JSON was removed


def test_kineto_collector_keeps_raw_trace_without_reader(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from teller.record.collectors.kineto import KinetoCollector

    monkeypatch.setitem(sys.modules, "teller.ingest.kineto", None)
    sink = EventSink(tmp_path)
    c = KinetoCollector(cuda=False)
    c.start(sink)
    _small_torch_program()
    c.stop()
    sink.close()
    info = c.info()
    assert info["raw_trace"] and (tmp_path / "kineto").is_dir()
    d = json.loads(open(info["raw_trace"]).read())
    assert any(e.get("name") == "aten::mm" for e in d["traceEvents"])
    assert any("reader unavailable" in e for e in info["errors"])


# ------------------------------------------------------------------ raw buffers (no objects)

import ctypes  # noqa: E402

from teller.record.collectors.cupti import (  # noqa: E402
    QUIET_APIS,
    PendingBuffers,
    RawBuffers,
    RawLayout,
    parse_decode,
    quiet_cbids,
    unique_rows,
    walk_records,
)
from teller.testing.cupti_layouts import c_string as _cstr  # noqa: E402
from teller.testing.cupti_layouts import layouts  # noqa: E402
from teller.testing.cupti_layouts import struct as _dt  # noqa: E402

#: C-like record layouts with the field names and offsets a CUPTI header would give
#: (camelCase on purpose for the API record: the layout lookup accepts both spellings).
LAYOUTS = layouts(kernel_bytes=92, camel_api=True)  # the kernel record padded to 96
GROUP_OF = {K["RUNTIME"]: "API", K["DRIVER"]: "API", K["CONCURRENT_KERNEL"]: "KERNEL", K["MEMCPY"]: "MEMCPY",
            K["MEMSET"]: "MEMSET", K["SYNCHRONIZATION"]: "SYNC", K["MARKER"]: "MARKER"}


def pack(records: list) -> np.ndarray:
    """Pack synthetic records into one buffer the way CUPTI does (8-byte aligned structs)."""
    parts = []
    for r in records:
        dt = LAYOUTS[GROUP_OF[r.kind]]
        row = np.zeros(1, dt)
        for name in dt.names:
            if name == "object_id":
                raw = np.array([r.object_id.pt.process_id, r.object_id.pt.thread_id, 0], "<u4").tobytes()
                row["object_id"] = np.frombuffer(raw, "V12")
                continue
            attr = {"processId": "process_id", "threadId": "thread_id", "correlationId": "correlation_id",
                    "returnValue": "return_value", "flags": "flags_"}.get(name, name)
            v = getattr(r, attr, 0)
            row[name] = _cstr(v) if name in ("name", "domain") else v
        b = row.tobytes()
        parts.append(b + b"\0" * (-len(b) % 8))
    return np.frombuffer(b"".join(parts), np.uint8).copy()


def raw_decoder() -> RecordDecoder:
    cm = ClockMap()
    cm.add(CUPTI_T0, 0)
    return RecordDecoder(K, lambda kind, cbid: RT_NAMES.get(cbid, f"cuFunc{cbid}_v2"), cm, LAYOUTS)


def mixed_records() -> list:
    t = CUPTI_T0
    return [
        marker(2, t + 1, 1, "STEP id=0 reqs=req_0,req_1", tid=9),
        api("RUNTIME", 211, t + 10, t + 20, corr=1, tid=9),
        kernel("_Z6vecAddPfS_S_i", t + 30, t + 40, corr=1, grid=(4, 2, 1)),
        api("DRIVER", 307, t + 41, t + 45, corr=2, tid=9, ret=1),
        kernel("ampere_sgemm", t + 50, t + 60, corr=2, graph=3),
        memcpy(t + 61, t + 70, corr=3, nbytes=1 << 20, copy_kind=2),
        memset(t + 71, t + 72, corr=4),
        sync(t + 73, t + 80, corr=5, stream=12, typ=3),
        marker(4, t + 90, 1, tid=9),
        marker(1, t + 91, 7, "note"),
    ]


def test_raw_decode_matches_object_decode():
    recs = mixed_records()
    buf = pack(recs)
    raw = table(raw_decoder().decode_raw(buf, len(buf))).sort_by([("start_ns", "ascending"), ("corr_id", "ascending")])
    obj = table(identity_decoder().decode(recs)).sort_by([("start_ns", "ascending"), ("corr_id", "ascending")])
    assert raw.num_rows == obj.num_rows == len(recs) - 1
    for c in raw.column_names:
        assert col(raw, c) == col(obj, c), c
    assert col(raw, "name")[0] == "STEP id=0 reqs=req_0,req_1" and col(raw, "tid")[0] == 9


def test_raw_walk_stops_at_unknown_kind_and_counts_it():
    recs = mixed_records()[:3]
    buf = pack(recs)
    junk = np.zeros(16, np.uint8)
    junk[:4] = np.frombuffer(np.uint32(17).tobytes(), np.uint8)  # OVERHEAD: no layout
    full = np.concatenate([buf, junk])
    offs, kinds, used = walk_records(full, len(full), {v: RawLayout(g, LAYOUTS[g]).stride for v, g in GROUP_OF.items()})
    assert used == len(buf) and len(offs) == 3
    dec = raw_decoder()
    out = dec.decode_raw(full, len(full))
    assert sum(len(g["start_ns"]) for g in out) == 2  # the marker start stays open
    assert dec.counts()["unwalked_bytes"] == 16 and dec.counts()["skipped_records"] == {"kind_17": 1}


def test_raw_layout_needs_integer_fields():
    bad = _dt([("kind", "<u4", 0), ("cbid", "<u4", 4), ("start", "<f8", 8)], 16)
    with pytest.raises((KeyError, TypeError)):
        RawLayout("API", bad)
    assert RawLayout("KERNEL", LAYOUTS["KERNEL"]).stride == 96


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["rt", "drv", "k", "cp", "ms", "sy"]), min_size=1, max_size=40))
def test_raw_decode_equals_objects_on_random_buffers(spec):
    recs = []
    for i, what in enumerate(spec):
        s = CUPTI_T0 + 10 * i
        if what == "rt":
            recs.append(api("RUNTIME", 211, s, s + 5, corr=i))
        elif what == "drv":
            recs.append(api("DRIVER", 5, s, s + 5, corr=i, tid=3))
        elif what == "k":
            recs.append(kernel(f"_Z2k{i % 3}v", s, s + 5, corr=i, grid=(i % 4 + 1, 1, 1)))
        elif what == "cp":
            recs.append(memcpy(s, s + 5, corr=i, copy_kind=i % 11))
        elif what == "ms":
            recs.append(memset(s, s + 5, corr=i))
        else:
            recs.append(sync(s, s + 5, corr=i, typ=i % 5))
    buf = pack(recs)
    raw = table(raw_decoder().decode_raw(buf, len(buf))).sort_by("corr_id")
    obj = table(identity_decoder().decode(recs)).sort_by("corr_id")
    assert raw.to_pylist() == obj.to_pylist()


def test_raw_buffers_hand_out_and_take_back():
    got = []

    def dropped(ctx, stream, ptr):
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_size_t))[0] = 2
        return 0

    lib = NS(cuptiActivityRegisterCallbacks=lambda req, done: 0, cuptiActivityGetNumDroppedRecords=dropped)
    rb = RawBuffers(lib, 4096, lambda arr, valid: got.append(bytes(arr[:valid])))
    rb.register()
    bufp, size, maxr = (ctypes.c_void_p * 1)(), (ctypes.c_size_t * 1)(), (ctypes.c_size_t * 1)()
    rb._request(bufp, size, maxr)
    assert size[0] == 4096 and maxr[0] == 0 and bufp[0]
    ctypes.memmove(bufp[0], b"abcdefgh", 8)
    rb._completed(None, 0, bufp[0], 4096, 8)
    assert got == [b"abcdefgh"] and rb.dropped == 2 and rb.errors == []
    rb._request(bufp, size, maxr)  # the buffer is reused from the free list
    assert len(rb._free) == 0 and len(rb._live) == 1
    rb._completed(None, 0, 12345, 4096, 8)  # not ours: reported, not decoded
    assert got == [b"abcdefgh"] and rb.errors


# ------------------------------------------------------------------ deferred decoding


def test_pending_buffers_copy_keep_order_and_bound_the_bytes_held():
    pb = PendingBuffers(cap_bytes=250)
    src = np.arange(200, dtype=np.uint8)
    assert pb.add(src, 100) == []
    src[:] = 7  # CUPTI refills its buffer: the held copy must not change
    assert pb.add(src, 100) == [] and pb.bytes == 200
    out = pb.add(np.full(120, 3, np.uint8), 120)  # 320 > 250: the oldest goes back
    assert len(out) == 1 and out[0].tolist() == list(range(100))
    assert pb.bytes == 220 and pb.peak_bytes == 320 and pb.released_early == 1
    out = pb.add(np.zeros(999, np.uint8), 999)  # over the cap alone: the older ones go, it stays
    assert [a.tolist() for a in out] == [[7] * 100, [3] * 120] and pb.released_early == 3
    rest = pb.take()
    assert [len(a) for a in rest] == [999] and pb.bytes == 0 and len(pb) == 0 and pb.take() == []
    assert pb.info()["buffers_in"] == 4 and pb.info()["bytes_in"] == 1319


def test_decode_mode_names():
    assert parse_decode(None) == parse_decode("inline") == parse_decode("raw") == ("raw", "inline")
    assert parse_decode("Deferred") == ("raw", "deferred") and parse_decode("objects") == ("objects", "inline")
    with pytest.raises(ValueError):
        parse_decode("later")
    c = CuptiCollector(decode="nonsense")  # never raises into the engine
    assert (c.decode_mode, c.decode_at) == ("raw", "inline") and c.errors


def _buffers(fake) -> "Callable":  # noqa: F821
    """Buffer ``i`` of a deterministic stream, its record times after the collector's last anchor."""

    def make(i: int) -> np.ndarray:
        t = fake.state["ts"] + 1  # records come after the last anchor, before the next one
        recs = [api("RUNTIME", 211, t + 10 * j, t + 10 * j + 5, corr=100 * i + j, tid=9) for j in range(6)]
        recs += [kernel(f"_Z2k{i % 3}v", t + 70, t + 90, corr=100 * i, grid=(i + 1, 1, 1)),
                 memcpy(t + 91, t + 95, corr=100 * i + 1), sync(t + 96, t + 99, corr=100 * i + 2)]
        recs += [marker(2, t + 3, 500 + i, f"STEP id={i}", tid=9)]  # its end comes in the next buffer
        if i:
            recs.append(marker(4, t + 2, 500 + i - 1, tid=9))
        return pack(recs)

    return make


def _drive(tmp_path, monkeypatch, decode: str, n: int = 5, pending_mb: float | None = None):
    """A raw-path collector fed ``n`` synthetic buffers (the last one by the final flush)."""
    import teller.record.collectors.cupti as cupti_mod

    # τ of an anchor as a fixed function of CUPTI's time, its offset jumping by up to 2.4 µs from
    # anchor to anchor (so a record mapped with other anchors than inline would land elsewhere)
    monkeypatch.setattr(cupti_mod, "take_anchor", lambda read: (lambda s: (
        s, (s - CUPTI_T0) + ((s - CUPTI_T0) // 1000 % 7) * 400, 3))(int(read())))
    fake = fake_cupti([])
    make = _buffers(fake)
    sink = EventSink(tmp_path, pid=1234)
    c = CuptiCollector(decode=decode, pending_mb=pending_mb)
    c._cupti, c.sink, c._active = fake, sink, True
    c.decoder = RecordDecoder(K, lambda kind, cbid: RT_NAMES.get(cbid, f"cuFunc{cbid}_v2"), c.clockmap, LAYOUTS)
    c._anchor()
    for i in range(n - 1):
        buf = make(i)
        c._raw_completed(buf, len(buf))
        buf[:] = 0  # the buffer goes back to CUPTI and is overwritten
        c.flush()
    fake.activity_flush_all = lambda flag: c._raw_completed(make(n - 1), len(make(n - 1)))
    c.stop()
    sink.close()
    return c, RunDir(tmp_path).read_events()


@pytest.mark.parametrize("pending_mb", [None, 1200 / 2**20])
def test_deferred_decode_equals_inline_exactly(tmp_path, monkeypatch, pending_mb):
    ci, inline = _drive(tmp_path / "inline", monkeypatch, "inline")
    cd, deferred = _drive(tmp_path / "deferred", monkeypatch, "deferred", pending_mb=pending_mb)
    assert inline.num_rows == 5 * 9 + 5  # 9 events a buffer, 4 paired ranges, 1 left open
    assert deferred.to_pylist() == inline.to_pylist()  # same rows, same order, same τ
    assert col(deferred, "flags").count(FLAG_TRUNCATED) == 1
    info = cd.info()
    assert info["decode_at"] == "deferred" and ci.info()["deferred"] is None
    assert info["records"] == ci.info()["records"] == 54 and info["buffers"] == 5
    assert info["clock_anchors"]["count"] == ci.info()["clock_anchors"]["count"]
    d = info["deferred"]
    assert d["buffers_in"] == 5 and d["held_bytes"] == 0 and d["peak_bytes"] > 0
    if pending_mb is None:  # nothing decoded before stop; everything at once after the final flush
        assert d["decoded_before_stop"] == 0 and d["peak_bytes"] == d["bytes_in"]
    else:  # the cap (1,200 bytes: two buffers of about 530) decoded the oldest as new ones came
        assert d["decoded_before_stop"] >= 2 and d["peak_bytes"] < d["bytes_in"]
    assert info["errors"] == [] and info["lost_buffers"] == 0
    json.dumps(info)


def test_deferred_stop_decodes_once(tmp_path, monkeypatch):
    c, t = _drive(tmp_path, monkeypatch, "deferred")
    rows = t.num_rows
    c.decode_pending()
    c.stop()
    assert c.info()["records"] == 54 and c.sink.rows_written == rows and len(c.pending) == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 2**32), st.integers(-(2**40), 2**40)),
                min_size=1, max_size=60))
def test_unique_rows_matches_numpy(rows):
    keys = np.array(rows, np.int64)
    uniq, inv = unique_rows(keys)
    assert np.array_equal(uniq[inv], keys)
    assert sorted(map(tuple, uniq.tolist())) == sorted(map(tuple, np.unique(keys, axis=0).tolist()))


def test_unique_rows_falls_back_when_hashes_collide(monkeypatch):
    import teller.record.collectors.cupti as cupti_mod

    monkeypatch.setattr(cupti_mod, "_ROW_MULT", np.zeros(12, np.uint64))  # every row hashes alike
    keys = np.array([[1, 2], [3, 4], [1, 2]], np.int64)
    uniq, inv = unique_rows(keys)
    assert uniq.tolist() == [[1, 2], [3, 4]] and inv.tolist() == [0, 1, 0]


def test_quiet_api_filter_selects_query_calls_only():
    rt = {"cudaGetDevice_v3020": 1, "cudaLaunchKernel_v7000": 2, "cudaGetLastError_v3020": 3,
          "cudaStreamIsCapturing_ptsz_v10000": 4, "cudaMemcpyAsync_v3020": 5}
    assert quiet_cbids(rt, runtime=True) == [1, 3, 4]
    drv = {"cuGetProcAddress_v2": 10, "cuLaunchKernel": 11, "cuCtxGetCurrent": 12, "cudaGetDevice_v3020": 13}
    assert quiet_cbids(drv, runtime=False) == [10, 12]
    assert "cudaLaunchKernel" not in QUIET_APIS and "cuLaunchKernel" not in QUIET_APIS


def test_collector_applies_api_filter(tmp_path, install_fake):
    pending: list = []
    fake = fake_cupti(pending)
    calls = []
    fake.runtime_api_trace_cbid = enum.IntEnum("rt", {"cudaGetDevice_v3020": 5, "cudaLaunchKernel_v7000": 211})
    fake.driver_api_trace_cbid = enum.IntEnum("drv", {"cuCtxGetCurrent": 8, "cuLaunchKernel": 307})
    fake.activity_enable_runtime_api = lambda cbid, on: calls.append(("rt", cbid, on))
    fake.activity_enable_driver_api = lambda cbid, on: calls.append(("drv", cbid, on))
    install_fake(fake)
    c = CuptiCollector(decode="objects")
    c.start(EventSink(tmp_path, pid=1))
    assert calls == [("rt", 5, 0), ("drv", 8, 0)]
    assert c.info()["api_filter"] == {"on": True, "quiet_cbids": 2}
    c.stop()


def test_kineto_thread_ids_of_new_threads_are_noted_and_remapped(tmp_path):
    pytest.importorskip("torch")
    from teller.record.collectors.kineto import KinetoCollector, remap_tids

    sink = EventSink(tmp_path)
    c = KinetoCollector(cuda=False)
    c.start(sink)
    seen = {}

    def worker():
        seen["ident"], seen["native"] = threading.get_ident(), threading.get_native_id()

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    c.stop()
    assert c.tidmap[seen["ident"] & 0xFFFFFFFF] == seen["native"]
    assert threading.getprofile() is None  # the hook is removed at stop
    tid = np.array([seen["ident"] & 0xFFFFFFFF, seen["native"], 12345], np.int64)
    out, n = remap_tids(tid, c.tidmap)
    assert out.tolist() == [seen["native"], seen["native"], 12345] and n == 1


# ------------------------------------------------------------------ the bundled GPU recording

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "h200_llama8l_cupti"


def test_bundled_gpu_recording_reconstructs_into_request_trees(tmp_path):
    """The committed H200 recording: every kernel binds to its launch, chains reach STEP."""
    if not EXAMPLE.is_dir():
        pytest.skip("examples/h200_llama8l_cupti not present")
    import shutil

    from teller.reconstruct import reconstruct

    run = tmp_path / "ex"
    shutil.copytree(EXAMPLE, run)
    summary = reconstruct(run)
    assert summary["binding_coverage"] == 1.0 and summary["unbound"] == 0
    assert summary["steps"] >= 16 and summary["requests"] >= 24
    f = RunDir(run).read_table("forest").select(["node_id", "parent_id", "layer", "name"]).to_pylist()
    by_id = {r["node_id"]: r for r in f}

    def chain(r):
        out = []
        while r is not None:
            out.append(r["layer"])
            r = by_id.get(r["parent_id"])
        return out[::-1]

    chains = {tuple(chain(r)) for r in f if r["layer"] == "K"}
    assert ("STEP", "FE", "BE", "RT", "K") in chains or any(
        c[0] == "STEP" and "FE" in c and "BE" in c and c[-2:] == ("RT", "K") for c in chains)
    info = json.loads((EXAMPLE / "run.json").read_text())
    assert info["collector"]["resolved"] == "cupti" and info["dropped_records"]["cupti"] == 0


def _with_finalize(fake):
    """The fake with ``cuptiFinalize``: CUPTI forgets its callbacks and enabled kinds."""
    fake.state["finalized"] = 0

    def finalize():
        fake.state["finalized"] += 1
        fake.state["enabled"].clear()
        fake.state.pop("done", None)
        fake.state.pop("req", None)

    fake.finalize = finalize
    return fake


@pytest.mark.parametrize("attach", ["start", "first-window"])
def test_detail_windows_detach_and_attach_cupti(tmp_path, install_fake, monkeypatch, attach):
    """The detail gate's switches: off flushes what is held, disables the kinds and finalizes
    CUPTI (no flush or clock anchor touches it while detached); on registers the callbacks again
    and enables the kinds; records of every window are decoded. With ``first-window`` CUPTI is not
    touched at all before the first window."""
    monkeypatch.setenv("TELLER_CUPTI_ATTACH", attach)
    monkeypatch.setenv("TELLER_CUPTI_TEARDOWN", "1")
    pending: list = []
    fake = _with_finalize(install_fake(fake_cupti(pending)))
    sink = EventSink(tmp_path, pid=7)
    c = CuptiCollector(kinds=["RUNTIME", "CONCURRENT_KERNEL", "MARKER"], decode="objects", api_filter=False)
    ts0 = fake.state["ts"]
    c.start(sink)
    lazy = attach == "first-window"
    assert c.available
    if lazy:  # nothing of CUPTI ran: no clock read, no callbacks, no kind enabled
        assert fake.state["ts"] == ts0 and "done" not in fake.state and fake.state["enabled"] == set()
        assert c.info()["never_attached"] and c.info()["attach"] == "first-window"
        assert not c.detail_on  # what the runtime's detail gate starts from
        c.flush()
        assert fake.state["flushes"] == []
        c.set_detail(True)
    assert fake.state["enabled"] == {"RUNTIME", "CONCURRENT_KERNEL", "MARKER"} and "done" in fake.state
    assert c.detail_on
    t = fake.state["ts"]
    pending += [api("RUNTIME", 211, t + 10, t + 20, corr=1), kernel("_Z1kv", t + 30, t + 40, corr=1)]
    c.set_detail(False)  # the first window ends
    assert fake.state["finalized"] == 1 and fake.state["enabled"] == set() and fake.state["flushes"] == [1]
    c.flush()
    c.set_detail(False)  # already off: nothing
    assert fake.state["flushes"] == [1] and fake.state["finalized"] == 1
    c.set_detail(True)  # the next window
    assert fake.state["enabled"] == {"RUNTIME", "CONCURRENT_KERNEL", "MARKER"} and "done" in fake.state
    t = fake.state["ts"]
    pending += [api("RUNTIME", 211, t + 10, t + 20, corr=2), kernel("_Z1kv", t + 30, t + 40, corr=2)]
    c.stop()
    sink.close()
    ev = RunDir(tmp_path).read_events().sort_by("start_ns")
    assert col(ev, "kind") == ["RUNTIME", "KERNEL", "RUNTIME", "KERNEL"]
    info = c.info()
    assert info["detail_switches"] == (3 if lazy else 2) and info["errors"] == [] and not info["never_attached"]


@pytest.mark.parametrize("cuda, detached", [("13.0", True), ("12.6", True), ("12.4", False), (None, False)])
def test_cupti_teardown_waits_for_a_safe_cuda(tmp_path, install_fake, monkeypatch, cuda, detached):
    """By default CUPTI is detached between windows only with CUDA 12.6 or later (torch's build),
    where its teardown is safe with CUDA graphs; otherwise, and with no CUDA known, its kinds are
    only disabled, and the collector says why."""
    monkeypatch.delenv("TELLER_CUPTI_TEARDOWN", raising=False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(cuda=cuda)))
    fake = _with_finalize(install_fake(fake_cupti([])))
    c = CuptiCollector(kinds=["RUNTIME"], decode="objects", api_filter=False)
    c.start(EventSink(tmp_path, pid=3))
    c.set_detail(False)
    assert fake.state["finalized"] == int(detached) and fake.state["enabled"] == set()
    c.set_detail(True)
    assert fake.state["enabled"] == {"RUNTIME"}
    info = c.info()
    why = {"13.0": "CUDA 13.0: CUPTI detached", "12.6": "CUDA 12.6: CUPTI detached", "12.4": "CUDA 12.4 < 12.6",
           None: "CUDA version unknown"}[cuda]
    assert info["detail_teardown"] is detached and info["detail_teardown_note"].startswith(why)
    c.stop()


def test_a_failed_detach_is_attached_again_at_the_next_window(tmp_path, install_fake, monkeypatch):
    """cuptiFinalize raising after the kinds were disabled: the error is kept, and the next
    window enables the kinds again instead of believing they are still on."""
    monkeypatch.setenv("TELLER_CUPTI_TEARDOWN", "1")
    fake = _with_finalize(install_fake(fake_cupti([])))

    def broken():
        raise RuntimeError("CUPTI_ERROR_UNKNOWN")

    fake.finalize = broken
    c = CuptiCollector(kinds=["RUNTIME"], decode="objects", api_filter=False)
    c.start(EventSink(tmp_path, pid=5))
    with pytest.raises(RuntimeError):
        c.set_detail(False)
    assert fake.state["enabled"] == set() and any("detail off" in e for e in c.info()["errors"])
    c.set_detail(True)
    assert fake.state["enabled"] == {"RUNTIME"}
    c.stop()
