"""Labelling on a host-bound GPU engine: device-time evidence, engine log lines, warm-up steps.

A hand-built run of 40 steps (one process): each step is STEP → FE LlamaMLP → RT launch →
KERNEL. Inside the fault window the MLP's kernel runs 1.5 ms instead of 10 µs while every host
range keeps its length (extra device work behind a host-bound step), and the first step is a
slow cold step.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from teller.inject.labels import label_run, read_step_labels, warmup_steps
from teller.rundir import RunDir

STEP_NS = 1_000_000
PID = 42


def _run(tmp_path, n=40, slow_kernels=range(20, 26), offload_steps=()):
    rows = {c: [] for c in ("node_id", "parent_id", "layer", "name", "kind", "start_ns", "end_ns", "step_id", "size", "pid")}

    def add(parent, layer, name, kind, start, end, step, size):
        nid = len(rows["node_id"])
        for c, v in zip(rows, (nid, parent, layer, name, kind, start, end, step, size, PID), strict=True):
            rows[c].append(v)
        return nid

    steps = []
    for s in range(n):
        t = 10 * STEP_NS * s
        dur = STEP_NS * (30 if s == 0 else 1)  # step 0: a cold step, 30x longer
        k = 1_500_000 if s in slow_kernels else 10_000
        sid = add(-1, "STEP", f"STEP id={s} reqs=req_{s}", "RANGE", t, t + dur, -1, 4)
        rows["step_id"][sid] = sid
        fe = add(sid, "FE", "LlamaMLP", "RANGE", t + 1000, t + 200_000, sid, 3)
        rt = add(fe, "RT", "cudaLaunchKernel", "RUNTIME", t + 2000, t + 8000, sid, 2)
        add(rt, "K", "spin_kernel" if s in slow_kernels else "gemm", "KERNEL", t + 10_000, t + 10_000 + k, sid, 1)
        steps.append((sid, s, t, t + dur))
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir(parents=True)
    forest = pa.table({c: pa.array(v) for c, v in rows.items()})
    for c in ("layer", "name", "kind"):
        forest = forest.set_column(forest.column_names.index(c), c, forest.column(c).dictionary_encode())
    rd.write_table(forest, "forest")
    rd.write_table(pa.table({
        "step_id": pa.array([x[0] for x in steps], pa.int64()), "step_num": pa.array([x[1] for x in steps], pa.int64()),
        "rank": pa.array([0] * n, pa.int32()), "pid": pa.array([PID] * n, pa.int64()),
        "start_ns": pa.array([x[2] for x in steps], pa.int64()), "end_ns": pa.array([x[3] for x in steps], pa.int64()),
        "name": [f"STEP id={x[1]} reqs=req_{x[1]}" for x in steps]}), "steps")
    text = [f"Offloaded 1 requests (0 to CPU, 1 soft reset) at step {s}" if s in offload_steps else f"request req_{s} added"
            for s in range(n)]
    rd.write_table(pa.table({"text": text, "step_id": pa.array([x[0] for x in steps], pa.int64())}), "log_alignment")
    return rd.path, steps


def _window(mech, start, end, **kw):
    return {"id": "f0", "mechanism": mech, "category": kw.pop("category"), "magnitude": 1500.0, "pid": PID,
            "rank": 0, "start_tau_ns": start, "end_tau_ns": end, **kw}


def test_device_time_shows_a_fault_the_host_ranges_hide(tmp_path):
    run, steps = _run(tmp_path)
    w = _window("targeted_op_delay", steps[20][2], steps[25][3], category="kernel", targets=["MLP"],
                targets_hit=["FE LlamaMLP"])
    s = label_run(run, {"run_id": "r", "windows": [w], "plan": [w]})
    t = read_step_labels(run).to_pydict()
    abnormal = [i for i, a in enumerate(t["is_anomaly"]) if a]
    assert abnormal == list(range(20, 26)) and s["in_window_no_effect"] == 0
    for i in abnormal:
        assert t["operator_labels"][i] == ["FE LlamaMLP"]
        assert "K" in t["layer"][i].split(",") and "GPU work" in t["explanation"][i]
        assert t["effect_ms"][i] > 1.4 and t["ref_p99_ms"][i] < 0.1


def test_warm_up_steps_are_kept_out_of_the_reference_and_the_labels(tmp_path):
    run, steps = _run(tmp_path, slow_kernels=())
    st = RunDir(run).read_table("steps")
    assert warmup_steps(st).tolist()[:3] == [True, True, False]
    # a step-evidence window over the first 15 steps: only the cold step is slow, and it is not a
    # label; the 25 steps after the window are the reference
    w = _window("gpu_compute_contention", steps[0][2], steps[14][3], category="kernel")
    s = label_run(run, {"run_id": "r", "windows": [w], "plan": [w]})
    assert s["in_window"] == 15 and s["reference_steps"] == 25 and s["abnormal"] == 0


def test_engine_log_lines_show_kv_pressure_in_fast_steps(tmp_path):
    run, steps = _run(tmp_path, slow_kernels=(), offload_steps=(12, 30))
    w = _window("kv_cache_pressure", steps[10][2], steps[35][3], category="memory")
    label_run(run, {"run_id": "r", "windows": [w], "plan": [w]})
    t = read_step_labels(run).to_pydict()
    assert [i for i, a in enumerate(t["is_anomaly"]) if a] == [12, 30]
    assert all("engine logged" in t["explanation"][i] for i in (12, 30))
    assert np.isfinite(t["ref_p99_ms"][12])
