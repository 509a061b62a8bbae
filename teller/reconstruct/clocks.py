"""Clock skew between host threads and the GPU (docs/design.md §5.4, "clocks").

GPU work cannot start before the host call that launched it. A launch→kernel pair whose kernel
starts more than :data:`BEFORE_LAUNCH_TOL_NS` before its call is *before launch*; a thread with
most of its pairs before launch has its own clock off (a thread's events shifted by an hour, a
second host clock mapped wrongly). Its offset is estimated from its pairs: the low quantile
(:data:`LAG_QUANTILE`) of its launch→start lags is moved onto that of the threads whose clocks
agree with the GPU (about 5 µs on the bundled H200 runs; 0 when no thread agrees). Threads whose
events lie outside the run's recorded span (``run.json`` start/end wall) are named too; those
without pairs cannot be repaired and are reported only.

Everything is per thread lane with numpy reductions; nothing loops over events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: A GPU row starting this much before its launching call counts as before launch.
BEFORE_LAUNCH_TOL_NS = 2_000
#: A thread with at least this share of its pairs before launch has its clock repaired.
SKEWED_SHARE = 0.5
#: The quantile of launch→start lags that is matched between a skewed thread and the others.
LAG_QUANTILE = 0.01
#: Slack around the run's recorded span before a thread counts as outside it.
OUTSIDE_SLACK_NS = 1_000_000_000


@dataclass
class Clocks:
    """Per-lane offsets applied (``offset``, ns, 0 = untouched) and the report for reconstruct.json."""

    offset: np.ndarray
    report: dict[str, Any] = field(default_factory=dict)
    words: list[str] = field(default_factory=list)


def _quantile_per_lane(lane: np.ndarray, lag: np.ndarray, n_lanes: int, q: float) -> np.ndarray:
    out = np.zeros(n_lanes, np.int64)
    if not lane.size:
        return out
    o = np.lexsort((lag, lane))
    ls, gs = lane[o], lag[o]
    first = np.flatnonzero(np.r_[True, ls[1:] != ls[:-1]])
    cnt = np.diff(np.r_[first, len(ls)])
    out[ls[first]] = gs[first + np.minimum((cnt * q).astype(np.int64), cnt - 1)]
    return out


def check_clocks(call_lane: np.ndarray, call_start: np.ndarray, gpu_start: np.ndarray, n_lanes: int,
                 lane_first: np.ndarray, lane_last: np.ndarray, lane_is_host: np.ndarray,
                 span_ns: int | None, lane_name) -> Clocks:
    """Detect and estimate per-thread clock offsets.

    ``call_lane``/``call_start``/``gpu_start``: one entry per bound launch→GPU pair (the lane and
    start of the launching call, the GPU row's start). ``lane_first``/``lane_last``: each lane's
    earliest start and latest end; ``lane_is_host``: lanes of host threads; ``span_ns``: the run's
    recorded length (None: unknown); ``lane_name(l)``: "pid P thread T" for the words."""
    lag = gpu_start.astype(np.int64) - call_start.astype(np.int64)
    before = lag < -BEFORE_LAUNCH_TOL_NS
    pairs = np.bincount(call_lane, minlength=n_lanes)
    n_before = np.bincount(call_lane, weights=before, minlength=n_lanes).astype(np.int64)
    skewed = (pairs > 0) & (n_before >= SKEWED_SHARE * np.maximum(pairs, 1))
    good = (pairs > 0) & ~skewed & (n_before == 0)
    ref_rows = good[call_lane]
    ref = int(np.quantile(lag[ref_rows], LAG_QUANTILE, method="lower")) if ref_rows.any() else 0
    sk = skewed[call_lane]  # only the skewed threads' lags are sorted (usually none)
    q = _quantile_per_lane(call_lane[sk], lag[sk], n_lanes, LAG_QUANTILE) if sk.any() else np.zeros(n_lanes, np.int64)
    offset = np.where(skewed, q - ref, 0).astype(np.int64)  # added to the thread's times
    rep: dict[str, Any] = {"gpu_before_launch": int(before.sum()), "launch_pairs": int(len(lag)),
                           "tolerance_ns": BEFORE_LAUNCH_TOL_NS, "reference_lag_ns": ref}
    words: list[str] = []
    threads = []
    for ln in np.flatnonzero(n_before):
        rec = {"thread": lane_name(ln), "pairs": int(pairs[ln]), "before_launch": int(n_before[ln]),
               "repaired": bool(skewed[ln]), "offset_ns": int(offset[ln])}
        threads.append(rec)
        if skewed[ln]:
            way = ("ahead of", "moved back") if offset[ln] < 0 else ("behind", "moved forward")
            words.append(f"clock skew: {n_before[ln]:,} of {pairs[ln]:,} GPU rows launched from {lane_name(ln)} start "
                         f"before their launch call; that thread's clock ran {_human(abs(offset[ln]))} {way[0]} the GPU's, "
                         f"its events were {way[1]} by that much (flagged clock_repaired)")
        else:
            words.append(f"clock skew: {n_before[ln]:,} of {pairs[ln]:,} GPU rows launched from {lane_name(ln)} start "
                         f"before their launch call (too few to estimate an offset; left as recorded)")
    rep["threads_before_launch"] = threads
    rep["after_repair_gpu_before_launch"] = int((lag - offset[call_lane] < -BEFORE_LAUNCH_TOL_NS).sum())
    outside = []
    if span_ns is not None and span_ns > 0:
        for when, shift in (("recorded", np.zeros(n_lanes, np.int64)), ("after_repair", offset)):
            first, last = lane_first + shift, lane_last + shift
            out = lane_is_host & ((first < -OUTSIDE_SLACK_NS) | (last > span_ns + OUTSIDE_SLACK_NS))
            if when == "recorded":
                outside = [{"thread": lane_name(ln), "first_ns": int(lane_first[ln]), "last_ns": int(lane_last[ln]),
                            "repaired": bool(skewed[ln])} for ln in np.flatnonzero(out)]
            else:
                rep["after_repair_threads_outside_run"] = int(out.sum())
        for o in outside:
            if not o["repaired"]:
                words.append(f"clock skew: {o['thread']} has events outside the run ({_human(o['first_ns'])} to "
                             f"{_human(o['last_ns'])} after its start, the run lasted {_human(span_ns)}); no launch "
                             f"pairs to estimate its offset, left as recorded")
    rep["run_span_ns"] = span_ns
    rep["threads_outside_run"] = outside
    rep["threads_repaired"] = int(skewed.sum())
    return Clocks(offset, rep, words)


def _human(ns: int | float) -> str:
    a = abs(float(ns))
    sign = "-" if ns < 0 else ""
    for unit, f in (("h", 3.6e12), ("min", 6e10), ("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if a >= f:
            return f"{sign}{a / f:.3g} {unit}"
    return f"{sign}{a:.0f} ns"
