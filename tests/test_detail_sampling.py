"""benchmarks/detail_sampling.py: the in-run pairing of light blocks with quiet ones within each
of the engine's two paces (``--pool``), on iteration tables built with a known cost."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

spec = importlib.util.spec_from_file_location(
    "detail_sampling", Path(__file__).resolve().parents[1] / "benchmarks" / "detail_sampling.py")
ds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ds)


def _table(path: Path, cost: float, seed: int, cycles: int = 60) -> Path:
    """Windows of 4 detailed iterations every 32, the 28 between them alternating blocks of 4
    quiet and light; each iteration runs at a fast (20 ms) or slow (70 ms) pace that persists for
    a few iterations, whatever is recorded; light iterations take ``1 + cost`` times as long."""
    rng = np.random.default_rng(seed)
    cls = np.array(list(("QQQQLLLL" * 4)[:28] + "DDDD") * cycles)
    n = len(cls)
    slow = np.zeros(n, bool)
    state = False
    for i in range(n):
        if rng.random() < (0.3 if state else 0.1):
            state = not state
        slow[i] = state
    dur = np.where(slow, 70e6, 20e6) * rng.normal(1.0, 0.03, n)
    dur = np.where(cls == "L", dur * (1 + cost), np.where(cls == "D", dur * 1.8, dur)).astype(np.int64)
    start = np.concatenate([[0], np.cumsum(dur)[:-1]])
    warm = np.zeros(n, bool)
    warm[:8] = True
    nxt = np.append(cls[1:], "")
    pq.write_table(pa.table({"run": ["r"] * n, "pid": np.ones(n, np.int64), "cls": cls.tolist(),
                             "switch": ((cls == "Q") & (nxt == "D")) | ((cls == "D") & (nxt != "D")),
                             "warmup": warm, "start_ns": start, "dur_ns": dur,
                             "prefill": np.full(n, 360, np.int64), "decode": np.full(n, 140, np.int64)}), path)
    return path


def test_otsu_splits_two_paces():
    x = np.log(np.r_[np.full(30, 20.0), np.full(10, 70.0)])
    assert np.log(20) < ds._otsu(x) < np.log(70)


@pytest.mark.parametrize("cost", [0.0, 0.05])
def test_pool_recovers_a_known_light_cost_within_each_pace(tmp_path, cost):
    res = ds.pool([str(_table(tmp_path / f"t{s}.parquet", cost, s)) for s in range(3)])
    assert len(res["runs"]) == 3
    for r in res["runs"]:
        assert 20 < r["pace_cut_ms"] < 70 and abs(r["pace_fast_share_light"] - r["pace_fast_share_quiet"]) < 0.1
    for pace_, tol in (("fast", 0.006), ("slow", 0.02)):
        m, h = res[f"light_cost_{pace_}_mean"], res[f"light_cost_{pace_}_ci95"]
        assert abs(m - cost) < tol and 0 < h < tol, (pace_, m, h)
    # the fast pace's interval is narrow: its blocks are not mixed with the slow one
    assert res["light_cost_fast_ci95"] < res["light_cost_slow_ci95"]
    assert 0.0 < res["quiet_time_share_fast"] < 1.0
    tw = res["light_cost_time_weighted_mean"]
    assert abs(tw - cost) < 0.015
    # both paces hold paired blocks, the fast one most (it holds most iterations)
    one = ds.pool([str(tmp_path / "t0.parquet")])["runs"][0]
    assert one["light_blocks_paired_fast"] > one["light_blocks_paired_slow"] > 0
