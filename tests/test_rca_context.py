"""The flag expert's shape-free context (:mod:`teller.rca.context`): the iteration columns as the
trees read them, the layer mix against the run's own steps (hand-computed, and unchanged when a
run's statistics all move together, as another model shape moves them), and the context of a
real dataset's units checked against its ``iterations.parquet``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from rca_slice import DATA, iteration_units

from teller.localize.features import ITER_FEATURES
from teller.rca.context import (
    CONTEXT_COLUMNS,
    CONTEXT_ITER,
    context_features,
    dataset_context_features,
    dataset_unit_iterations,
    iteration_context,
    run_relative,
)
from teller.rca.data import UNIT_STAT_COLUMNS


def test_iteration_context_reads_times_in_log_us_counts_in_log_and_unknowns_as_nan():
    row = np.full(len(ITER_FEATURES), np.nan)
    at = {c: ITER_FEATURES.index(c) for c in ITER_FEATURES}
    row[at["iter.gap"]] = 2e6  # 2 ms
    row[at["iter.dur"]] = 9e9  # not read: it grows with the model's layers
    row[at["batch.waiting"]] = 3
    row[at["batch.kv_frac"]] = 0.25
    row[at["iter.admit_delay"]] = -1  # unknown
    got = iteration_context(row[None])
    assert got.shape == (1, len(CONTEXT_ITER)) and got.dtype == np.float32
    col = dict(zip(CONTEXT_ITER, got[0].tolist(), strict=True))
    assert col["iter.gap"] == pytest.approx(np.log1p(2000.0))
    assert col["batch.waiting"] == pytest.approx(np.log1p(3.0))
    assert col["batch.kv_frac"] == pytest.approx(0.25)
    assert np.isnan(col["iter.admit_delay"]) and np.isnan(col["iter.schedule"])
    assert "iter.dur" not in CONTEXT_ITER and "iter.gpu_busy" not in CONTEXT_ITER


def test_run_relative_is_the_robust_z_against_the_units_own_run_and_view():
    k = len(UNIT_STAT_COLUMNS)
    a = np.tile(np.array([[1.0], [2.0], [3.0], [4.0], [5.0]]), (1, k))  # run a: median 3, IQR 2
    b = np.tile(np.array([[10.0], [10.0], [10.0], [30.0]]), (1, k))  # run b: median 10, IQR 5
    stats = np.r_[a, b]
    runs = ["a"] * 5 + ["b"] * 4
    z = run_relative(stats, runs, ["vertical"] * 9)
    assert z.dtype == np.float32 and z.shape == (9, k)
    assert z[:5, 0] == pytest.approx((np.arange(1, 6) - 3.0) / (2.0 / 1.349) / 4.0)
    assert z[5:8, 0] == pytest.approx(0.0) and z[8, 0] == pytest.approx(20.0 / 5.0 * 1.349 / 4.0)
    far = run_relative(np.r_[np.zeros((4, k)), np.full((1, k), 100.0)], ["c"] * 5, ["vertical"] * 5)
    assert far[4, 0] == pytest.approx(5.0) and far[0, 0] == 0.0  # the scale's floor, the z clipped at 20
    # a run whose every statistic moves by the same amount (another shape, a slower host) reads
    # the same; so does a run read on its own
    shifted = stats + np.r_[np.zeros((5, k)), np.full((4, k), 7.5)]
    assert np.allclose(run_relative(shifted, runs, ["vertical"] * 9), z)
    assert np.allclose(run_relative(b, ["b"] * 4, ["vertical"] * 4), z[5:])
    # views apart: the same run's horizontal units are their own group
    views = ["vertical"] * 5 + ["horizontal"] * 4
    assert np.allclose(run_relative(np.r_[a, b], ["a"] * 9, views), z)
    assert run_relative(np.zeros((0, k)), [], []).shape == (0, k)
    both = context_features(np.full((9, len(ITER_FEATURES)), np.nan), z)
    assert both.shape == (9, len(CONTEXT_COLUMNS)) and np.array_equal(both[:, len(CONTEXT_ITER):], z)


def test_a_datasets_units_get_their_steps_iteration_rows():
    ds = iteration_units()
    u = ds.units
    got = dataset_unit_iterations(ds)
    assert got.shape == (len(u), len(ITER_FEATURES))
    it = pq.read_table(DATA / "iterations.parquet", columns=["run_id", "step_id", "gap_ns", "waiting"])
    rec = pq.read_table(DATA / "records.parquet", columns=["record_id", "step_id", "step_ids"])
    rid = rec.column("record_id").to_numpy()
    key = {(r, int(s)): (float(g), float(w)) for r, s, g, w in zip(
        it.column("run_id").to_pylist(), it.column("step_id").to_pylist(), it.column("gap_ns").to_pylist(),
        it.column("waiting").to_pylist(), strict=True)}
    gap, wait = ITER_FEATURES.index("iter.gap"), ITER_FEATURES.index("batch.waiting")
    checked = 0
    for i in range(len(u)):
        row = int(np.flatnonzero(rid == u.record_id[i])[0])
        steps = rec.column("step_ids")[row].as_py() or [rec.column("step_id")[row].as_py()]
        want = [key[(u.run_id[i], int(s))] for s in steps if (u.run_id[i], int(s)) in key]
        if not want:
            continue
        assert got[i, gap] == pytest.approx(max(g for g, _ in want))  # a horizontal unit: the largest over its ranks
        assert got[i, wait] == pytest.approx(max(w for _, w in want))
        checked += 1
    assert checked >= len(u) // 2
    assert (u.view == "horizontal").any() and not np.isnan(got[:, gap]).all()
    # the features of every unit, computed once per loaded dataset
    from teller.tpe.tokenizer import TraceTokenizer

    tok = TraceTokenizer.load(Path(__file__).resolve().parents[1] / "teller" / "rca" / "default" / "trace_tokenizer")
    ctx = dataset_context_features(ds, np.arange(len(u)), tok)
    assert ctx.shape == (len(u), len(CONTEXT_COLUMNS)) and ds.cache["unit_context"] is not None
    assert np.array_equal(dataset_context_features(ds, np.array([3, 1]), None), ctx[[3, 1]], equal_nan=True)  # from the cache
    rel = ctx[:, len(CONTEXT_ITER):]
    for r in np.unique(u.run_id).tolist():  # each run and view is its own reference: its median is 0
        for v in ("vertical", "horizontal"):
            m = (u.run_id == r) & (u.view == v)
            if m.sum() >= 3:
                assert np.allclose(np.median(rel[m], axis=0), 0.0, atol=1e-6)
    assert pc.max(it.column("gap_ns")).as_py() > 0
