"""Reconstruction on hand-built runs with known trees (docs/design.md §4–5)."""

from __future__ import annotations

import json

import pytest
from test_reconstruct_helpers import (
    by_name,
    check_forest,
    parent_names,
    reconciles,
    run_and_read,
    write_run,
)

from teller.errors import TellerError
from teller.reconstruct import reconstruct
from teller.rundir import FLAG_DUPLICATE, FLAG_REPAIRED, FLAG_TRUNCATED, FLAG_UNBOUND, RunDir


def push(name, t, tid=1, **kw):
    return {"kind": "NVTX_PUSH", "name": name, "start_ns": t, "tid": tid, **kw}


def pop(t, tid=1, **kw):
    return {"kind": "NVTX_POP", "start_ns": t, "tid": tid, **kw}


def rng(name, s, e, tid=1, **kw):
    return {"kind": "RANGE", "name": name, "start_ns": s, "end_ns": e, "tid": tid, **kw}


def call(name, s, e, corr, tid=1, kind="RUNTIME", **kw):
    return {"kind": kind, "name": name, "start_ns": s, "end_ns": e, "corr_id": corr, "tid": tid, **kw}


def gpu(name, s, e, corr, kind="KERNEL", stream=7, **kw):
    return {"kind": kind, "name": name, "start_ns": s, "end_ns": e, "corr_id": corr, "tid": -1, "device": 0, "stream": stream, **kw}


def test_known_tree_exact_parents_and_order(tmp_path):
    rows = [
        push("STEP id=1 reqs=req_a,req_b", 0),
        push("FE Attn", 10),
        rng("BE aten::mm", 20, 40),
        call("cudaLaunchKernel", 22, 30, 7),
        call("cuLaunchKernel", 23, 29, 8, kind="DRIVER"),
        gpu("gemm", 50, 60, 7),
        gpu("gemm2", 61, 70, 7),
        pop(45),
        {"kind": "MARKER", "name": "tick", "start_ns": 46},
        push("FE MLP", 47),
        pop(90),
        pop(100),
    ]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    assert [r["name"] for r in f] == [
        "STEP id=1 reqs=req_a,req_b", "Attn", "aten::mm", "cudaLaunchKernel", "cuLaunchKernel", "gemm", "gemm2", "tick", "MLP",
    ]
    assert [r["parent_id"] for r in f] == [-1, 0, 1, 2, 3, 3, 3, 0, 0]
    assert [r["depth"] for r in f] == [0, 1, 2, 3, 4, 4, 4, 1, 1]
    assert [r["size"] for r in f] == [9, 6, 5, 4, 1, 1, 1, 1, 1]
    assert all(r["step_id"] == 0 for r in f)
    assert [r["layer"] for r in f] == ["STEP", "FE", "BE", "RT", "DRV", "K", "K", "OTHER", "FE"]
    n = by_name(f)
    assert (n["Attn"]["start_ns"], n["Attn"]["end_ns"]) == (10, 45)
    assert (n["tick"]["start_ns"], n["tick"]["end_ns"]) == (46, 46)
    assert s["events_in"] == 12 and s["nodes"] == 9 and s["pops_consumed"] == 3 and reconciles(s)
    assert s["binding_coverage"] == 1.0 and s["layers"]["K"] == 2
    check_forest(rd.read_table("forest"))
    assert json.loads((tmp_path / "r" / "reconstruct.json").read_text())["nodes"] == 9


def test_pushpop_and_range_give_the_same_tree(tmp_path):
    tree = [("STEP id=3", 0, 100), ("FE A", 5, 50), ("BE x", 6, 20), ("BE y", 20, 49), ("FE B", 50, 99)]
    pp = []
    for name, s, e in tree:
        pp += [push(name, s), pop(e)]
    pp.sort(key=lambda r: (r["start_ns"], r["kind"] == "NVTX_PUSH"))  # pops first at equal times
    calls = [call("cudaLaunchKernel", 7, 9, 1), call("cudaMemcpyAsync", 60, 70, 2), gpu("k", 30, 40, 1), gpu("m", 80, 85, 2, kind="MEMCPY")]
    _, f1, _ = run_and_read(tmp_path / "pp", pp + calls)
    _, f2, _ = run_and_read(tmp_path / "rg", [rng(*t) for t in reversed(tree)] + calls)
    keep = ("name", "parent_id", "start_ns", "end_ns", "depth", "size", "step_id", "layer")
    assert [{k: r[k] for k in keep} for r in f1] == [{k: r[k] for k in keep} for r in f2]
    assert parent_names(f1) == {"STEP id=3": None, "A": "STEP id=3", "x": "A", "cudaLaunchKernel": "x", "k": "cudaLaunchKernel",
                                "y": "A", "B": "STEP id=3", "cudaMemcpyAsync": "B", "m": "cudaMemcpyAsync"}


def test_range_id_pairing_across_threads_and_reuse(tmp_path):
    rows = [
        push("a", 0, tid=1, range_id=5), pop(10, tid=2, range_id=5),  # ended on another thread
        push("b", 20, tid=1, range_id=5), pop(30, tid=1, range_id=5),  # id reused
        push("c", 40, tid=1, range_id=6), push("c2", 41, tid=1, range_id=6), pop(45, tid=1, range_id=6),
        pop(50, tid=1, range_id=9),  # no push with that id
    ]
    s, f, _ = run_and_read(tmp_path / "r", rows)
    n = by_name(f)
    assert (n["a"]["start_ns"], n["a"]["end_ns"], n["a"]["tid"]) == (0, 10, 1)
    assert (n["b"]["start_ns"], n["b"]["end_ns"]) == (20, 30)
    assert n["c2"]["end_ns"] == 45 and n["c"]["flags"] & FLAG_TRUNCATED and n["c"]["flags"] & FLAG_DUPLICATE
    assert s["repaired_pops_without_push"] == 1 and s["pops_consumed"] == 3 and reconciles(s)


def test_unbalanced_input_is_repaired_and_counted(tmp_path):
    rows = [
        pop(1),  # pop without push
        push("A", 2),
        push("B", 3),
        pop(5),
        pop(6),
        pop(7),  # another stray pop
        push("open", 10),
        push("inner", 11),
        pop(12),
        call("cudaFree", 20, 15, -1),  # end before start
        rng("late", 30, 40, tid=2),
    ]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    n = by_name(f)
    assert s["repaired_pops_without_push"] == 2 and s["pops_consumed"] == 3 and reconciles(s)
    assert n["open"]["flags"] & FLAG_TRUNCATED and n["open"]["end_ns"] == 20  # thread 1's last event time
    assert n["inner"]["parent_id"] == n["open"]["node_id"]
    assert n["cudaFree"]["flags"] & FLAG_REPAIRED and n["cudaFree"]["end_ns"] == 20
    assert n["cudaFree"]["parent_id"] == n["open"]["node_id"]
    assert s["truncated"] == 1 and s["repaired_negative_duration"] == 1
    check_forest(rd.read_table("forest"))


def test_partial_overlap_is_clipped_to_the_parent(tmp_path):
    rows = [rng("A", 0, 10), rng("B", 5, 15), rng("C", 12, 14), call("cudaMalloc", 9, 11, 3)]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    n = by_name(f)
    assert n["B"]["parent_id"] == n["A"]["node_id"] and n["B"]["end_ns"] == 10 and n["B"]["flags"] & FLAG_REPAIRED
    assert n["cudaMalloc"]["parent_id"] == n["B"]["node_id"] and n["cudaMalloc"]["end_ns"] == 10
    assert n["C"]["parent_id"] == -1 and n["C"]["flags"] == 0  # B is closed (clipped) before C starts
    assert s["repaired_partial_overlap"] == 2
    check_forest(rd.read_table("forest"))


def test_kernel_binding_unbound_graph_and_preference(tmp_path):
    rows = [
        rng("BE op", 0, 100),
        call("cudaLaunchKernel", 10, 20, 1),
        call("cuLaunchKernel", 11, 19, 1, kind="DRIVER"),  # same corr: the runtime call wins
        call("cudaGraphLaunch", 30, 40, 2),
        call("cudaMemsetAsync", 50, 55, 3),
        gpu("k1", 200, 210, 1),
        gpu("g1", 220, 230, 2, graph_id=9),
        gpu("g2", 231, 240, 2, graph_id=9),
        gpu("g3", 241, 250, 2, graph_id=9, stream=8),
        gpu("set", 251, 252, 3, kind="MEMSET"),
        gpu("lost", 260, 270, 77),
        gpu("nocorr", 280, 290, -1),
        {"kind": "SYNC", "name": "sync", "start_ns": 300, "end_ns": 310, "corr_id": 3, "tid": -1, "device": 0, "stream": 7},
    ]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    n = by_name(f)
    assert n["k1"]["parent_id"] == n["cudaLaunchKernel"]["node_id"]
    assert {n[k]["parent_id"] for k in ("g1", "g2", "g3")} == {n["cudaGraphLaunch"]["node_id"]}
    assert [n[k]["graph_id"] for k in ("g1", "g2", "g3")] == [9, 9, 9]
    assert n["set"]["parent_id"] == n["cudaMemsetAsync"]["node_id"] and n["set"]["layer"] == "MEM"
    assert n["sync"]["parent_id"] == n["cudaMemsetAsync"]["node_id"] and n["sync"]["layer"] == "SYNC"
    for k in ("lost", "nocorr"):
        assert n[k]["parent_id"] == -1 and n[k]["flags"] & FLAG_UNBOUND
    assert n["cuLaunchKernel"]["parent_id"] == n["cudaLaunchKernel"]["node_id"]
    assert s["gpu_activity"] == 7 and s["gpu_bound"] == 5 and s["binding_coverage"] == pytest.approx(5 / 7)
    assert s["unbound"] == 2
    check_forest(rd.read_table("forest"))


def test_gpu_rows_with_device_in_pid_bind_by_rank(tmp_path):
    rows = [call("cudaLaunchKernel", 0, 5, 11, pid=4242), gpu("k", 10, 20, 11, pid=0)]
    s, f, _ = run_and_read(tmp_path / "r", rows)
    assert by_name(f)["k"]["parent_id"] == by_name(f)["cudaLaunchKernel"]["node_id"] and s["binding_coverage"] == 1.0


def test_steps_requests_and_gpu_step_ids(tmp_path):
    rows = [
        push("STEP id=7 reqs=req_0,req_3", 0), call("cudaLaunchKernel", 1, 2, 1), pop(10),
        push("STEP id=8 reqs=req_3,,req_3", 20), pop(30),
        push("STEP id=9", 40), pop(50),
        gpu("k", 12, 15, 1),
    ]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    steps = rd.read_table("steps").to_pylist()
    assert [(r["step_num"], r["n_requests"], r["start_ns"], r["end_ns"]) for r in steps] == [(7, 2, 0, 10), (8, 1, 20, 30), (9, 0, 40, 50)]
    req = rd.read_table("requests").to_pylist()
    assert [(r["request_id"], r["step_num"]) for r in req] == [("req_0", 7), ("req_3", 7), ("req_3", 8)]
    assert {r["step_id"] for r in req if r["step_num"] == 7} == {steps[0]["step_id"]}
    k = by_name(f)["k"]
    assert k["step_id"] == steps[0]["step_id"]  # launched inside step 7, ran after it
    # the step's subtree is the block [step_id, step_id + size)
    block = f[steps[0]["step_id"] : steps[0]["step_id"] + steps[0]["size"]]
    assert {r["name"] for r in block} == {"STEP id=7 reqs=req_0,req_3", "cudaLaunchKernel", "k"}
    assert s["steps"] == 3 and s["requests"] == 2 and s["request_step_pairs"] == 3


def test_nested_steps_take_the_innermost(tmp_path):
    rows = [
        rng("ProfilerStep#1", 0, 100), rng("STEP id=5 reqs=r", 10, 50), call("cudaLaunchKernel", 20, 30, 1),
        call("cudaMemcpyAsync", 60, 70, 2), gpu("k", 80, 90, 1), gpu("m", 91, 95, 2, kind="MEMCPY"), rng("after", 200, 210),
    ]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    n = by_name(f)
    assert n["cudaLaunchKernel"]["step_id"] == n["k"]["step_id"] == n["STEP id=5 reqs=r"]["node_id"]
    assert n["cudaMemcpyAsync"]["step_id"] == n["m"]["step_id"] == n["ProfilerStep#1"]["node_id"]
    assert n["STEP id=5 reqs=r"]["step_id"] == n["STEP id=5 reqs=r"]["node_id"] and n["after"]["step_id"] == -1
    assert s["steps"] == 2
    check_forest(rd.read_table("forest"))


def test_profiler_step_and_custom_patterns(tmp_path):
    rows = [rng("ProfilerStep#4", 0, 10), rng("ProfilerStep#5", 10, 20), rng("iteration 12 (batch=a;b)", 30, 40), rng("ProfilerStep#x", 50, 60)]
    s, f, rd = run_and_read(tmp_path / "r", rows, step_patterns=[r"^iteration (?P<id>\d+) \(batch=(?P<reqs>[^)]*)\)$"])
    steps = rd.read_table("steps").to_pylist()
    assert [(r["name"], r["step_num"], r["n_requests"]) for r in steps] == [
        ("ProfilerStep#4", 4, 0), ("ProfilerStep#5", 5, 0), ("iteration 12 (batch=a;b)", 12, 1)]
    assert by_name(f)["ProfilerStep#x"]["layer"] == "OTHER"
    assert rd.read_table("requests").column("request_id").to_pylist() == ["a;b"]


def test_python_only_step_pattern_and_bad_pattern(tmp_path):
    rows = [rng("run 3 go", 0, 10)]
    _, _, rd = run_and_read(tmp_path / "r", rows, step_patterns=[r"^run (?P<id>\d+)(?= go)"])  # look-ahead: not RE2
    assert rd.read_table("steps").column("step_num").to_pylist() == [3]
    with pytest.raises(TellerError, match="step-pattern"):
        reconstruct(tmp_path / "r", step_patterns=["(unclosed"])


def test_layer_column_and_tags(tmp_path):
    rows = [
        rng("FE Llama", 0, 100), rng("COMM all_gather bytes=4 group=tp seq=0", 10, 20),
        rng("aten::mm", 30, 40, layer="BE"), rng("STEP bogus", 200, 300), rng("BE", 400, 410),
        gpu("ncclDevKernel_AllReduce", 500, 510, 99, layer="COMM"),
        {"kind": "MARKER", "name": "FE not a tag for markers", "start_ns": 50},
    ]
    s, f, _ = run_and_read(tmp_path / "r", rows)
    n = by_name(f)
    assert n["Llama"]["layer"] == "FE" and n["aten::mm"]["layer"] == "BE"
    assert n["all_gather bytes=4 group=tp seq=0"]["layer"] == "COMM" and n["all_gather bytes=4 group=tp seq=0"]["bytes"] == 4
    assert n["STEP bogus"]["layer"] == "STEP"
    assert n["BE"]["layer"] == "OTHER"  # a tag needs a name after it
    assert n["ncclDevKernel_AllReduce"]["layer"] == "COMM" and n["ncclDevKernel_AllReduce"]["flags"] & FLAG_UNBOUND
    assert n["FE not a tag for markers"]["layer"] == "OTHER"
    assert s["layers"]["COMM"] == 2


def _comm_rank(rank, t0, seqs, group="tp"):
    rows = []
    for i, q in enumerate(seqs):
        rows.append(rng(f"COMM all_reduce bytes={1024 * (q + 1)} group={group} seq={q}", t0 + 10 * i, t0 + 10 * i + 5, rank=rank, pid=10 + rank))
    return rows


def test_comm_edges_across_two_ranks(tmp_path):
    rows = _comm_rank(0, 0, [0, 1, 2]) + _comm_rank(1, 3, [0, 1, 2, 3]) + _comm_rank(1, 100, [0], group="dp")
    # Kineto-style NCCL kernels without a seq: numbered per (rank, group, collective) in start order
    for rank in (0, 1):
        for i in range(2):
            args = json.dumps({"Collective name": "allreduce", "Process Group Name": "0", "In msg nelems": 10, "dtype": "BFloat16"})
            rows.append(gpu("ncclKernel_AllReduce", 200 + 20 * i + rank, 210 + 20 * i, -1, layer="COMM", rank=rank, pid=10 + rank, device=rank, args=args))
    s, f, rd = run_and_read(tmp_path / "r", rows)
    e = rd.read_table("comm_edges").to_pylist()
    ranges = sorted((r["seq"], r["group"], r["src_rank"], r["dst_rank"], r["bytes"]) for r in e if r["collective"] == "all_reduce")
    assert ranges == [(0, "tp", 0, 1, 1024), (1, "tp", 0, 1, 2048), (2, "tp", 0, 1, 3072)]
    kern = sorted((r["seq"], r["group"], r["collective"], r["bytes"]) for r in e if r["collective"] == "allreduce")
    assert kern == [(0, "0", "allreduce", 20), (1, "0", "allreduce", 20)]
    for r in e:
        src, dst = f[r["src_node_id"]], f[r["dst_node_id"]]
        assert (src["rank"], dst["rank"]) == (r["src_rank"], r["dst_rank"]) and src["layer"] == dst["layer"] == "COMM"
    assert s["comm_edges"] == 5


def test_empty_run_and_cli(tmp_path):
    rd = RunDir(tmp_path / "empty")
    rd.write_events(__import__("teller.rundir", fromlist=["empty_events"]).empty_events())
    s = reconstruct(rd.path)
    assert s["events_in"] == 0 and s["nodes"] == 0 and reconciles(s)
    for t in ("forest", "steps", "requests", "comm_edges"):
        assert rd.read_table(t).num_rows == 0
    from teller.cli import main

    write_run(tmp_path / "cli", [rng("STEP id=1", 0, 5)])
    assert main(["reconstruct", str(tmp_path / "cli"), "--no-logs"]) == 0
    assert RunDir(tmp_path / "cli").read_table("steps").num_rows == 1
    assert main(["reconstruct", str(tmp_path / "missing"), "--no-logs"]) == 2


def test_forest_schema_types(tmp_path):
    _, _, rd = run_and_read(tmp_path / "r", [rng("STEP id=1", 0, 5), call("cudaLaunchKernel", 1, 2, 1), gpu("k", 3, 4, 1)])
    t = rd.read_table("forest")
    types = {f.name: str(f.type) for f in t.schema}
    assert types["node_id"] == types["parent_id"] == types["step_id"] == types["start_ns"] == "int64"
    assert types["layer"].startswith("dictionary") and types["name"].startswith("dictionary")
    assert types["depth"] == "int32" and types["args"] == "string"
    for col in ("node", "rank", "pid", "tid", "device", "stream", "corr_id", "flags"):
        assert col in types


def test_tag_words_set_layer_and_leave_the_name(tmp_path):
    rows = [
        rng("STEP id=3 reqs=r1", 0, 100),
        rng("OTHER update_batch", 10, 20),
        rng("COMM all_reduce bytes=64 group=tp seq=0", 30, 40),
        rng("plain range", 50, 60),
    ]
    _, f, _ = run_and_read(tmp_path / "r", rows)
    got = {r["name"]: r["layer"] for r in f}
    assert got == {"STEP id=3 reqs=r1": "STEP", "update_batch": "OTHER",
                   "all_reduce bytes=64 group=tp seq=0": "COMM", "plain range": "OTHER"}


def test_range_open_at_thread_end_leaves_phase_times_sane(tmp_path):
    """A STEP still open at thread end is closed at the thread's last event; the per-phase CPU
    times in reconstruct.json stay non-negative (the truncation must not disturb the phase clock)."""
    rows = [push("STEP id=1", 0), rng("FE a", 1, 5), call("cudaLaunchKernel", 2, 3, 1), gpu("k", 4, 6, 1)]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    assert by_name(f)["STEP id=1"]["flags"] & FLAG_TRUNCATED and by_name(f)["STEP id=1"]["end_ns"] == 5
    written = json.loads((tmp_path / "r" / "reconstruct.json").read_text())
    for t in (s["timings"], written["timings"]):
        assert t and all(v >= 0 for v in t.values()), t
    assert 0 <= sum(s["timings"].values()) <= s["cpu_seconds"] + 0.01
