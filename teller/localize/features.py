"""Operator-instance features φ(x) from a call forest (docs/design.md §6), all vectorized.

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

Steps are those ``teller reconstruct`` decided (:func:`teller.reconstruct.steps.decide_steps`:
STEP ranges, profiler steps or fixed windows): :func:`read_steps` builds the :class:`StepTable`
from ``steps.parquet``, the forest's ``step_idx`` column and the rule in ``reconstruct.json``.
A dataset's subtrees carry no ``step_idx``; :func:`teller.forest.step_blocks` gives their steps.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from teller.errors import TellerError
from teller.forest import Forest, family_names
from teller.reconstruct.steps import FALLBACK_LAYERS, INSTANCE_LAYERS
from teller.rundir import LAYER_CODE, RunDir

__all__ = [
    "FEATURES",
    "INSTANCE_LAYERS",
    "FALLBACK_LAYERS",
    "StepTable",
    "Instances",
    "family_names",
    "instance_features",
    "read_steps",
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

    @property
    def n(self) -> int:
        return len(self.step_num)


def read_steps(rd: RunDir, fa: Forest) -> StepTable:
    """The steps ``teller reconstruct`` decided for the run in ``rd`` (``fa``: its forest):
    ``steps.parquet`` gives the steps, the forest's ``step_idx`` column every row's step,
    ``reconstruct.json`` the rule (``steps_rule``) and what it found (``steps_detail``)."""
    fix = f"re-run `teller reconstruct {rd.path}`"
    if "step_idx" not in fa.table.column_names:
        raise TellerError(f"{fa.path or rd.path / 'forest.parquet'}: no step_idx column (written before "
                          f"reconstruction decided the steps); {fix}")
    if not rd.has_table("steps"):
        raise TellerError(f"{rd.path / 'steps.parquet'}: missing; {fix}")
    steps = rd.read_table("steps")
    meta_path = rd.path / "reconstruct.json"
    try:
        meta = json.loads(meta_path.read_text())
        rule, detail = meta["steps_rule"], meta["steps_detail"]
    except (OSError, ValueError, KeyError) as e:
        raise TellerError(f"{meta_path}: no steps_rule/steps_detail ({e}); {fix}") from e
    step_of_row = fa.step_idx
    if step_of_row.size and int(step_of_row.max()) >= steps.num_rows:
        raise TellerError(f"{fa.path}: step_idx {int(step_of_row.max())} beyond the {steps.num_rows} rows of "
                          f"{rd.path / 'steps.parquet'}; {fix}")
    return StepTable(step_of_row, _np(steps, "step_num"), _np(steps, "rank"), _np(steps, "step_id"),
                     _np(steps, "start_ns"), _np(steps, "end_ns"),
                     [x or "" for x in steps.column("name").to_pylist()], _np(steps, "n_requests", np.int32, 0),
                     rule, detail)


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


def run_features(run: str | os.PathLike, layers: tuple[str, ...] | None = None) -> RunFeatures:
    """Read a reconstructed run: its steps (:func:`read_steps`) and instance features."""
    rd = RunDir(run).require()
    fa = Forest.read(rd.path)
    st = read_steps(rd, fa)
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
