"""The iteration context of a dataset's steps: what ``teller diagnose`` reads from a run
directory's ``iterations.parquet`` and aligned logs (:func:`teller.localize.features.read_steps`),
read from a dataset folder (``iterations.parquet``, ``logs.parquet`` and the vertical records)
for its steps given as keys (sorted ``run_code << 40 | step_id`` of the sorted run names). The
numeric stage's rows of `teller evaluate` and the root-cause model's flag expert read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.localize.features import (
    ITER_FEATURES,
    first_log_lines,
    iteration_matrix,
    request_admission_delay,
)
from teller.rundir import str_array

__all__ = ["dataset_context", "keys_of"]


def keys_of(runs: np.ndarray, run_names: np.ndarray, step_id: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index into the sorted ``keys`` (``run_code << 40 | step_id``) of each (run name, step id),
    -1 where the pair is not a key."""
    if not len(keys) or not len(runs):
        return np.full(len(step_id), -1, np.int64)
    g = np.clip(np.searchsorted(runs, run_names), 0, len(runs) - 1)
    k = g.astype(np.int64) << 40 | np.asarray(step_id, np.int64)
    pos = np.clip(np.searchsorted(keys, k), 0, len(keys) - 1)
    return np.where((runs[g] == run_names) & (keys[pos] == k), pos, -1)


def dataset_context(ds: str | Path, runs: np.ndarray, keys: np.ndarray) -> dict[str, Any] | None:
    """Per step key (sorted ``run_code << 40 | step_id``, ``runs`` sorted names): the iteration
    columns (``iter``, n × :data:`ITER_FEATURES`, NaN where unknown), the batch (``batch``:
    requests served, NaN), the warm-up flag (``warmup``) and whether the step has an iteration
    row (``has``), from the dataset's ``iterations.parquet``; None when the dataset has none.

    ``iter.admit_delay`` (:func:`teller.localize.features.admission_delay`) is computed as
    ``teller diagnose`` computes it from a run directory: arrivals are each request's first log
    line (``logs.parquet``), first steps those of the vertical records, the iterations those of
    ``iterations.parquet``. A dataset keeps a sample of each run's steps, so only the kept
    iterations between an arrival and a first step count (a lower bound), and of those only the
    ones whose step has request rows: a dataset that leaves some steps' rows out but keeps their
    iterations (`teller dataset nest`) would otherwise make every request first seen after such a
    step look held back through it (fault-free steps with admission delays of seconds)."""
    ds = Path(ds)
    if not (ds / "iterations.parquet").is_file():
        return None
    n = len(keys)
    it = pq.read_table(ds / "iterations.parquet")
    irun = str_array(it.column("run_id"))
    pos = keys_of(runs, irun, it.column("step_id").to_numpy(), keys)
    hit = pos >= 0
    out = {"iter": np.full((n, len(ITER_FEATURES)), np.nan), "batch": np.full(n, np.nan),
           "warmup": np.zeros(n, bool), "has": np.zeros(n, bool)}
    out["iter"][pos[hit]] = iteration_matrix(it)[hit]
    nreq = it.column("n_requests").to_numpy(zero_copy_only=False).astype(np.float64)
    out["batch"][pos[hit]] = np.where(nreq > 0, nreq, np.nan)[hit]
    out["warmup"][pos[hit]] = it.column("warmup").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)[hit]
    out["has"][pos[hit]] = True
    out["iter"][:, ITER_FEATURES.index("iter.admit_delay")] = _admission_delays(ds, it, irun, pos)
    return out


def _admission_delays(ds: Path, it: pa.Table, irun: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``iter.admit_delay`` per key (:func:`dataset_context`); ``pos``: each iteration row's key."""
    n = int(pos.max(initial=-1)) + 1
    out = np.full(max(n, 0), np.nan)
    if not (ds / "logs.parquet").is_file() or not n:
        return out
    first = first_log_lines(pq.read_table(ds / "logs.parquet", columns=["run_id", "request_id", "ts_ns"]),
                            ["run_id", "request_id"])
    frun = str_array(first.column("run_id"))
    rec = pq.read_table(ds / "records.parquet", columns=["run_id", "request_id", "step_id", "view"])
    rec = rec.filter(pc.equal(rec.column("view"), "vertical"))
    rrun, rsid = str_array(rec.column("run_id")), rec.column("step_id").to_numpy().astype(np.int64)
    col = {c: it.column(c).to_numpy().astype(np.int64) for c in ("step_id", "start_ns", "end_ns", "pid", "waiting")}
    for name in np.unique(irun).tolist():  # runs: tens
        rows = np.flatnonzero(irun == name)
        m, f = np.flatnonzero(rrun == name), np.flatnonzero(frun == name)
        # only the iterations of steps with request rows: a step whose rows a derived dataset left
        # out (`teller dataset nest`) would count as an iteration that ran without its requests
        rows = rows[np.isin(col["step_id"][rows], rsid[m])]
        d = request_admission_delay(*(col[c][rows] for c in ("step_id", "start_ns", "end_ns", "pid", "waiting")),
                                    rec.column("request_id").take(pa.array(m)), rsid[m],
                                    first.column("request_id").take(pa.array(f)),
                                    first.column("ts_ns_min").to_numpy()[f],
                                    idle_gaps=False)  # the dataset keeps the sampled steps' iterations only
        ok = pos[rows] >= 0
        out[pos[rows][ok]] = d[ok]
    return out
