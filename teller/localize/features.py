"""Operator-instance features φ(x) from a call forest (DESIGN.md §6), all vectorized.

An *instance* is an FE, BE or COMM node of a step (COMM: host ranges and NCCL kernels alike) (when a run has none of those, e.g. an Nsight
Systems export without NVTX, its host RT/DRV calls are the instances instead; the choice is
reported). Its *family* is its layer tag plus its name with ``key=value`` words removed and
stand-alone numbers replaced by ``#`` (``COMM all_reduce bytes=8192 group=tp seq=3`` →
``COMM all_reduce``; ``FE model.layers.3.mlp`` → ``FE model.layers.#.mlp``).

Features of an instance x (nanoseconds, counts and bytes; every sum runs over x's whole subtree):

====================  ==========================================================================
``dur_ns``            end − start of x
``self_ns``           dur minus the time of x's direct host children (its own Python/C++ work;
                      :attr:`teller.forest.Forest.self_ns`)
``rt_ns``, ``rt_n``   CUDA runtime calls: total time, count
``drv_ns``, ``drv_n`` CUDA driver calls: total time, count
``k_n``, ``k_ns``     kernels bound to calls under x: count, total GPU time
``mem_bytes``         bytes moved by memcpy/memset under x
``mem_ns``            GPU time of those copies/sets
``sync_ns``           synchronization time recorded under x
``overlap``           share of x's kernel time during which other GPU work ran on the same device
                      (stream overlap; 0 when x launched no kernel)
``comm_bytes``        communication size: bytes of the outermost COMM nodes in x's subtree
====================  ==========================================================================

Subtree sums use the forest's depth-first row layout (every subtree is the block
``[row, row + size)``: one cumulative sum per feature); a forest not laid out that way (a
hand-built or foreign one whose parents merely precede their children) falls back to summing
level by level, bottom-up. Both give the same numbers.

Steps. Instances are grouped by the step they belong to, found by the first rule that applies:

1. ``STEP ranges``: the forest's STEP nodes (``step_id`` column; ``steps.parquet`` when present).
2. ``profiler steps``: host ranges named like a profiler step (``ProfilerStep#N``, ``step:N``,
   ``step N``, ``step_N``); each owns its subtree.
3. ``fixed windows``: the run's time is cut into windows of ``window_ns`` (default 100 ms, or a
   tenth of the run when it lasts under a second); a root node and its whole subtree go to the
   window its start falls in.

The rule used is reported (``StepTable.rule``) and written into the diagnosis.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from teller.forest import Forest, family_names
from teller.rundir import LAYER_CODE, RunDir

__all__ = [
    "FEATURES",
    "INSTANCE_LAYERS",
    "FALLBACK_LAYERS",
    "StepTable",
    "Instances",
    "assign_steps",
    "family_names",
    "instance_features",
    "run_features",
]

#: Feature names, in column order of the feature matrix.
FEATURES = (
    "dur_ns",
    "self_ns",
    "rt_ns",
    "rt_n",
    "drv_ns",
    "drv_n",
    "k_n",
    "k_ns",
    "mem_bytes",
    "mem_ns",
    "sync_ns",
    "overlap",
    "comm_bytes",
)
#: Layers whose nodes are operator instances.
INSTANCE_LAYERS = ("FE", "BE", "COMM")
#: Used instead when a run has no FE/BE/COMM node at all (e.g. a CUDA-only trace).
FALLBACK_LAYERS = ("RT", "DRV")
#: Host ranges that mark profiler steps in foreign traces (rule 2).
PROFILER_STEP_RE = r"(?i)^\s*(?:profilerstep\s*#\s*|step\s*[:#_=\s]\s*)(\d+)\s*$"
#: Default length of a fixed window (rule 3).
DEFAULT_WINDOW_NS = 100_000_000



def _np(table: pa.Table, name: str, dtype: Any = np.int64, fill: int = -1) -> np.ndarray:
    col = table.column(name)
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if col.null_count:
        col = col.fill_null(fill)
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


# ------------------------------------------------------------------------------------------------
# steps


@dataclass
class StepTable:
    """Steps of a run and the step index of every forest row (-1: in no step)."""

    step_of_row: np.ndarray
    step_num: np.ndarray
    rank: np.ndarray
    node_id: np.ndarray  # the step's node id (-1 for fixed windows)
    start: np.ndarray
    end: np.ndarray
    names: list[str]
    n_requests: np.ndarray
    rule: str  # "STEP ranges" | "profiler steps" | "fixed windows"
    detail: str
    row: np.ndarray | None = None  # forest row of each step's node (-1 for fixed windows)

    @property
    def n(self) -> int:
        return len(self.step_num)


def assign_steps(fa: Forest, steps: pa.Table | None = None, window_ns: int | None = None,
                 layers: tuple[str, ...] | None = None) -> StepTable:
    """Group forest rows into steps by the first rule that applies (module docstring).

    Under rules 1 and 2, work of the same process that ran on another thread during a step (a
    root node starting inside the step's interval: a backward thread, a batching loop) joins that
    step. A rule under which no instance (of ``layers``, default FE/BE/COMM else RT/DRV) falls
    inside a step gives way to the next."""
    inst = _instance_mask(fa, layers)
    for rule in (_step_ranges, _profiler_steps):
        st = rule(fa, steps)
        if st is None:
            continue
        attached = _attach_by_time(fa, st)
        if (st.step_of_row[inst] >= 0).any() or not inst.any():
            if attached:
                st.detail += f"; {attached} root node(s) of other threads joined the step running at their start"
            return st
    return _fixed_windows(fa, window_ns)


def _instance_mask(fa: Forest, layers: tuple[str, ...] | None) -> np.ndarray:
    if layers is None:
        layers = INSTANCE_LAYERS
        if not np.isin(fa.layer, [LAYER_CODE[x] for x in INSTANCE_LAYERS]).any():
            layers = FALLBACK_LAYERS
    m = np.isin(fa.layer, [LAYER_CODE[x] for x in layers])
    return m & ~fa.is_gpu if set(layers) <= {"RT", "DRV"} else m


def _step_ranges(fa: Forest, steps: pa.Table | None) -> StepTable | None:
    """Rule 1: STEP nodes."""
    n = fa.n
    is_step = fa.layer == LAYER_CODE["STEP"]
    if not is_step.any():
        return None
    srows = np.flatnonzero(is_step)
    sid = fa.step_id
    if np.all(sid < 0) or np.any(sid[srows] != fa.node_id[srows]):
        owner = fa.propagate_down(np.where(is_step, np.arange(n), -1), is_step)
    else:  # reconstruct's step_id column: the node id of the innermost enclosing STEP
        keys = fa.node_id[srows]
        o = np.argsort(keys)
        pos = np.clip(np.searchsorted(keys, sid, sorter=o), 0, len(srows) - 1)
        hit = (sid >= 0) & (keys[o[pos]] == sid)
        owner = np.where(hit, srows[o[pos]], -1)
    idx_of_row = np.full(n, -1, np.int64)
    idx_of_row[srows] = np.arange(len(srows))
    step_of_row = np.where(owner >= 0, idx_of_row[np.maximum(owner, 0)], -1)
    step_num = np.arange(len(srows), dtype=np.int64)
    n_req = np.zeros(len(srows), np.int32)
    if steps is not None and steps.num_rows:
        row_of_node = {int(i): r for r, i in enumerate(fa.node_id[srows].tolist())}
        st_id = _np(steps, "step_id")
        r = np.array([row_of_node.get(int(i), -1) for i in st_id.tolist()], dtype=np.int64)
        ok = r >= 0
        step_num[r[ok]] = _np(steps, "step_num")[ok]
        if "n_requests" in steps.column_names:
            n_req[r[ok]] = _np(steps, "n_requests", np.int32)[ok]
    else:
        step_num = _parse_step_nums(fa, srows)
    return StepTable(step_of_row, step_num, fa.rank[srows].astype(np.int64), fa.node_id[srows],
                     fa.start[srows], fa.end[srows], [fa.name(int(r)) for r in srows], n_req,
                     "STEP ranges", f"{len(srows)} STEP ranges", srows)


def _profiler_steps(fa: Forest, steps: pa.Table | None = None) -> StepTable | None:
    """Rule 2: host ranges named like profiler steps."""
    n = fa.n
    rx = re.compile(PROFILER_STEP_RE)
    nums = np.array([int(m.group(1)) if (m := rx.match(s)) else -1 for s in fa.names] or [-1], dtype=np.int64)
    prof = (nums[fa.name_codes] >= 0) & ~fa.is_gpu if n else np.zeros(0, bool)
    if not prof.any():
        return None
    srows = np.flatnonzero(prof)
    idx_of_row = np.full(n, -1, np.int64)
    idx_of_row[srows] = np.arange(len(srows))
    step_of_row = fa.propagate_down(np.where(prof, idx_of_row, -1), prof)
    return StepTable(step_of_row, nums[fa.name_codes[srows]], fa.rank[srows].astype(np.int64),
                     fa.node_id[srows], fa.start[srows], fa.end[srows],
                     [fa.name(int(r)) for r in srows], np.zeros(len(srows), np.int32),
                     "profiler steps", f"{len(srows)} host ranges named like profiler steps (no STEP ranges)", srows)


def _attach_by_time(fa: Forest, st: StepTable) -> int:
    """Give the roots of the same process that are in no step the step running at their start
    (and their subtrees); returns how many roots joined a step. GPU rows follow their launches."""
    roots = np.flatnonzero((fa.parent < 0) & (st.step_of_row < 0) & ~fa.is_gpu)
    if not len(roots) or not st.n:
        return 0
    if st.row is None:
        return 0
    pos = st.row
    proc_s = np.stack([fa.node[pos], fa.rank[pos], fa.pid[pos]]).astype(np.int64)
    proc_r = np.stack([fa.node[roots], fa.rank[roots], fa.pid[roots]]).astype(np.int64)
    _, inv = np.unique(np.concatenate([proc_s, proc_r], axis=1), axis=1, return_inverse=True)
    inv = inv.reshape(-1)
    ps, pr = inv[: st.n], inv[st.n:]
    got = np.full(len(roots), -1, np.int64)
    for p in np.unique(pr).tolist():  # processes: a handful
        sidx = np.flatnonzero(ps == p)
        if not len(sidx):
            continue
        sidx = sidx[np.argsort(st.start[sidx], kind="stable")]
        ridx = np.flatnonzero(pr == p)
        t = fa.start[roots[ridx]]
        j = np.searchsorted(st.start[sidx], t, side="right") - 1
        ok = (j >= 0) & (t < st.end[sidx[np.maximum(j, 0)]])
        got[ridx[ok]] = sidx[j[ok]]
    sel = got >= 0
    if not sel.any():
        return 0
    val = st.step_of_row.copy()
    src = np.zeros(fa.n, bool)
    val[roots[sel]] = got[sel]
    src[roots[sel]] = True
    src |= st.step_of_row >= 0
    joined = fa.propagate_down(np.where(src, val, -1), src | (fa.parent < 0))
    st.step_of_row = np.where(st.step_of_row >= 0, st.step_of_row, joined)
    return int(sel.sum())


def _fixed_windows(fa: Forest, window_ns: int | None) -> StepTable:
    """Rule 3: fixed time windows over root start times, per rank."""
    n = fa.n
    roots = np.flatnonzero(fa.parent < 0)
    if not len(roots):
        e = np.zeros(0, np.int64)
        return StepTable(np.full(n, -1, np.int64), e, e, e, e, e, [], np.zeros(0, np.int32), "fixed windows", "empty forest")
    t0 = int(fa.start[roots].min())
    span = int(fa.end.max()) - t0
    if window_ns is None:
        window_ns = DEFAULT_WINDOW_NS if span >= 10 * DEFAULT_WINDOW_NS else max(span // 10, 1)
    window_ns = max(int(window_ns), 1)
    root_of = fa.propagate_down(np.arange(n), fa.parent < 0)
    w_root = (fa.start[roots] - t0) // window_ns
    keys = np.stack([fa.rank[roots].astype(np.int64), w_root])
    uniq, inv = np.unique(keys, axis=1, return_inverse=True)
    root_idx = np.full(n, -1, np.int64)
    root_idx[roots] = inv.reshape(-1)
    k = uniq.shape[1]
    starts = t0 + uniq[1] * window_ns
    return StepTable(root_idx[root_of], uniq[1].astype(np.int64), uniq[0].astype(np.int64), np.full(k, -1, np.int64),
                     starts, starts + window_ns, [f"window {int(w)}" for w in uniq[1]], np.zeros(k, np.int32),
                     "fixed windows", f"no step holds an operator: windows of {window_ns / 1e6:g} ms by root start time")


def _parse_step_nums(fa: Forest, srows: np.ndarray) -> np.ndarray:
    out = np.arange(len(srows), dtype=np.int64)
    for i, r in enumerate(srows.tolist()):
        m = re.search(r"\bid=(\d+)", fa.name(r)) or re.search(r"(\d+)\s*$", fa.name(r))
        if m:
            out[i] = int(m.group(1))
    return out


# ------------------------------------------------------------------------------------------------
# families and features

def _overlap_ns(fa: Forest, gpu: np.ndarray) -> np.ndarray:
    """Per GPU row: ns of its interval during which other GPU activity ran on the same device."""
    out = np.zeros(fa.n, np.int64)
    g = np.flatnonzero(gpu)
    if not len(g):
        return out
    for dev in np.unique(fa.device[g]).tolist():
        rows = g[fa.device[g] == dev]
        s, e = fa.start[rows], fa.end[rows]
        t = np.concatenate([s, e])
        d = np.concatenate([np.ones(len(rows), np.int64), -np.ones(len(rows), np.int64)])
        o = np.lexsort((d, t))  # ends before starts at the same instant
        t, d = t[o], d[o]
        active = np.cumsum(d)  # active count on [t_i, t_{i+1})
        busy2 = active >= 2
        seg = np.diff(t) * busy2[:-1]
        m = np.concatenate([[0], np.cumsum(seg)])  # measure of the ≥2 set up to t_i

        def measure(q: np.ndarray, t=t, m=m, busy2=busy2) -> np.ndarray:
            j = np.searchsorted(t, q, side="right") - 1
            j = np.clip(j, 0, len(t) - 1)
            return m[j] + (q - t[j]) * busy2[j]

        out[rows] = np.maximum(measure(e) - measure(s), 0)
    return out


@dataclass
class Instances:
    """Operator instances of a run: forest rows, families, steps and the feature matrix."""

    rows: np.ndarray  # forest rows
    family: np.ndarray  # int32 codes into ``families``
    families: list[str]
    step: np.ndarray  # step index (StepTable), -1 in no step
    X: np.ndarray  # (n, len(FEATURES)) float64
    parent: np.ndarray  # index (into these instances) of the nearest instance ancestor, -1 none
    layers: tuple[str, ...]

    @property
    def n(self) -> int:
        return len(self.rows)

    def family_of(self) -> np.ndarray:
        """Family name of every instance (object array)."""
        return np.asarray(self.families, dtype=object)[self.family] if self.n else np.zeros(0, object)

    def subset(self, keep: np.ndarray) -> "Instances":
        idx = np.flatnonzero(keep) if keep.dtype == bool else keep
        remap = np.full(self.n + 1, -1, np.int64)
        remap[idx] = np.arange(len(idx))
        par = self.parent[idx]
        return Instances(self.rows[idx], self.family[idx], self.families, self.step[idx], self.X[idx],
                         remap[np.where(par >= 0, par, self.n)], self.layers)


def instance_features(fa: Forest, step_of_row: np.ndarray | None = None,
                      layers: tuple[str, ...] | None = None) -> Instances:
    """Instances of ``layers`` (default FE/BE/COMM, else RT/DRV when none exist) and φ(x)."""
    n = fa.n
    if layers is None:
        layers = INSTANCE_LAYERS
        if not np.isin(fa.layer, [LAYER_CODE[x] for x in INSTANCE_LAYERS]).any():
            layers = FALLBACK_LAYERS
    codes = [LAYER_CODE[x] for x in layers]
    is_inst = np.isin(fa.layer, codes)
    if set(layers) <= {"RT", "DRV"}:
        is_inst &= ~fa.is_gpu
    rows = np.flatnonzero(is_inst)
    step_of_row = np.full(n, -1, np.int64) if step_of_row is None else step_of_row
    dur = fa.dur_ns
    gpu = fa.is_gpu
    self_ns = fa.self_ns
    rt = fa.kind_or_layer("RUNTIME", "RT") & ~gpu
    drv = fa.kind_or_layer("DRIVER", "DRV") & ~gpu
    kern = fa.kind_or_layer("KERNEL", "K") & gpu
    mem = (fa.kind_or_layer("MEMCPY", "MEM") | fa.kind_or_layer("MEMSET", "MEM")) & gpu
    sync = fa.kind_or_layer("SYNC", "SYNC")
    comm = fa.layer == LAYER_CODE["COMM"]
    outer_comm = comm & (fa.nearest_ancestor(comm) < 0)
    ovl = _overlap_ns(fa, kern | mem)
    zeros = np.zeros(n, np.int64)

    def ss(v: np.ndarray) -> np.ndarray:
        return fa.subtree_sums(v, rows).astype(np.float64)

    k_ns = ss(np.where(kern, dur, zeros))
    X = np.column_stack([
        dur[rows].astype(np.float64),
        self_ns[rows].astype(np.float64),
        ss(np.where(rt, dur, zeros)),
        ss(rt.astype(np.int64)),
        ss(np.where(drv, dur, zeros)),
        ss(drv.astype(np.int64)),
        ss(kern.astype(np.int64)),
        k_ns,
        ss(np.where(mem, np.maximum(fa.nbytes, 0), zeros)),
        ss(np.where(mem, dur, zeros)),
        ss(np.where(sync, dur, zeros)),
        np.divide(ss(np.where(kern, ovl, zeros)), k_ns, out=np.zeros(len(rows)), where=k_ns > 0),
        ss(np.where(outer_comm, np.maximum(fa.nbytes, 0), zeros)),
    ]) if len(rows) else np.zeros((0, len(FEATURES)))
    # families: the forest's (one encoding), renumbered over the families the instances have
    used, family = np.unique(fa.family[rows], return_inverse=True)
    families = [fa.families[i] for i in used.tolist()]
    family = family.reshape(-1).astype(np.int32)
    # nearest instance ancestor, as an index into the instances
    idx_of_row = np.full(n + 1, -1, np.int64)
    idx_of_row[rows] = np.arange(len(rows))
    anc = fa.nearest_ancestor(is_inst)[rows]
    parent = idx_of_row[np.where(anc >= 0, anc, n)]
    return Instances(rows, family, families, step_of_row[rows], X, parent, tuple(layers))


@dataclass
class RunFeatures:
    """Everything the numeric stage reads from one run."""

    path: Path
    forest: Forest
    steps: StepTable
    instances: Instances
    comm_edges: pa.Table | None
    summary: dict[str, Any]


def run_features(run: str | os.PathLike, window_ns: int | None = None,
                 layers: tuple[str, ...] | None = None) -> RunFeatures:
    """Read a reconstructed run and compute its steps and instance features."""
    rd = RunDir(run).require()
    fa = Forest.read(rd.path)
    steps = rd.read_table("steps") if rd.has_table("steps") else None
    st = assign_steps(fa, steps, window_ns, layers)
    inst = instance_features(fa, st.step_of_row, layers)
    edges = rd.read_table("comm_edges") if rd.has_table("comm_edges") else None
    in_step = int((inst.step >= 0).sum())
    summary = {
        "nodes": fa.n,
        "steps": st.n,
        "step_rule": st.rule,
        "instance_layers": list(inst.layers),
        "instances": inst.n,
        "instances_in_steps": in_step,
        "instances_outside_steps": inst.n - in_step,
        "families": len(inst.families),
        "preorder_layout": fa.preorder,
    }
    return RunFeatures(rd.path, fa, st, inst, edges, summary)
