"""A unit's shape-free context, which the flag expert may read instead of its layer mix
(docs/design.md §9, "Flag expert").

The layer mix against the training reference (:meth:`teller.rca.data.ReferenceStats.unit_features`)
reads a model shape the model never saw as a departure everywhere: on the workload split's
held-out shape, trees on it cost step F1 (docs/results.md, "The flag expert"). Two kinds of
numbers carry across shapes:

- **the engine iteration around the unit** (:data:`CONTEXT_ITER`, from ``iterations.parquet`` and
  the aligned logs: :data:`teller.localize.features.ITER_FEATURES`): the gap before it, the
  scheduling and post-processing times, the batch (requests, prefills, decodes, waiting, KV
  fill, preemptions) and the admission delay of the requests it serves first. These read faults
  that live between steps (a delayed admission leaves the step's own times unchanged) and scale
  with the host, not with the model's layers. The iteration's own length and busy times are
  left out: those grow with the layers.
- **the layer mix against the run's own steps** (:func:`run_relative`): each unit statistic's
  robust z against the median and IQR of the same run and view (every unit of that run the
  reader has: a dataset's, or every step `teller diagnose` reads). Most steps of a run are
  normal, so the run is its own reference, whatever its shape.

:func:`context_features` puts the two side by side (55 columns); unknown values stay NaN, which
the trees route on their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.errors import TellerError
from teller.localize.context import dataset_context
from teller.localize.features import ITER_FEATURES
from teller.rca.data import UNIT_STAT_COLUMNS, Dataset, encode_units, median_scale, unit_statistics

#: the iteration columns the context reads (those that do not grow with the model's layers)
CONTEXT_ITER = ("iter.gap", "iter.schedule", "iter.post", "batch.n_requests", "batch.prefill", "batch.decode",
                "batch.waiting", "batch.kv_frac", "batch.preempted", "iter.admit_delay")
#: the columns of :func:`context_features`
CONTEXT_COLUMNS = CONTEXT_ITER + tuple(f"run_z.{c}" for c in UNIT_STAT_COLUMNS)
_ITER_AT = [ITER_FEATURES.index(c) for c in CONTEXT_ITER]


def iteration_context(iterations: np.ndarray) -> np.ndarray:
    """(n, len(CONTEXT_ITER)) float32 from rows of :data:`ITER_FEATURES` (NaN unknown): times as
    ``log1p(µs)``, counts as ``log1p``, the KV fill as it is; negative values (unknown) NaN."""
    x = np.asarray(iterations, np.float64).reshape(-1, len(ITER_FEATURES))[:, _ITER_AT]
    x = np.where(x < 0, np.nan, x)
    out = np.empty_like(x)
    for k, c in enumerate(CONTEXT_ITER):
        if c.startswith("iter."):
            out[:, k] = np.log1p(x[:, k] / 1e3)
        elif c == "batch.kv_frac":
            out[:, k] = x[:, k]
        else:
            out[:, k] = np.log1p(x[:, k])
    return out.astype(np.float32)


def run_relative(stats: np.ndarray, run_id: Sequence[str], view: Sequence[str]) -> np.ndarray:
    """Per unit (float32, one column per :data:`UNIT_STAT_COLUMNS`): its statistics' robust z
    against the median and IQR/1.349 (at least 0.05) of the units of the same run and view among
    ``stats`` (:func:`teller.rca.data.unit_statistics`), divided by 4 and clipped at ±5."""
    x = np.asarray(stats, np.float64).reshape(-1, len(UNIT_STAT_COLUMNS))
    out = np.zeros_like(x)
    if not len(x):
        return out.astype(np.float32)
    key = np.char.add(np.char.add(np.asarray(run_id, dtype=str), "\x00"), np.asarray(view, dtype=str))
    names, code = np.unique(key, return_inverse=True)
    order = np.argsort(code, kind="stable")
    bounds = np.searchsorted(code[order], np.arange(len(names) + 1))
    for g in range(len(names)):  # runs × views: tens
        rows = order[bounds[g]:bounds[g + 1]]
        med, sc = median_scale(x[rows], axis=0)
        out[rows] = np.clip((x[rows] - med) / sc, -20.0, 20.0) / 4.0
    return out.astype(np.float32)


def context_features(iterations: np.ndarray, relative: np.ndarray) -> np.ndarray:
    """The flag expert's shape-free columns (:data:`CONTEXT_COLUMNS`): :func:`iteration_context`
    of the units' iteration rows beside their :func:`run_relative` statistics."""
    it = iteration_context(iterations)
    rel = np.asarray(relative, np.float32).reshape(len(it), len(UNIT_STAT_COLUMNS))
    return np.hstack([it, rel]).astype(np.float32)


def units_context(inp: Any, stats: np.ndarray, iterations: np.ndarray | None = None) -> np.ndarray:
    """:func:`context_features` of the units of ``inp`` (:class:`teller.rca.data.StepInputs`)
    whose :func:`teller.rca.data.unit_statistics` are ``stats``, each against the units of ``inp``
    of its run and view (which should then be every step of the run that is read);
    ``iterations``: their rows of :data:`ITER_FEATURES` (None: unknown)."""
    n = len(stats)
    it = np.full((n, len(ITER_FEATURES)), np.nan) if iterations is None else iterations
    return context_features(it, run_relative(stats, list(inp.run_id) or [""] * n, list(inp.view) or [""] * n))


def _unit_context(ds: Dataset) -> tuple[np.ndarray, np.ndarray, dict[str, Any]] | None:
    """Each unit's steps (one per rank of a horizontal unit, the record's own step for a vertical
    one) against the dataset's iteration context (:func:`teller.localize.context.dataset_context`):
    ``owner`` (the unit of each step row), ``at`` (the step row's row in the context) and the
    context; None for a dataset without units, records or iterations."""
    u = ds.units
    n = len(u)
    path = Path(ds.path) / "records.parquet"
    if not n or not (Path(ds.path) / "iterations.parquet").is_file() or not path.is_file():
        return None
    rec = pq.read_table(path, columns=["record_id", "run_id", "step_id", "step_ids"])
    rid = rec.column("record_id").to_numpy().astype(np.int64)
    order = np.argsort(rid, kind="stable")
    at = np.clip(np.searchsorted(rid[order], u.record_id), 0, max(len(rid) - 1, 0))
    pos = order[at]
    if len(rid) == 0 or not (rid[pos] == u.record_id).all():
        raise TellerError(f"{path}: the units' records are not all there; rebuild the dataset with `teller dataset build`")
    own = rec.column("step_ids").take(pa.array(pos))
    lens = np.asarray(pc.list_value_length(own).fill_null(0).to_numpy(zero_copy_only=False), np.int64)
    sid = rec.column("step_id").to_numpy().astype(np.int64)[pos]
    flat = np.asarray(pc.list_flatten(own).to_numpy(zero_copy_only=False), np.int64) if lens.sum() else np.zeros(0, np.int64)
    has = lens > 0  # a horizontal record lists its ranks' steps; a vertical one may list none
    k = np.where(has, lens, 1)
    owner = np.repeat(np.arange(n), k)
    listed = np.repeat(has, k)  # output rows in unit order, as the flattened lists are
    steps = np.empty(int(k.sum()), np.int64)
    steps[listed] = flat
    steps[~listed] = sid[~has]
    run = np.asarray(u.run_id, dtype=str)[owner]
    runs = np.unique(run)
    key = np.searchsorted(runs, run).astype(np.int64) << 40 | steps
    keys = np.unique(key)
    ctx = dataset_context(ds.path, runs, keys)
    return None if ctx is None else (owner, np.searchsorted(keys, key), ctx)


def dataset_unit_iterations(ds: Dataset) -> np.ndarray:
    """Per unit of ``ds`` (float64, n × :data:`ITER_FEATURES`, NaN unknown): the iteration row of
    its step (:func:`teller.localize.context.dataset_context`: ``iterations.parquet``, the
    admission delays from ``logs.parquet``), the largest value over the ranks of a horizontal
    unit. All NaN for a dataset without iterations."""
    n = len(ds.units)
    out = np.full((n, len(ITER_FEATURES)), np.nan)
    got = _unit_context(ds)
    if got is None:
        return out
    owner, at, ctx = got
    rows = ctx["iter"][at]
    filled = np.where(np.isnan(rows), -np.inf, rows)
    best = np.full((n, rows.shape[1]), -np.inf)
    np.maximum.at(best, owner, filled)
    out[:] = np.where(np.isinf(best), np.nan, best)
    return out


def dataset_unit_warmup(ds: Dataset) -> np.ndarray:
    """Per unit of ``ds``: whether any of its steps is a warm-up iteration (``iterations.parquet``'s
    ``warmup`` column, as `teller evaluate` leaves warm-up steps out of episodes); all False for a
    dataset without iterations."""
    n = len(ds.units)
    got = _unit_context(ds)
    if got is None:
        return np.zeros(n, bool)
    owner, at, ctx = got
    return np.bincount(owner, weights=ctx["warmup"][at].astype(np.float64), minlength=n) > 0


#: units encoded at a time for their statistics (their tokens are not kept)
_STATS_BATCH = 4096


def dataset_context_features(ds: Dataset, idx: np.ndarray, trace_tok: Any) -> np.ndarray:
    """:func:`context_features` of units ``idx`` of ``ds``, each against the units of its run and
    view that ``ds`` holds; computed for every unit once per loaded dataset (``ds.cache``).
    ``trace_tok``: a model's trace tokenizer (the units are serialized for their statistics)."""
    got = ds.cache.get("unit_context")
    if got is None:
        u = ds.units
        n = len(u)
        stats = np.zeros((n, len(UNIT_STAT_COLUMNS)))
        for s in range(0, n, _STATS_BATCH):
            part = np.arange(s, min(n, s + _STATS_BATCH))
            sub = u.select(part)
            inp = encode_units(ds.forest, trace_tok, sub.run_id.tolist(), sub.step_ids, [""] * len(part), 8,
                               sub.view.tolist())
            stats[part] = unit_statistics(inp)
        got = context_features(dataset_unit_iterations(ds), run_relative(stats, u.run_id, u.view))
        ds.cache["unit_context"] = got
    return got[np.asarray(idx, np.int64)]
