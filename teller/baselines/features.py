"""Step features of the classical baselines, computed once per step from the dataset's subtrees.

All of it is vectorized over the forest rows (bincounts on a row → step index); the only Python
loops run over distinct names (a few thousand) and feature columns.

**Standard statistical features** (:data:`STANDARD`, one value per step; durations in ns):

- per layer tag L of docs/design.md §4 (STEP, FE, BE, COMM, RT, DRV, K, MEM, SYNC, OTHER):
  ``n_L`` (nodes), ``dur_L`` (summed duration), ``self_L`` (summed self time: duration minus the
  direct host children; a GPU row's self time is its duration);
- ``wall_ns``: the step's duration (its STEP node); ``rows``: forest rows; ``max_depth``;
- ``gpu_busy_ns``: union of the intervals of its GPU rows (kernels, copies, sets); ``gpu_span_ns``:
  first GPU start to last GPU end; ``host_not_gpu_ns`` = ``wall_ns − gpu_busy_ns``;
- ``kernel_n``, ``kernel_ns``; ``memcpy_n``, ``memset_n``, ``mem_bytes`` (bytes of copies/sets);
- ``sync_n``, ``sync_ns`` (synchronization rows);
- ``comm_ns``, ``comm_n``, ``comm_bytes``: host COMM ranges not nested in another COMM range;
  ``comm_gpu_ns``: GPU COMM rows (NCCL kernels);
- ``n_requests`` (records of the step), ``n_log_lines`` (aligned log lines of the step).

In the horizontal view a step has several rank steps (units): each feature is summed over them,
and its spread (``max − min`` over the ranks) is added as ``spread_<feature>``.

**Name features** (the second set), per step, over operator families (``LAYER name`` with
:func:`teller.forest.family_names`; ``STEP`` for step nodes):

- ``count``/``dur``/``self`` of each (layer, name) family: the operator-count features and the
  flattened per-operator durations; the columns kept are the ``vocab`` families that occur in the
  most train steps (:class:`FeatureMaker`, fitted on the train part only);
- (parent family, family) pairs: count and summed duration, hashed (CRC-32 of the pair) into
  :data:`PAIR_BUCKETS` buckets.

Every value goes through ``log1p`` (all are counts, bytes or ns ≥ 0) before the models see it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import scipy.sparse as sp

from teller.baselines.steps import StepSet
from teller.errors import TellerError
from teller.forest import Forest, family_names
from teller.rundir import KIND_CODE, LAYER_CODE, LAYERS, dict_codes

PAIR_BUCKETS = 512
_PER_LAYER = tuple(f"{k}_{lay}" for lay in LAYERS for k in ("n", "dur", "self"))
#: the standard statistical features of one unit (rank step), in column order
STANDARD = _PER_LAYER + (
    "wall_ns", "rows", "max_depth", "gpu_busy_ns", "gpu_span_ns", "host_not_gpu_ns", "kernel_n", "kernel_ns",
    "memcpy_n", "memset_n", "mem_bytes", "sync_n", "sync_ns", "comm_ns", "comm_n", "comm_bytes", "comm_gpu_ns",
    "n_requests", "n_log_lines")
#: the subtree columns :func:`forest_columns` reads (callers may drop the others first: the rows it
#: takes are copied with every column it is given)
FEATURE_COLUMNS = ("run_id", "step_id", "node_id", "parent_id", "layer", "name", "start_ns", "end_ns", "kind", "tid",
                   "device", "bytes", "depth")
_SPAN = np.int64(1) << 40  # > any step's time span in ns (18 minutes)


@dataclass
class ForestColumns:
    """The subtree columns the features read, on the rows of the wanted units only."""

    unit: np.ndarray  # unit index of each row
    parent: np.ndarray  # row of the parent within these rows, -1 none
    layer: np.ndarray  # codes into LAYERS
    kind: np.ndarray  # codes into KINDS, -1 unknown
    name_codes: np.ndarray
    names: list[str]
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    depth: np.ndarray
    gpu: np.ndarray  # GPU activity (thread id -1 on a device)


def feature_table(subtrees: pa.Table) -> pa.Table:
    """``subtrees`` with only :data:`FEATURE_COLUMNS` (those it has): what the features read."""
    return subtrees.select([c for c in FEATURE_COLUMNS if c in subtrees.column_names])


def forest_columns(subtrees: pa.Table, runs: np.ndarray, unit_key: np.ndarray) -> ForestColumns:
    """Decode the subtree rows of the units ``unit_key`` (``run_code << 40 | step_id``, sorted;
    ``run_code`` indexes ``runs``). The one place the evaluation reads forest columns."""
    rcodes, rdict = dict_codes(subtrees, "run_id")
    remap = np.searchsorted(runs, np.asarray(rdict, dtype=object).astype(str))
    known = np.asarray([r < len(runs) and runs[r] == d for r, d in zip(remap.tolist(), rdict, strict=True)] or [False])
    run_code = np.where(known[rcodes], remap[rcodes], -1).astype(np.int64)
    step_id = subtrees.column("step_id").to_numpy().astype(np.int64)
    key = run_code << 40 | step_id
    pos = np.clip(np.searchsorted(unit_key, key), 0, max(len(unit_key) - 1, 0))
    hit = (run_code >= 0) & (step_id >= 0) & (unit_key[pos] == key) if len(unit_key) else np.zeros(len(key), bool)
    rows = np.flatnonzero(hit)
    subtrees = feature_table(subtrees)
    t = subtrees.take(pa.array(rows)) if len(rows) < subtrees.num_rows else subtrees

    def col(name: str, fill: int = -1) -> np.ndarray:
        c = t.column(name)
        return c.fill_null(fill).to_numpy().astype(np.int64) if c.null_count else c.to_numpy().astype(np.int64)

    unit = pos[rows]
    # a step's rows are one DFS block of its run's forest (node ids consecutive), so a parent
    # inside the block is ``node_id - parent_id`` rows up; anything else has no parent here
    # (node ids repeat across runs, so the forest's own parent lookup does not apply)
    fa = Forest.from_table(t.select([c for c in t.column_names if c not in ("run_id", "args")]))
    node_id, par_id = fa.node_id, col("parent_id")
    prow = np.arange(len(rows), dtype=np.int64) - (node_id - par_id)
    okp = (par_id >= 0) & (prow >= 0) & (prow < len(rows))
    okp[okp] = (node_id[prow[okp]] == par_id[okp]) & (unit[prow[okp]] == unit[okp])
    parent = np.where(okp, prow, -1)
    # GPU activity as these baselines were published: thread id -1 on a device (the forest's
    # is_gpu also counts thread-less SYNC records, which would change their features)
    return ForestColumns(unit=unit, parent=parent, layer=fa.layer, kind=fa.kind, name_codes=fa.name_codes, names=fa.names,
                         start=fa.start, end=np.maximum(fa.end, fa.start), nbytes=np.maximum(fa.nbytes, 0),
                         depth=col("depth", 0), gpu=(fa.tid < 0) & (fa.device >= 0))


@dataclass
class StepFeatures:
    """Features of every step of a :class:`StepSet` (module docstring)."""

    std: np.ndarray  # (steps, len(std_names))
    std_names: list[str]
    fam_count: sp.csr_matrix  # (steps, families)
    fam_dur: sp.csr_matrix
    fam_self: sp.csr_matrix
    families: list[str]
    pair_count: np.ndarray  # (steps, PAIR_BUCKETS)
    pair_dur: np.ndarray
    info: dict[str, Any]


def _group_max(group: np.ndarray, v: np.ndarray, n: int) -> np.ndarray:
    """Per group (0..n-1) the maximum of ``v`` (0 for an empty group)."""
    out = np.zeros(n)
    if not len(group):
        return out
    o = np.argsort(group, kind="stable")
    g = group[o]
    starts = np.flatnonzero(np.concatenate([[True], g[1:] != g[:-1]]))
    out[g[starts]] = np.maximum.reduceat(v[o], starts)
    return out


def _gpu_busy(fc: ForestColumns, n_units: int) -> tuple[np.ndarray, np.ndarray]:
    """Per unit: length of the union of its GPU intervals, and first start to last end."""
    g = np.flatnonzero(fc.gpu)
    busy = np.zeros(n_units)
    span = np.zeros(n_units)
    if not len(g):
        return busy, span
    u, s, e = fc.unit[g], fc.start[g], fc.end[g]
    base = (-_group_max(u, -s.astype(np.float64), n_units)).astype(np.int64)
    last = _group_max(u, (e - base[u]).astype(np.float64), n_units)
    has = np.bincount(u, minlength=n_units) > 0
    span[has] = last[has]
    o = np.lexsort((s, u))
    u, s, e = u[o], s[o] - base[u[o]] + u[o] * _SPAN, e[o] - base[u[o]] + u[o] * _SPAN
    cm = np.maximum.accumulate(e)
    prev = np.concatenate([[np.iinfo(np.int64).min], cm[:-1]])
    first = np.concatenate([[True], u[1:] != u[:-1]])
    prev = np.where(first, u * _SPAN, prev)
    busy = np.bincount(u, weights=np.maximum(e - np.maximum(s, prev), 0), minlength=n_units)
    return busy, span


def _unit_features(fc: ForestColumns, n_units: int, n_requests: np.ndarray, n_log: np.ndarray) -> np.ndarray:
    n = len(fc.unit)
    dur = (fc.end - fc.start).astype(np.float64)
    host_child = np.flatnonzero((fc.parent >= 0) & ~fc.gpu)
    child = np.bincount(fc.parent[host_child], weights=dur[host_child], minlength=n) if n else np.zeros(0)
    self_t = np.where(fc.gpu, dur, np.maximum(dur - child, 0))
    u = fc.unit
    cols: dict[str, np.ndarray] = {}

    def bc(w: np.ndarray | None, m: np.ndarray) -> np.ndarray:
        return np.bincount(u[m], weights=None if w is None else w[m], minlength=n_units).astype(np.float64)

    for li, lay in enumerate(LAYERS):
        m = fc.layer == li
        cols[f"n_{lay}"], cols[f"dur_{lay}"], cols[f"self_{lay}"] = bc(None, m), bc(dur, m), bc(self_t, m)
    step_rows = fc.layer == LAYER_CODE["STEP"]
    cols["wall_ns"] = bc(dur, step_rows)
    cols["rows"] = bc(None, np.ones(n, bool))
    cols["max_depth"] = _group_max(u, fc.depth.astype(np.float64), n_units)
    busy, span = _gpu_busy(fc, n_units)
    cols["gpu_busy_ns"], cols["gpu_span_ns"] = busy, span
    cols["host_not_gpu_ns"] = np.maximum(cols["wall_ns"] - busy, 0)
    kern = fc.kind == KIND_CODE["KERNEL"]
    cols["kernel_n"], cols["kernel_ns"] = bc(None, kern), bc(dur, kern)
    cpy, mset = fc.kind == KIND_CODE["MEMCPY"], fc.kind == KIND_CODE["MEMSET"]
    cols["memcpy_n"], cols["memset_n"] = bc(None, cpy), bc(None, mset)
    cols["mem_bytes"] = bc(fc.nbytes.astype(np.float64), cpy | mset)
    sync = fc.kind == KIND_CODE["SYNC"]
    cols["sync_n"], cols["sync_ns"] = bc(None, sync), bc(dur, sync)
    comm = fc.layer == LAYER_CODE["COMM"]
    par_comm = np.zeros(n, bool)
    hp = fc.parent >= 0
    par_comm[hp] = comm[fc.parent[hp]]
    outer = comm & ~fc.gpu & ~par_comm
    cols["comm_ns"], cols["comm_n"] = bc(dur, outer), bc(None, outer)
    cols["comm_bytes"] = bc(fc.nbytes.astype(np.float64), outer)
    cols["comm_gpu_ns"] = bc(dur, comm & fc.gpu)
    cols["n_requests"] = n_requests.astype(np.float64)
    cols["n_log_lines"] = n_log.astype(np.float64)
    return np.column_stack([cols[k] for k in STANDARD])


def _families(fc: ForestColumns) -> tuple[np.ndarray, list[str]]:
    """Family code of every row and the family names (one string per distinct (layer, name))."""
    k = len(fc.names) + 1
    key = fc.layer.astype(np.int64) * k + fc.name_codes
    present = np.flatnonzero(np.bincount(key, minlength=len(LAYERS) * k))
    strings = []
    for x in present.tolist():  # distinct (layer, name) pairs
        lay, nc = divmod(x, k)
        strings.append("STEP" if LAYERS[lay] == "STEP" else family_names(LAYERS[lay], [fc.names[nc]])[0])
    fams = sorted(set(strings))
    at = {f: i for i, f in enumerate(fams)}
    table = np.zeros(len(LAYERS) * k, np.int64)
    table[present] = [at[x] for x in strings]
    return table[key], fams


def _to_steps(steps: StepSet, per_unit: np.ndarray | sp.csr_matrix, spread: bool) -> Any:
    """Sum unit rows into step rows (and, for dense input with ``spread``, max − min per step)."""
    n = steps.n
    lens = np.diff(steps.unit_ptr)
    step_of = np.repeat(np.arange(n), lens)
    agg = sp.csr_matrix((np.ones(len(step_of)), (step_of, steps.unit_idx)), shape=(n, per_unit.shape[0]))
    summed = agg @ per_unit
    if sp.issparse(per_unit) or not spread:
        return summed.tocsr() if sp.issparse(summed) else np.asarray(summed)
    vals = per_unit[steps.unit_idx]
    mx = np.full((n, per_unit.shape[1]), -np.inf)
    mn = np.full((n, per_unit.shape[1]), np.inf)
    np.maximum.at(mx, step_of, vals)
    np.minimum.at(mn, step_of, vals)
    return np.hstack([np.asarray(summed), np.where(np.isfinite(mx - mn), mx - mn, 0)])


def step_features(steps: StepSet, subtrees: pa.Table, logs: pa.Table | None = None) -> StepFeatures:
    """Compute every feature of ``steps`` from the dataset's subtree rows (and aligned log lines)."""
    nu = len(steps.unit_key)
    fc = forest_columns(subtrees, steps.runs, steps.unit_key)
    covered = np.bincount(fc.unit, minlength=nu) > 0
    if not covered.all():
        raise TellerError(f"{steps.dataset}: {int((~covered).sum())} of {nu} steps have no subtree rows; "
                          "rebuild the dataset with `teller dataset build` (its subtrees/ must hold every step)")
    # requests and log lines per unit (a horizontal step's requests are counted once)
    lens = np.diff(steps.unit_ptr)
    req_u = np.zeros(nu)
    first_unit = steps.unit_idx[steps.unit_ptr[:-1][lens > 0]]
    np.add.at(req_u, first_unit, steps.n_requests[lens > 0])
    n_log = np.zeros(nu)
    if logs is not None and logs.num_rows:
        lr = np.asarray(logs.column("run_id").cast(pa.string()).to_numpy(zero_copy_only=False), dtype=object).astype(str)
        rc = np.searchsorted(steps.runs, lr)
        ok = (rc < len(steps.runs)) & (steps.runs[np.minimum(rc, len(steps.runs) - 1)] == lr)
        lk = rc.astype(np.int64) << 40 | logs.column("step_id").fill_null(-1).to_numpy().astype(np.int64)
        p = np.clip(np.searchsorted(steps.unit_key, lk), 0, max(nu - 1, 0))
        hit = ok & (steps.unit_key[p] == lk)
        n_log = np.bincount(p[hit], minlength=nu).astype(np.float64)
    std_u = _unit_features(fc, nu, req_u, n_log)
    horiz = steps.view == "horizontal"
    std = _to_steps(steps, std_u, spread=horiz)
    std_names = list(STANDARD) + ([f"spread_{k}" for k in STANDARD] if horiz else [])
    fam, families = _families(fc)
    nf = len(families)
    dur = (fc.end - fc.start).astype(np.float64)
    host_child = np.flatnonzero((fc.parent >= 0) & ~fc.gpu)
    child = np.bincount(fc.parent[host_child], weights=dur[host_child], minlength=len(dur)) if len(dur) else np.zeros(0)
    self_t = np.where(fc.gpu, dur, np.maximum(dur - child, 0))

    def spm(w: np.ndarray) -> sp.csr_matrix:
        return _to_steps(steps, sp.csr_matrix((w, (fc.unit, fam)), shape=(nu, nf)), spread=False)

    fam_count, fam_dur, fam_self = spm(np.ones(len(fam))), spm(dur), spm(self_t)
    # (parent family, family) pairs, hashed
    pf = np.where(fc.parent >= 0, fam[np.maximum(fc.parent, 0)], nf)
    pk = pf * (nf + 1) + fam
    upk = np.flatnonzero(np.bincount(pk, minlength=(nf + 1) * (nf + 1)))
    names_ext = families + ["<root>"]
    table = np.zeros((nf + 1) * (nf + 1), np.int64)
    table[upk] = [zlib.crc32(f"{names_ext[a]}\x1f{names_ext[b]}".encode()) % PAIR_BUCKETS
                  for a, b in (divmod(int(x), nf + 1) for x in upk)]
    flat = fc.unit * PAIR_BUCKETS + table[pk]
    pc_u = np.bincount(flat, minlength=nu * PAIR_BUCKETS).reshape(nu, PAIR_BUCKETS).astype(np.float64)
    pd_u = np.bincount(flat, weights=dur, minlength=nu * PAIR_BUCKETS).reshape(nu, PAIR_BUCKETS)
    info = {"forest_rows": int(len(fc.unit)), "units": int(nu), "families": nf, "pairs": int(len(upk))}
    return StepFeatures(std=std, std_names=std_names, fam_count=fam_count, fam_dur=fam_dur, fam_self=fam_self,
                        families=families, pair_count=_to_steps(steps, pc_u, spread=False),
                        pair_dur=_to_steps(steps, pd_u, spread=False), info=info)


def read_dataset_features(ds: str | Path, steps: StepSet) -> StepFeatures:
    """Read the subtrees and logs of dataset ``ds`` and compute the features of ``steps``."""
    from teller.dataset.codec import read_subtrees

    ds = Path(ds)
    sub = read_subtrees(ds)
    logs = None
    if (ds / "logs.parquet").is_file():
        logs = pq.read_table(ds / "logs.parquet", columns=["run_id", "step_id"])
        logs = logs.filter(pc.greater_equal(logs.column("step_id"), 0))
    return step_features(steps, sub, logs)  # forest_columns keeps the columns it reads


class FeatureMaker:
    """Design matrices for the classical methods: the standard features, and with ``names`` the
    name features added (families kept: the ``vocab`` occurring in the most train steps).
    ``fit`` on the train steps, ``transform`` any steps; values go through ``log1p``."""

    def __init__(self, names: bool = False, vocab: int = 256):
        self.names = names
        self.vocab = vocab

    def fit(self, f: StepFeatures, idx: np.ndarray) -> "FeatureMaker":
        if self.names:
            df = np.asarray((f.fam_count[idx] > 0).sum(0)).ravel()
            order = np.lexsort((np.arange(len(df)), -df))
            self.columns_ = np.sort(order[: min(self.vocab, int((df > 0).sum()))])
        else:
            self.columns_ = np.zeros(0, np.int64)
        self.feature_names_ = list(f.std_names)
        if self.names:
            fams = [f.families[i] for i in self.columns_.tolist()]
            self.feature_names_ += ([f"count[{x}]" for x in fams] + [f"dur[{x}]" for x in fams] + [f"self[{x}]" for x in fams]
                                    + [f"pair_count[{b}]" for b in range(PAIR_BUCKETS)] + [f"pair_dur[{b}]" for b in range(PAIR_BUCKETS)])
        return self

    def transform(self, f: StepFeatures, idx: np.ndarray) -> np.ndarray:
        parts = [f.std[idx]]
        if self.names:
            c = self.columns_
            parts += [f.fam_count[idx][:, c].toarray(), f.fam_dur[idx][:, c].toarray(), f.fam_self[idx][:, c].toarray(),
                      f.pair_count[idx], f.pair_dur[idx]]
        return np.log1p(np.maximum(np.hstack(parts), 0)).astype(np.float32)
