"""Align log lines to (request, step): vectorized interval stabbing with numpy.

Rules, in order (docs/design.md §5.6), for a line at time τ with tolerance tol (per line: the
configured tolerance, at least the resolution of the line's timestamp):

1. ``request_id`` / ``request_id_nearest``: the line names requests present in requests.parquet.
   Candidates are the steps of those requests; when the line's pid has steps of the request, only
   those. The best candidate minimises, in order: distance d(τ, [start, end]) (0 inside),
   duration (innermost), the position of the request in the line, start, step_id, request id. Rule
   ``request_id`` when d ≤ tol, else ``request_id_nearest``. With τ unknown (no clock anchor)
   the earliest step of the first named request wins, rule ``request_id_nearest``.
2. ``time_window``: otherwise, the steps of the line's pid (when that pid has steps; else all
   steps, any rank) minimising (d, duration, start, step_id), if d ≤ tol.
3. ``unaligned``: everything else.

The core, :func:`best_intervals`, is exact for arbitrary (overlapping, nested) intervals and
never forms a lines × steps product: per group it sorts intervals by start, keeps the running
maximum of their ends, finds the nearest distance d_min of each query with two searchsorted
calls, then enumerates only the intervals that can lie within d_min (those between the first
running-max end ≥ τ − d_min and the last start ≤ τ + d_min). For the sequential steps of one
engine loop that is one to three candidates per line; heavily nested input costs more but stays
correct. Queries are processed in chunks so the candidate pairs fit in memory.
"""

from __future__ import annotations

import numpy as np

I64_MAX = np.iinfo(np.int64).max

RULES = ("request_id", "request_id_nearest", "time_window", "unaligned")
RULE_CODE = {r: i for i, r in enumerate(RULES)}


def segment_cummax(g: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Running max of ``v`` within runs of equal ``g`` (``g`` sorted ascending, codes ≥ 0).

    Returns (running max, index of the latest element achieving it). Values are rank-compressed
    so group code × rank cannot overflow int64.
    """
    n = len(v)
    if n == 0:
        return v.astype(np.int64), np.zeros(0, np.int64)
    uniq, inv = np.unique(v, return_inverse=True)
    r = np.int64(len(uniq) + 1)
    gd = np.unique(g, return_inverse=True)[1].astype(np.int64)
    key = gd * r + inv.astype(np.int64)
    cm = np.maximum.accumulate(key)
    pm = uniq[cm - gd * r]
    arg = np.maximum.accumulate(np.where(key == cm, np.arange(n), -1))
    return pm.astype(np.int64), arg.astype(np.int64)


def group_searchsorted(g: np.ndarray, v: np.ndarray, qg: np.ndarray, qv: np.ndarray,
                       side: str = "left") -> np.ndarray:
    """``searchsorted`` of ``qv`` within the run of ``g == qg`` of a (g, v)-sorted array.

    Returns global positions. ``g`` and ``qg`` are dense non-negative group codes. Values are
    rank-compressed so the (group, value) key fits in int64 for any τ range.
    """
    n = len(v)
    allv = np.concatenate([v, qv])
    uniq, inv = np.unique(allv, return_inverse=True)
    r = np.int64(len(uniq) + 1)
    key = g.astype(np.int64) * r + inv[:n]
    qkey = qg.astype(np.int64) * r + inv[n:]
    return np.searchsorted(key, qkey, side=side)


def best_intervals(q_group: np.ndarray, q_t: np.ndarray, q_valid: np.ndarray,
                   iv_group: np.ndarray, iv_start: np.ndarray, iv_end: np.ndarray,
                   max_pairs: int = 4_000_000) -> tuple[np.ndarray, np.ndarray]:
    """For each query, the interval of its group nearest to ``q_t``.

    Ties on the distance d = max(start − t, 0, t − end) go to the shorter interval, then the
    earlier start, then the lower interval index. Returns (interval index or −1, distance or
    int64 max). Groups are arbitrary integers; invalid queries and empty groups give −1.
    """
    nq = len(q_t)
    out_i = np.full(nq, -1, np.int64)
    out_d = np.full(nq, I64_MAX, np.int64)
    if nq == 0 or len(iv_start) == 0:
        return out_i, out_d
    iv_start = np.asarray(iv_start, np.int64)
    iv_end = np.maximum(np.asarray(iv_end, np.int64), iv_start)
    groups, iv_g = np.unique(np.asarray(iv_group, np.int64), return_inverse=True)
    order = np.lexsort((np.arange(len(iv_start)), iv_end, iv_start, iv_g))
    g, s, e = iv_g[order].astype(np.int64), iv_start[order], iv_end[order]
    pm, pam = segment_cummax(g, e)

    qpos = np.searchsorted(groups, q_group)
    qpos_c = np.minimum(qpos, len(groups) - 1)
    has = np.asarray(q_valid, bool) & (qpos < len(groups)) & (groups[qpos_c] == q_group)
    qi = np.flatnonzero(has)
    if len(qi) == 0:
        return out_i, out_d
    qg = qpos_c[qi].astype(np.int64)
    t = np.asarray(q_t, np.int64)[qi]
    seg_lo = np.searchsorted(g, qg, "left")
    seg_hi = np.searchsorted(g, qg, "right")

    # nearest distance: the interval with the largest end among those starting ≤ t, or the first
    # interval starting after t
    hi0 = group_searchsorted(g, s, qg, t, "right")
    a_ok = hi0 > seg_lo
    ia = np.where(a_ok, hi0 - 1, 0)
    d_a = np.where(a_ok, np.maximum(t - pm[ia], 0), I64_MAX)
    b_ok = hi0 < seg_hi
    ib = np.where(b_ok, hi0, 0)
    d_b = np.where(b_ok, s[ib] - t, I64_MAX)
    dmin = np.minimum(d_a, d_b)

    # every interval at distance dmin lies in [lo, hi)
    hi = group_searchsorted(g, s, qg, t + dmin, "right")
    lo = group_searchsorted(g, pm, qg, t - dmin, "left")
    cnt = np.maximum(hi - lo, 0)
    ends = np.cumsum(cnt)
    starts_c = ends - cnt
    best_pos = np.full(len(qi), -1, np.int64)
    a = 0
    while a < len(qi):
        # a chunk of queries whose candidate pairs fit in max_pairs (at least one query)
        b = int(np.searchsorted(ends, starts_c[a] + max_pairs, "right"))
        b = max(b, a + 1)
        c = cnt[a:b]
        tot = int(c.sum())
        if tot:
            rq = np.repeat(np.arange(a, b), c)
            pos = np.arange(tot) - np.repeat(starts_c[a:b] - starts_c[a], c) + np.repeat(lo[a:b], c)
            tq = t[rq]
            d = np.maximum(np.maximum(s[pos] - tq, tq - e[pos]), 0)
            keep = d <= dmin[rq]
            rq, pos = rq[keep], pos[keep]
            dur = e[pos] - s[pos]
            o = np.lexsort((pos, dur, rq))  # pos order = (start, end, index) within the group
            rq, pos = rq[o], pos[o]
            first = np.ones(len(rq), bool)
            first[1:] = rq[1:] != rq[:-1]
            best_pos[rq[first]] = pos[first]
        a = b
    ok = best_pos >= 0
    out_i[qi[ok]] = order[best_pos[ok]]
    out_d[qi[ok]] = dmin[ok]
    return out_i, out_d


def align(
    tau: np.ndarray,
    tau_known: np.ndarray,
    tol: np.ndarray,
    pid: np.ndarray,
    pair_line: np.ndarray,
    pair_req: np.ndarray,
    pair_pos: np.ndarray,
    step_pid: np.ndarray,
    step_start: np.ndarray,
    step_end: np.ndarray,
    mem_req: np.ndarray,
    mem_step: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Align lines to steps. Returns (step index or −1, rule code, aligned request code or −1).

    Lines: ``tau`` (used where ``tau_known``), per-line ``tol``, ``pid`` (−1 unknown).
    Named known requests: pairs (``pair_line``, ``pair_req`` code, ``pair_pos`` = order of the
    mention in the line). Steps: arrays indexed by step index, in step_id order (the last
    tie-break is the lower step index). Membership: (``mem_req`` code,
    ``mem_step`` step index) rows from requests.parquet.
    """
    n = len(tau)
    tau = np.asarray(tau, np.int64)
    tau_known = np.asarray(tau_known, bool)
    pid = np.asarray(pid, np.int64)
    step_start = np.asarray(step_start, np.int64)
    step_end = np.maximum(np.asarray(step_end, np.int64), step_start)
    out_step = np.full(n, -1, np.int64)
    out_rule = np.full(n, RULE_CODE["unaligned"], np.int8)
    out_req = np.full(n, -1, np.int64)
    n_steps = len(step_start)
    if n == 0 or n_steps == 0:
        return out_step, out_rule, out_req
    step_pid = np.asarray(step_pid, np.int64)
    pids = np.unique(step_pid)
    npid = len(pids)

    def pid_code(p: np.ndarray) -> np.ndarray:
        """Dense code of a pid among the step pids; npid when absent or unknown."""
        pos = np.minimum(np.searchsorted(pids, p), npid - 1)
        return np.where((p >= 0) & (pids[pos] == p), pos, npid)

    # 1. by request id
    has_req = np.zeros(n, bool)
    if len(pair_line) and len(mem_req):
        mem_req = np.asarray(mem_req, np.int64)
        mem_step = np.asarray(mem_step, np.int64)
        o = np.argsort(mem_step, kind="stable")  # ties inside a group go to the lower step index
        mem_req, mem_step = mem_req[o], mem_step[o]
        # groups: (request, pid) pairs first, then the request alone
        mem_pc = pid_code(step_pid[mem_step])
        key_rp = mem_req * (npid + 1) + mem_pc
        rp_keys = np.unique(key_rp)
        n_rp = len(rp_keys)
        iv_group = np.concatenate([np.searchsorted(rp_keys, key_rp), n_rp + mem_req])
        iv_step = np.concatenate([mem_step, mem_step])
        pl = np.asarray(pair_line, np.int64)
        pr = np.asarray(pair_req, np.int64)
        q_key = pr * (npid + 1) + pid_code(pid[pl])
        kpos = np.minimum(np.searchsorted(rp_keys, q_key), n_rp - 1)
        own = (pid_code(pid[pl]) < npid) & (rp_keys[kpos] == q_key)
        q_group = np.where(own, kpos, n_rp + pr)
        # τ unknown: a time before every step makes the earliest step the nearest
        t_unknown = np.int64(step_start.min()) - 1
        q_t = np.where(tau_known[pl], tau[pl], t_unknown)
        bi, bd = best_intervals(q_group, q_t, np.ones(len(pl), bool), iv_group,
                                step_start[iv_step], step_end[iv_step])
        ok = bi >= 0
        pl, pr, pp, bi, bd = pl[ok], pr[ok], np.asarray(pair_pos)[ok], bi[ok], bd[ok]
        st = iv_step[bi]
        # τ known: (d, duration, mention, start, step); τ unknown: the first mention decides,
        # then its earliest step (bd is then the distance from a time before every step)
        kt = tau_known[pl]
        dur = step_end[st] - step_start[st]
        o = np.lexsort((pr, st, step_start[st], np.where(kt, 0, dur), np.where(kt, 0, bd), pp,
                        np.where(kt, dur, 0), np.where(kt, bd, 0), pl))
        pl, pr, st, bd = pl[o], pr[o], st[o], bd[o]
        first = np.ones(len(pl), bool)
        first[1:] = pl[1:] != pl[:-1]
        pl, pr, st, bd = pl[first], pr[first], st[first], bd[first]
        out_step[pl] = st
        out_req[pl] = pr
        within = tau_known[pl] & (bd <= tol[pl])
        out_rule[pl] = np.where(within, RULE_CODE["request_id"], RULE_CODE["request_id_nearest"])
        has_req[pl] = True

    # 2. by time
    q = np.flatnonzero(~has_req & tau_known)
    if len(q):
        all_steps = np.arange(n_steps)
        iv_group = np.concatenate([pid_code(step_pid), np.full(n_steps, npid)])
        iv_step = np.concatenate([all_steps, all_steps])
        bi, bd = best_intervals(pid_code(pid[q]), tau[q], np.ones(len(q), bool), iv_group,
                                step_start[iv_step], step_end[iv_step])
        ok = (bi >= 0) & (bd <= tol[q])
        out_step[q[ok]] = iv_step[bi[ok]]
        out_rule[q[ok]] = RULE_CODE["time_window"]
    return out_step, out_rule, out_req
