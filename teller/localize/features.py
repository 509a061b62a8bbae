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
``comm_ns``           communication time: summed duration of those nodes (a STEP's or a module's
                      collectives together: a slow link shows in their sum when no single call
                      leaves the family's range)
====================  ==========================================================================

The STEP range itself and the OTHER ranges (``OTHER schedule``, ``OTHER update_batch``) are
instances too (:data:`SCORED_LAYERS`; a STEP node's family is ``STEP``, as the labels name it).
They carry the runtime-call mix of their subtree as well (:data:`MIX_FEATURES`: synchronous and
asynchronous memcpy calls, pageable copies, stream/event and device synchronizations,
allocations: counts and time; ``pageable_n`` is NaN where the copies' memory kinds are not known),
and a STEP instance its iteration (:data:`ITER_FEATURES`, from ``iterations.parquet`` through
:func:`read_iterations`; NaN when the run has none) and its admission delay (``iter.admit_delay``,
:func:`admission_delay`: of the requests the step serves first, the longest time one had arrived,
by its first log line in ``log_alignment.parquet``, while iterations of its process ran with
nothing waiting; NaN without aligned logs, a recorded queue length, or a newly admitted request)
and its pace (``iter.per_kernel``, :func:`iteration_pace`: the iteration's time per kernel
launched under its STEP, the median over the step and the :data:`PACE_NEIGHBOURS` nearest
iterations of its process either side). On the other instances those columns are NaN, which the
localizer leaves out of their distances.

Every instance also carries the batch its step served (:attr:`Instances.batch`, the step's
request count): :class:`teller.localize.gmm.GMMLocalizer` normalises the features by it. Steps
that are warm-up (:func:`teller.forest.warmup_steps`, or the ``warmup`` column of
``iterations.parquet``) are marked in :attr:`StepTable.warmup`; references leave them out.

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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.errors import TellerError
from teller.forest import Forest, family_names, warmup_steps
from teller.reconstruct.iterations import ITERATIONS_SCHEMA, read_iterations
from teller.reconstruct.steps import FALLBACK_LAYERS, INSTANCE_LAYERS, SWITCH_FAMILY, without_detail
from teller.rundir import LAYER_CODE, RunDir

__all__ = [
    "FEATURES",
    "OP_FEATURES",
    "MIX_FEATURES",
    "ITER_FEATURES",
    "ITERATIONS_COLUMNS",
    "INSTANCE_LAYERS",
    "SCORED_LAYERS",
    "FALLBACK_LAYERS",
    "StepTable",
    "DETAIL_FEATURES",
    "admission_delay",
    "iteration_pace",
    "request_admission_delay",
    "first_log_lines",
    "pageable_of",
    "Instances",
    "family_names",
    "instance_features",
    "read_iterations",
    "read_steps",
    "run_features",
]

#: Operator features, every instance (the first columns of the feature matrix).
OP_FEATURES = (
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
    "comm_ns",
)
#: Runtime-call mix of a STEP or OTHER instance's subtree (NaN on operator instances).
MIX_FEATURES = (
    "memcpy_sync_n",
    "memcpy_sync_ns",
    "memcpy_async_n",
    "memcpy_async_ns",
    "pageable_n",
    "stream_sync_n",
    "stream_sync_ns",
    "device_sync_n",
    "device_sync_ns",
    "alloc_n",
    "alloc_ns",
)
#: Iteration and batch context of a STEP instance (``iterations.parquet``; NaN when absent or -1).
ITER_FEATURES = (
    "iter.dur",
    "iter.gap",
    "iter.schedule",
    "iter.post",
    "iter.host_busy",
    "iter.gpu_busy",
    "batch.n_requests",
    "batch.prefill",
    "batch.decode",
    "batch.waiting",
    "batch.kv_frac",
    "batch.preempted",
    "iter.admit_delay",
    "iter.per_kernel",
)
#: Iterations of the same process on each side of a step whose time per kernel joins the step's
#: own in ``iter.per_kernel`` (:func:`iteration_pace`)
PACE_NEIGHBOURS = 2
#: Feature names, in column order of the feature matrix.
FEATURES = OP_FEATURES + MIX_FEATURES + ITER_FEATURES
#: What a step recorded without detail (``teller record --detail-every``: no BE ranges, no GPU
#: activity) lacks: every feature but the ranges' durations, COMM sizes and times, the iteration's time,
#: gap, schedule and post times and the batch context. NaN on its instances.
DETAIL_FEATURES = tuple(f for f in FEATURES if f not in (
    "dur_ns", "comm_bytes", "comm_ns", "iter.dur", "iter.gap", "iter.schedule", "iter.post", "batch.n_requests",
    "batch.prefill", "batch.decode", "batch.waiting", "batch.kv_frac", "batch.preempted", "iter.admit_delay"))

#: The iteration's times, which a collector switch between detail windows lengthens: NaN on the
#: STEP instance of the iteration that holds one (``OTHER detail_switch``)
SWITCH_FEATURES = ("iter.dur", "iter.gap", "iter.schedule", "iter.post", "iter.host_busy", "iter.per_kernel")
#: Layers whose nodes are scored as instances: operators, OTHER ranges and the STEP range.
SCORED_LAYERS = (*INSTANCE_LAYERS, "OTHER", "STEP")
#: ``iterations.parquet``'s columns and types (:data:`teller.reconstruct.iterations.ITERATIONS_SCHEMA`).
ITERATIONS_COLUMNS = {fld.name: fld.type for fld in ITERATIONS_SCHEMA}
#: ITER_FEATURES from iterations.parquet columns (``batch.kv_frac`` = kv_used / kv_total)
_ITER_SOURCE = {"iter.dur": "dur_ns", "iter.gap": "gap_ns", "iter.schedule": "schedule_ns", "iter.post": "post_ns",
                "iter.host_busy": "host_busy_ns", "iter.gpu_busy": "gpu_busy_ns", "batch.n_requests": "n_requests",
                "batch.prefill": "prefill", "batch.decode": "decode", "batch.waiting": "waiting",
                "batch.preempted": "preempted"}
#: runtime/driver call names of each mix class
_MIX_CALLS = {
    "memcpy_sync": r"^(cuda|cu)Memcpy(?!.*Async)",
    "memcpy_async": r"^(cuda|cu)Memcpy.*Async",
    "stream_sync": r"^(cuda|cu)(StreamSynchronize|EventSynchronize)",
    "device_sync": r"^(cudaDeviceSynchronize|cuCtxSynchronize|cudaThreadSynchronize)",
    "alloc": r"^(cuda|cu)(Malloc|Free|MemAlloc|MemFree|HostAlloc|MemHostAlloc|MallocHost|FreeHost|MemFreeHost)",
}



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
    warmup: np.ndarray | None = None  # per step: warm-up (left out of references)
    iterations: np.ndarray | None = None  # (steps, len(ITER_FEATURES)) float64, NaN unknown; None: no table

    @property
    def n(self) -> int:
        return len(self.step_num)

    def batch(self) -> np.ndarray:
        """Requests each step served (float; NaN where unknown)."""
        b = self.n_requests.astype(np.float64)
        return np.where(b > 0, b, np.nan)


def iteration_matrix(t: pa.Table) -> np.ndarray:
    """:data:`ITER_FEATURES` of every row of an ``iterations.parquet`` table (n × 14, float64;
    -1, the contract's "not recorded", becomes NaN)."""
    out = np.full((t.num_rows, len(ITER_FEATURES)), np.nan)
    for j, name in enumerate(ITER_FEATURES):
        if name == "batch.kv_frac":
            used, total = _np(t, "kv_used").astype(np.float64), _np(t, "kv_total").astype(np.float64)
            ok = (used >= 0) & (total > 0)
            out[ok, j] = used[ok] / total[ok]
            continue
        if name not in _ITER_SOURCE:
            continue  # derived from other tables (iter.admit_delay: :func:`admission_delay`; iter.per_kernel:
            # :func:`iteration_pace`, from the forest)
        v = _np(t, _ITER_SOURCE[name]).astype(np.float64)
        out[:, j] = np.where(v >= 0, v, np.nan)
    return out


#: an idle stretch of the engine after a request's arrival counts in ``iter.admit_delay`` beyond
#: this (:func:`admission_delay`): a woken engine starts its next iteration well within it
IDLE_PICKUP_NS = 5_000_000


def admission_delay(start: np.ndarray, end: np.ndarray, pid: np.ndarray, waiting: np.ndarray,
                    req_step: np.ndarray, req_arrival: np.ndarray, idle_gaps: bool = True) -> np.ndarray:
    """``iter.admit_delay`` of every step: the longest time a request first served by the step
    had arrived without being queued, i.e. the summed duration of the iterations of the step's
    process that ran entirely between the request's arrival and the step's start while no request
    was waiting. A request that arrives while the engine runs is taken by the next iteration's
    scheduling, or counted as waiting until capacity frees up; iterations that run with an empty
    queue after it arrived mean it never reached the queue (a slow admission path).

    The engine's idle stretches count the same way: time between two of the process's iterations
    (no iteration ran: its idle ranges) that lies after the request's arrival and before the step,
    each stretch when it lasts more than :data:`IDLE_PICKUP_NS` after the arrival. An engine that
    was idle when a request arrived starts its next iteration within a fraction of a millisecond
    (0.001–0.17 ms for the arrivals inside idle stretches of the CPU test campaign), while a held
    request leaves it idle for the whole hold when nothing else runs; an idle stretch before the
    process's first iteration (start-up) never counts. ``idle_gaps`` False leaves the stretches
    out: for iterations that are not all of the process's (a dataset keeps the sampled steps'
    only), the time between two of them is not idle time.

    ``start``, ``end``, ``pid``, ``waiting``: per step, its iteration (τ ns; waiting −1 = not
    recorded); ``req_step``: per request (and process), the index of its first step (−1 none);
    ``req_arrival``: its arrival on τ (−1 unknown). NaN for steps that admit no request with a
    known arrival, and where the queue length is not recorded."""
    n = len(start)
    out = np.full(n, np.nan)
    ok = (req_step >= 0) & (req_arrival >= 0)
    if not n or not ok.any() or not (waiting >= 0).any():
        return out
    rs, ra = req_step[ok].astype(np.int64), req_arrival[ok].astype(np.int64)
    delay = np.zeros(len(rs))
    for p in np.unique(pid[rs]).tolist():  # processes (ranks): a handful
        steps = np.flatnonzero(pid == p)
        steps = steps[np.argsort(start[steps], kind="stable")]
        s, e = start[steps], end[steps]
        idle = np.where(waiting[steps] == 0, e - s, 0).astype(np.float64)
        cum = np.concatenate([[0.0], np.cumsum(idle)])
        r = np.flatnonzero(pid[rs] == p)
        i0 = np.searchsorted(s, ra[r], side="left")  # first iteration starting at or after the arrival
        i1 = np.searchsorted(e, start[rs[r]], side="right")  # iterations ending by the step's start
        delay[r] = np.where(i1 > i0, cum[np.maximum(i1, i0)] - cum[i0], 0.0)
        if not idle_gaps:
            continue
        # idle stretches: the one before iteration k is (e[k-1], s[k]); those wholly after the
        # arrival (k > i0) up to the step's own, and the part after the arrival of the one it fell in
        gap = np.r_[0.0, np.maximum(s[1:] - e[:-1], 0)].astype(np.float64)
        cgap = np.concatenate([[0.0], np.cumsum(np.where(gap > IDLE_PICKUP_NS, gap, 0.0))])
        k1 = np.searchsorted(s, start[rs[r]], side="left")  # the step's own iteration
        whole = np.where(k1 > i0, cgap[np.minimum(np.maximum(k1, i0) + 1, len(s))] - cgap[np.minimum(i0 + 1, len(s))], 0.0)
        i0c = np.minimum(i0, len(s) - 1)
        part = np.where((i0 >= 1) & (i0 <= k1) & (i0 < len(s)),
                        s[i0c] - np.maximum(e[np.maximum(i0c - 1, 0)], ra[r]), 0).astype(np.float64)
        delay[r] += whole + np.where(part > IDLE_PICKUP_NS, part, 0.0)
    known = waiting[rs] >= 0
    np.fmax.at(out, rs[known], delay[known])
    return out


def iteration_pace(dur: np.ndarray, k_n: np.ndarray, pid: np.ndarray, start: np.ndarray,
                   neighbours: int = PACE_NEIGHBOURS) -> np.ndarray:
    """``iter.per_kernel`` of every step: its iteration time per kernel launched (``dur`` /
    ``k_n``), the median over the step and the ``neighbours`` nearest steps of the same process
    (``pid``) on either side in ``start`` order (fewer at a process's first and last steps; steps
    without a time or a kernel count are skipped).

    An engine that launches its kernels from the host spends host time per kernel: a deeper model
    or a prefill launches more of them, and the time per kernel stays put. Contention for the host
    (other processes on its cores, a thread holding the GIL) slows every launch of every iteration
    while it lasts: a 2-layer tensor-parallel iteration then takes 2-3 times the reference's time
    per kernel, where the iteration time alone sits under the reference's 4-layer iterations. One
    slow iteration among normal ones (a descheduled thread) is a single value the median passes
    over; contention that lasts moves the whole neighbourhood. In a dataset, which keeps a sample
    of each run's steps, the neighbours are the nearest kept steps."""
    n = len(dur)
    out = np.full(n, np.nan)
    with np.errstate(all="ignore"):
        v = np.where((k_n > 0) & np.isfinite(dur), dur / np.where(k_n > 0, k_n, 1.0), np.nan)
    if not n:
        return out
    order = np.lexsort((start, pid))
    p = pid[order]
    bounds = np.flatnonzero(np.r_[True, p[1:] != p[:-1], True])
    w = 2 * neighbours + 1
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):  # processes: a handful
        x = np.concatenate([np.full(neighbours, np.nan), v[order[lo:hi]], np.full(neighbours, np.nan)])
        win = np.lib.stride_tricks.sliding_window_view(x, w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # windows without a value
            out[order[lo:hi]] = np.nanmedian(win, axis=1)
    return out


def request_admission_delay(it_step_id: np.ndarray, start: np.ndarray, end: np.ndarray, pid: np.ndarray,
                            waiting: np.ndarray, row_request: pa.Array, row_step_id: np.ndarray,
                            arrival_request: pa.Array, arrival_ns: np.ndarray, idle_gaps: bool = True) -> np.ndarray:
    """:func:`admission_delay` from the tables that hold it: the iterations (``it_step_id``,
    ``start``, ``end``, ``pid``, ``waiting``: one row per step), the requests' rows (one per
    request and step it ran in: ``row_request``, ``row_step_id``) and each request's arrival
    (``arrival_request``, ``arrival_ns``: its first log line on τ). A request's first step is the
    earliest of its rows on each process. ``idle_gaps``: as :func:`admission_delay`."""
    sorder = np.argsort(it_step_id, kind="stable")
    pos = np.clip(np.searchsorted(it_step_id[sorder], row_step_id), 0, max(len(it_step_id) - 1, 0))
    sidx = np.where(it_step_id[sorder][pos] == row_step_id, sorder[pos], -1) if len(it_step_id) else \
        np.full(len(row_step_id), -1, np.int64)
    names = arrival_request.cast(pa.string())
    names = names.combine_chunks() if isinstance(names, pa.ChunkedArray) else names
    rcode = pc.index_in(row_request.cast(pa.string()), value_set=names).fill_null(-1)
    rcode = rcode.to_numpy(zero_copy_only=False).astype(np.int64)
    keep = (sidx >= 0) & (rcode >= 0)
    rcode, sidx = rcode[keep], sidx[keep]
    o = np.lexsort((start[sidx], pid[sidx], rcode))
    rcode, sidx = rcode[o], sidx[o]
    first = np.r_[True, (rcode[1:] != rcode[:-1]) | (pid[sidx][1:] != pid[sidx][:-1])] if len(o) else np.zeros(0, bool)
    return admission_delay(start, end, pid, waiting, sidx[first], np.asarray(arrival_ns, np.int64)[rcode[first]],
                           idle_gaps=idle_gaps)


def first_log_lines(lines: pa.Table, by: list[str]) -> pa.Table:
    """The earliest τ of the lines naming each request (``lines``: ``request_id``, ``ts_ns`` and
    the ``by`` columns; lines without a request or a time left out): columns ``by`` and
    ``ts_ns_min``."""
    lines = lines.filter(pc.and_(pc.is_valid(lines.column("request_id")), pc.greater_equal(lines.column("ts_ns"), 0)))
    return lines.group_by(by).aggregate([("ts_ns", "min")])


def _run_admission_delay(rd: RunDir, it: pa.Table) -> np.ndarray | None:
    """:func:`request_admission_delay` of a run directory: arrivals from
    ``log_alignment.parquet`` (the line's ``request_id``), request rows from ``requests.parquet``.
    None when the run has no aligned logs or no request table."""
    if not (rd.has_table("requests") and rd.has_table("log_alignment")):
        return None
    try:
        rq = rd.read_table("requests", columns=["request_id", "step_id"])
        lg = rd.read_table("log_alignment", columns=["request_id", "ts_ns"])
    except (TellerError, OSError, pa.ArrowInvalid, KeyError):
        return None
    first = first_log_lines(lg, ["request_id"])
    if not first.num_rows or not rq.num_rows:
        return None
    return request_admission_delay(_np(it, "step_id"), _np(it, "start_ns"), _np(it, "end_ns"), _np(it, "pid"),
                                   _np(it, "waiting"), rq.column("request_id"),
                                   rq.column("step_id").to_numpy(zero_copy_only=False).astype(np.int64),
                                   first.column("request_id"), first.column("ts_ns_min").to_numpy())


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
    it = read_iterations(rd, steps)
    if it is not None:
        warm = it.column("warmup").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
        iters = iteration_matrix(it)
        delay = _run_admission_delay(rd, it)
        if delay is not None:
            iters[:, ITER_FEATURES.index("iter.admit_delay")] = delay
    else:  # the same rule the reconstruction writes into iterations.parquet
        warm, iters = warmup_steps(steps), None
    return StepTable(step_of_row, _np(steps, "step_num"), _np(steps, "rank"), _np(steps, "step_id"),
                     _np(steps, "start_ns"), _np(steps, "end_ns"),
                     [x or "" for x in steps.column("name").to_pylist()], _np(steps, "n_requests", np.int32, 0),
                     rule, detail, warm, iters)


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
    batch: np.ndarray | None = None  # requests of the instance's step (NaN unknown); None: not known at all

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
                         remap[np.where(par >= 0, par, self.n)], self.layers,
                         None if self.batch is None else self.batch[idx])


class _SubtreeSums:
    """Subtree sums (:meth:`teller.forest.Forest.subtree_sums`) of masked values for the instance
    rows: with the depth-first layout, from the positions of the masked rows alone (the
    instances' subtree bounds searched once per mask, one cumulative sum per value over the
    masked rows: no forest-sized temporary per feature); else through ``subtree_sums``. Integer
    sums, so both give the same numbers."""

    def __init__(self, fa: Forest, rows: np.ndarray):
        self.fa, self.rows = fa, rows
        self.end = rows + fa.size[rows] if fa.preorder else None

    def __call__(self, mask: np.ndarray, values: tuple[np.ndarray | None, ...]) -> list[np.ndarray]:
        """Per value (None: the count of masked rows) its sums over each instance's subtree, float64."""
        fa = self.fa
        if self.end is None:
            zeros = np.zeros(fa.n, np.int64)
            return [fa.subtree_sums(mask.astype(np.int64) if v is None else np.where(mask, v, zeros), self.rows)
                    .astype(np.float64) for v in values]
        pos = np.flatnonzero(mask)
        lo, hi = np.searchsorted(pos, self.rows), np.searchsorted(pos, self.end)
        out = []
        for v in values:
            if v is None:
                out.append((hi - lo).astype(np.float64))
                continue
            c = np.zeros(len(pos) + 1, np.int64)
            np.cumsum(np.asarray(v, np.int64)[pos], out=c[1:])
            out.append((c[hi] - c[lo]).astype(np.float64))
        return out


def _name_class(fa: Forest, pattern: str) -> np.ndarray:
    """Rows whose name matches ``pattern`` (a regex, tested once per distinct name)."""
    import re

    rx = re.compile(pattern)
    hit = np.array([bool(rx.search(x or "")) for x in fa.names] or [False])
    return hit[fa.name_codes] if fa.n else np.zeros(0, bool)


def instance_features(fa: Forest, step_of_row: np.ndarray | None = None,
                      layers: tuple[str, ...] | None = None, step_batch: np.ndarray | None = None,
                      step_iter: np.ndarray | None = None, pageable: np.ndarray | None = None,
                      step_detail: np.ndarray | None = None) -> Instances:
    """Instances of ``layers`` (default :data:`SCORED_LAYERS`, else RT/DRV when the run has no
    FE/BE/COMM node) and φ(x) (:data:`FEATURES`).

    ``step_batch`` (per step: requests served) gives :attr:`Instances.batch`; ``step_iter``
    (steps × :data:`ITER_FEATURES`) the iteration columns of STEP instances; ``pageable`` (per
    row: a copy from or to pageable host memory) the ``pageable_n`` column (NaN without it);
    ``step_detail`` (per step: recorded in detail, not
    :func:`teller.reconstruct.steps.without_detail`) leaves the
    features a step recorded without detail lacks (:data:`DETAIL_FEATURES`) NaN on its
    instances."""
    n = fa.n
    if layers is None:
        layers = SCORED_LAYERS
        if not np.isin(fa.layer, [LAYER_CODE[x] for x in INSTANCE_LAYERS]).any():
            layers = FALLBACK_LAYERS
    codes = [LAYER_CODE[x] for x in layers]
    is_inst = np.isin(fa.layer, codes)
    if set(layers) <= {"RT", "DRV"}:
        is_inst &= ~fa.is_gpu
    fams = fa.families
    switch = fa.family == fams.index(SWITCH_FAMILY) if SWITCH_FAMILY in fams else np.zeros(n, bool)
    is_inst &= ~switch  # TELLER's own work between detail windows is no operator of the engine
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
    sums = _SubtreeSums(fa, rows)
    X = np.full((len(rows), len(FEATURES)), np.nan)
    if len(rows):
        # each column written in place (no (instances × 13) block assembled first)
        col = {name: j for j, name in enumerate(OP_FEATURES)}
        X[:, col["dur_ns"]] = dur[rows]
        X[:, col["self_ns"]] = self_ns[rows]
        nbytes = np.maximum(fa.nbytes, 0)
        for mask, names, values in ((rt, ("rt_ns", "rt_n"), (dur, None)), (drv, ("drv_ns", "drv_n"), (dur, None)),
                                    (kern, ("k_n", "k_ns", "overlap"), (None, dur, ovl)),
                                    (mem, ("mem_bytes", "mem_ns"), (nbytes, dur)), (sync, ("sync_ns",), (dur,)),
                                    (outer_comm, ("comm_bytes", "comm_ns"), (nbytes, dur))):
            for name, v in zip(names, sums(mask, values), strict=True):
                X[:, col[name]] = v
        k_ns = X[:, col["k_ns"]]
        ov = X[:, col["overlap"]]
        X[:, col["overlap"]] = np.divide(ov, k_ns, out=np.zeros(len(rows)), where=k_ns > 0)
        lay = fa.layer[rows]
        whole = np.isin(lay, [LAYER_CODE["STEP"], LAYER_CODE["OTHER"]])  # STEP and OTHER instances
        if whole.any():
            # runtime-call mix: runtime calls, and driver calls not made by a recorded runtime call
            call = rt | (drv & (fa.nearest_ancestor(rt) < 0))
            wrows = np.flatnonzero(whole)
            cols: list[np.ndarray] = []
            for cls in ("memcpy_sync", "memcpy_async", "pageable", "stream_sync", "device_sync", "alloc"):
                # (few STEP/OTHER rows, sparse calls: sums from the calls' positions)
                if cls == "pageable":
                    cols.append(fa.subtree_sums_sparse(pageable & mem, None, rows[wrows]).astype(np.float64)
                                if pageable is not None else np.full(len(wrows), np.nan))
                    continue
                m = call & _name_class(fa, _MIX_CALLS[cls])
                cols.append(fa.subtree_sums_sparse(m, None, rows[wrows]).astype(np.float64))
                cols.append(fa.subtree_sums_sparse(m, dur, rows[wrows]).astype(np.float64))
            o = len(OP_FEATURES)
            X[wrows, o:o + len(MIX_FEATURES)] = np.column_stack(cols)
        st = step_of_row[rows]
        bare = np.zeros(len(rows), bool)  # instances of steps recorded without detail
        if step_detail is not None and not np.all(step_detail):
            bare = (st >= 0) & ~np.asarray(step_detail, bool)[np.maximum(st, 0)]
        if step_iter is not None:
            srows = np.flatnonzero((lay == LAYER_CODE["STEP"]) & (st >= 0))
            o = len(OP_FEATURES) + len(MIX_FEATURES)
            X[srows, o:] = step_iter[st[srows]]
            # the pace over the detailed steps only (a step without detail counts no kernels)
            k_n = np.where(bare[srows], np.nan, X[srows, OP_FEATURES.index("k_n")])
            X[srows, FEATURES.index("iter.per_kernel")] = iteration_pace(
                X[srows, FEATURES.index("iter.dur")], k_n, fa.pid[rows[srows]], fa.start[rows[srows]])
        if bare.any():
            X[np.ix_(np.flatnonzero(bare), [FEATURES.index(f) for f in DETAIL_FEATURES])] = np.nan
        if switch.any():  # a detail switch's time is TELLER's: out of the ranges and iterations holding it
            holds = np.flatnonzero(fa.subtree_counts(switch)[rows] > 0)
            X[np.ix_(holds, [FEATURES.index("dur_ns"), FEATURES.index("self_ns")])] = np.nan
            sw_steps = np.unique(step_of_row[switch & (step_of_row >= 0)])
            srow = np.flatnonzero((lay == LAYER_CODE["STEP"]) & np.isin(st, sw_steps))
            X[np.ix_(srow, [FEATURES.index(f) for f in SWITCH_FEATURES])] = np.nan
    # families: the forest's (one encoding), renumbered over the families the instances have;
    # every STEP node is one family, ``STEP``, as the labels name it
    fam_rows = fa.family[rows]
    used, family = np.unique(fam_rows, return_inverse=True)
    families = [fa.families[i] for i in used.tolist()]
    family = family.reshape(-1).astype(np.int32)
    is_step_inst = fa.layer[rows] == LAYER_CODE["STEP"]
    if is_step_inst.any():
        named = ["STEP" if f.startswith("STEP") else f for f in families]
        families, remap = np.unique(np.asarray(named, dtype=object).astype(str), return_inverse=True)
        families = [str(f) for f in families]
        family = remap.reshape(-1).astype(np.int32)[family]
    # nearest instance ancestor, as an index into the instances
    idx_of_row = np.full(n + 1, -1, np.int64)
    idx_of_row[rows] = np.arange(len(rows))
    anc = fa.nearest_ancestor(is_inst)[rows]
    parent = idx_of_row[np.where(anc >= 0, anc, n)]
    step = step_of_row[rows]
    batch = None
    if step_batch is not None:
        batch = np.full(len(rows), np.nan)
        ok = step >= 0
        batch[ok] = np.asarray(step_batch, np.float64)[step[ok]]
    return Instances(rows, family, families, step, X, parent, tuple(layers), batch)


def pageable_rows(run: str | os.PathLike, fa: Forest) -> np.ndarray | None:
    """:func:`pageable_of` the run's forest, from its ``args`` column; None when the forest keeps
    no ``args``."""
    import pyarrow.parquet as pq

    p = Path(run) / "forest.parquet"
    try:
        if "args" not in pq.ParquetFile(p).schema_arrow.names:
            return None
        args = pq.read_table(p, columns=["args"], read_dictionary=["args"]).column("args")
    except (OSError, pa.ArrowInvalid):
        return None
    return pageable_of(fa, args)


def pageable_of(fa: Forest, args: pa.Array | pa.ChunkedArray) -> np.ndarray | None:
    """Per row of ``fa`` (``args``: its args column): a copy whose source or destination is
    pageable host memory (CUPTI's memcpy ``src_kind``/``dst_kind``), or None when no copy has
    memory kinds."""
    if len(args) != fa.n:
        return None
    mem = fa.kind_or_layer("MEMCPY", "MEM")
    if not mem.any():
        return None
    from teller.rundir import dict_codes

    codes, values = dict_codes(pa.table({"args": args}), "args")
    vals = [v or "" for v in values]
    has = np.array([("src_kind" in v) for v in vals] or [False])[codes]
    if not (has & mem).any():
        return None
    pg = np.array([("Pageable" in v) for v in vals] or [False])[codes]
    return pg & mem


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
    pg = pageable_rows(rd.path, fa)
    detail = ~without_detail(st.names)
    inst = instance_features(fa, st.step_of_row, layers, step_batch=st.batch(), step_iter=st.iterations, pageable=pg,
                             step_detail=detail)
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
        "warmup_steps": int(st.warmup.sum()) if st.warmup is not None else 0,
        "steps_without_detail": int((~detail).sum()),
        "iterations": st.iterations is not None,
        "pageable_kinds": pg is not None,
    }
    return RunFeatures(rd.path, fa, st, inst, edges, summary)
