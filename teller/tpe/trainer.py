"""TPE training: learn merges from serialized steps (docs/design.md §8).

Read the reference functions first; they state TPE the way minbpe states BPE, on plain lists,
with the side channels as the only addition:

- :func:`pair_relation`: is the boundary between tokens ``i`` and ``i+1`` a pair, and with which
  depth step (TPE's pair rule: the right token is the left one's child, or its sibling at the
  same depth).
- :func:`get_stats`: count the pairs of a sequence.
- :func:`merge`: one wave of a merge with the side-channel rule of docs/design.md §8, literally:
  ``Δ'_i = Δ_i + Δ_{i+1}``, ``p'_i = p_i``, ``d'_i = d_i``, parent indices above ``i+1`` shift left
  by one, references to ``i+1`` are redirected to ``i``.
- :func:`reference_encode` / :func:`reference_train`: BPE's loops on top of them.

:func:`train` computes the same merges fast: every sequence is loaded once into a
:class:`~teller.tpe.engine.MergeEngine`, identical sequences are trained once with a weight, pair
counts are kept incrementally (each merge subtracts the pairs it destroys and adds the ones it
creates, as Hugging Face ``tokenizers`` does), and a heap gives the most frequent pair. Ties go
to the smallest ``(left id, right id, depth step)``, so training is deterministic for a corpus.
The tests check ``train == reference_train`` and ``encode == reference_encode`` on random trees.

Why the pair rule. Applied to *any* two tokens adjacent in the depth-first order, the rule of
docs/design.md §8 can merge a leaf with the next sibling of one of its ancestors; the absorbed token's
children would then hang under the leaf's parent — a call edge that never happened — and could
sit at a smaller depth than their new parent. Restricting pairs to "first child" and "next sibling
at the same depth" keeps, after every merge, each token's parent equal to the token holding its
first node's real parent and every child deeper than its parent. ``docs/tpe.md`` has examples.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from teller.errors import TellerError
from teller.tpe.engine import MergeEngine
from teller.tpe.normalize import Normalizer
from teller.tpe.serialize import Sequences, serialize_run
from teller.tpe.tokenizer import TraceTokenizer, _dedup, _select

Pair = tuple[int, int, int]  # (left id, right id, depth step)


class Subtrees:
    """The subtree each token id stands for (symbols and relative depths), so that two merges
    building the same subtree get the same id (as two BPE merges spelling the same string)."""

    def __init__(self, n_base: int):
        self.sym: list[np.ndarray] = [np.array([i], np.int32) for i in range(n_base)]
        self.dep: list[np.ndarray] = [np.zeros(1, np.int32) for _ in range(n_base)]
        self.ids: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self.sym)

    def make(self, a: int, b: int, delta: int) -> int:
        """Id of the token ``a`` + ``b`` hung ``delta`` levels down (a new id if never built)."""
        sym = np.concatenate([self.sym[a], self.sym[b]])
        dep = np.concatenate([self.dep[a], self.dep[b] + delta])
        k = sym.tobytes() + b"|" + dep.tobytes()
        t = self.ids.get(k)
        if t is None:
            t = self.ids[k] = len(self.sym)
            self.sym.append(sym)
            self.dep.append(dep)
        return t


# --------------------------------------------------------------------------------------------
# reference (clear, slow): lists in, lists out


def pair_relation(parent: Sequence[int], depth: Sequence[int], i: int) -> int | None:
    """Depth step of the pair (i, i+1), or None when the boundary is not a pair."""
    j = i + 1
    if parent[j] == i:
        return depth[j] - depth[i]  # j hangs under i
    if parent[j] == parent[i] and depth[j] == depth[i]:
        return 0  # j is i's next sibling
    return None


def get_stats(ids: Sequence[int], parent: Sequence[int], depth: Sequence[int], counts: Counter | None = None, weight: int = 1) -> Counter:
    """Count the pairs of one sequence (into ``counts``)."""
    counts = Counter() if counts is None else counts
    for i in range(len(ids) - 1):
        rel = pair_relation(parent, depth, i)
        if rel is not None:
            counts[(ids[i], ids[i + 1], rel)] += weight
    return counts


def merge(ids: list[int], parent: list[int], depth: list[int], duration: list[int], pair: Pair, new_id: int):
    """Merge every occurrence of ``pair`` (those present now; left to right, no overlap) into
    ``new_id`` with the side-channel rule of docs/design.md §8. Returns new lists."""
    hits = []
    i = 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1], pair_relation(parent, depth, i)) == pair:
            hits.append(i)
            i += 2
        else:
            i += 1
    ids, parent, depth, duration = list(ids), list(parent), list(depth), list(duration)
    for i in reversed(hits):  # right to left: the indices of earlier hits stay valid
        ids[i] = new_id
        duration[i] = duration[i] + duration[i + 1]  # Δ'_i = Δ_i + Δ_{i+1}; p'_i = p_i; d'_i = d_i
        del ids[i + 1], parent[i + 1], depth[i + 1], duration[i + 1]
        parent = [i if p == i + 1 else p - 1 if p > i + 1 else p for p in parent]  # redirect, shift
    return ids, parent, depth, duration


def reference_encode(ids, parent, depth, duration, merges: Sequence[tuple[int, int, int, int]]):
    """BPE encoding with TPE pairs: merge the lowest-ranked pair present until none is.
    ``merges``: ``(left, right, depth step, new id)`` in rank order."""
    rank = {tuple(m[:3]): (r, m[3]) for r, m in enumerate(merges)}
    ids, parent, depth, duration = list(ids), list(parent), list(depth), list(duration)
    while len(ids) >= 2:
        stats = get_stats(ids, parent, depth)
        pair = min(stats, key=lambda p: rank.get(p, (float("inf"),))[0])
        if pair not in rank:
            break
        ids, parent, depth, duration = merge(ids, parent, depth, duration, pair, rank[pair][1])
    return ids, parent, depth, duration


def reference_train(corpus: Sequence[tuple[list[int], list[int], list[int]]], n_base: int, vocab_size: int, min_frequency: int = 2,
                    max_token_nodes: int | None = None) -> list[tuple[int, int, int, int]]:
    """Learn merges on (ids, parent, depth) sequences: the most frequent pair (ties: smallest),
    merged everywhere; learned pairs that reappear are merged again before counting. Pairs whose
    token would stand for more than ``max_token_nodes`` nodes are never merged."""
    merges: list[tuple[int, int, int, int]] = []
    trees = Subtrees(n_base)
    seqs = [(list(i), list(p), list(d), [0] * len(i)) for i, p, d in corpus]
    while len(trees) < vocab_size:
        seqs = [reference_encode(*s, merges) for s in seqs]
        stats: Counter = Counter()
        for ids, par, dep, _ in seqs:
            get_stats(ids, par, dep, stats)
        if max_token_nodes:
            stats = Counter({p: c for p, c in stats.items() if len(trees.sym[p[0]]) + len(trees.sym[p[1]]) <= max_token_nodes})
        if not stats:
            break
        pair = min(stats, key=lambda p: (-stats[p], p))
        if stats[pair] < min_frequency:
            break
        new = trees.make(*pair)
        merges.append((*pair, new))
        seqs = [merge(*s, pair, new) for s in seqs]
    return merges


# --------------------------------------------------------------------------------------------
# fast training


def _as_batches(corpus: Sequences | Iterable[Sequences | str | os.PathLike], normalizer: Normalizer, duration: str) -> list[Sequences]:
    if isinstance(corpus, Sequences):
        return [corpus]
    out = []
    for c in corpus:
        out.append(c if isinstance(c, Sequences) else serialize_run(c, duration=duration, normalizer=normalizer))
    return out


def train(corpus: Sequences | Iterable[Sequences | str | os.PathLike], vocab_size: int, min_frequency: int = 2,
          seed: int = 0, max_sequences: int | None = None, normalizer: Normalizer | None = None, duration: str = "self",
          max_token_nodes: int | None = None, progress: Callable[[int, int], None] | None = None) -> TraceTokenizer:
    """Train a TPE tokenizer of (at most) ``vocab_size`` tokens.

    ``corpus``: serialized batches or reconstructed run directories. ``max_sequences``: train on a
    sample of that many sequences drawn with ``seed`` (default: all). ``max_token_nodes``: no token
    stands for more nodes than this (default: no limit; without one, a corpus of identical steps
    ends with one token per step). Training stops early when no pair occurs ``min_frequency``
    times. The result carries a ``training`` summary in ``meta``.
    """
    t0 = time.perf_counter()
    norm = normalizer or Normalizer()
    batch = Sequences.concat(_as_batches(corpus, norm, duration))
    # one symbol table: frequent symbols first, then by name (deterministic)
    cnt = np.bincount(batch.codes, minlength=len(batch.symbols)) if len(batch.codes) else np.zeros(len(batch.symbols), np.int64)
    freq = {s: c for s, c in zip(batch.symbols, cnt.tolist(), strict=True) if c}
    symbols = sorted(freq, key=lambda s: (-freq[s], s))
    tok = TraceTokenizer(symbols, [], norm, duration)
    if vocab_size < tok.n_base:
        raise TellerError(f"--vocab-size {vocab_size} is smaller than the base vocabulary ({tok.n_base}: special tokens and the corpus' {len(symbols)} symbols); ask for at least {tok.n_base}")
    lut = np.array([tok.token_to_id.get(s, 1) for s in batch.symbols] or [0], dtype=np.int32)  # unused symbols: <unk>
    ids = lut[batch.codes] if len(batch.codes) else np.zeros(0, np.int32)
    par, dep, offsets = batch.parent, batch.depth, batch.offsets
    lens = batch.lengths()
    n_seq, n_sym = len(lens), int(offsets[-1])
    if max_sequences is not None and max_sequences < n_seq:
        pick = np.sort(np.random.default_rng(seed).choice(n_seq, size=max_sequences, replace=False))
        ids, par, dep, offsets = _select(ids, par, dep, offsets, pick)
    uniq, rep = _dedup(ids, par, dep, offsets)
    weights = np.bincount(rep, minlength=len(uniq))
    ids, par, dep, offsets = _select(ids, par, dep, offsets, uniq)
    eng = MergeEngine(ids, par, dep, offsets, capacity=vocab_size, weights=weights, count_pairs=True)
    merges: list[tuple[int, int, int, int]] = []
    trees = Subtrees(tok.n_base)
    stop = "vocab_size reached"
    t1 = time.perf_counter()
    while len(trees) < vocab_size:
        eng.drain()
        best = eng.best(min_frequency)
        if best is None:
            stop = f"no pair occurs {min_frequency} times"
            break
        key, _count = best
        pair = eng.unpack(key)
        if max_token_nodes and len(trees.sym[pair[0]]) + len(trees.sym[pair[1]]) > max_token_nodes:
            eng.banned.add(key)
            continue
        new = trees.make(*pair)
        eng.add_rule(key, len(merges), new)
        merges.append((*pair, new))
        if progress is not None:
            progress(len(trees) - tok.n_base, vocab_size - tok.n_base)
    eng.drain()
    t2 = time.perf_counter()
    meta: dict[str, Any] = {
        "training": {
            "sequences": int(n_seq),
            "symbols": int(n_sym),
            "sequences_used": int(len(rep)),
            "distinct_sequences": int(len(uniq)),
            "base_symbols": len(symbols),
            "merges": len(merges),
            "vocab_size": len(trees),
            "vocab_size_requested": int(vocab_size),
            "min_frequency": int(min_frequency),
            "max_token_nodes": max_token_nodes,
            "seed": int(seed),
            "duration": duration,
            "stop": stop,
            "tokens_after": int((weights * _tokens_per_seq(eng, offsets)).sum()),
            "seconds": round(t2 - t0, 3),
            "merge_seconds": round(t2 - t1, 3),
        }
    }
    return TraceTokenizer(symbols, merges, norm, duration, meta)


def _tokens_per_seq(eng: MergeEngine, offsets: np.ndarray) -> np.ndarray:
    """Live tokens per (distinct) training sequence after the last merge."""
    c = np.concatenate([[0], np.cumsum(eng.alive, dtype=np.int64)])
    return c[offsets[1:]] - c[offsets[:-1]]
