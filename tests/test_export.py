"""`teller export`: the Perfetto protobuf is read back with Perfetto's own schema (perfetto_trace_pb2)
and replayed track by track; the Chrome JSON is parsed and its slices nested per thread. Both must
hold every forest node once, nest host calls as the forest does and join launches to GPU work."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from teller.errors import TellerError
from teller.reconstruct import reconstruct
from teller.report.export import export_trace

pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "h200_faulty_op_delay"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("export") / "run"
    shutil.copytree(EXAMPLE, r)
    reconstruct(r)
    return r


@pytest.fixture(scope="module")
def forest(run) -> dict[str, np.ndarray]:
    t = pq.read_table(run / "forest.parquet", columns=["node_id", "parent_id", "tid", "name", "start_ns", "end_ns"])
    return {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}


def _diagnosis(run: Path, forest: dict[str, np.ndarray]) -> Path:
    """A diagnosis.json flagging the first step, naming one of its operators as the suspect."""
    st = pq.read_table(run / "steps.parquet").slice(2, 1).to_pylist()[0]
    inside = np.flatnonzero((forest["start_ns"] >= st["start_ns"]) & (forest["end_ns"] <= st["end_ns"]) & (forest["tid"] >= 0))
    sus = int(forest["node_id"][inside[len(inside) // 2]])
    d = {"format": "teller.diagnosis", "version": 1, "steps": [
        {"step_num": st["step_num"], "rank": st["rank"], "node_id": st["step_id"], "start_ns": st["start_ns"],
         "end_ns": st["end_ns"], "score": 0.97, "flag": True, "top_family": "FE LlamaMLP", "fault_type": "kernel",
         "explanation": "The MLP's kernels ran 70x longer than in the reference.",
         "suspects": [{"node_id": sus, "family": "FE LlamaMLP", "a": 0.99}]},
        {"step_num": st["step_num"] + 1, "rank": 0, "node_id": -1, "start_ns": 0, "end_ns": 1, "score": 0.1, "flag": False}]}
    p = run / "diag_test.json"
    p.write_text(json.dumps(d))
    return p


def test_perfetto_replays_the_forest(run, forest, tmp_path):
    diag = _diagnosis(run, forest)
    out = tmp_path / "run.pftrace"
    s = export_trace(run, out, fmt="perfetto", diagnosis=diag)
    trace = pb.Trace.FromString(out.read_bytes())
    names, cats = {}, {}
    tracks = {}
    for p in trace.packet:
        if p.HasField("interned_data"):
            names.update({e.iid: e.name for e in p.interned_data.event_names})
            cats.update({e.iid: e.name for e in p.interned_data.event_categories})
        if p.HasField("track_descriptor"):
            tracks[p.track_descriptor.uuid] = p.track_descriptor
    # every child track hangs under a process track
    procs = {u for u, d in tracks.items() if d.HasField("process")}
    assert procs and all(d.parent_uuid in procs for u, d in tracks.items() if u not in procs)

    stacks: dict[int, list] = defaultdict(list)
    last_ts: dict[int, int] = {}
    parent_of_slice: dict[int, int] = {}
    begin_ts: dict[int, int] = {}
    flows: dict[int, list[int]] = defaultdict(list)
    n_slices = 0
    flagged = []
    instants = []
    for p in trace.packet:
        if not p.HasField("track_event"):
            continue
        te = p.track_event
        u = te.track_uuid
        assert u in tracks
        assert p.timestamp >= last_ts.get(u, 0), "timestamps go back on a track"
        last_ts[u] = p.timestamp
        ann = {a.name: a for a in te.debug_annotations}
        if te.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            n_slices += 1
            nid = ann["node_id"].int_value if "node_id" in ann else None
            if nid is not None:
                assert te.name_iid in names and te.category_iids[0] in cats
                top = stacks[u][-1] if stacks[u] else None
                parent_of_slice[nid] = top if top is not None else -1
                begin_ts[nid] = p.timestamp
                for f in te.flow_ids:
                    flows[f].append(nid)
            if "explanation" in ann:
                flagged.append(ann)
            stacks[u].append(nid)
        elif te.type == pb.TrackEvent.TYPE_SLICE_END:
            assert stacks[u], "END without BEGIN"
            stacks[u].pop()
        else:
            assert te.type == pb.TrackEvent.TYPE_INSTANT
            instants.append(ann)
    assert all(not v for v in stacks.values()), "unbalanced slices"

    nid, par, tid = forest["node_id"], forest["parent_id"], forest["tid"]
    steps = pq.read_table(run / "steps.parquet").num_rows
    assert n_slices == len(nid) + steps + 1 == s["slices"]
    assert set(parent_of_slice) == set(nid.tolist())  # every node once
    # host calls nest exactly as in the forest (a host node's parent on its thread track)
    host = tid >= 0
    host_parent = np.where(par >= 0, par, -1)
    hp = host & (host_parent >= 0)
    hp[hp] = tid[host_parent[hp]] >= 0
    exported = np.array([parent_of_slice[int(i)] for i in nid[hp].tolist()])
    assert np.array_equal(exported, host_parent[hp])
    roots = host & (par < 0)
    assert all(parent_of_slice[int(i)] == -1 for i in nid[roots].tolist())
    # launch flows: a GPU row and its launching call share a flow id
    gpu_bound = (~host) & (par >= 0)
    gpu_bound[gpu_bound] = tid[par[gpu_bound]] >= 0
    pairs = {(a, b) for ids in flows.values() for a in ids for b in ids if a != b}
    sample = np.flatnonzero(gpu_bound)[:: max(1, gpu_bound.sum() // 200)]
    assert len(sample) > 50
    assert all((int(par[i]), int(nid[i])) in pairs for i in sample.tolist())
    assert s["flows"] == int(gpu_bound.sum())
    # the diagnosis: one flagged step with its verdict, the suspect marked on its thread
    assert len(flagged) == 1 and flagged[0]["fault_type"].string_value == "kernel"
    assert "70x" in flagged[0]["explanation"].string_value
    assert len(instants) == 1 and instants[0]["node_id"].int_value in set(nid.tolist())
    # names survive exactly (a long templated CUDA kernel name)
    kernel = max((str(x) for x in pq.read_table(run / "forest.parquet", columns=["name"]).column("name").combine_chunks().dictionary.to_pylist()), key=len)
    assert kernel in set(names.values())


def test_chrome_json_nests_per_thread(run, forest, tmp_path):
    out = tmp_path / "run.json"
    s = export_trace(run, out, fmt="chrome", diagnosis=_diagnosis(run, forest))
    doc = json.loads(out.read_text())
    ev = doc["traceEvents"]
    meta = {(e["pid"], e.get("tid")) for e in ev if e["ph"] == "M"}
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == s["slices"]
    assert {e["args"]["node_id"] for e in xs if e["cat"] not in ("steps", "diagnosis")} == set(forest["node_id"].tolist())
    by_thread = defaultdict(list)
    for e in xs:
        assert (e["pid"], e["tid"]) in meta and (e["pid"], None) in meta
        assert e["dur"] >= 0
        by_thread[(e["pid"], e["tid"])].append((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)))
    for spans in by_thread.values():  # every slice of a thread inside the open one or after it
        spans.sort(key=lambda x: (x[0], -x[1]))
        stack: list[int] = []
        for a, b in spans:
            while stack and stack[-1] <= a and not (stack[-1] == a == b):
                stack.pop()
            assert not stack or b <= stack[-1] + 1, "slices overlap on a thread"
            stack.append(b)
    ids_s = [e["id"] for e in ev if e["ph"] == "s"]
    ids_f = [e["id"] for e in ev if e["ph"] == "f"]
    assert len(ids_s) == len(ids_f) == s["flows"] > 0 and sorted(ids_s) == sorted(ids_f)
    # exact ns: the first kernel's start survives the µs text
    k = next(e for e in xs if e["cat"] == "K")
    i = int(np.flatnonzero(forest["node_id"] == k["args"]["node_id"])[0])
    assert round(k["ts"] * 1000) == int(forest["start_ns"][i])
    d = [e for e in xs if e["cat"] == "diagnosis"]
    assert len(d) == 1 and d[0]["args"]["fault_type"] == "kernel"
    assert sum(e["ph"] == "i" for e in ev) == 1


def test_damaged_nesting_is_clipped_not_emitted(run, tmp_path):
    """A child that outlives its parent (damaged input) is clipped and counted; the trace stays valid."""
    r = tmp_path / "damaged"
    shutil.copytree(run, r)
    t = pq.read_table(r / "forest.parquet")
    par = t.column("parent_id").to_numpy()
    tid = t.column("tid").to_numpy()
    child = int(np.flatnonzero((par >= 0) & (tid >= 0))[10])
    end = t.column("end_ns").to_numpy().copy()
    end[child] = end[par[child]] + 5_000_000
    import pyarrow as pa

    t = t.set_column(t.column_names.index("end_ns"), "end_ns", pa.array(end))
    pq.write_table(t, r / "forest.parquet")
    out = tmp_path / "d.pftrace"
    s = export_trace(r, out, fmt="perfetto", diagnosis=None)
    assert s["clipped"] >= 1
    trace = pb.Trace.FromString(out.read_bytes())
    depth: dict[int, int] = defaultdict(int)
    last: dict[int, int] = {}
    for p in trace.packet:
        if p.HasField("track_event"):
            u = p.track_event.track_uuid
            assert p.timestamp >= last.get(u, 0)
            last[u] = p.timestamp
            depth[u] += 1 if p.track_event.type == 1 else -1 if p.track_event.type == 2 else 0
            assert depth[u] >= 0
    assert all(v == 0 for v in depth.values())


def test_errors_name_the_file_and_the_fix(tmp_path, run):
    empty = tmp_path / "norun"
    empty.mkdir()
    (empty / "run.json").write_text(json.dumps({"schema_version": 1}))
    with pytest.raises(TellerError, match="teller reconstruct"):
        export_trace(empty, tmp_path / "x.pftrace")
    with pytest.raises(TellerError, match="unknown"):
        export_trace(run, tmp_path / "x.bin", fmt="svg")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(TellerError, match="bad.json"):
        export_trace(run, tmp_path / "x.pftrace", diagnosis=bad)
    with pytest.raises(TellerError, match="teller diagnose"):
        export_trace(run, tmp_path / "x.pftrace", diagnosis=tmp_path / "missing.json")
