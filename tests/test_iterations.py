"""Engine iterations (iterations.parquet), batch fields of STEP messages and GAP rows."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import TINY_SERVE
from test_reconstruct_helpers import check_forest, reconciles, write_run

from teller.reconstruct import reconstruct
from teller.reconstruct.iterations import (
    BATCH_FIELDS,
    GAP_MIN_NS,
    GAP_NAME,
    ITERATIONS_SCHEMA,
    batch_fields,
)
from teller.rundir import LAYER_CODE, LAYERS, RunDir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXTERNAL = Path(__file__).parent / "data" / "external"
US = 1000


def test_gap_layer_is_appended():
    assert LAYERS[-1] == "GAP" and LAYER_CODE["GAP"] == 10 and LAYER_CODE["OTHER"] == 9 and LAYER_CODE["STEP"] == 0


def test_batch_fields_parsed_and_minus_one_when_absent():
    names = pa.array([
        "STEP id=3 reqs=req_0,req_1 prefill=120 decode=2 waiting=5 kv_used=40 kv_total=512 preempted=1",
        "STEP id=4 reqs=req_0 decode=7 kv_total=512",
        "STEP id=5 reqs=req_0",
        None,
        "STEP id=6 reqs=req_0 prefill=x decode=9",
    ])
    b = batch_fields(names)
    assert set(b) == set(BATCH_FIELDS)
    assert [b[k][0] for k in BATCH_FIELDS] == [120, 2, 5, 40, 512, 1]
    assert [b[k][1] for k in BATCH_FIELDS] == [-1, 7, -1, -1, 512, -1]
    assert all(b[k][2] == -1 and b[k][3] == -1 for k in BATCH_FIELDS)
    assert b["prefill"][4] == -1 and b["decode"][4] == 9
    assert all(len(batch_fields(pa.array([], pa.string()))[k]) == 0 for k in BATCH_FIELDS)


def _range(name: str, a: int, b: int, tid: int = 1) -> dict:
    return {"kind": "RANGE", "name": name, "start_ns": a * US, "end_ns": b * US, "tid": tid}


def _planted(tmp_path: Path) -> tuple[dict, RunDir]:
    """An engine thread with start-up work, three iterations, a planted 300 µs gap between the
    first STEP and the next schedule, a short 10 µs one, an idle wait, and a worker thread."""
    rows = [
        {"kind": "RUNTIME", "name": "cudaMalloc", "start_ns": 0, "end_ns": 50 * US},  # start-up: no iteration
        _range("OTHER schedule", 1000, 1100),
        _range("STEP id=0 reqs=req_0 prefill=12 decode=0 waiting=1 kv_used=3 kv_total=64 preempted=0", 1110, 1500),
        _range("BE aten::mm", 1200, 1300),
        # planted: nothing recorded from 1500 to 1800
        _range("OTHER schedule", 1800, 1900),
        _range("STEP id=1 reqs=req_0", 1900, 2300),
        _range("OTHER idle", 2350, 3000),
        _range("OTHER schedule", 3000, 3100),
        _range("STEP id=2 reqs=req_0,req_1 decode=2", 3100, 3400),
        _range("OTHER update_batch", 3400, 3450),
        _range("OTHER prepare_inputs", 1950, 2000, tid=2),  # another thread
    ]
    write_run(tmp_path / "run", rows)
    return reconstruct(tmp_path / "run"), RunDir(tmp_path / "run")


def test_planted_gap_becomes_a_gap_row_of_exactly_its_duration(tmp_path):
    s, rd = _planted(tmp_path)
    assert reconciles(s)
    forest = rd.read_table("forest")
    check_forest(forest)
    f = forest.to_pylist()
    gaps = [r for r in f if r["layer"] == "GAP"]
    # 1500-1800 (planted), 2300-2350 (before the idle wait); 1100-1110 is under GAP_MIN_NS
    assert [(r["start_ns"] // US, r["end_ns"] // US) for r in gaps] == [(1500, 1800), (2300, 2350)]
    assert all(r["name"] == GAP_NAME and r["parent_id"] == -1 and r["step_id"] == -1 and r["kind"] == "RANGE" for r in gaps)
    assert [r["step_idx"] for r in gaps] == [0, 1]
    assert all(r["tid"] == 1 and r["pid"] == 100 for r in gaps)
    # preorder: each GAP row right after the root it follows
    by_id = {r["node_id"]: r for r in f}
    for g in gaps:
        prev = next(r for r in reversed(f[: g["node_id"]]) if r["parent_id"] == -1)
        assert prev["end_ns"] == g["start_ns"] and by_id[g["node_id"] - 1]["tid"] == 1
    it = rd.read_table("iterations")
    assert it.schema.equals(ITERATIONS_SCHEMA)
    d = it.to_pydict()
    assert d["rule"] == ["engine ranges"] * 3
    assert [(a // US, b // US) for a, b in zip(d["start_ns"], d["end_ns"], strict=False)] == [(1000, 1800), (1800, 2350), (3000, 3450)]
    assert [x // US for x in d["schedule_ns"]] == [100, 100, 100]
    assert [x // US for x in d["step_ns"]] == [390, 400, 300]
    assert [x // US for x in d["post_ns"]] == [0, 0, 50]
    assert [x // US for x in d["gap_ns"]] == [310, 50, 0]
    assert [x // US for x in d["host_busy_ns"]] == [490, 500, 450]
    assert d["prefill"] == [12, -1, -1] and d["decode"] == [0, -1, 2] and d["kv_total"] == [64, -1, -1]
    assert d["n_requests"] == [1, 1, 2] and d["warmup"] == [True, True, False]
    # the iteration's roots (schedule, update) carry its step; the idle wait and start-up none
    idx = {(r["name"], r["start_ns"] // US): r["step_idx"] for r in f if r["parent_id"] == -1}
    assert idx[("schedule", 1000)] == 0 and idx[("schedule", 1800)] == 1 and idx[("schedule", 3000)] == 2
    assert idx[("update_batch", 3400)] == 2 and idx[("idle", 2350)] == -1 and idx[("cudaMalloc", 0)] == -1
    assert idx[("prepare_inputs", 1950)] == 1  # another thread: joins the step running at its start, as before
    js = s["iterations"]
    assert js["count"] == 3 and js["gap_rows"] == 2 and js["gap_ns_total"] == 360 * US
    assert s["layers"]["GAP"] == 2 and s["gap_nodes"] == 2


def _check_iterations(rd: RunDir, s: dict) -> None:
    """Iterations tile each engine thread: ordered, disjoint, each holding its STEP; the time
    identity holds; every untraced stretch ≥ GAP_MIN_NS inside one is a GAP row."""
    it = rd.read_table("iterations")
    steps = rd.read_table("steps")
    assert it.num_rows == steps.num_rows == s["iterations"]["count"] > 0
    d = {c: it.column(c).to_numpy(zero_copy_only=False) for c in it.column_names}
    st = {c: steps.column(c).to_numpy(zero_copy_only=False) for c in ("step_id", "start_ns", "end_ns", "tid", "pid")}
    assert (d["step_id"] == st["step_id"]).all() and (d["step_idx"] == np.arange(it.num_rows)).all()
    assert set(d["rule"]) == {"engine ranges"}
    assert ((d["start_ns"] <= st["start_ns"]) & (st["end_ns"] <= d["end_ns"])).all()
    assert (d["dur_ns"] == d["end_ns"] - d["start_ns"]).all() and (d["gap_ns"] >= 0).all()
    assert (d["dur_ns"] == d["host_busy_ns"] + d["gap_ns"]).all()
    assert (d["schedule_ns"] + d["step_ns"] + d["post_ns"] <= d["host_busy_ns"]).all()
    assert all((d[k] == -1).all() for k in BATCH_FIELDS)  # these recordings predate the batch fields
    assert ((d["gpu_busy_ns"] > 0) & (d["gpu_busy_ns"] <= d["dur_ns"] + 10**9)).all()
    for key in set(zip(d["pid"].tolist(), d["tid"].tolist(), strict=False)):
        m = (d["pid"] == key[0]) & (d["tid"] == key[1])
        a, b = d["start_ns"][m], d["end_ns"][m]
        assert (np.diff(a) > 0).all() and (b[:-1] <= a[1:]).all()
    # GAP rows: roots of the engine thread filling the untraced stretches of an iteration
    f = rd.read_table("forest", columns=["node_id", "parent_id", "layer", "start_ns", "end_ns", "pid", "tid", "step_idx", "size", "kind"])
    lay = np.asarray(f.column("layer").to_pylist())
    par, size = f.column("parent_id").to_numpy(), f.column("size").to_numpy()
    rows = np.arange(f.num_rows)
    assert (par < rows).all() and ((par < 0) | (rows < par + np.where(par >= 0, size[np.maximum(par, 0)], 0))).all()
    g = np.flatnonzero(lay == "GAP")
    fs, fe = f.column("start_ns").to_numpy(), f.column("end_ns").to_numpy()
    assert g.size == s["gap_nodes"] > 0 and (par[g] == -1).all() and (size[g] == 1).all()
    assert (fe[g] - fs[g] >= GAP_MIN_NS).all()
    sidx = f.column("step_idx").to_numpy()[g]
    assert (sidx >= 0).all() and (fs[g] >= d["start_ns"][sidx]).all() and (fe[g] <= d["end_ns"][sidx]).all()
    pid, tid = f.column("pid").to_numpy(), f.column("tid").to_numpy()
    host_root = (par < 0) & (tid >= 0) & (lay != "GAP")
    for k in range(it.num_rows):
        on = np.flatnonzero(host_root & (pid == d["pid"][k]) & (tid == d["tid"][k]) & (fs < d["end_ns"][k]) & (fe > d["start_ns"][k]))
        a, b = fs[on], fe[on]
        o = np.argsort(a)
        a, b = a[o], b[o]
        untraced = np.r_[a[1:], d["end_ns"][k]] - b
        assert int(untraced.sum()) == d["gap_ns"][k]
        mine = g[sidx == k]
        assert sorted((fe[mine] - fs[mine]).tolist()) == sorted(untraced[untraced >= GAP_MIN_NS].tolist())
    # the iteration's roots and GAP rows carry its step
    lens = {r: int((sidx == r).sum()) for r in range(it.num_rows)}
    assert sum(lens.values()) == g.size


@pytest.mark.parametrize("name", ["h200_normal_a", "h200_faulty_op_delay", "h200_tp_straggler"])
def test_examples_get_iterations(tmp_path, name):
    run = tmp_path / name
    shutil.copytree(EXAMPLES / name, run)
    s = reconstruct(run)
    assert reconciles(s) and s["iterations"]["rules"] == {"engine ranges": s["steps"]}
    _check_iterations(RunDir(run), s)
    if name != "h200_tp_straggler":  # single engine thread: schedule ranges before every STEP
        sched = RunDir(run).read_table("iterations").column("schedule_ns").to_numpy()
        assert (sched > 0).all()


def test_synthetic_forest_with_planted_gap(tmp_path):
    """synth_run's engine (STEPs back to back, sub-µs slack) with a schedule range planted before
    STEP 3 and a planted stretch of untraced time between STEP 2 and it."""
    from teller.rundir import concat_events, events_table
    from teller.testing.synth import synth_run

    t = synth_run(6000, seed=2, threads=1, pushpop="none")
    name = np.asarray(t.column("name").to_pylist(), dtype=object)
    start, end = t.column("start_ns").to_numpy().copy(), t.column("end_ns").to_numpy().copy()
    s3 = int(np.flatnonzero([str(x).startswith("STEP id=3 ") for x in name])[0])
    e2 = int(end[np.flatnonzero([str(x).startswith("STEP id=2 ") for x in name])[0]])
    t3 = int(start[s3])
    planted, sched = 150 * US, 30 * US
    later = start >= t3
    start[later] += planted + sched
    end[later & (end >= 0)] += planted + sched
    t = t.set_column(t.schema.get_field_index("start_ns"), "start_ns", pa.array(start))
    t = t.set_column(t.schema.get_field_index("end_ns"), "end_ns", pa.array(end))
    row = {c: [t.column(c)[s3].as_py()] for c in ("node", "rank", "pid", "tid", "device", "stream")}
    sched_start = t3 + planted + (t3 - e2)  # the synthetic slack after STEP 2 stays untraced too
    extra = events_table({**row, "kind": ["RANGE"], "name": ["OTHER schedule"], "start_ns": [sched_start], "end_ns": [sched_start + sched - (t3 - e2)]})
    rd = RunDir(tmp_path / "run")
    rd.write_events(concat_events([t, extra]))
    s = reconstruct(tmp_path / "run")
    assert reconciles(s)
    f = rd.read_table("forest", columns=["layer", "start_ns", "end_ns", "step_idx", "parent_id"]).to_pydict()
    gaps = [(a, b, k) for lay, a, b, k in zip(f["layer"], f["start_ns"], f["end_ns"], f["step_idx"], strict=False) if lay == "GAP"]
    assert gaps == [(e2, sched_start, 2)]  # exactly the planted stretch, in STEP 2's iteration
    assert sched_start - e2 == planted + 2 * (t3 - e2)
    it = rd.read_table("iterations").to_pydict()
    assert it["gap_ns"][2] >= planted and it["end_ns"][2] == sched_start == it["start_ns"][3]
    assert it["schedule_ns"][3] == sched - (t3 - e2) and it["schedule_ns"][2] == 0
    _check_iterations(rd, s)


@pytest.mark.parametrize("path", ["kineto/hta_nccl_data_rank0.json.gz", "nsys/vecadd_report1.sqlite"])
def test_foreign_traces_get_step_only_iterations(tmp_path, path):
    pytest.importorskip("teller.ingest.kineto" if path.startswith("kineto") else "teller.ingest.nsys")
    from teller.ingest import ingest

    ingest(EXTERNAL / path, tmp_path / "run")
    s = reconstruct(tmp_path / "run")
    rd = RunDir(tmp_path / "run")
    it = rd.read_table("iterations").to_pydict()
    steps = rd.read_table("steps").to_pydict()
    assert len(it["rule"]) == len(steps["step_id"]) > 0 and set(it["rule"]) == {"step only"}
    assert s["gap_nodes"] == 0 and s["layers"]["GAP"] == 0 and reconciles(s)
    assert it["start_ns"] == steps["start_ns"] and it["end_ns"] == steps["end_ns"] and set(it["gap_ns"]) == {0}


@pytest.mark.slow
def test_fresh_cpu_recording_gets_iterations(tmp_path):
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    rec = subprocess.run([sys.executable, "-m", "teller.cli", "record", "-o", str(run), "--collector", "cpu", "--",
                          sys.executable, "-m", "teller.workload", "serve", *TINY_SERVE], cwd=tmp_path, capture_output=True, timeout=600)
    assert rec.returncode == 0, rec.stderr.decode()[-2000:]
    s = reconstruct(run)
    rd = RunDir(run)
    it = rd.read_table("iterations").to_pydict()
    assert len(it["rule"]) == s["steps"] > 0 and set(it["rule"]) == {"engine ranges"}
    assert all(a <= b for a, b in zip(it["end_ns"][:-1], it["start_ns"][1:], strict=False))
    assert all(d == h + g for d, h, g in zip(it["dur_ns"], it["host_busy_ns"], it["gap_ns"], strict=False))
    f = rd.read_table("forest", columns=["layer", "step_idx", "start_ns", "end_ns"]).to_pydict()
    gaps = [i for i, x in enumerate(f["layer"]) if x == "GAP"]
    assert len(gaps) == s["gap_nodes"] and all(f["step_idx"][i] >= 0 for i in gaps)
    assert all(f["end_ns"][i] - f["start_ns"][i] >= GAP_MIN_NS for i in gaps)


def test_show_step_prints_the_iteration(tmp_path):
    from rich.console import Console

    from teller.inspect.show import show

    _planted(tmp_path)
    console = Console(record=True, width=200)
    show(tmp_path / "run", step=0, depth=3, console=console)
    out = console.export_text()
    lines = out.splitlines()
    assert lines[0].startswith("iteration of step 0 (rank 0, tid 1): 800.0 µs = schedule 100.0 µs + step 390.0 µs")
    assert "gap 310.0 µs (1 GAP node(s))" in lines[0] and "prefill=12 decode=0 waiting=1 kv_used=3 kv_total=64 preempted=0" in out
    sched, stp, gap = (next(i for i, x in enumerate(lines) if x.startswith(p)) for p in ("OTHER schedule", "STEP id=0", "GAP untraced"))
    assert sched < stp < gap and "300.0 µs" in lines[gap] and "aten::mm" in out
    console = Console(record=True, width=200)
    show(tmp_path / "run", step=2, console=console)
    out = console.export_text()
    assert "update_batch" in out and "GAP untraced" not in out and "decode=2" in out


def test_dataset_stores_whole_iterations(tmp_path):
    from teller.dataset.build import build_dataset
    from teller.dataset.codec import read_subtrees
    from teller.rca.data import step_forest
    from teller.rundir import RunInfo

    _planted(tmp_path)
    RunDir(tmp_path / "run").write_info(RunInfo(source="test"))
    build_dataset([tmp_path / "run"], tmp_path / "ds")
    sub = read_subtrees(tmp_path / "ds").to_pydict()
    rows = {(lay, n, s // US, k) for lay, n, s, k in zip(sub["layer"], sub["name"], sub["start_ns"], sub["step_idx"], strict=False)}
    assert {("OTHER", "schedule", 1000, 0), ("GAP", GAP_NAME, 1500, 0), ("OTHER", "schedule", 1800, 1),
            ("GAP", GAP_NAME, 2300, 1), ("OTHER", "update_batch", 3400, 2)} <= rows
    assert not any(n in ("idle", "cudaMalloc") for n in sub["name"])  # in no iteration
    assert sub["node_id"] == sorted(sub["node_id"])  # forest order
    import pyarrow.parquet as pq

    its = pq.read_table(tmp_path / "ds" / "iterations.parquet").to_pydict()
    assert its["run_id"] == ["run"] * 3 and [g // US for g in its["gap_ns"]] == [310, 50, 0]
    # readers keyed on step_id still see the STEP blocks alone
    sf = step_forest(read_subtrees(tmp_path / "ds"))
    assert len(sf.seqs) == 3 and sf.seqs[0].symbols[0] == "STEP"


def test_slice_of_a_step_reaches_its_gap_rows(tmp_path):
    """The slicer takes a step's rows by step_idx (teller.slicing.StepIndex), so the iteration's
    schedule range and GAP rows are candidates: the untraced stretch right after a suspect on its
    lane is its temporal neighbour."""
    from teller.forest import Forest
    from teller.slicing import StepIndex, build_slice

    _planted(tmp_path)
    fa = Forest.read(tmp_path / "run", columns=["step_idx", "pid", "tid", "device", "stream", "node", "kind"])
    rows = StepIndex(fa.step_idx).rows(0)
    layers = [LAYERS[x] for x in fa.layer[rows]]
    assert layers.count("GAP") == 1 and "OTHER" in layers and "STEP" in layers
    step_row = int(rows[np.asarray(layers) == "STEP"][0])
    gap_row = int(rows[np.asarray(layers) == "GAP"][0])
    sl = build_slice(fa, rows, np.array([step_row]), score=np.where(rows == step_row, 1.0, 0.0))
    assert gap_row in sl.rows.tolist()
    assert any({int(a), int(b)} == {step_row, gap_row} for a, b in sl.edges_t)


def test_a_run_reconstructed_before_iterations_is_reconstructed_once_more(tmp_path):
    from teller.reconstruct.ensure import ensure_reconstructed

    _planted(tmp_path)
    run = tmp_path / "run"
    notes = []
    ensure_reconstructed(run, notes.append)
    assert notes == []  # has iterations.parquet: used as it is
    (run / "iterations.parquet").unlink()
    ensure_reconstructed(run, notes.append)
    assert len(notes) == 1 and "predates engine iterations" in notes[0] and (run / "iterations.parquet").is_file()
