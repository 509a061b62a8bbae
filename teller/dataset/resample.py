"""``teller dataset resample SRC -o DST --max-normal N``: thin a dataset that kept every step.

A campaign is sometimes built with every step (``--normal-every 1``, no ``--max-normal``) on the
machine that recorded it, and the raw runs are gone by the time the dataset has to join parts
built with a step sampling (``teller dataset merge`` refuses parts sampled differently). Resampling
applies :func:`teller.dataset.build.sample_steps` to the dataset's own vertical records, run by
run, and writes exactly the dataset that ``teller dataset build --normal-every K --max-normal N``
over the same runs would have written (``tests/test_dataset_resample.py``):

- ``records.parquet``: the kept step numbers' vertical and horizontal records, in their order;
  ``record_id`` renumbered and the split columns recomputed (:func:`teller.dataset.splits.split_table`);
- ``subtrees/``: the forest rows of the kept iterations (a kept step's STEP block, through the
  rows' ``step_id``, and every row of its iteration, through ``step_idx``, as the builder takes them);
- ``logs.parquet`` and ``iterations.parquet``: the rows of the kept steps; ``comm_edges.parquet``
  whole (a build keeps every edge of a run, the records point into it);
- ``datasheet.json`` / ``.md``: recounted, the runs' kept steps and records with them.

Only a dataset that kept every step of its runs (whatever its sampling settings: a ``--max-normal``
above a run's step count keeps them all) can be resampled: a build's stride depends on how many
step numbers a run has, which a sampled dataset no longer knows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.dataset.build import sample_steps, sampling_rule, write_dataset
from teller.dataset.codec import read_subtrees
from teller.dataset.merge import TABLES, _records, _sheet, _table, check_parts
from teller.errors import InputError, TellerError


def _pairs(run: np.ndarray, key: np.ndarray) -> np.ndarray:
    """(run, key) pairs as one sortable structured array, for ``np.isin``-like lookups."""
    out = np.empty(len(run), dtype=[("r", run.dtype), ("k", np.int64)])
    out["r"], out["k"] = run, key
    return out


def _member(run: np.ndarray, key: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.isin(_pairs(run, key), want)


def _str(t: pa.Table, c: str) -> np.ndarray:
    """Column ``c`` as a numpy string array (a dictionary column through its codes: the subtrees'
    run ids, a few distinct values over millions of rows)."""
    col = t.column(c).combine_chunks()
    if pa.types.is_dictionary(col.type) and not col.null_count:
        values = np.asarray(col.dictionary.cast(pa.string()).to_pylist(), dtype=object).astype(str)
        return values[col.indices.to_numpy(zero_copy_only=False)]
    return np.asarray(col.cast(pa.string()).to_pylist(), dtype=object).astype(str)


def _horizontal_in_build_order(recs: pa.Table) -> pa.Table:
    """The records with each run's horizontal records in the order the builder's grouping of the
    run's (kept) vertical records gives them (:func:`teller.dataset.build._horizontal`), which is
    not their order in a dataset built from more steps."""
    run, view = _str(recs, "run_id"), _str(recs, "view")
    order = np.arange(recs.num_rows)
    for r in dict.fromkeys(run[view == "horizontal"].tolist()):
        h = np.flatnonzero((run == r) & (view == "horizontal"))
        v = recs.filter(pa.array((run == r) & (view == "vertical"))).select(["run_id", "request_id", "step_num", "rank"])
        g = v.group_by(["run_id", "request_id", "step_num"], use_threads=False).aggregate([("rank", "count")])
        g = g.filter(pc.greater(g.column("rank_count"), 1))
        want = _pairs(_str(g, "request_id"), g.column("step_num").to_numpy().astype(np.int64))
        have = _pairs(_str(recs, "request_id")[h], recs.column("step_num").to_numpy()[h].astype(np.int64))
        pos = np.argsort(have, kind="stable")
        at = np.searchsorted(have[pos], want)
        if len(want) != len(h) or not np.array_equal(have[pos][np.minimum(at, len(h) - 1)], want):
            raise TellerError(f"run {r}: its horizontal records do not match its vertical records' steps of two or more ranks; "
                              "rebuild the dataset with `teller dataset build`")
        order[h] = h[pos[at]]
    return recs.take(pa.array(order))


def resample_dataset(src: str | Path, out: str | Path, normal_every: int = 1, max_normal: int | None = None,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write to ``out`` the dataset ``src`` (built with every step) would have been with the step
    sampling ``normal_every`` / ``max_normal`` (module docstring); returns the datasheet dict.
    ``progress(done, total)`` is called after each run."""
    if normal_every < 1:
        raise TellerError(f"--normal-every {normal_every}: expected 1 (keep every step) or more")
    if max_normal is not None and max_normal < 1:
        raise TellerError(f"--max-normal {max_normal}: expected a number of step numbers ≥ 1 per run")
    if normal_every == 1 and not max_normal:
        raise TellerError("teller dataset resample: no sampling asked for; give --normal-every K (K > 1) or --max-normal N")
    (p,) = check_parts([src], out)
    sheet = _sheet(p)
    short = [r for r in sheet["runs"] if r.get("status") != "skipped" and r.get("steps_kept") != r.get("steps")]
    if short:
        r = short[0]
        raise InputError(p / "datasheet.json", f"already sampled: run {r.get('run_id')!r} kept {r.get('steps_kept')} of its "
                         f"{r.get('steps')} steps ({(sheet.get('sampling') or {}).get('rule', 'sampling unknown')})",
                         "resample a dataset that kept every step (`teller dataset build` without "
                         "--normal-every/--max-normal), or build the runs again with the sampling wanted")
    recs = _records(p, None)
    run, view = _str(recs, "run_id"), _str(recs, "view")
    num = recs.column("step_num").to_numpy().astype(np.int64)
    sid = recs.column("step_id").to_numpy().astype(np.int64)
    keep = np.zeros(recs.num_rows, bool)
    steps_of: dict[str, np.ndarray] = {}
    runs = list(dict.fromkeys(run.tolist()))
    for k, r in enumerate(runs):
        vert = np.flatnonzero((run == r) & (view == "vertical"))
        sel = sample_steps(recs.take(pa.array(vert)).select(["step_num", "is_anomaly"]), normal_every, max_normal)
        keep |= (run == r) & np.isin(num, num[vert][sel])
        steps_of[r] = np.unique(sid[vert][sel])
        if progress is not None:
            progress(k + 1, len(runs))
    recs = _horizontal_in_build_order(recs.filter(pa.array(keep)))
    if not recs.num_rows:
        raise TellerError(f"{p}: no records left after resampling")
    want = _pairs(np.concatenate([np.full(len(s), r, dtype=object) for r, s in steps_of.items()]).astype(str),
                  np.concatenate(list(steps_of.values())))
    # the kept iterations' forest rows: their STEP blocks (the rows' step_id) and every row of the
    # same step_idx (schedule and update ranges, GAP rows), as teller.dataset.build takes them
    subs = read_subtrees(p)
    s_run = _str(subs, "run_id")
    rows = _member(s_run, subs.column("step_id").to_numpy(zero_copy_only=False), want)
    if "step_idx" in subs.column_names:
        idx = subs.column("step_idx").to_numpy(zero_copy_only=False)
        heads = rows & _member(s_run, subs.column("node_id").to_numpy(zero_copy_only=False), want)
        rows |= _member(s_run, idx, np.unique(_pairs(s_run[heads], idx[heads])))
    tables: dict[str, list[pa.Table]] = {k: [] for k in TABLES}
    for name in TABLES:
        t = _table(p, name)
        if t is None or (name == "comm_edges" and not t.num_rows):
            continue
        if name != "comm_edges":  # a build keeps every edge of a run: the records point into them
            t = t.filter(pa.array(_member(_str(t, "run_id"), t.column("step_id").to_numpy(), want)))
        tables[name].append(t)
    kept_run = _str(recs, "run_id")
    run_rows = [dict(row, records=int((kept_run == row["run_id"]).sum()), steps_kept=len(steps_of[row["run_id"]]))
                if row.get("run_id") in steps_of else dict(row) for row in sheet["runs"]]
    return write_dataset([recs], [subs.filter(pa.array(rows))], tables, Path(out), run_rows,
                         int(sheet.get("seed", 0)), sampling_rule(normal_every, max_normal))
