"""Serialize steps and slices of the call forest into symbol sequences (docs/design.md §8).

``forest.parquet`` rows are a depth-first preorder in which every subtree is the contiguous block
``[node_id, node_id + size)`` (see :mod:`teller.forest`). A step's depth-first
traversal is therefore a slice of the forest's rows, and its parent indices are the forest's
parent ids minus the step's node id: no traversal, only a gather. :func:`check_preorder` verifies
that on every batch (an older or foreign forest that breaks it is an error, not a silent
mis-serialization).

A serialized node emits one symbol, its layer tag and normalized name (:mod:`.normalize`), and
keeps three side channels: ``parent`` (index of its parent in the same sequence, -1 for a root),
``depth`` (number of ancestors in the sequence) and ``duration`` (ns). By default the duration is
the node's *self* time (:attr:`teller.forest.Forest.self_ns`): for a host node its span minus the
spans of its host children, for GPU activity (kernels, copies, memsets, device syncs) its own
span. Self times add up without counting a nested interval twice, so when TPE merges tokens and
adds their durations (docs/design.md §8) the sum stays a time budget. ``duration="total"`` keeps
plain spans.

A slice (a subset of a step's nodes, e.g. the causal slice of docs/design.md §7) keeps the forest's
row order; each node's parent is its nearest ancestor inside the slice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from teller.errors import TellerError
from teller.forest import Forest, ranges
from teller.rundir import RunDir
from teller.tpe.normalize import Normalizer

DURATIONS = ("self", "total")
__all__ = ["DURATIONS", "Sequences", "Trace", "check_preorder", "dfs_parents", "ranges", "run_step_ids",
           "serialize_nodes", "serialize_run", "serialize_steps"]
_DEFAULT_NORMALIZER = Normalizer()


@dataclass
class Trace:
    """One serialized sequence: symbols and side channels, index-aligned."""

    symbols: list[str]
    parent: np.ndarray  # int32, -1 for roots
    depth: np.ndarray  # int32
    duration: np.ndarray  # int64 ns

    def __len__(self) -> int:
        return len(self.symbols)


@dataclass
class Sequences:
    """A batch of serialized sequences, columnar: concatenated per-node arrays and offsets.

    Sequence ``i`` is rows ``offsets[i]:offsets[i+1]``; ``codes`` index ``symbols`` (the batch's
    symbol table); ``parent`` is local to the sequence; ``node_id`` is the forest row (provenance);
    ``key`` identifies each sequence (the step's node id, or the slice's first node).
    """

    symbols: list[str]
    codes: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    duration: np.ndarray
    offsets: np.ndarray
    node_id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    key: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    checked: bool = False  # check_preorder already passed (set by the serializer)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_nodes(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, i: int) -> Trace:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        sym = np.asarray(self.symbols, dtype=object)[self.codes[a:b]] if b > a else np.zeros(0, object)
        return Trace(list(sym), self.parent[a:b].copy(), self.depth[a:b].copy(), self.duration[a:b].copy())

    def __iter__(self) -> Iterator[Trace]:
        for i in range(len(self)):
            yield self[i]

    @classmethod
    def from_traces(cls, traces: Sequence[Trace]) -> "Sequences":
        """Pack Python-built traces (tests, small inputs) into a batch."""
        table: dict[str, int] = {}
        codes = [np.asarray([table.setdefault(s, len(table)) for s in t.symbols], dtype=np.int32) for t in traces]
        lens = np.array([len(t) for t in traces], dtype=np.int64)
        offsets = np.zeros(len(traces) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])

        def cat(arrs, dt):
            return np.concatenate([np.asarray(a, dtype=dt) for a in arrs]) if arrs else np.zeros(0, dt)

        return cls(
            symbols=list(table),
            codes=cat(codes, np.int32),
            parent=cat([t.parent for t in traces], np.int32),
            depth=cat([t.depth for t in traces], np.int32),
            duration=cat([t.duration for t in traces], np.int64),
            offsets=offsets,
            node_id=np.full(int(offsets[-1]), -1, np.int64),
            key=np.arange(len(traces), dtype=np.int64),
        )

    @classmethod
    def concat(cls, batches: Sequence["Sequences"]) -> "Sequences":
        """One batch from several (symbol tables merged; e.g. the steps of several runs)."""
        table: dict[str, int] = {}
        codes, parent, depth, dur, node, key, lens = [], [], [], [], [], [], []
        for b in batches:
            lut = np.array([table.setdefault(x, len(table)) for x in b.symbols] or [0], dtype=np.int32)
            codes.append(lut[b.codes] if len(b.codes) else np.zeros(0, np.int32))
            parent.append(b.parent)
            depth.append(b.depth)
            dur.append(b.duration)
            node.append(b.node_id if len(b.node_id) == len(b.codes) else np.full(len(b.codes), -1, np.int64))
            key.append(b.key if len(b.key) == len(b) else np.full(len(b), -1, np.int64))
            lens.append(b.lengths())
        lens_a = np.concatenate(lens) if lens else np.zeros(0, np.int64)
        offsets = np.zeros(len(lens_a) + 1, dtype=np.int64)
        np.cumsum(lens_a, out=offsets[1:])

        def cat(x, dt):
            return np.concatenate(x).astype(dt) if x else np.zeros(0, dt)

        return cls(list(table), cat(codes, np.int32), cat(parent, np.int32), cat(depth, np.int32), cat(dur, np.int64),
                   offsets, cat(node, np.int64), cat(key, np.int64), all(b.checked for b in batches))

    def select(self, idx: np.ndarray) -> "Sequences":
        """The sequences ``idx`` (in that order) as a new batch sharing the symbol table."""
        idx = np.asarray(idx, dtype=np.int64)
        a, b = self.offsets[idx], self.offsets[idx + 1]
        rows = ranges(a, b)
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(b - a, out=offsets[1:])
        return Sequences(self.symbols, self.codes[rows], self.parent[rows], self.depth[rows], self.duration[rows],
                         offsets, self.node_id[rows] if len(self.node_id) else self.node_id,
                         self.key[idx] if len(self.key) else self.key, self.checked)


def dfs_parents(depth: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Parents implied by a preorder's depths: the last earlier node one level up in the same
    sequence (-1 for depth 0). Vectorized per depth level."""
    n = len(depth)
    out = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return out
    seq = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    pos = np.arange(n, dtype=np.int64)
    maxd = int(depth.max())
    for d in range(1, maxd + 1):
        kids = np.flatnonzero(depth == d)
        ups = np.flatnonzero(depth == d - 1)
        if not kids.size or not ups.size:
            continue
        k = np.searchsorted(ups, kids) - 1
        ok = k >= 0
        cand = ups[np.maximum(k, 0)]
        ok &= seq[cand] == seq[kids]
        out[kids[ok]] = pos[cand[ok]] - offsets[seq[kids[ok]]]
    return out


def check_preorder(parent: np.ndarray, depth: np.ndarray, offsets: np.ndarray, where: str = "") -> None:
    """Raise unless every sequence is a depth-first preorder: roots at depth 0, each node's parent
    earlier in the sequence and one level up, and the parent the one the depths imply (the last
    node one level up), i.e. no subtree interleaves with another."""
    n = len(parent)
    if n == 0:
        return
    seq = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    local = np.arange(n, dtype=np.int64) - offsets[seq]
    p = parent.astype(np.int64)
    bad = (p < -1) | (p >= local)
    root = p < 0
    gp = np.where(root, 0, p + offsets[seq])
    bad |= root & (depth != 0)
    bad |= ~root & (depth != depth[np.clip(gp, 0, n - 1)] + 1)
    if not bad.any():
        bad |= dfs_parents(depth, offsets) != p
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        s = int(seq[i])
        raise TellerError(
            f"{where or 'trace'}: sequence {s} node {int(local[i])} (parent {int(p[i])}, depth {int(depth[i])}) "
            "breaks the depth-first order TPE needs; rebuild the forest with `teller reconstruct RUN`"
        )


# --------------------------------------------------------------------------------------------
# forest

#: The forest columns the serializer reads beyond the structural ones (``is_gpu`` for self times).
_READ_COLUMNS = ["tid", "device", "kind"]


def run_step_ids(run: str | os.PathLike) -> np.ndarray:
    """Node id of each step of the run (``steps.parquet``'s ``step_id``: a STEP range's or profiler
    step's node; -1 for a fixed window, which has no node; empty without steps)."""
    rd = RunDir(run)
    if not rd.has_table("steps"):
        return np.zeros(0, np.int64)
    return rd.read_table("steps", columns=["step_id"]).column("step_id").to_numpy().astype(np.int64)


def _symbols(forest: Forest, normalizer: Normalizer | None) -> tuple[np.ndarray, list[str]]:
    """Symbol code of every row and the symbol table (one normalization per (layer, name) pair)."""
    return forest.pair_map((normalizer or _DEFAULT_NORMALIZER).symbols)


def _pack(forest: Forest, rows: np.ndarray, offsets: np.ndarray, parent: np.ndarray, depth: np.ndarray, key: np.ndarray,
          duration: str, normalizer: Normalizer | None) -> Sequences:
    if duration not in DURATIONS:
        raise ValueError(f"duration must be one of {DURATIONS}, not {duration!r}")
    dur = forest.self_ns if duration == "self" else forest.dur_ns
    check_preorder(parent, depth, offsets, forest.path)
    codes, symbols = _symbols(forest, normalizer)
    return Sequences(symbols, codes[rows], parent.astype(np.int32), depth.astype(np.int32),
                     dur[rows].astype(np.int64, copy=False), offsets, rows.astype(np.int64, copy=False),
                     key.astype(np.int64, copy=False), checked=True)


def serialize_steps(forest: Forest, step_ids: Sequence[int] | np.ndarray, duration: str = "self",
                    normalizer: Normalizer | None = None) -> Sequences:
    """One sequence per step: the step node's subtree in forest row order (its DFS preorder).

    ``step_ids`` are node ids of STEP nodes (``steps.parquet``'s ``step_id``, :func:`run_step_ids`).
    Any node id works (its subtree is serialized), which is how non-STEP roots are encoded.
    """
    ids = np.asarray(step_ids, dtype=np.int64)
    sid = forest.rows_of(ids)
    n = len(forest)
    if (sid < 0).any():
        bad = int(ids[sid < 0][0])
        raise TellerError(f"{forest.path or 'forest'}: node {bad} does not exist (the forest has {n} rows); pick a step_id from steps.parquet")
    size = forest.size[sid]
    offsets = np.zeros(len(sid) + 1, dtype=np.int64)
    np.cumsum(size, out=offsets[1:])
    rows = ranges(sid, sid + size)
    base = np.repeat(sid, size)
    parent = forest.parent[rows].astype(np.int64)  # in place from here: a node per row of every step, held once
    parent -= base
    parent[offsets[:-1][size > 0]] = -1
    depth = forest.depth[rows].astype(np.int64)
    depth -= forest.depth[base]
    del base
    return _pack(forest, rows, offsets, parent, depth, ids, duration, normalizer)


def serialize_nodes(forest: Forest, node_sets: Sequence[np.ndarray], duration: str = "self",
                    normalizer: Normalizer | None = None) -> Sequences:
    """One sequence per node set (a slice): nodes in forest row order, each node's parent its
    nearest ancestor inside the set, depth the number of such ancestors."""
    sets = [np.unique(np.asarray(s, dtype=np.int64)) for s in node_sets]
    n = len(forest)
    for s in sets:
        if s.size and (s[0] < 0 or s[-1] >= n):
            raise TellerError(f"{forest.path or 'forest'}: slice names node {int(s[0] if s[0] < 0 else s[-1])}, which is not in the forest ({n} rows)")
    lens = np.array([len(s) for s in sets], dtype=np.int64)
    offsets = np.zeros(len(sets) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    rows = np.concatenate(sets) if sets else np.zeros(0, np.int64)
    seq = np.repeat(np.arange(len(sets), dtype=np.int64), lens)
    # membership of (sequence, node) by one sorted key
    key = seq * n + rows
    anc = forest.parent[rows].copy()
    pos = np.full(len(rows), -1, dtype=np.int64)
    live = np.flatnonzero(anc >= 0)
    while live.size:
        k = seq[live] * n + anc[live]
        j = np.searchsorted(key, k)
        hit = (j < len(key)) & (key[np.minimum(j, len(key) - 1)] == k)
        pos[live[hit]] = j[hit]
        rest = live[~hit]
        anc[rest] = forest.parent[anc[rest]]
        live = rest[anc[rest] >= 0]
    parent = np.where(pos >= 0, pos - offsets[seq], -1)
    depth = np.zeros(len(rows), dtype=np.int64)
    has = np.flatnonzero(pos >= 0)
    for _ in range(int(forest.depth.max(initial=0)) + 1):  # depth levels, not nodes
        nd = depth[pos[has]] + 1
        if np.array_equal(nd, depth[has]):
            break
        depth[has] = nd
    keys = np.array([s[0] if s.size else -1 for s in sets], dtype=np.int64)
    return _pack(forest, rows, offsets, parent, depth, keys, duration, normalizer)


def serialize_run(run: str | os.PathLike, step_ids: Sequence[int] | None = None, duration: str = "self", normalizer: Normalizer | None = None) -> Sequences:
    """Every step of a reconstructed run as a batch: the rows of its iteration, i.e. of its
    ``step_idx`` (the step's node subtree with, for engine iterations, the schedule/update ranges
    and GAP rows around it and roots of other threads that joined it; for fixed windows the
    window's rows; :func:`serialize_nodes`), keyed by the step's node id (a window: its first
    row). With ``step_ids`` (node ids), those nodes' subtrees (:func:`serialize_steps`)."""
    forest = Forest.read(run, [*_READ_COLUMNS, "step_idx"])
    sid = run_step_ids(run) if step_ids is None else step_ids
    if step_ids is None and not len(sid):
        raise TellerError(f"{run}: the run has no steps (steps.parquet is empty); serialize chosen subtrees with serialize_steps(forest, node_ids)")
    if step_ids is None:
        if "step_idx" not in forest.table.column_names:
            if (np.asarray(sid) < 0).any():
                raise TellerError(f"{forest.path}: no step_idx column; re-run `teller reconstruct {run}`")
            return serialize_steps(forest, sid, duration, normalizer)
        order = np.argsort(forest.step_idx, kind="stable")
        bounds = np.searchsorted(forest.step_idx[order], np.arange(len(sid) + 1))
        seqs = serialize_nodes(forest, [order[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)], duration, normalizer)
        sid = np.asarray(sid, np.int64)
        seqs.key = np.where(sid >= 0, sid, seqs.key)
        return seqs
    return serialize_steps(forest, sid, duration, normalizer)
