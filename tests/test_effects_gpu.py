"""GPU time of a step in the effect measures: kernels, copies and sets in the step's subtree."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from teller.inject.effects import window_effects
from teller.inject.labels import StepMeasures

US = 1_000
STEP_NS = 1_000 * US
# per step: (kernel µs, second GPU row kind, its µs); steps 0-1 are cold (left out of baselines),
# 2-3 run before the window, 4-5 inside it
GPU = [(5000, "MEMCPY", 0), (5000, "MEMCPY", 0), (100, "MEMCPY", 50), (100, "MEMCPY", 50),
       (400, "MEMSET", 20), (400, "MEMSET", 20)]


def _run(tmp_path: Path) -> Path:
    """Six steps, each ``STEP > FE LlamaMLP > RT cudaLaunchKernel > (K gemm, MEM copy)`` in DFS
    preorder, with a ``RT cudaStreamSynchronize`` of 300 µs host time beside the launch."""
    rows: dict[str, list] = {k: [] for k in ("layer", "name", "kind", "start_ns", "end_ns", "step_id", "size")}
    steps: dict[str, list] = {k: [] for k in ("step_id", "step_num", "rank", "pid", "start_ns", "end_ns", "name")}

    def add(layer, name, kind, start, dur, step, size):
        for k, v in zip(rows, (layer, name, kind, start, start + dur, step, size), strict=True):
            rows[k].append(v)

    for s, (k_us, mem_kind, mem_us) in enumerate(GPU):
        t0, sid = s * STEP_NS, len(rows["layer"])
        add("STEP", f"STEP id={s} reqs=r{s}", "RANGE", t0, 800 * US, sid, 6)
        add("FE", "LlamaMLP", "RANGE", t0 + 10 * US, 700 * US, sid, 5)
        add("RT", "cudaLaunchKernel", "RUNTIME", t0 + 20 * US, 10 * US, sid, 3)
        add("K", "gemm", "KERNEL", t0 + 40 * US, k_us * US, sid, 1)
        add("MEM", f"Memcpy {mem_kind}", mem_kind, t0 + 50 * US, mem_us * US, sid, 1)
        add("RT", "cudaStreamSynchronize", "RUNTIME", t0 + 100 * US, 300 * US, sid, 1)
        for k, v in zip(steps, (sid, s, 0, 7, t0, t0 + 800 * US, f"STEP id={s} reqs=r{s}"), strict=True):
            steps[k].append(v)
    run = tmp_path / "run"
    run.mkdir()
    dict_cols = {"layer", "name", "kind"}
    pq.write_table(pa.table({k: pa.array(v).dictionary_encode() if k in dict_cols else pa.array(v, pa.int64())
                             for k, v in rows.items()}), run / "forest.parquet")
    pq.write_table(pa.table({k: pa.array(v, pa.string() if k == "name" else pa.int64()) for k, v in steps.items()}),
                   run / "steps.parquet")
    window = {"id": "f0", "mechanism": "gpu_compute_contention", "category": "kernel", "magnitude": 1.0,
              "pid": 7, "rank": 0, "start_tau_ns": 4 * STEP_NS, "end_tau_ns": 5 * STEP_NS + 800 * US,
              "targets": [], "targets_hit": [], "injections": 0}
    (run / "labels.json").write_text(json.dumps({"run_id": "gpu-toy", "plan": [], "windows": [window]}))
    return run


def test_step_gpu_time_sums_kernels_copies_and_sets_of_the_subtree(tmp_path: Path) -> None:
    sm = StepMeasures(_run(tmp_path))
    want = np.array([k + m for k, _, m in GPU], float) * US  # host rows (RT, FE) never count
    np.testing.assert_array_equal(sm.gpu, want)
    # the GPU time under a family: FE LlamaMLP holds the launch, so all of it; the sync none
    np.testing.assert_array_equal(sm.family_columns(["FE LlamaMLP"], device=True), want)
    np.testing.assert_array_equal(sm.family_columns(["RT cudaStreamSynchronize"], device=True), np.zeros(6))


def test_window_effects_report_gpu_time_in_and_out(tmp_path: Path) -> None:
    (e,) = window_effects(_run(tmp_path))
    assert (e["in_n"], e["out_n"]) == (2, 2)  # cold steps 0-1 stay out of the baseline
    assert e["gpu_out_p50_ms"] == pytest.approx(0.150)
    assert e["gpu_in_p50_ms"] == pytest.approx(0.420)
    assert e["in_p50_ms"] == pytest.approx(e["out_p50_ms"])  # wall time unchanged: only the GPU shows it
    # growth of GPU time under a family: the FE that launched the work and its launch call, +0.27 ms
    grown = {s.rsplit(" +", 1)[0]: float(s.rsplit(" +", 1)[1].split()[0]) for s in e["affected_layers_gpu"]}
    assert grown["FE LlamaMLP"] == pytest.approx(0.27)
    assert grown["RT cudaLaunchKernel"] == pytest.approx(0.27)
