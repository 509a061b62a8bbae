"""Nesting, GPU binding and the row order of the forest (docs/design.md §5.2–5.4), all vectorized.

Nesting (per thread). Host events sorted by (start asc, end desc, kind rank, input order) are
processed as if by the classic stack: pop every entry that is closed at the new start, the top
is the parent, push. Here the same answer comes from pointer jumping: each node keeps a skip
pointer ``L`` (initially the previous node); if ``L`` is open at the node's start it is the
parent, else jump to ``L[L]`` — every node skipped was closed before ``L`` began. All nodes jump
together, so the number of rounds grows with nesting depth and the log of sibling runs, not with
the number of events. An entry is *open* at time ``t`` when its end is after ``t`` (or equal,
for a zero-length node). Markers never contain anything. Host calls (RT, DRV, SYNC) take part like
ranges, so a driver call made inside a runtime call becomes its child, as trace viewers draw it;
at equal start and end, ranges enclose runtime calls, which enclose driver calls, then SYNC
records; otherwise the input order decides.

Partial overlaps (A starts, B starts, A ends, B ends) are repaired as the stack would: B stays
A's child and its end is clipped to A's (FLAG_REPAIRED). Rounds alternate between finding parents
and clipping the topmost violations until nothing is left to clip.

Row order. Rows are a depth-first preorder of the whole forest, so every subtree is a contiguous
block ``[node_id, node_id + size)``: roots first by thread (node, rank, pid, tid), host roots of a
thread in start order, then GPU activity that matched no host call (by device, stream, start).
Children of a node: host children in start order, then bound GPU activity in start order.
Positions come from counting, not from a tree walk: a host node's subtree is the run of nodes up
to the first later node that finds it closed (:func:`extent`, one ``searchsorted`` per thread),
depth is the number of earlier nodes not yet closed, and GPU rows slot in after their launching
call's subtree (:func:`preorder`).
"""

from __future__ import annotations

import numpy as np

from teller.reconstruct._np import lexorder, segment_starts, sort_with_ties


def _search_parents(first: np.ndarray, s: np.ndarray, e: np.ndarray, leaf: np.ndarray) -> np.ndarray:
    """Innermost open predecessor of every node (positions in sorted order, -1 for roots)."""
    h = len(s)
    it = np.int32 if h < 2**31 - 2 else np.int64
    parent = np.full(h, -1, dtype=it)
    if h < 2:
        return parent
    # c is open at u's start  <=>  end[c] > start[u] - (1 if u has zero length else 0);
    # a leaf's end is -inf, so it is never open.
    thr = s - (e == s)
    ends = np.where(leaf, np.iinfo(np.int64).min, e)
    # roots: nothing earlier on the thread is still open (running max of ends per thread)
    reach = np.empty_like(ends)
    bounds = np.flatnonzero(first).tolist() + [h]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        np.maximum.accumulate(ends[a:b], out=reach[a:b])
    todo = reach[:-1] > thr[1:]  # for nodes 1..h-1
    del reach
    todo &= ~first[1:]
    # round one without gathers: the previous node is the parent when it is still open
    prev_open = ends[:-1] > thr[1:]
    hit = np.flatnonzero(todo & prev_open).astype(it) + 1
    parent[hit] = hit - 1
    todo &= ~prev_open
    del prev_open, hit
    u = np.flatnonzero(todo).astype(it) + 1
    del todo
    # the previous node was closed: keep jumping; every node skipped closed before it began
    skip = np.arange(-1, h - 1, dtype=it)
    skip[first] = -1
    skip[u] = np.maximum(u - 2, -1)
    while u.size:
        c = skip[u]
        ok = c >= 0
        op = ends[c] > thr[u]
        op &= ok
        parent[u[op]] = c[op]
        ok &= ~op
        rest = u[ok]
        skip[rest] = skip[c[ok]]
        u = rest
    return parent


def _ancestor_min(parent: np.ndarray, e: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """min(end) over the strict ancestors of ``nodes`` (all have a parent)."""
    a = parent[nodes]
    m = e[a].copy()
    a = parent[a]
    live = np.flatnonzero(a >= 0)
    while live.size:
        al = a[live]
        m[live] = np.minimum(m[live], e[al])
        a[live] = parent[al]
        live = live[a[live] >= 0]
    return m


def nest(first: np.ndarray, s: np.ndarray, e: np.ndarray, leaf: np.ndarray, max_rounds: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Parents of host nodes given in (thread, start asc, end desc, ...) order.

    ``first`` marks the first node of each thread. Returns (parent positions, clipped ends,
    repaired mask, rounds used). ``e`` is not modified.
    """
    e = e.copy()
    repaired = np.zeros(len(s), dtype=bool)
    for rounds in range(1, max_rounds + 1):
        parent = _search_parents(first, s, e, leaf)
        ch = np.flatnonzero(parent >= 0)
        bad = ch[e[ch] > e[parent[ch]]]
        if not bad.size:
            return parent, e, repaired, rounds
        m = _ancestor_min(parent, e, bad)
        # Clip only where the parent stays open at the child's start once clipped (end > start);
        # the topmost violations always qualify, the rest wait for the next search.
        ok = m > s[bad]
        e[bad[ok]] = m[ok]
        repaired[bad[ok]] = True
    # Pathological chains of overlaps: clip what can be clipped, detach the rest as roots.
    parent = _search_parents(first, s, e, leaf)
    ch = np.flatnonzero(parent >= 0)
    bad = ch[e[ch] > e[parent[ch]]]
    if bad.size:
        m = _ancestor_min(parent, e, bad)
        ok = m > s[bad]
        e[bad[ok]] = m[ok]
        parent[bad[~ok]] = -1
        repaired[bad] = True
    return parent, e, repaired, max_rounds + 1


def join(hkey: np.ndarray, hprio: np.ndarray, gkey: np.ndarray) -> np.ndarray:
    """For every ``gkey``, the index of the matching ``hkey`` (-1 if none).

    Among equal host keys the lowest ``hprio``, then the lowest index wins. Dense keys (CUPTI
    correlation ids count up from 1) use a direct-address table; sparse ones a sort-merge.
    """
    it = np.int32 if len(hkey) < 2**31 - 2 else np.int64
    out = np.full(len(gkey), -1, dtype=it)
    if not len(hkey) or not len(gkey):
        return out
    lo = int(min(hkey.min(), gkey.min()))
    hi = int(max(hkey.max(), gkey.max()))
    span = hi - lo + 1
    pick = np.arange(len(hkey), dtype=it)
    hk = hkey
    # resolve duplicate host keys first (rare: shared correlation ids)
    order = np.argsort(hkey, kind="stable")
    sk = hkey[order]
    dup = np.zeros(len(sk), dtype=bool)
    eq = sk[1:] == sk[:-1]
    dup[1:] |= eq
    dup[:-1] |= eq
    if dup.any():
        rows = order[dup]
        sub = lexorder([hkey[rows], hprio[rows], rows])
        rows = rows[sub]
        keep_first = segment_starts(hkey[rows])
        drop = np.ones(len(hkey), dtype=bool)
        drop[order[~dup]] = False
        drop[rows[keep_first]] = False
        pick = pick[~drop]
        hk = hkey[~drop]
    if span <= 4 * (len(hkey) + len(gkey)) + 1024:
        table = np.full(span, -1, dtype=it)
        table[hk - lo] = pick
        return table[gkey - lo]
    order = np.argsort(hk, kind="stable")
    uk = hk[order]
    go = np.argsort(gkey, kind="stable")
    q = gkey[go]
    pos = np.searchsorted(uk, q)
    pos_c = np.minimum(pos, len(uk) - 1)
    hit = uk[pos_c] == q
    out[go[hit]] = pick[order[pos_c[hit]]]
    return out


def extent(first: np.ndarray, s: np.ndarray, e: np.ndarray, leaf: np.ndarray) -> np.ndarray:
    """For host nodes in sorted order (as for :func:`nest`, ends already clipped): the position right
    after each node's subtree, i.e. the first later node on the thread that finds it closed.

    The closers of a node ending at E are the nodes starting after E, or at E with non-zero length
    (which sort before zero-length ones), so one ``searchsorted`` per thread finds them.
    """
    h = len(s)
    it = np.int32 if h < 2**31 - 2 else np.int64
    ends = np.where(leaf, np.iinfo(np.int64).min, e)
    zero = e == s
    out = np.empty(h, dtype=it)
    bounds = np.flatnonzero(first).tolist() + [h]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        sl, el = s[a:b], ends[a:b]
        j = np.searchsorted(sl, el, side="left")
        own = np.arange(b - a)
        jc = np.minimum(j, b - a - 1)
        redo = (j <= own) | ((j < b - a) & (sl[jc] == el) & zero[a:b][jc])
        j[redo] = np.searchsorted(sl, el[redo], side="right")
        np.maximum(j, own + 1, out=j)
        out[a:b] = a + j
    return out


def innermost(sp: np.ndarray, stop: np.ndarray, n: int) -> np.ndarray:
    """For marked positions ``sp`` (ascending) owning the blocks ``[sp, stop)`` of a preorder (two
    blocks are disjoint or nested): the index into ``sp`` of the innermost block holding each
    position ``0..n-1`` (-1 in none). Disjoint blocks (the usual case) are painted by a running
    sum; nested ones walk up the enclosing blocks of the last mark at or before each position."""
    it = np.int32 if n < 2**31 - 2 else np.int64
    out = np.full(n, -1, dtype=it)
    if not sp.size:
        return out
    sp64, stop64 = sp.astype(np.int64), stop.astype(np.int64)
    sparent = _search_parents(np.r_[True, np.zeros(len(sp) - 1, bool)], sp64, stop64, np.zeros(len(sp), bool))
    k_of = np.arange(len(sp), dtype=np.int64)
    if (sparent < 0).all():
        mark = np.zeros(n + 1, dtype=np.int64)
        mark[sp64] = k_of + 1
        np.subtract.at(mark, stop64, k_of + 1)
        np.cumsum(mark[:n], out=mark[:n])
        mark[:n] -= 1
        return mark[:n].astype(it)
    cand = np.cumsum(np.bincount(sp64, minlength=n)[:n]) - 1  # the last mark at or before i
    act = np.flatnonzero(cand >= 0).astype(it)
    k = cand[act]
    while act.size:
        inside = act < stop64[k]
        out[act[inside]] = k[inside]
        act, k = act[~inside], sparent[k[~inside]]
        keep = k >= 0
        act, k = act[keep], k[keep]
    return out


def preorder(pop: np.ndarray, parent: np.ndarray, is_step: np.ndarray, gpu_parent: np.ndarray, gpu_lane: np.ndarray, gpu_start: np.ndarray) -> dict[str, np.ndarray]:
    """Depth-first preorder of the forest: host nodes (sorted order, with ``pop`` from :func:`extent`
    and ``parent`` from :func:`nest`) plus GPU leaves hanging under host nodes (``gpu_parent``,
    -1 when unbound).

    Returns host and GPU final positions (``hpos``, ``gpos``: the node ids) and, per host / GPU
    node, depth, subtree size and the node id of the innermost enclosing STEP (-1). Everything is
    counting (bincount/cumsum) except one sort of the GPU rows.

    Host node ``i`` owns host positions ``[i, pop[i])``; its GPU children go right after its last
    host descendant, deeper parents' first, so the GPU rows sit at ``K = pop[p] - 1`` in host terms.
    """
    h, g = len(pop), len(gpu_parent)
    it = np.int32 if h + g < 2**31 - 2 else np.int64
    if h == 0:  # no host event at all (a trace of kernels only): every GPU row is a root
        order = sort_with_ties([gpu_lane.astype(np.int64)], [gpu_start, np.arange(g)])
        none, zero = np.zeros(0, it), np.zeros(0, np.int32)
        return {"hpos": none, "gpos": np.arange(g, dtype=it), "order": order, "hparent": none,
                "gparent": np.full(g, -1, it), "hdepth": zero, "gdepth": np.zeros(g, np.int32),
                "hsize": none, "hstep": none, "gstep": np.full(g, -1, it)}
    idx = np.arange(h, dtype=it)
    # depth: ancestors of i are the earlier nodes not yet closed at i
    depth = np.cumsum(np.bincount(pop, minlength=h + 1)[:h], dtype=np.int32)
    np.subtract(idx, depth, out=depth)
    # GPU rows: slot after the parent's subtree, deeper parents first, then start order
    bound = gpu_parent >= 0
    gp = np.where(bound, gpu_parent, 0)
    slot = np.where(bound, pop[gp].astype(np.int64) - 1, h + gpu_lane.astype(np.int64))
    deeper = np.where(bound, int(depth.max(initial=0)) - depth[gp], 0)
    order = sort_with_ties([slot, deeper], [gpu_start, np.arange(g)])
    gpu_parent, bound, gp, slot = gpu_parent[order], bound[order], gp[order], slot[order]
    gpos = np.arange(g, dtype=it) + np.where(bound, slot + 1, h).astype(it)
    # host i moves down by the GPU rows slotted before it
    hpos = np.zeros(h, dtype=it)
    np.cumsum(np.bincount(slot[bound] + 1, minlength=h)[:h], dtype=it, out=hpos)
    hpos += idx
    # subtree sizes: host descendants plus GPU rows hanging under them
    under = np.zeros(h + 1, dtype=it)
    np.cumsum(np.bincount(gp[bound], minlength=h), dtype=it, out=under[1:])
    hsize = under[pop]
    hsize -= under[:h]
    hsize += pop
    hsize -= idx
    del under
    # innermost STEP at or above each host node
    sp = np.flatnonzero(is_step)
    k = innermost(sp, pop[sp], h)
    hstep = np.where(k >= 0, hpos[sp[np.maximum(k, 0)]] if sp.size else -1, -1).astype(it)
    return {
        "hpos": hpos,
        "gpos": gpos,
        "order": order,
        "hparent": np.where(parent >= 0, hpos[np.maximum(parent, 0)], -1).astype(it),
        "gparent": np.where(bound, hpos[gp], -1).astype(it),
        "hdepth": depth,
        "gdepth": np.where(bound, depth[gp] + 1, 0).astype(np.int32),
        "hsize": hsize,
        "hstep": hstep,
        "gstep": np.where(bound, hstep[gp], -1).astype(it),
    }
