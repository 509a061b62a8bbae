"""Alignment of log lines to (request, step): hand-built cases with known answers, and the
vectorized aligner against a brute-force reference on random inputs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from teller.logs.align import (
    RULE_CODE,
    RULES,
    align,
    best_intervals,
    group_searchsorted,
    segment_cummax,
)

MS = 1_000_000


# ------------------------------------------------------------------------------------------
# brute-force references (loops; the spec written out literally)


def dist(t, s, e):
    return max(s - t, 0, t - e)


def brute_best(q_group, q_t, iv_group, iv_start, iv_end):
    out = []
    for g, t in zip(q_group, q_t, strict=True):
        best = None
        for i, (ig, s, e) in enumerate(zip(iv_group, iv_start, iv_end, strict=True)):
            if ig != g:
                continue
            e = max(e, s)
            key = (dist(t, s, e), e - s, s, i)
            if best is None or key < best:
                best = key
        out.append((-1, None) if best is None else (best[3], best[0]))
    return out


def brute_align(tau, known, tol, pid, named, step_pid, start, end, mem):
    """named: per line, list of lists of request codes (one list per mention); mem: (req, step)."""
    end = [max(e, s) for s, e in zip(start, end, strict=True)]
    n_steps = len(start)
    out = []
    for i in range(len(tau)):
        pairs = []
        t_unknown = min(start) - 1 if n_steps else 0
        t = tau[i] if known[i] else t_unknown
        for pos, codes in enumerate(named[i]):
            for r in codes:
                steps_r = [s for (rr, s) in mem if rr == r]
                if not steps_r:
                    continue
                own = [s for s in steps_r if pid[i] >= 0 and step_pid[s] == pid[i]]
                cand = own or steps_r
                for s in cand:
                    d = dist(t, start[s], end[s])
                    if known[i]:
                        key = (d, end[s] - start[s], pos, start[s], s)
                    else:
                        key = (0, 0, pos, d, end[s] - start[s], start[s], s)
                    pairs.append((key, r, s, d))
        if pairs:
            key, r, s, d = min(pairs)
            rule = "request_id" if known[i] and d <= tol[i] else "request_id_nearest"
            out.append((s, rule, r))
            continue
        if not known[i] or n_steps == 0:
            out.append((-1, "unaligned", -1))
            continue
        own = [s for s in range(n_steps) if pid[i] >= 0 and step_pid[s] == pid[i]]
        cand = own or list(range(n_steps))
        key, s = min(((dist(tau[i], start[s], end[s]), end[s] - start[s], start[s], s), s) for s in cand)
        if key[0] <= tol[i]:
            out.append((s, "time_window", -1))
        else:
            out.append((-1, "unaligned", -1))
    return out


# ------------------------------------------------------------------------------------------
# helpers


def test_segment_cummax_restarts_per_group():
    g = np.array([0, 0, 0, 1, 1, 2])
    v = np.array([5, 3, 9, 1, 4, -7])
    pm, arg = segment_cummax(g, v)
    assert pm.tolist() == [5, 5, 9, 1, 4, -7]
    assert arg.tolist() == [0, 0, 2, 3, 4, 5]


def test_group_searchsorted_matches_per_group_searchsorted():
    g = np.array([0, 0, 0, 2, 2])
    v = np.array([10, 20, 30, 5, 50])
    qg = np.array([0, 0, 2, 2, 2])
    qv = np.array([20, 35, 0, 5, 60])
    left = group_searchsorted(g, v, qg, qv, "left")
    right = group_searchsorted(g, v, qg, qv, "right")
    assert left.tolist() == [1, 3, 3, 3, 5]
    assert right.tolist() == [2, 3, 3, 4, 5]


def test_best_intervals_nested_and_gap():
    # group 7: a long interval containing a short one, and a later one
    start = np.array([0, 40, 200])
    end = np.array([100, 60, 300])
    grp = np.array([7, 7, 7])
    q_t = np.array([50, 10, 150, 170, 500])
    idx, d = best_intervals(np.full(5, 7), q_t, np.ones(5, bool), grp, start, end)
    assert idx.tolist() == [1, 0, 0, 2, 2]  # innermost at 50; gap: nearer side wins
    assert d.tolist() == [0, 0, 50, 30, 200]
    idx, _ = best_intervals(np.array([8]), np.array([50]), np.array([True]), grp, start, end)
    assert idx.tolist() == [-1]  # no interval in that group


# ------------------------------------------------------------------------------------------
# known answers


def _steps():
    # rank 0 (pid 100) and rank 1 (pid 200) run overlapping steps; pid 100 also has step 4 later
    step_pid = np.array([100, 200, 100, 200, 100])
    start = np.array([0, 1 * MS, 20 * MS, 21 * MS, 1000 * MS])
    end = np.array([10 * MS, 12 * MS, 30 * MS, 33 * MS, 1010 * MS])
    return step_pid, start, end


def _run(tau, pid, named, mem, tol_ms=5, known=None):
    step_pid, start, end = _steps()
    n = len(tau)
    tau = np.asarray(tau, np.int64)
    known = np.ones(n, bool) if known is None else np.asarray(known, bool)
    tol = np.full(n, tol_ms * MS, np.int64)
    pl, pr, pp = [], [], []
    for i, mentions in enumerate(named):
        for k, codes in enumerate(mentions):
            for c in codes:
                pl.append(i)
                pr.append(c)
                pp.append(k)
    mem = np.asarray(mem, np.int64).reshape(-1, 2)
    s, rule, req = align(tau, known, tol, np.asarray(pid, np.int64), np.asarray(pl, np.int64),
                         np.asarray(pr, np.int64), np.asarray(pp, np.int64), step_pid, start, end,
                         mem[:, 0], mem[:, 1])
    ref = brute_align(tau.tolist(), known.tolist(), tol.tolist(), list(pid), named, step_pid.tolist(),
                      start.tolist(), end.tolist(), [tuple(x) for x in mem.tolist()])
    got = [(int(a), RULES[b], int(c)) for a, b, c in zip(s, rule, req, strict=True)]
    assert got == ref
    return got


def test_time_window_prefers_own_pid_on_overlapping_ranks():
    # τ = 5 ms lies in step 0 (pid 100) and step 1 (pid 200)
    got = _run([5 * MS, 5 * MS, 5 * MS], [100, 200, -1], [[], [], []], [])
    assert got[0] == (0, "time_window", -1)
    assert got[1] == (1, "time_window", -1)
    # unknown pid: both contain τ, the shorter (innermost) one wins: step 0 (10 ms) vs 1 (11 ms)
    assert got[2] == (0, "time_window", -1)


def test_line_outside_every_window_is_unaligned():
    got = _run([500 * MS, 34 * MS, 39 * MS], [100, 200, 200], [[], [], []], [])
    assert got[0] == (-1, "unaligned", -1)
    assert got[1] == (3, "time_window", -1)  # 1 ms after step 3's end: within 5 ms
    assert got[2] == (-1, "unaligned", -1)  # 6 ms after: outside


def test_request_id_rules():
    # request 0 ran in steps 0 and 2 (rank 0) and 1 and 3 (rank 1); request 1 only in step 4
    mem = [(0, 0), (0, 2), (0, 1), (0, 3), (1, 4)]
    got = _run(
        [25 * MS, 25 * MS, 500 * MS, 500 * MS, 3 * MS],
        [100, -1, 100, 300, 100],
        [[[0]], [[0]], [[0]], [[1]], [[1], [0]]],
        mem,
    )
    assert got[0] == (2, "request_id", 0)  # inside step 2 on its own pid
    assert got[1] == (2, "request_id", 0)  # pid unknown: steps 2 and 3 contain τ; 2 is shorter
    assert got[2] == (2, "request_id_nearest", 0)  # far from request 0's steps: nearest (step 2)
    assert got[3] == (4, "request_id_nearest", 1)
    # names requests 1 and 0: request 0's step 0 contains τ, request 1's step is far away
    assert got[4] == (0, "request_id", 0)


def test_unknown_time_aligns_by_request_only():
    mem = [(0, 2), (0, 3)]
    got = _run([-1, -1], [-1, -1], [[[0]], []], mem, known=[False, False])
    assert got[0] == (2, "request_id_nearest", 0)  # earliest step of the request
    assert got[1] == (-1, "unaligned", -1)


# ------------------------------------------------------------------------------------------
# property: vectorized == brute force


@st.composite
def interval_sets(draw):
    n_iv = draw(st.integers(0, 12))
    groups = draw(st.lists(st.integers(0, 3), min_size=n_iv, max_size=n_iv))
    starts = draw(st.lists(st.integers(-50, 200), min_size=n_iv, max_size=n_iv))
    durs = draw(st.lists(st.integers(-5, 80), min_size=n_iv, max_size=n_iv))
    n_q = draw(st.integers(0, 15))
    qg = draw(st.lists(st.integers(0, 4), min_size=n_q, max_size=n_q))
    qt = draw(st.lists(st.integers(-100, 400), min_size=n_q, max_size=n_q))
    return groups, starts, [s + d for s, d in zip(starts, durs, strict=True)], qg, qt


@settings(max_examples=300, deadline=None)
@given(interval_sets(), st.integers(1, 4))
def test_best_intervals_equals_brute_force(data, max_pairs):
    groups, starts, ends, qg, qt = data
    idx, d = best_intervals(np.asarray(qg, np.int64), np.asarray(qt, np.int64), np.ones(len(qt), bool),
                            np.asarray(groups, np.int64), np.asarray(starts, np.int64),
                            np.asarray(ends, np.int64), max_pairs=max_pairs)
    ref = brute_best(qg, qt, groups, starts, ends)
    assert [int(i) for i in idx] == [r[0] for r in ref]
    for i, (ri, rd) in zip(range(len(qt)), ref, strict=True):
        if ri >= 0:
            assert int(d[i]) == rd


@st.composite
def alignment_cases(draw):
    n_steps = draw(st.integers(0, 8))
    step_pid = draw(st.lists(st.sampled_from([1, 2, 3]), min_size=n_steps, max_size=n_steps))
    start = draw(st.lists(st.integers(0, 300), min_size=n_steps, max_size=n_steps))
    dur = draw(st.lists(st.integers(0, 60), min_size=n_steps, max_size=n_steps))
    n_req = draw(st.integers(0, 4))
    mem = draw(st.lists(st.tuples(st.integers(0, max(n_req - 1, 0)), st.integers(0, max(n_steps - 1, 0))),
                        max_size=12)) if n_req and n_steps else []
    n = draw(st.integers(0, 12))
    tau = draw(st.lists(st.integers(-20, 400), min_size=n, max_size=n))
    known = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    tol = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    pid = draw(st.lists(st.sampled_from([-1, 1, 2, 3, 4]), min_size=n, max_size=n))
    named = [draw(st.lists(st.lists(st.integers(0, max(n_req - 1, 0)), min_size=1, max_size=2), max_size=2))
             if n_req else [] for _ in range(n)]
    return step_pid, start, [s + d for s, d in zip(start, dur, strict=True)], mem, tau, known, tol, pid, named


@settings(max_examples=300, deadline=None)
@given(alignment_cases())
def test_align_equals_brute_force(case):
    step_pid, start, end, mem, tau, known, tol, pid, named = case
    pl, pr, pp = [], [], []
    for i, mentions in enumerate(named):
        for k, codes in enumerate(mentions):
            for c in codes:
                pl.append(i)
                pr.append(c)
                pp.append(k)
    mem_arr = np.asarray(mem, np.int64).reshape(-1, 2)
    s, rule, req = align(np.asarray(tau, np.int64), np.asarray(known, bool), np.asarray(tol, np.int64),
                         np.asarray(pid, np.int64), np.asarray(pl, np.int64), np.asarray(pr, np.int64),
                         np.asarray(pp, np.int64), np.asarray(step_pid, np.int64),
                         np.asarray(start, np.int64), np.asarray(end, np.int64), mem_arr[:, 0], mem_arr[:, 1])
    ref = brute_align(tau, known, tol, pid, named, step_pid, start, end, [tuple(m) for m in mem])
    got = [(int(a), RULES[b], int(c)) for a, b, c in zip(s, rule, req, strict=True)]
    assert got == ref
    assert set(int(x) for x in rule) <= set(RULE_CODE.values())
