"""Engine iterations and GAP nodes (docs/design.md §5.6).

An *iteration* belongs to one step. Under the STEP-range rule, for a STEP whose message is our
engine hook's (``STEP id=...``) and that is a root of its thread, the iteration is the run of the
thread's root ranges that serve it:

- the thread's roots are split into *segments* by ``OTHER idle`` ranges (idle time belongs to
  no iteration);
- within a segment, the iteration of STEP k starts at the first root after STEP k-1 ended
  (normally ``OTHER schedule``; the STEP itself when there is none). The first STEP of a segment
  starts at the contiguous run of OTHER roots right before it (start-up work before that, such as
  model loading and CUDA context creation, belongs to no iteration);
- it ends where the next iteration starts; the last one of a segment ends at the start of the
  idle range that closes the segment or, at the thread's end, at the end of its last root.

Everything else (foreign STEP patterns, profiler steps, fixed windows, nested STEPs) gets rule
``step only``: the iteration is the step.

Untraced stretches of an iteration (time covered by no root range of its thread) of at least
:data:`GAP_MIN_NS` become forest roots of layer ``GAP`` named ``untraced`` (family ``GAP untraced``); shorter ones
count in ``gap_ns`` only. The OTHER root ranges of an iteration (schedule, update; never idle)
and its GAP rows carry the iteration's ``step_idx``, with their subtrees; STEP subtrees keep
theirs; other roots inside an iteration (a runtime call made outside any range) count in its
``host_busy_ns`` but keep the step they had.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.errors import TellerError
from teller.rundir import LAYER_CODE, RunDir

#: Shortest untraced stretch of an iteration that becomes a GAP node.
GAP_MIN_NS = 20_000
GAP_NAME = "untraced"
IDLE_NAME = "idle"
#: Batch-context fields of the STEP message (``key=<int>``), -1 when absent.
BATCH_FIELDS = ("prefill", "decode", "waiting", "kv_used", "kv_total", "preempted")
ITERATION_RULES = ("engine ranges", "step only")

ITERATIONS_SCHEMA = pa.schema(
    [
        ("step_id", pa.int64()),
        ("step_idx", pa.int64()),
        ("pid", pa.int64()),
        ("tid", pa.int64()),
        ("rank", pa.int32()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("dur_ns", pa.int64()),
        ("step_ns", pa.int64()),
        ("schedule_ns", pa.int64()),
        ("post_ns", pa.int64()),
        ("gap_ns", pa.int64()),
        ("host_busy_ns", pa.int64()),
        ("gpu_busy_ns", pa.int64()),
        ("n_requests", pa.int32()),
        *[(f, pa.int64()) for f in BATCH_FIELDS],
        ("warmup", pa.bool_()),
        ("rule", pa.string()),
    ]
)

_OTHER, _STEP, _GAP = LAYER_CODE["OTHER"], LAYER_CODE["STEP"], LAYER_CODE["GAP"]


def batch_fields(names: pa.Array) -> dict[str, np.ndarray]:
    """The batch-context fields of STEP messages (``... prefill=12 decode=3 ...``): one int64
    array per field of :data:`BATCH_FIELDS`, -1 where the message does not carry it."""
    names = pc.fill_null(names.cast(pa.string()), "")
    out = {}
    for key in BATCH_FIELDS:
        if not len(names):
            out[key] = np.zeros(0, np.int64)
            continue
        st = pc.extract_regex(names, rf"(?:^|\s){key}=(?P<v>-?\d{{1,18}})(?:\s|$)")
        text = pc.if_else(st.is_valid(), st.field("v"), pa.scalar("-1", pa.string()))  # no match: a null struct
        out[key] = np.asarray(pc.cast(text, pa.int64()).to_numpy(zero_copy_only=False), np.int64)
    return out



def read_iterations(rd: RunDir, steps: pa.Table | None = None) -> pa.Table | None:
    """``iterations.parquet`` of the run in ``rd`` checked against :data:`ITERATIONS_SCHEMA`'s
    columns (and, given ``steps``, one row per ``steps.parquet`` row in the same order), or None
    when the run has none (reconstructed before iterations existed, or by another tool)."""
    if not rd.has_table("iterations"):
        return None
    path = rd.path / "iterations.parquet"
    fix = f"re-run `teller reconstruct {rd.path}`"
    try:
        t = rd.read_table("iterations")
    except Exception as e:  # unreadable Parquet: name the file
        raise TellerError(f"{path}: unreadable ({e}); {fix}") from e
    missing = [c for c in ITERATIONS_SCHEMA.names if c not in t.column_names]
    if missing:
        raise TellerError(f"{path}: lacks columns {missing}; {fix}")
    if steps is not None:
        if t.num_rows != steps.num_rows:
            raise TellerError(f"{path}: {t.num_rows} rows, steps.parquet {steps.num_rows} (one iteration per step "
                              f"expected); {fix}")
        a, b = (np.asarray(pc.fill_null(x.column("step_id"), -1), np.int64) for x in (t, steps))
        bad = np.flatnonzero(a != b)
        if len(bad):
            raise TellerError(f"{path}: row {int(bad[0])} has step_id {int(a[bad[0]])} where steps.parquet has "
                              f"{int(b[bad[0]])} (rows must follow steps.parquet); {fix}")
    return t

@dataclass
class Roots:
    """The host roots of the forest, grouped by thread lane and in start order within each."""

    row: np.ndarray  # forest row of each root
    lane: np.ndarray
    start: np.ndarray
    end: np.ndarray
    layer: np.ndarray
    idle: np.ndarray  # an ``OTHER idle`` range


@dataclass
class Iterations:
    """What the iteration pass decided: the per-step columns (:data:`ITERATIONS_SCHEMA` minus
    gpu_busy, batch fields and warm-up), the GAP stretches to insert (after forest row
    ``gap_after``, on ``gap_lane``, ``[gap_start, gap_end)``, for step ``gap_step``), and the root
    blocks ``[first, stop)`` that join their iteration's step (``join_step``)."""

    cols: dict[str, np.ndarray]
    gap_after: np.ndarray
    gap_lane: np.ndarray
    gap_start: np.ndarray
    gap_end: np.ndarray
    gap_step: np.ndarray
    join_first: np.ndarray
    join_step: np.ndarray


def engine_iterations(roots: Roots, step_row: np.ndarray, engine: np.ndarray, step_start: np.ndarray,
                      step_end: np.ndarray, gap_min_ns: int = GAP_MIN_NS) -> Iterations:
    """Iterations of the steps whose STEP rows are ``step_row`` (ascending forest rows, one per
    step in step order; ``engine``: the step may have an engine-range iteration, i.e. its STEP
    is a root with our hook's message). Loops over thread lanes only."""
    n = len(step_row)
    cols = {
        "start_ns": step_start.astype(np.int64).copy(),
        "end_ns": step_end.astype(np.int64).copy(),
        "schedule_ns": np.zeros(n, np.int64),
        "post_ns": np.zeros(n, np.int64),
        "host_busy_ns": (step_end - step_start).astype(np.int64),
        "engine": np.zeros(n, bool),
    }
    gaps: list[tuple[np.ndarray, ...]] = []
    joins: list[tuple[np.ndarray, np.ndarray]] = []
    # which root is which step (roots are forest rows; steps too)
    r_is_step = np.full(len(roots.row), -1, np.int64)
    if n and len(roots.row):
        j = np.searchsorted(roots.row, step_row)
        ok = engine & (j < len(roots.row)) & (roots.row[np.minimum(j, len(roots.row) - 1)] == step_row)
        r_is_step[j[ok]] = np.flatnonzero(ok)
    bounds = np.flatnonzero(np.r_[True, roots.lane[1:] != roots.lane[:-1]]) if len(roots.row) else np.zeros(0, np.int64)
    bounds = np.r_[bounds, len(roots.row)]
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        k_of = r_is_step[a:b]
        if not (k_of >= 0).any():
            continue
        _lane_iterations(roots, a, b, k_of, cols, gaps, joins, gap_min_ns)
    cols["dur_ns"] = cols["end_ns"] - cols["start_ns"]
    cols["gap_ns"] = np.where(cols["engine"], cols["dur_ns"] - cols["host_busy_ns"], 0)
    cat = (lambda i: np.concatenate([g[i] for g in gaps]).astype(np.int64)) if gaps else (lambda i: np.zeros(0, np.int64))
    jcat = (lambda i: np.concatenate([g[i] for g in joins]).astype(np.int64)) if joins else (lambda i: np.zeros(0, np.int64))
    return Iterations(cols, cat(0), cat(1), cat(2), cat(3), cat(4), jcat(0), jcat(1))


def _lane_iterations(roots: Roots, a: int, b: int, k_of: np.ndarray, cols: dict, gaps: list, joins: list, gap_min_ns: int) -> None:
    """One thread lane: roots ``[a, b)`` of ``roots``; ``k_of``: the step of each root that is an
    engine STEP (-1 else)."""
    m = b - a
    idx = np.arange(m)
    idle = roots.idle[a:b]
    start, end, layer = roots.start[a:b], roots.end[a:b], roots.layer[a:b]
    seg = np.cumsum(idle)  # idle roots close a segment (they belong to no iteration)
    sp = np.flatnonzero(k_of >= 0)  # positions of the engine STEPs
    ks = k_of[sp]
    sseg = seg[sp]
    ns = len(sp)
    same_prev = np.r_[False, sseg[1:] == sseg[:-1]]
    same_next = np.r_[sseg[:-1] == sseg[1:], False]
    # first root of each iteration: after the previous STEP of the segment, else the run of
    # plain OTHER roots right before the STEP
    plain_other = (layer == _OTHER) & ~idle & (k_of < 0)
    last_bad = np.maximum.accumulate(np.where(plain_other, -1, idx))
    lo = np.where(same_prev, np.r_[0, sp[:-1]] + 1, np.where(sp > 0, last_bad[np.maximum(sp - 1, 0)] + 1, 0))
    # last root: before the next iteration's first, else before the idle closing the segment
    nxt_idle = np.minimum.accumulate(np.where(idle, idx, m)[::-1])[::-1]  # first idle at or after p
    hi = np.where(same_next, np.r_[lo[1:], 0] - 1, nxt_idle[sp] - 1)
    t0 = start[lo]
    t1 = np.where(same_next, np.r_[t0[1:], 0], np.where(nxt_idle[sp] < m, start[np.minimum(nxt_idle[sp], m - 1)], end[hi]))
    # owner of every root (-1 none): ranges [lo, hi] are disjoint and ordered
    mark = np.zeros(m + 1, np.int64)
    np.add.at(mark, lo, np.arange(ns) + 1)
    np.subtract.at(mark, hi + 1, np.arange(ns) + 1)
    owner = np.cumsum(mark[:m]) - 1  # index into sp, -1 none
    own = owner >= 0
    o = np.where(own, owner, 0)
    dur = end - start
    before = own & (idx < sp[o]) & (layer == _OTHER)
    after = own & (idx > sp[o]) & (layer == _OTHER)
    sched = np.bincount(o[before], dur[before], minlength=ns).astype(np.int64)
    post = np.bincount(o[after], dur[after], minlength=ns).astype(np.int64)
    busy = np.bincount(o[own], dur[own], minlength=ns).astype(np.int64)
    cols["start_ns"][ks], cols["end_ns"][ks] = t0, t1
    cols["schedule_ns"][ks], cols["post_ns"][ks], cols["host_busy_ns"][ks] = sched, post, busy
    cols["engine"][ks] = True
    # untraced stretch after every owned root: to the next root of the iteration, or its end
    is_last = own & (idx == hi[o])
    nxt = np.where(is_last, t1[o], np.r_[start[1:], 0])
    g = np.flatnonzero(own & (nxt - end >= gap_min_ns))
    if g.size:
        gaps.append((roots.row[a + g], roots.lane[a + g], end[g], nxt[g], ks[o[g]]))
    j = np.flatnonzero(own & (k_of < 0) & (layer == _OTHER))
    if j.size:
        joins.append((roots.row[a + j], ks[o[j]]))


def gpu_busy(step_idx: np.ndarray, start: np.ndarray, end: np.ndarray, n_steps: int) -> np.ndarray:
    """Per step, the length of the union of the GPU intervals ``[start, end)`` of its rows
    (``step_idx`` -1: in no step)."""
    keep = step_idx >= 0
    s, e, k = start[keep].astype(np.int64), end[keep].astype(np.int64), step_idx[keep].astype(np.int64)
    out = np.zeros(n_steps, np.int64)
    if not len(k):
        return out
    order = np.lexsort((s, k))
    s, e, k = s[order], e[order], k[order]
    first = np.r_[True, k[1:] != k[:-1]]
    # running max of the ends within each step: offset every group above the previous ones
    rel = e - s.min()
    span = int(max(rel.max(), 0)) + 1
    grp = np.cumsum(first) - 1
    if span * (int(grp[-1]) + 1) < 2**62:
        reach = np.maximum.accumulate(rel + grp * span) - grp * span
    else:  # very long runs with very many steps: per group
        reach = np.empty_like(rel)
        for a, b in zip(np.flatnonzero(first).tolist(), np.r_[np.flatnonzero(first)[1:], len(k)].tolist(), strict=True):
            np.maximum.accumulate(rel[a:b], out=reach[a:b])
    prev = np.r_[np.iinfo(np.int64).min, reach[:-1]]
    prev[first] = np.iinfo(np.int64).min
    base = s.min()
    covered = np.maximum(0, (e - base) - np.maximum(s - base, prev))
    np.add.at(out, k, covered)
    return out
