"""Pair NVTX pushes with pops into ranges (docs/design.md §5.1), without a per-event Python loop.

Two rules, chosen per event:

- ``range_id >= 0`` on both ends: pair by (process, range_id); within one id, a push pairs with
  the pop right after it in time (ids may be reused). Such ranges may end on another thread.
- otherwise LIFO per thread (node, rank, pid, tid, device, stream), computed from the depth walk:
  with ``+1`` per push and ``-1`` per pop, a pop that would take the depth below every earlier
  minimum has no push (dropped and counted); on the walk reflected at its running minimum a push
  reaching depth ``d`` pairs with the next pop leaving depth ``d``. Sorting the remaining events
  by depth (a stable radix sort keeps time order within a depth) puts each push right before its
  pop. Events at the same instant keep their input order.

A push never popped becomes a range ending at its thread's last event time (FLAG_TRUNCATED).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from teller.reconstruct._np import segment_starts, sort_with_ties


@dataclass
class Pairing:
    """Result of pairing: per push (same order as the ``push`` input), and counts of pops."""

    pop_of_push: np.ndarray  # event index of the matching pop, -1 if never popped
    pops_consumed: int
    pops_unmatched: np.ndarray  # event indices of pops without a push (no node, counted)
    duplicate: np.ndarray  # bool per push: an unpopped push whose range id was pushed again


def _lifo(idx: np.ndarray, is_push: np.ndarray, lane: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LIFO pairing of the events ``idx`` (pushes and pops). Returns (push idx, pop idx) pairs."""
    if not len(idx):
        return np.zeros(0, idx.dtype), np.zeros(0, idx.dtype)
    order = sort_with_ties([lane[idx], t[idx]], [idx])
    ev = idx[order]
    del order
    push = is_push[ev]
    ln = lane[ev]
    bounds = np.flatnonzero(segment_starts(ln)).tolist() + [len(ev)]
    level = np.empty(len(ev), dtype=np.int64)
    keep = np.ones(len(ev), dtype=bool)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):  # one pass per thread
        walk = np.cumsum(np.where(push[a:b], 1, -1))
        low = np.minimum.accumulate(walk)
        if low[-1] < 0:  # pops without a push: reflect the walk at its running minimum
            np.minimum(low, 0, out=low)
            prev = np.empty_like(low)
            prev[0] = 0
            prev[1:] = low[:-1]
            keep[a:b] = push[a:b] | (low >= prev)
            walk -= low
        level[a:b] = walk
    level[~push] += 1  # a pop is keyed by the depth it leaves
    if not keep.all():
        ev, push, ln, level = ev[keep], push[keep], ln[keep], level[keep]
    lt = np.int16 if level.max(initial=0) < 2**15 else np.int64
    by_level = np.argsort(level.astype(lt), kind="stable")  # radix sort; time order kept per depth
    ev, push, ln, level = ev[by_level], push[by_level], ln[by_level], level[by_level]
    k = np.flatnonzero(push[:-1] & ~push[1:] & (level[:-1] == level[1:]) & (ln[:-1] == ln[1:]))
    return ev[k], ev[k + 1]


def _by_id(idx: np.ndarray, is_push: np.ndarray, proc: np.ndarray, rid: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pair by (process, range id). Returns (push idx, pop idx, pushes seen twice)."""
    if not len(idx):
        z = np.zeros(0, idx.dtype)
        return z, z, z
    order = sort_with_ties([proc[idx], rid[idx], t[idx]], [idx])
    ev = idx[order]
    push = is_push[ev]
    same = (proc[ev][1:] == proc[ev][:-1]) & (rid[ev][1:] == rid[ev][:-1])
    k = np.flatnonzero(push[:-1] & ~push[1:] & same)
    dup = np.flatnonzero(push[:-1] & push[1:] & same)
    return ev[k], ev[k + 1], ev[dup]


def pair(push: np.ndarray, pop: np.ndarray, lane: np.ndarray, proc: np.ndarray, t: np.ndarray, range_id: np.ndarray | None) -> Pairing:
    """Match pushes and pops (event index arrays, ascending) on their threads.

    ``lane``/``proc`` are per-event thread and process codes, ``t`` the event time (start_ns),
    ``range_id`` the NVTX range id (-1 when absent; ``None``: absent everywhere).
    """
    n = len(lane)
    is_push = np.zeros(n, dtype=bool)
    is_push[push] = True
    ev = np.concatenate([push, pop])
    ev.sort()
    has_id = range_id[ev] >= 0 if range_id is not None else np.zeros(len(ev), dtype=bool)
    if has_id.any():
        # an id counts only when both ends have one; the rest pair LIFO
        a_push, a_pop, dup = _by_id(ev[has_id], is_push, proc, range_id, t)
    else:
        a_push = a_pop = dup = np.zeros(0, ev.dtype)
    b_push, b_pop = _lifo(ev[~has_id], is_push, lane, t)

    pop_of = np.full(n, -1, dtype=push.dtype) if n else np.zeros(0, push.dtype)
    pop_of[a_push] = a_pop
    pop_of[b_push] = b_pop
    consumed = np.zeros(n, dtype=bool)
    consumed[a_pop] = True
    consumed[b_pop] = True
    duplicate = np.zeros(n, dtype=bool)
    duplicate[dup] = True
    return Pairing(
        pop_of_push=pop_of[push],
        pops_consumed=int(len(a_pop) + len(b_pop)),
        pops_unmatched=pop[~consumed[pop]],
        duplicate=duplicate[push],
    )
