"""Planted anomalies (docs/design.md §11): synthetic runs with known abnormal steps and operators, for
evaluating the localizer before a labelled dataset exists (a test and benchmark fixture).

:func:`plant` edits a canonical events table of a synthetic run (:mod:`teller.testing.synth`, written
with ``pushpop="none"`` so every range is one RANGE row) so that, in chosen steps, every instance
of one operator is slowed by one of three mechanisms:

- ``host``: the operator's own host time grows by (factor − 1) × its duration, as a
  ``time.sleep`` inside it would (a delay inserted right after it starts);
- ``kernel``: the kernels it launches run factor × longer; later work on the same stream waits;
- ``churn``: allocator churn: a ``cudaFree`` and a ``cudaMalloc`` runtime call appear inside it,
  taking (factor − 1) × its duration together.

Times are shifted by a monotone warp of the engine thread (and of the GPU rows it launched), so
nesting, binding and every other thread stay intact. The ground truth goes to ``labels.json``:
one window per planted instance (start/end on τ after the warp, mechanism, magnitude, operator
family).

The metrics that score a diagnosis against this truth are in :mod:`teller.evaluate.metrics`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import pyarrow as pa

from teller.rundir import KIND_CODE, KINDS, RunDir, RunInfo, events_table, kind_codes
from teller.testing.synth import synth_tables

MECHANISMS = ("host", "kernel", "churn")
_CATEGORY = {"host": "scheduling/software", "kernel": "CUDA/kernel", "churn": "runtime/driver"}


@dataclass
class Plant:
    """One planted fault: ``target`` (an NVTX message such as ``BE aten::mul``) in steps ``steps``
    (step numbers) slowed by ``mechanism`` with magnitude ``factor``."""

    target: str
    steps: list[int]
    mechanism: str = "host"
    factor: float = 3.0


def _warp(t: np.ndarray, points: np.ndarray, delays: np.ndarray) -> np.ndarray:
    """t + Σ delays of the points at or before t (-1 stays -1)."""
    if not len(points):
        return t
    o = np.argsort(points, kind="stable")
    p, c = points[o], np.concatenate([[0], np.cumsum(delays[o])])
    shift = c[np.searchsorted(p, t, side="right")]
    return np.where(t >= 0, t + shift, t)


def plant(events: pa.Table, plants: Iterable[Plant]) -> tuple[pa.Table, list[dict[str, Any]]]:
    """Apply ``plants`` to one rank's canonical events; returns the new table and label windows."""
    cols = {c: events.column(c).combine_chunks() for c in events.column_names}
    kind = kind_codes(events)
    names = cols["name"].cast(pa.string()).to_pylist()
    names = np.asarray([x or "" for x in names], dtype=object)
    start = cols["start_ns"].to_numpy().copy()
    end = cols["end_ns"].to_numpy().copy()
    tid = cols["tid"].to_numpy()
    pid = cols["pid"].to_numpy()
    corr = cols["corr_id"].to_numpy()
    device = cols["device"].to_numpy()
    stream = cols["stream"].to_numpy()
    is_range = kind == KIND_CODE["RANGE"]
    if (kind == KIND_CODE["NVTX_PUSH"]).any():
        raise ValueError("plant() needs paired RANGE rows: write the synthetic run with pushpop='none'")
    host_call = (kind == KIND_CODE["RUNTIME"]) | (kind == KIND_CODE["DRIVER"])
    gpu = tid < 0
    rx = re.compile(r"^STEP id=(\d+)")
    step_num = np.array([int(m.group(1)) if (m := rx.match(s)) else -1 for s in names.tolist()], np.int64)
    step_rows = np.flatnonzero(is_range & (step_num >= 0))
    windows: list[dict[str, Any]] = []
    planted: list[tuple[int, Plant]] = []
    extra_rows: list[dict[str, np.ndarray]] = []
    next_corr = int(corr.max(initial=0)) + (1 << 41)
    for pl in plants:
        if pl.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}")
        srows = step_rows[np.isin(step_num[step_rows], pl.steps)]
        tgt = np.flatnonzero(is_range & (names == pl.target))
        inside = np.zeros(len(tgt), bool)
        for r in srows.tolist():  # planted steps: a handful
            inside |= (tid[tgt] == tid[r]) & (start[tgt] >= start[r]) & (end[tgt] <= end[r])
        tgt = tgt[inside]
        if not len(tgt):
            continue
        th = int(tid[tgt[0]])
        on_thread = tid == th
        calls = np.flatnonzero(host_call & on_thread)
        thread_corr = corr[calls]
        launched = gpu & np.isin(corr, thread_corr) & (corr >= 0)
        dur = end[tgt] - start[tgt]
        if pl.mechanism in ("host", "churn"):
            pts = start[tgt] + 1
            dl = np.round((pl.factor - 1.0) * dur).astype(np.int64)
            sel = on_thread | launched
            start[sel] = _warp(start[sel], pts, dl)
            end[sel] = _warp(end[sel], pts, dl)
            if pl.mechanism == "churn":
                p = _warp(pts, pts, dl) - dl  # the gap [p, p + dl)
                k = len(tgt)
                s1, e1 = p + dl // 20, p + dl * 9 // 20
                s2, e2 = p + dl * 11 // 20, p + dl * 19 // 20
                extra_rows.append({
                    "kind": np.full(2 * k, KIND_CODE["RUNTIME"], np.int8),
                    "name": np.concatenate([np.full(k, "cudaFree", object), np.full(k, "cudaMalloc", object)]),
                    "start_ns": np.concatenate([s1, s2]), "end_ns": np.concatenate([e1, e2]),
                    "tid": np.full(2 * k, th, np.int64), "pid": np.full(2 * k, int(pid[tgt[0]]), np.int64),
                    "corr_id": next_corr + np.arange(2 * k, dtype=np.int64),
                })
                next_corr += 2 * k
        else:  # kernel
            ts = tgt[np.argsort(start[tgt], kind="stable")]
            j = np.searchsorted(start[ts], start[calls], side="right") - 1
            tcalls = calls[(j >= 0) & (end[calls] <= end[ts[np.maximum(j, 0)]])]
            kern = np.flatnonzero(launched & np.isin(corr, corr[tcalls]) & (kind == KIND_CODE["KERNEL"]))
            kd = end[kern] - start[kern]
            add = np.round((pl.factor - 1.0) * kd).astype(np.int64)
            for dv, sm in {(int(device[r]), int(stream[r])) for r in kern.tolist()}:  # a few streams
                on = gpu & (device == dv) & (stream == sm)
                mine = (device[kern] == dv) & (stream[kern] == sm)
                pts, dl = end[kern][mine], add[mine]
                start[on] = _warp(start[on], pts, dl)
                end[on] = _warp(end[on], pts, dl)
        planted.extend((r, pl) for r in tgt.tolist())
    # windows last: a later plant may shift the times of an earlier one
    rank_col = cols["rank"].to_numpy()
    for r, pl in planted:
        windows.append({"start_ns": int(start[r]), "end_ns": int(end[r]), "category": _CATEGORY[pl.mechanism],
                        "mechanism": pl.mechanism, "magnitude": float(pl.factor),
                        "operators": [pl.target], "rank": int(rank_col[r])})
    out = {c: cols[c] for c in cols}
    out["start_ns"], out["end_ns"] = start, end
    table = events_table({k: v for k, v in out.items()}, events.num_rows)
    if extra_rows:
        add = {k: np.concatenate([e[k] for e in extra_rows]) for k in extra_rows[0]}
        m = len(add["kind"])
        rank = int(cols["rank"].to_numpy()[0]) if events.num_rows else 0
        add.update(rank=np.full(m, rank, np.int32), node=np.zeros(m, np.int32))
        add["kind"] = pa.DictionaryArray.from_arrays(pa.array(add["kind"]), pa.array(KINDS))
        table = pa.concat_tables([table, events_table(add, m)]).unify_dictionaries().combine_chunks()
    return table, windows


def write_planted_run(path: str | os.PathLike, n_events: int, plants: list[Plant], seed: int = 0,
                      **synth_kwargs: Any) -> RunDir:
    """A synthetic run with ``plants`` applied to rank 0 and the truth in ``labels.json``."""
    rd = RunDir(path)
    windows: list[dict[str, Any]] = []
    rows = 0
    synth_kwargs.setdefault("pushpop", "none")
    for r, table in enumerate(synth_tables(n_events, seed=seed, **synth_kwargs)):
        if r == 0 and plants:
            table, windows = plant(table, plants)
        rd.write_events(table, name=f"rank{r}")
        rows += table.num_rows
    rd.write_info(RunInfo(source="synth+planted", command=["teller.testing.planted", str(n_events)],
                          counts={"events": rows}, extra={"synth": {"seed": seed, **synth_kwargs}}))
    rd.write_labels({"source": "planted", "windows": windows})
    return rd
