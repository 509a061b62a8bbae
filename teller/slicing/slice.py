"""Causal-context slice G_s of a step around its suspicious instances I_s (docs/design.md §7).

Nodes are forest rows of the step (plus the peers of its collectives on other ranks). Edges:

- **E_p** parent → child (the call tree);
- **E_t** temporal succession: two nodes of the step on the same lane (host thread, or GPU
  device+stream), at the same depth, with disjoint intervals (the ops that ran just before and
  after an anchor; anchors are the suspects and the GPU activity they launched);
- **E_c** compute–communication coupling: on a lane, a compute instance (FE/BE) is coupled to
  the first COMM node at its depth that starts after it ends (the collective that waits for it:
  the synchronized region between two collectives); a COMM node is coupled to its peers on the
  other ranks (``comm_edges.parquet``).

Relevance of a node v, each term in [0, 1]:

    R(v) = α·susp(v) + β·anc(v) + γ·temp(v) + η·comm(v)

- susp(v): the anomaly score a(v) of an instance (0 for other nodes);
- anc(v): ``decay`` ** hops when v lies in the subtree of a suspect (its calls, its kernels),
  1 for the suspect itself;
- temp(v): exp(−Δt(u, v) / τ) over E_t edges from an anchor u, Δt the non-negative gap between
  the two intervals, τ = ``temporal_scale_ns`` or, by default, u's own duration, at least 1 µs
  (scale-free: a neighbour one suspect-length away scores e⁻¹);
- comm(v): 1 when v is E_c-coupled to a suspect.

G_s = the nodes with R ≥ ``threshold`` (suspects always), plus up to ``hops`` ancestors of each
(Anc_h), capped at ``max_nodes`` (suspects are never dropped; then their ancestors, then the
most relevant). Every slice node is reported with its nearest ancestor inside the slice, so the
slice reads as a tree.

Defaults (:class:`SliceConfig`): α = 1, β = 0.8, γ = 0.8, η = 0.6, decay = 0.8, threshold 0.5,
h = 2, max_nodes 256. With them a suspect's direct calls (0.64) and their kernels (0.51) enter,
deeper descendants do not; a neighbour enters when its gap is under about half a suspect-length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from teller.forest import Forest
from teller.rundir import LAYER_CODE

__all__ = ["SliceConfig", "Slice", "build_slice", "StepIndex"]


@dataclass
class SliceConfig:
    """Knobs of the slice builder (module docstring for meanings and defaults)."""

    alpha: float = 1.0
    beta: float = 0.8
    gamma: float = 0.8
    eta: float = 0.6
    decay: float = 0.8
    threshold: float = 0.5
    hops: int = 2
    temporal_scale_ns: float | None = None
    max_nodes: int = 256
    max_anchors: int = 256


@dataclass
class Slice:
    """One step's slice: forest rows (sorted), their relevance and its terms, the tree parent of
    each inside the slice (-1: none), and the E_p / E_t / E_c edges among slice rows."""

    rows: np.ndarray
    relevance: np.ndarray
    terms: dict[str, np.ndarray]
    parent: np.ndarray
    suspect: np.ndarray  # bool per slice row
    edges_p: np.ndarray  # (k, 2) rows
    edges_t: np.ndarray
    edges_c: np.ndarray
    dropped: int = 0  # nodes above threshold left out by max_nodes
    info: dict = field(default_factory=dict)


class StepIndex:
    """Rows of each step, from a step index per row (one stable sort, then slicing)."""

    def __init__(self, step_of_row: np.ndarray):
        self.order = np.argsort(step_of_row, kind="stable")
        self.keys = step_of_row[self.order]

    def rows(self, step: int) -> np.ndarray:
        lo, hi = np.searchsorted(self.keys, [step, step + 1])
        return self.order[lo:hi]


def _lanes(fa: Forest, rows: np.ndarray, gpu: np.ndarray) -> np.ndarray:
    """Lane code per row: host thread (node, pid, tid) or GPU queue (node, device, stream)."""
    g = gpu[rows]
    cols = np.stack([
        g.astype(np.int64),
        fa.node[rows].astype(np.int64),
        np.where(g, fa.device[rows], fa.pid[rows]).astype(np.int64),
        np.where(g, fa.stream[rows], fa.tid[rows]).astype(np.int64),
    ])
    _, inv = np.unique(cols, axis=1, return_inverse=True)
    return inv.reshape(-1)


def build_slice(fa: Forest, rows: np.ndarray, suspects: np.ndarray, score: np.ndarray | None = None,
                comm_pairs: np.ndarray | None = None, config: SliceConfig | None = None,
                gpu: np.ndarray | None = None) -> Slice:
    """The slice of the step made of forest ``rows`` around ``suspects`` (rows).

    ``score`` gives a(v) per row of ``rows`` (NaN/absent: 0). ``comm_pairs`` are (row, row) pairs of
    the same collective on different ranks (from ``comm_edges.parquet``, as rows)."""
    cfg = config or SliceConfig()
    rows = np.asarray(rows, np.int64)
    order = np.argsort(rows, kind="stable")
    rows = rows[order]
    score = None if score is None else np.asarray(score, np.float64)[order]
    suspects = np.unique(np.asarray(suspects, np.int64))
    n = len(rows)
    gpu = fa.is_gpu if gpu is None else gpu
    e0 = np.zeros((0, 2), np.int64)
    if n == 0 or len(suspects) == 0:
        return Slice(np.zeros(0, np.int64), np.zeros(0), {}, np.zeros(0, np.int64), np.zeros(0, bool), e0, e0, e0)

    def loc(r: np.ndarray) -> np.ndarray:
        """Index in ``rows`` of each forest row, -1 when not in the step."""
        r = np.asarray(r, np.int64)
        p = np.clip(np.searchsorted(rows, r), 0, n - 1)
        return np.where(rows[p] == r, p, -1)

    sl = loc(suspects)
    is_sus = np.zeros(n, bool)
    is_sus[sl[sl >= 0]] = True
    susp = np.zeros(n) if score is None else np.clip(np.nan_to_num(score, nan=0.0), 0.0, 1.0)
    # anc: decay ** hops below the nearest suspect ancestor-or-self, walking up inside the step
    anc = np.where(is_sus, 1.0, 0.0)
    cur = loc(fa.parent[rows])
    live = (cur >= 0) & ~is_sus
    hops = 1
    while live.any():
        hit = live & is_sus[np.maximum(cur, 0)]
        anc[hit] = cfg.decay ** hops
        live &= ~hit
        cur = np.where(live, loc(fa.parent[rows[np.maximum(cur, 0)]]), -1)
        live &= cur >= 0
        hops += 1
    in_sus_tree = anc > 0
    # temporal succession: anchors = suspects + GPU activity under them; neighbours on the same
    # lane at the same depth with disjoint intervals
    lane = _lanes(fa, rows, gpu)
    depth = fa.depth[rows].astype(np.int64)
    s, e = fa.start[rows], fa.end[rows]
    anchors = np.flatnonzero(is_sus | (in_sus_tree & gpu[rows]))[: cfg.max_anchors]
    temp = np.zeros(n)
    t_src = np.full(n, -1, np.int64)
    if len(anchors):
        same = (lane[anchors][:, None] == lane[None, :]) & (depth[anchors][:, None] == depth[None, :])
        gap = np.maximum(s[None, :] - e[anchors][:, None], s[anchors][:, None] - e[None, :])
        ok = same & (gap >= 0) & ~is_sus[None, :]
        tau = (np.full(len(anchors), float(cfg.temporal_scale_ns)) if cfg.temporal_scale_ns
               else np.maximum(e[anchors] - s[anchors], 1000).astype(np.float64))
        prox = np.where(ok, np.exp(-np.maximum(gap, 0) / tau[:, None]), 0.0)
        best = np.argmax(prox, axis=0)
        temp = prox[best, np.arange(n)]
        t_src = np.where(temp > 0, anchors[best], -1)
    # compute-communication coupling: each compute instance -> first COMM at its lane and depth
    # starting at or after its end
    comm = np.zeros(n)
    is_comm = (fa.layer[rows] == LAYER_CODE["COMM"]) & ~gpu[rows]
    is_compute = np.isin(fa.layer[rows], [LAYER_CODE["FE"], LAYER_CODE["BE"]])
    ci, pi = np.flatnonzero(is_comm), np.flatnonzero(is_compute)
    c_local = e0
    if len(ci) and len(pi):
        t0 = int(min(s.min(), e.min()))
        span = int(max(s.max(), e.max())) - t0 + 1
        group = lane * (int(depth.max()) + 1) + depth
        ck = group[ci] * span + (s[ci] - t0)
        o = np.argsort(ck, kind="stable")
        ck, cis = ck[o], ci[o]
        pk = group[pi] * span + (e[pi] - t0)
        j = np.searchsorted(ck, pk, side="left")
        okj = j < len(ck)
        okj[okj] = group[cis[j[okj]]] == group[pi[okj]]
        cp, cc = pi[okj], cis[j[okj]]
        c_local = np.stack([cp, cc], axis=1)
        comm[cc[is_sus[cp]]] = 1.0  # the collective that waits for a suspect
        fed = is_sus[cc]
        if fed.any():  # the last compute feeding a suspect collective
            fp, fc = cp[fed], cc[fed]
            o2 = np.lexsort((e[fp], fc))
            last = np.r_[fc[o2][1:] != fc[o2][:-1], True]
            comm[fp[o2][last]] = 1.0
    peers = np.zeros(0, np.int64)
    if comm_pairs is not None and len(comm_pairs):
        cpairs = np.asarray(comm_pairs, np.int64).reshape(-1, 2)
        sus_rows = rows[is_sus]
        a_in, b_in = np.isin(cpairs[:, 0], sus_rows), np.isin(cpairs[:, 1], sus_rows)
        peers = np.unique(np.concatenate([cpairs[a_in, 1], cpairs[b_in, 0]]))
        peers = peers[loc(peers) < 0]  # the same collective on other ranks
    R = cfg.alpha * susp + cfg.beta * anc + cfg.gamma * temp + cfg.eta * comm
    chosen = (R >= cfg.threshold) | is_sus
    # Anc_h: up to h ancestors of every chosen node (and of the peers)
    parts = [rows[chosen], peers]
    for start_set in (rows[chosen], peers):
        fr = start_set
        for _ in range(max(cfg.hops, 0)):
            fr = fa.parent[fr]
            fr = fr[fr >= 0]
            if not len(fr):
                break
            parts.append(fr)
    all_rows = np.unique(np.concatenate(parts))
    li = loc(all_rows)
    rel = np.where(li >= 0, R[np.maximum(li, 0)], 0.0)
    is_peer = np.isin(all_rows, peers)
    rel[is_peer] = cfg.eta
    sus_mask = np.isin(all_rows, suspects)
    dropped = 0
    if len(all_rows) > max(cfg.max_nodes, int(sus_mask.sum())):
        # suspects first (never dropped), then their ancestors, then by relevance
        anc_mask = np.zeros(len(all_rows), bool)
        fr = suspects
        while len(fr):
            fr = fa.parent[fr]
            fr = fr[fr >= 0]
            anc_mask |= np.isin(all_rows, fr)
        tier = np.where(sus_mask, 2, np.where(anc_mask, 1, 0))
        order = np.lexsort((-rel, -tier))
        top = np.sort(order[: max(cfg.max_nodes, int(sus_mask.sum()))])
        dropped = len(all_rows) - len(top)
        all_rows, rel, sus_mask, li, is_peer = all_rows[top], rel[top], sus_mask[top], li[top], is_peer[top]
    # tree parent inside the slice: nearest ancestor that is in the slice (membership by a search
    # in the slice's sorted rows: no array the size of the forest per slice)
    members = np.sort(all_rows)

    def in_slice(r: np.ndarray) -> np.ndarray:
        p = np.minimum(np.searchsorted(members, r), len(members) - 1)
        return members[p] == r

    par = fa.parent[all_rows].copy()
    move = (par >= 0) & ~in_slice(par)
    while move.any():
        par[move] = fa.parent[par[move]]
        move = (par >= 0) & ~in_slice(par)
    edges_p = np.stack([par[par >= 0], all_rows[par >= 0]], axis=1)
    inside = li >= 0
    src = t_src[li[inside]]
    edges_t = np.stack([rows[src[src >= 0]], all_rows[inside][src >= 0]], axis=1) if (src >= 0).any() else e0
    edges_t = edges_t[np.isin(edges_t[:, 0], all_rows)]
    edges_c = np.stack([rows[c_local[:, 0]], rows[c_local[:, 1]]], axis=1) if len(c_local) else e0
    if comm_pairs is not None and len(comm_pairs):
        edges_c = np.concatenate([edges_c, np.asarray(comm_pairs, np.int64).reshape(-1, 2)])
    edges_c = edges_c[np.isin(edges_c[:, 0], all_rows) & np.isin(edges_c[:, 1], all_rows)]
    gi = np.maximum(li, 0)
    terms = {
        "susp": np.where(inside, susp[gi], 0.0),
        "anc": np.where(inside, anc[gi], 0.0),
        "temp": np.where(inside, temp[gi], 0.0),
        "comm": np.where(inside, comm[gi], np.where(is_peer, 1.0, 0.0)),
    }
    return Slice(all_rows, rel, terms, par, sus_mask, edges_p, edges_t, edges_c, dropped,
                 {"step_nodes": int(n), "above_threshold": int(chosen.sum()), "peers": int(len(peers))})


def comm_pairs_rows(fa: Forest, edges: pa.Table | None) -> np.ndarray:
    """``comm_edges.parquet`` as (row, row) pairs of the forest ``fa``."""
    if edges is None or edges.num_rows == 0:
        return np.zeros((0, 2), np.int64)
    src = edges.column("src_node_id").to_numpy()
    dst = edges.column("dst_node_id").to_numpy()
    if np.array_equal(fa.node_id, np.arange(fa.n)):
        ok = (src < fa.n) & (dst < fa.n) & (src >= 0) & (dst >= 0)
        return np.stack([src[ok], dst[ok]], axis=1).astype(np.int64)
    o = np.argsort(fa.node_id)
    ids = fa.node_id[o]

    def rows(x: np.ndarray) -> np.ndarray:
        p = np.clip(np.searchsorted(ids, x), 0, max(len(ids) - 1, 0))
        return np.where(ids[p] == x, o[p], -1)

    a, b = rows(src), rows(dst)
    ok = (a >= 0) & (b >= 0)
    return np.stack([a[ok], b[ok]], axis=1).astype(np.int64)
