"""Steps decided once, in reconstruct (docs/design.md §5.5): STEP ranges, profiler steps or fixed
windows, the rule written into steps.parquet / reconstruct.json, every forest row's step_idx."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_reconstruct_helpers import run_and_read, write_run

from teller.reconstruct import reconstruct
from teller.reconstruct.steps import STEPS_FILE_SCHEMA
from teller.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
EXT = ROOT / "tests" / "data" / "external"


def rng(name, s, e, tid=1, **kw):
    return {"kind": "RANGE", "name": name, "start_ns": s, "end_ns": e, "tid": tid, **kw}


def call(name, s, e, corr, tid=1, **kw):
    return {"kind": "RUNTIME", "name": name, "start_ns": s, "end_ns": e, "corr_id": corr, "tid": tid, **kw}


def gpu(name, s, e, corr, **kw):
    return {"kind": "KERNEL", "name": name, "start_ns": s, "end_ns": e, "corr_id": corr, "tid": -1, "device": 0, "stream": 7, **kw}


def _steps(rd: RunDir) -> list[dict]:
    return rd.read_table("steps").to_pylist()


def _idx(forest: list[dict]) -> dict[str, int]:
    return {r["name"]: r["step_idx"] for r in forest}


def test_step_ranges_rule_columns_and_gpu_rows(tmp_path):
    rows = [
        rng("STEP id=7 reqs=r0", 0, 100), rng("FE attn", 10, 50), call("cudaLaunchKernel", 20, 30, 1),
        rng("STEP id=8", 200, 300), rng("FE mlp", 210, 250),
        rng("FE outside", 400, 450), gpu("k", 120, 130, 1),
    ]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    steps = _steps(rd)
    assert rd.read_table("steps").schema.equals(STEPS_FILE_SCHEMA)
    assert [(r["step_idx"], r["step_num"], r["rule"], r["n_requests"]) for r in steps] == [
        (0, 7, "STEP ranges", 1), (1, 8, "STEP ranges", 0)]
    idx = _idx(f)
    assert idx["attn"] == idx["cudaLaunchKernel"] == idx["k"] == 0  # the kernel ran after the step: its launch's
    assert idx["mlp"] == 1 and idx["outside"] == -1
    assert all(steps[r["step_idx"]]["step_id"] == r["step_id"] for r in f if r["step_idx"] >= 0)
    on_disk = json.loads((tmp_path / "r" / "reconstruct.json").read_text())
    assert (on_disk["steps_rule"], on_disk["steps_detail"], on_disk["steps"]) == ("STEP ranges", "2 STEP ranges", 2)
    assert s["steps_rule"] == "STEP ranges"


def test_profiler_step_names_without_step_ranges(tmp_path):
    rows = [
        rng("step 3", 0, 100), rng("BE aten::mm", 10, 50), call("cudaLaunchKernel", 20, 30, 1), gpu("k", 60, 70, 1),
        rng("ProfilerStep #4", 100, 200), rng("BE aten::add", 110, 120),
        rng("BE aten::late", 300, 310),
    ]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    steps = _steps(rd)
    by = {r["name"]: r for r in f}
    assert [(r["name"], r["step_num"], r["step_id"], r["rule"]) for r in steps] == [
        ("step 3", 3, by["step 3"]["node_id"], "profiler steps"), ("ProfilerStep #4", 4, by["ProfilerStep #4"]["node_id"], "profiler steps")]
    assert steps[0]["size"] == by["step 3"]["size"] == 4
    idx = _idx(f)
    assert idx["aten::mm"] == idx["cudaLaunchKernel"] == idx["k"] == 0 and idx["aten::add"] == 1 and idx["aten::late"] == -1
    assert all(r["step_id"] == -1 for r in f)  # no STEP node: step_id (the innermost STEP) stays -1
    assert s["steps_rule"] == "profiler steps" and s["steps"] == 2 and rd.read_table("requests").num_rows == 0


def test_fixed_windows_per_rank_and_window_ms(tmp_path):
    ms = 1_000_000
    rows = [rng("BE a", 0, ms // 2), call("cudaLaunchKernel", 10, 20, 1), gpu("k", 5 * ms, 5 * ms + 10, 1),
            rng("BE b", 2 * ms + 5, 2 * ms + 9), rng("BE c", 2 * ms + 50, 2 * ms + 90, tid=2),
            rng("BE d", 7 * ms, 8 * ms, rank=1, pid=200)]
    write_run(tmp_path / "r", rows)
    from teller.cli import main

    assert main(["reconstruct", str(tmp_path / "r"), "--no-logs", "--window-ms", "2"]) == 0
    rd = RunDir(tmp_path / "r")
    steps = _steps(rd)
    assert [(r["step_idx"], r["rank"], r["step_num"], r["name"], r["step_id"], r["start_ns"], r["end_ns"], r["size"]) for r in steps] == [
        (0, 0, 0, "window 0", -1, 0, 2 * ms, 3), (1, 0, 1, "window 1", -1, 2 * ms, 4 * ms, 2), (2, 1, 3, "window 3", -1, 6 * ms, 8 * ms, 1)]
    assert {r["rule"] for r in steps} == {"fixed windows"}
    idx = _idx(rd.read_table("forest").to_pylist())
    assert idx == {"a": 0, "cudaLaunchKernel": 0, "k": 0, "b": 1, "c": 1, "d": 2}  # the kernel: its root's window
    summary = json.loads((tmp_path / "r" / "reconstruct.json").read_text())
    assert summary["steps_rule"] == "fixed windows" and "windows of 2 ms" in summary["steps_detail"]
    # Python: the same window; the default is a tenth of a run shorter than a second
    assert reconstruct(tmp_path / "r", window_ns=2 * ms)["steps"] == 3
    assert reconstruct(tmp_path / "r")["steps_detail"] == "no step holds an operator: windows of 0.8 ms by root start time"


def test_other_threads_join_the_step_running_at_their_start(tmp_path):
    rows = [
        rng("STEP id=1", 0, 100), rng("FE fwd", 10, 20),
        rng("BE backward", 50, 150, tid=2), call("cudaLaunchKernel", 60, 70, 5, tid=2), gpu("kb", 200, 210, 5),
        rng("BE before", 0, 0, tid=3), rng("BE after", 100, 120, tid=3),  # at the step's start; at its end (closed)
        rng("BE other process", 50, 60, tid=9, pid=101),
    ]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    idx = _idx(f)
    assert idx["backward"] == idx["cudaLaunchKernel"] == idx["kb"] == 0 and idx["before"] == 0
    assert idx["after"] == -1 and idx["other process"] == -1
    assert s["steps_detail"] == "1 STEP ranges; 2 root node(s) of other threads joined the step running at their start"
    assert by_step_id(f)["backward"] == -1  # step_id stays the STEP enclosing the row on its own thread


def by_step_id(f):
    return {r["name"]: r["step_id"] for r in f}


def test_a_rule_without_operators_in_its_steps_gives_way(tmp_path):
    rows = [rng("STEP id=1", 0, 10), rng("step 2", 20, 30), rng("FE op", 40, 50)]
    s, f, rd = run_and_read(tmp_path / "r", rows)
    assert s["steps_rule"] == "fixed windows" and all(r["rule"] == "fixed windows" for r in _steps(rd))
    assert by_step_id(f)["STEP id=1"] == 0  # step_id keeps naming the enclosing STEP node
    assert rd.read_table("requests").num_rows == 0
    # no operator instance at all: the STEP ranges stand
    s, _, _ = run_and_read(tmp_path / "q", [rng("STEP id=1", 0, 10), rng("plain", 40, 50)])
    assert s["steps_rule"] == "STEP ranges" and s["steps"] == 1


def test_empty_run_has_no_steps(tmp_path):
    from teller.rundir import empty_events

    rd = RunDir(tmp_path / "e")
    rd.write_events(empty_events())
    s = reconstruct(rd.path)
    assert (s["steps"], s["steps_rule"], s["steps_detail"]) == (0, "fixed windows", "empty forest")
    assert rd.read_table("steps").schema.equals(STEPS_FILE_SCHEMA) and rd.read_table("forest").num_rows == 0


# ------------------------------------------------------------------------------------------------
# the numeric stage and the diagnosis see reconstruct's steps

SOURCES = sorted((EXT / "kineto").iterdir()) + sorted((EXT / "nsys").iterdir()) + [
    ROOT / "examples" / n for n in ("h200_faulty_op_delay", "h200_llama8l_kineto")]


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_diagnose_sees_the_steps_of_reconstruct(tmp_path, src):
    """Per real trace (all three rules and the attach-by-time rule occur among them): the steps
    ``run_features`` (the numeric stage) and ``teller diagnose`` use are those ``teller reconstruct``
    wrote: rule, detail, count, row → step, and per step its number, rank, node id and interval."""
    from teller.ingest import ingest
    from teller.localize.features import run_features
    from teller.report.diagnose import diagnose

    if not src.exists():
        pytest.skip(f"{src} not present")
    ingest(src, tmp_path / "run")
    rd = RunDir(tmp_path / "run")
    for window_ns in (None, 1_000_000):
        s = reconstruct(rd.path, window_ns=window_ns)
        steps = rd.read_table("steps")
        st = run_features(rd.path).steps
        assert (st.rule, st.detail, st.n) == (s["steps_rule"], s["steps_detail"], s["steps"])
        assert set(steps.column("rule").to_pylist()) <= {s["steps_rule"]}
        np.testing.assert_array_equal(st.step_of_row, rd.read_table("forest", columns=["step_idx"]).column(0).to_numpy())
        for col, mine in (("step_num", st.step_num), ("rank", st.rank), ("step_id", st.node_id),
                          ("start_ns", st.start), ("end_ns", st.end), ("n_requests", st.n_requests)):
            np.testing.assert_array_equal(steps.column(col).to_numpy(), mine, err_msg=col)
        assert steps.column("name").to_pylist() == st.names
    # the diagnosis (reference: the run itself) reports the same steps; window_ns only applies
    # to a run that must be reconstructed, so the last reconstruction's steps stay
    d = diagnose(rd.path, reference=[rd.path], out=tmp_path / "out", window_ns=5_000_000)
    assert d["steps_rule"] == {"rule": s["steps_rule"], "detail": s["steps_detail"]}
    assert d["summary"]["steps"] == s["steps"] == len(d["steps"])
    got = sorted((x["index"], x["step_num"], x["rank"], x["node_id"], x["start_ns"], x["end_ns"]) for x in d["steps"])
    assert got == [(i, *(int(steps.column(c)[i].as_py()) for c in ("step_num", "rank", "step_id", "start_ns", "end_ns")))
                   for i in range(steps.num_rows)]


def test_step_idx_is_the_same_when_written_in_small_chunks(tmp_path, monkeypatch):
    """Under STEP ranges the index is looked up per written chunk; blocks that joined by time
    may straddle chunk boundaries."""
    import teller.reconstruct as R

    rows = [rng("STEP id=1", 0, 100), rng("FE fwd", 10, 20), rng("STEP id=2", 200, 300), rng("FE fwd2", 210, 220)]
    for tid, t0 in ((2, 50), (3, 250)):
        rows += [rng(f"BE bw{tid}", t0, t0 + 30, tid=tid)] + [rng(f"BE c{tid}_{i}", t0 + i, t0 + i + 1, tid=tid) for i in range(5)]
    _, whole, _ = run_and_read(tmp_path / "a", rows)
    monkeypatch.setattr(R, "CHUNK_ROWS", 3)
    _, chunked, rd = run_and_read(tmp_path / "b", rows)
    assert rd.read_table("forest").num_rows == 16 and len(rd.read_table("forest").to_batches()) > 4
    assert [r["step_idx"] for r in chunked] == [r["step_idx"] for r in whole]
    idx = _idx(whole)
    assert idx["bw2"] == idx["c2_4"] == 0 and idx["bw3"] == idx["c3_0"] == 1 and idx["fwd2"] == 1
