"""The merge engine: TPE merges applied to a whole batch of sequences at once, in numpy.

The clear, one-merge-at-a-time statement of TPE is :mod:`teller.tpe.trainer`'s reference
functions (``get_stats``, ``merge``); this module computes exactly the same result fast, and
the tests check that on random trees. Both the trainer and the tokenizer use it.

Representation. The batch's nodes are concatenated (positions ``0..N-1``). A *token* is a run of
consecutive nodes ``[t, end[t])`` named by its first position ``t``; live tokens form a doubly
linked list per sequence (``nxt``/``prv``, -1 at the ends). The side channels of docs/design.md §8
need no per-merge bookkeeping in this form:

- ``p'_i = p_i``: a token's parent is the token holding its first node's parent; "references to
  ``i+1`` are redirected to ``i``" holds because the absorbed nodes now belong to token ``i``, and
  "indices above ``i+1`` shift left" is the renumbering of live tokens at output time.
- ``d'_i = d_i``: a token's depth is its first node's depth.
- ``Δ'_i = Δ_i + Δ_{i+1}``: a token's duration is the sum over its nodes, one ``reduceat`` at
  output time.

Pairs. Two adjacent tokens ``(L, R)`` form a pair when ``R`` hangs under ``L`` (the parent of
``R``'s first node lies in ``L``) or ``R`` is ``L``'s sibling (their first nodes have the same
parent node; the reference states it as "same parent token and same depth", which is the same
thing). The key is ``(id(L), id(R), depth(R) - depth(L))``: the depth step says where ``R`` hangs
inside ``L`` (0: beside it; k ≥ 1: under the node of ``L`` at relative depth k-1 on its last
branch), so a merged token has one fixed inner shape and decodes back to the exact subtree.

Both tests read only the two tokens' first nodes and ``L``'s extent, so merging two tokens
changes which boundaries are pairs only next to the merge: a merge never turns a distant
boundary into a pair or out of one, and a pair seen once stays a pair while its two tokens live.

A *wave* of a pair merges every occurrence of it, left to right without overlap (in ``a a a`` only
the first two merge). Training keeps pair counts incrementally: each wave subtracts the pairs at
the boundaries it touches before the merge and adds those after it; nothing is recounted.
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np


class MergeEngine:
    """Token sequences of a batch and merge waves on them.

    ``codes``/``parent``/``depth``/``offsets`` as in :class:`teller.tpe.serialize.Sequences`
    (``codes`` already token ids); ``capacity`` bounds token ids (keys pack ``id * capacity``);
    ``weights`` per sequence multiply counts (identical sequences trained once);
    ``count_pairs`` keeps pair counts (training) — without it only pairs that have a rule are
    indexed (encoding). ``merges`` are known rules ``(a, b, depth_step, new_id)`` in rank order.
    """

    def __init__(self, codes: np.ndarray, parent: np.ndarray, depth: np.ndarray, offsets: np.ndarray,
                 capacity: int, weights: np.ndarray | None = None, count_pairs: bool = True,
                 merges: np.ndarray | None = None):
        n = len(codes)
        it = np.int32 if n < 2**31 - 3 else np.int64
        self.n = n
        # Every per-node array has one extra slot at index n (= index -1): a sentinel that is
        # never a pair with anything, so "no next token" (-1) needs no special case.
        seq = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
        par = np.asarray(parent, dtype=np.int64)
        self.par = np.full(n + 1, n + 1, dtype=it)  # parent node; n for roots, n+1 for the sentinel
        self.par[:n] = np.where(par >= 0, par + offsets[seq], n)
        del seq, par
        self.sym = np.full(n + 1, -1, dtype=np.int32)
        self.sym[:n] = codes
        self.dep = np.full(n + 1, -1, dtype=np.int32)
        self.dep[:n] = depth
        self.nxt = np.arange(1, n + 2, dtype=it)
        self.prv = np.arange(-1, n, dtype=it)
        ends = np.asarray(offsets[1:], dtype=np.int64)
        starts = np.asarray(offsets[:-1], dtype=np.int64)
        nonempty = ends > starts
        self.nxt[(ends - 1)[nonempty]] = -1
        self.prv[starts[nonempty]] = -1
        self.nxt[n] = -1
        self.end = np.arange(1, n + 2, dtype=it)
        self.alive = np.ones(n + 1, dtype=bool)
        self.alive[n] = False
        w = np.ones(len(offsets) - 1, dtype=np.int64) if weights is None else np.asarray(weights, dtype=np.int64)
        self.w = np.zeros(n + 1, dtype=np.int64)
        self.w[:n] = np.repeat(w, np.diff(offsets))
        self.V = int(capacity)
        merges = np.zeros((0, 4), np.int64) if merges is None else np.asarray(merges, dtype=np.int64).reshape(-1, 4)
        self.D = int(max(int(self.dep.max(initial=0)) + 1, int(merges[:, 2].max(initial=0)) + 1))
        self.count_pairs = count_pairs
        self.counts: dict[int, int] = {}
        self.index: dict[int, list[np.ndarray]] = {}  # key -> sorted arrays of left positions (may be stale)
        keys = ((merges[:, 0] * self.V + merges[:, 1]) * self.D + merges[:, 2]).tolist()
        self.rules: dict[int, tuple[int, int]] = {k: (r, int(t)) for r, (k, t) in enumerate(zip(keys, merges[:, 3].tolist(), strict=True))}  # key -> (rank, new id)
        self._rule_keys: np.ndarray | None = None  # sorted rule keys, rebuilt lazily
        self.banned: set[int] = set()  # pairs training decided never to merge
        self.heap: list[tuple[int, int]] = []  # (-count, key), lazy
        self.pending: list[tuple[int, int]] = []  # (rank, key) of rules whose pair is present
        self.merges_applied = 0
        self._build()

    # ---- keys ---------------------------------------------------------------------------------
    def pack(self, a: int, b: int, delta: int) -> int:
        return (a * self.V + b) * self.D + delta

    def unpack(self, key: int) -> tuple[int, int, int]:
        ab, delta = divmod(int(key), self.D)
        a, b = divmod(ab, self.V)
        return a, b, delta

    def _has_rule(self, keys: np.ndarray) -> np.ndarray:
        if self._rule_keys is None:
            self._rule_keys = np.array(sorted(self.rules), dtype=np.int64)
        rk = self._rule_keys
        if not rk.size or not keys.size:
            return np.zeros(len(keys), dtype=bool)
        j = np.searchsorted(rk, keys)
        j[j == len(rk)] = 0
        return rk[j] == keys

    def pair_keys(self, left: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For live tokens ``left``: the ones whose boundary with the next token is a pair, and
        the pair keys (order kept)."""
        right = self.nxt[left]  # -1 (no next token) reads the sentinel slot
        pr = self.par[right]
        ok = pr == self.par[left]  # right is left's sibling
        ok |= (pr >= left) & (pr < self.end[left])  # right hangs under a node of left
        left, right = left[ok], right[ok]
        keys = self.sym[left].astype(np.int64)
        keys *= self.V
        keys += self.sym[right]
        keys *= self.D
        keys += self.dep[right] - self.dep[left]
        return left, keys

    # ---- index and counts ---------------------------------------------------------------------
    def _build(self) -> None:
        pos, keys = self.pair_keys(np.arange(self.n, dtype=self.nxt.dtype))
        if self.count_pairs:
            self._add_counts(keys, self.w[pos])
        else:
            keep = self._has_rule(keys)
            pos, keys = pos[keep], keys[keep]
        self._index_add(pos, keys)

    def _index_add(self, pos: np.ndarray, keys: np.ndarray) -> None:
        """Index positions (sorted) under their keys; rules whose pair appears become pending."""
        if not len(keys):
            return
        order = np.argsort(keys, kind="stable")  # stable: positions stay sorted within a key
        k, p = keys[order], pos[order]
        cut = np.flatnonzero(k[1:] != k[:-1]) + 1
        starts = np.r_[0, cut]
        stops = np.r_[cut, len(k)]
        index, rules, pending = self.index, self.rules, self.pending
        for key, a, b in zip(k[starts].tolist(), starts.tolist(), stops.tolist(), strict=True):
            lst = index.get(key)
            if lst is None:
                index[key] = [p[a:b]]
            else:
                lst.append(p[a:b])
            r = rules.get(key)
            if r is not None:
                heapq.heappush(pending, (r[0], key))

    def _add_counts(self, keys: np.ndarray, w: np.ndarray) -> None:
        if not len(keys):
            return
        order = np.argsort(keys)
        k = keys[order]
        cut = np.flatnonzero(k[1:] != k[:-1]) + 1
        starts = np.r_[0, cut]
        tot = np.add.reduceat(w[order], starts)
        counts, heap, rules, banned = self.counts, self.heap, self.rules, self.banned
        for key, d in zip(k[starts].tolist(), tot.tolist(), strict=True):
            if d == 0:
                continue
            c = counts.get(key, 0) + d
            if c:
                counts[key] = c
                if key not in rules and key not in banned:
                    heapq.heappush(heap, (-c, key))
            else:
                counts.pop(key, None)

    def best(self, min_count: int = 1) -> tuple[int, int] | None:
        """The most frequent pair without a rule (ties: the smallest key), or None."""
        heap, counts, rules, banned = self.heap, self.counts, self.rules, self.banned
        while heap:
            negc, key = heap[0]
            if key in rules or key in banned or counts.get(key, 0) != -negc:
                heapq.heappop(heap)
                continue
            if -negc < min_count:
                return None
            return key, -negc
        return None

    # ---- merging ------------------------------------------------------------------------------
    def add_rule(self, key: int, rank: int, new_id: int) -> None:
        self.rules[key] = (rank, new_id)
        self._rule_keys = None
        heapq.heappush(self.pending, (rank, key))

    def drain(self, on_wave: Callable[[int, int], None] | None = None) -> None:
        """Apply rules whose pairs are present, lowest rank first, until none is."""
        while self.pending:
            rank, key = heapq.heappop(self.pending)
            if key not in self.index:
                continue
            n = self.wave(key, self.rules[key][1])
            if on_wave is not None and n:
                on_wave(key, n)

    def wave(self, key: int, new_id: int) -> int:
        """Merge every current occurrence of pair ``key`` into token ``new_id``; returns how many."""
        parts = self.index.pop(key, None)
        if not parts:
            return 0
        cand = parts[0] if len(parts) == 1 else _sorted_unique(np.concatenate(parts))
        # An indexed position is still this pair iff it is live and both tokens keep their ids
        # (a pair stays a pair while its two tokens live; see the module docstring).
        a, b, _ = self.unpack(key)
        cand = cand[self.alive[cand]]
        cand = cand[(self.sym[cand] == a) & (self.sym[self.nxt[cand]] == b)]
        if not cand.size:
            return 0
        if a == b and cand.size > 1:  # chains a a a: greedy left to right, every other one
            cont = self.nxt[cand[:-1]] == cand[1:]
            if cont.any():
                brk = np.r_[True, ~cont]
                start = np.flatnonzero(brk)
                run = np.cumsum(brk) - 1
                cand = cand[(np.arange(cand.size) - start[run]) % 2 == 0]
        A = cand
        B = self.nxt[A]
        R = self.nxt[B]
        prv = self.prv
        if self.count_pairs:  # pairs at the touched boundaries, before the merge
            before = _sorted_unique(np.concatenate([prv[A], A, B]))
            if before.size and before[0] < 0:
                before = before[before >= 0]
            pos_b, keys_b = self.pair_keys(before)
        # apply (docs/design.md §8): the left token keeps its place, parent and depth; the right one is absorbed
        self.sym[A] = new_id
        self.nxt[A] = R
        prv[R] = A  # R = -1 writes the sentinel slot, which nothing reads as a token
        self.alive[B] = False
        self.end[A] = self.end[B]
        after = _sorted_unique(np.concatenate([prv[A], A]))
        if after.size and after[0] < 0:
            after = after[after >= 0]
        pos_a, keys_a = self.pair_keys(after)  # ... and after it
        if self.count_pairs:
            self._add_counts(np.concatenate([keys_b, keys_a]), np.concatenate([-self.w[pos_b], self.w[pos_a]]))
        else:
            keep = self._has_rule(keys_a)
            pos_a, keys_a = pos_a[keep], keys_a[keep]
        self._index_add(pos_a, keys_a)
        self.merges_applied += len(A)
        return len(A)

    # ---- output ----------------------------------------------------------------------------
    def live(self) -> np.ndarray:
        """Positions of the live tokens (in sequence order)."""
        return np.flatnonzero(self.alive[: self.n])


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values. The inputs are a few sorted runs concatenated, which a stable sort
    (timsort) merges in linear time; much faster here than np.unique's hashing."""
    if x.size < 2:
        return x
    x = np.sort(x, kind="stable")
    keep = np.empty(x.size, dtype=bool)
    keep[0] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return x[keep]
