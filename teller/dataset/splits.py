"""Splits of the step records: request-disjoint 80/10/10, run-disjoint, mechanism-disjoint, workload-disjoint.

All are deterministic given the seed. ``split_request``: the (run, request) pairs are
shuffled and cut 80/10/10, so every step of a request lands in one split (a request id such as
``req_3`` names a different request in every run). ``split_run``: whole runs, shuffled and cut
80/10/10 (at least one run in test when there are three or more). ``split_mechanism``: for
every category with two or more mechanisms one mechanism (drawn with the seed) is held out for
test; records of the others, and normal records, follow their request split (val stays val).
``split_workload`` (only when the runs served two or more model shapes, the ``workload`` column
of :mod:`.build`): the shape with the most records is trained on (its records follow their
request split, test folded into train), every other shape is test: a model trained on one model
shape is scored on runs of another.

**A step's part.** Splits are per record, and a step holds the records of all the requests it
served, which ``split_request`` scatters over the three parts. Everything that scores *steps*
(``teller evaluate``, the root-cause models) gives a step the part of one representative record:
one of its records picked by a hash (CRC-32) of the step's key (run, view, step ids)
(:func:`step_representatives`). The pick is independent from step to step, so the parts keep
about the 80/10/10 proportions and no step is in two parts; a test step's other requests can be
train requests (unavoidable for a model of steps). For the run, mechanism and workload splits a
step's records share their part, so the rule is exact there.
"""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa

SPLITS = ("train", "val", "test")
#: the split columns a records table can hold (split_workload only for two or more model shapes)
SPLIT_COLUMNS = ("split_request", "split_run", "split_mechanism", "split_workload")


def step_keys(run_id: np.ndarray, view: np.ndarray, step_ids: pa.ListArray) -> np.ndarray:
    """The key of each record's step: run, view and the step ids (one per rank), as one string."""
    off = step_ids.offsets.to_numpy().astype(np.int64)
    val = step_ids.values.to_numpy().astype(np.int64)
    return np.asarray([f"{r}\x1f{v}\x1f" + ",".join(map(str, val[off[i]:off[i + 1]].tolist()))
                       for i, (r, v) in enumerate(zip(run_id.tolist(), view.tolist(), strict=True))], dtype=object)


def step_representatives(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps of records given by their step keys (records in ``record_id`` order): ``first``
    (each step's first record, steps in order of first appearance), ``inv`` (each record's step),
    ``counts`` (records per step) and ``rep`` (each step's representative record: the one a
    CRC-32 of its key picks, module docstring)."""
    keys = np.asarray(keys, dtype=object)
    uk, first, inv, counts = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    inv, first, counts, uk = rank[inv.reshape(-1)], first[order], counts[order], uk[order]
    by_step = np.argsort(inv, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    pick = np.asarray([zlib.crc32(k.encode()) for k in uk.tolist()], np.int64) % counts
    return first, inv, counts, by_step[starts + pick]


def representatives_of(records: pa.Table, step_of_record: np.ndarray, n_steps: int) -> np.ndarray:
    """Each step's representative record (an index into ``records``, which must be in
    ``record_id`` order) for a caller that grouped the records into ``n_steps`` steps its own way
    (``step_of_record``). Raises ValueError when that grouping is not the one of the step keys
    (a step whose records name different step ids)."""
    run = np.asarray(records.column("run_id").cast(pa.string()).to_pylist(), dtype=object)
    view = np.asarray(records.column("view").cast(pa.string()).to_pylist(), dtype=object)
    _, _, _, rep = step_representatives(step_keys(run, view, records.column("step_ids").combine_chunks()))
    step_of_record = np.asarray(step_of_record)
    if len(rep) != n_steps or len(np.unique(step_of_record[rep])) != n_steps:
        raise ValueError("the step ids of a step differ between its records")
    out = np.empty(n_steps, np.int64)
    out[step_of_record[rep]] = rep
    return out


def _cut(n: int, rng: np.random.Generator, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> np.ndarray:
    """Split codes (0 train, 1 val, 2 test) for n shuffled items."""
    perm = rng.permutation(n)
    n_train = int(round(fractions[0] * n))
    n_val = int(round(fractions[1] * n))
    if n >= 3:
        n_train = min(n_train, n - 2)
        n_val = max(1, min(n_val, n - n_train - 1))
    codes = np.full(n, 2, np.int8)
    codes[perm[:n_train]] = 0
    codes[perm[n_train:n_train + n_val]] = 1
    return codes


def assign_splits(run_id: np.ndarray, request_id: np.ndarray, mechanism: np.ndarray, category: np.ndarray,
                  seed: int = 0, workload: np.ndarray | None = None) -> dict[str, list[str]]:
    """Split names per record for the protocols (arrays of equal length); ``split_workload`` only
    when ``workload`` holds two or more shapes. Also returns the held-out mechanisms and workloads."""
    names = np.array(SPLITS, dtype=object)
    key = np.char.add(np.char.add(run_id.astype(str), "\x1f"), request_id.astype(str))
    uk, inv = np.unique(key, return_inverse=True)
    req = _cut(len(uk), np.random.default_rng(seed))[inv]
    ur, rinv = np.unique(run_id.astype(str), return_inverse=True)
    run = _cut(len(ur), np.random.default_rng(seed + 1))[rinv]
    rng = np.random.default_rng(seed + 2)
    held: set[str] = set()
    mech = mechanism.astype(str)
    cat = category.astype(str)
    for c in sorted(set(cat[mech != ""])):
        ms = sorted(set(mech[(cat == c) & (mech != "")]))
        if len(ms) >= 2:
            pick = ms[int(rng.integers(len(ms)))]
            # c == "": records in a window without effect name their mechanism and no category; they
            # are no category of their own (their draw is still made, so the held-out set of a
            # dataset built before this rule stays the same)
            if c:
                held.add(pick)
    mcode = np.where(np.isin(mech, sorted(held)), 2, np.where(req == 2, 0, req)) if held else req.copy()
    out: dict[str, list[str]] = {"split_request": names[req].tolist(), "split_run": names[run].tolist(),
                                 "split_mechanism": names[mcode].tolist()}
    held_wl: list[str] = []
    if workload is not None:
        wl = workload.astype(str)
        uw, counts = np.unique(wl, return_counts=True)
        if len(uw) >= 2:
            main = uw[int(np.argmax(counts))]  # the most records; ties: the first in sorted order
            out["split_workload"] = names[np.where(wl == main, np.where(req == 2, 0, req), 2)].tolist()
            held_wl = sorted(set(uw.tolist()) - {main})
    out["held_out_mechanisms"], out["held_out_workloads"] = sorted(held), held_wl  # type: ignore[assignment]
    return out


def split_table(records: pa.Table, seed: int = 0) -> tuple[pa.Table, dict[str, list[str]]]:
    """Add the split columns to a records table; returns it and what is held out
    (``{"mechanisms": [...], "workloads": [...]}``)."""
    wl = (np.asarray(records.column("workload").to_pylist(), dtype=object)
          if "workload" in records.column_names else None)
    s = assign_splits(np.asarray(records.column("run_id").to_pylist(), dtype=object),
                      np.asarray(records.column("request_id").to_pylist(), dtype=object),
                      np.asarray(records.column("mechanism").to_pylist(), dtype=object),
                      np.asarray(records.column("fault_type").to_pylist(), dtype=object), seed, workload=wl)
    held = {"mechanisms": s.pop("held_out_mechanisms"), "workloads": s.pop("held_out_workloads")}
    for k, v in s.items():
        records = records.append_column(k, pa.array(v, pa.string()).dictionary_encode())
    return records, held
