"""Serialize steps and slices of the call forest into symbol sequences (DESIGN.md §8).

``forest.parquet`` rows are a depth-first preorder in which every subtree is the contiguous block
``[node_id, node_id + size)`` (see :mod:`teller.reconstruct.forest`). A step's depth-first
traversal is therefore a slice of the forest's rows, and its parent indices are the forest's
parent ids minus the step's node id: no traversal, only a gather. :func:`check_preorder` verifies
that on every batch (an older or foreign forest that breaks it is an error, not a silent
mis-serialization).

A serialized node emits one symbol, its layer tag and normalized name (:mod:`.normalize`), and
keeps three side channels: ``parent`` (index of its parent in the same sequence, -1 for a root),
``depth`` (number of ancestors in the sequence) and ``duration`` (ns). By default the duration is
the node's *self* time: for a host node its span minus the spans of its host children, for GPU
activity (kernels, copies, memsets, device syncs; rows with ``tid < 0``) its own span. Self
times add up without counting a nested interval twice, so when TPE merges tokens and adds their
durations (DESIGN.md §8) the sum stays a time budget. ``duration="total"`` keeps plain spans.

A slice (a subset of a step's nodes, e.g. the causal slice of DESIGN.md §7) keeps the forest's
row order; each node's parent is its nearest ancestor inside the slice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from teller.errors import TellerError
from teller.rundir import LAYERS, RunDir
from teller.tpe.normalize import Normalizer

DURATIONS = ("self", "total")


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


def ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, e)`` for each pair, vectorized."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(ends, dtype=np.int64) - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    shift = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return shift + np.arange(total, dtype=np.int64)


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


@dataclass
class Forest:
    """The forest columns the serializer needs, plus per-node symbol codes."""

    parent: np.ndarray
    depth: np.ndarray
    size: np.ndarray
    self_ns: np.ndarray
    total_ns: np.ndarray
    codes: np.ndarray  # int32 into symbols
    symbols: list[str]
    steps: pa.Table | None = None
    path: str = ""

    def __len__(self) -> int:
        return len(self.parent)

    def step_ids(self) -> np.ndarray:
        if self.steps is None or self.steps.num_rows == 0:
            return np.zeros(0, np.int64)
        return self.steps.column("step_id").to_numpy().astype(np.int64)


_FOREST_COLS = ["parent_id", "layer", "name", "start_ns", "end_ns", "tid", "depth", "size"]


def forest_from_table(table: pa.Table, normalizer: Normalizer | None = None, steps: pa.Table | None = None, path: str = "") -> Forest:
    """Per-node arrays and symbols from a forest table (``forest.parquet`` columns)."""
    missing = [c for c in _FOREST_COLS if c not in table.column_names]
    if missing:
        raise TellerError(f"{path or 'forest'}: missing columns {missing}; rebuild it with `teller reconstruct RUN`")
    norm = normalizer or Normalizer()
    n = table.num_rows
    table = table.select(_FOREST_COLS).unify_dictionaries()

    def np64(c: str) -> np.ndarray:
        col = table.column(c)
        return (col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)).to_numpy(zero_copy_only=False).astype(np.int64)

    def dict_col(c: str) -> tuple[np.ndarray, list[str]]:
        col = table.column(c)
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        if not pa.types.is_dictionary(col.type):
            col = col.dictionary_encode()
        idx = col.indices
        if idx.null_count:
            idx = idx.fill_null(len(col.dictionary))
        return idx.to_numpy(zero_copy_only=False).astype(np.int64), col.dictionary.cast(pa.string()).to_pylist() + [""]

    parent = np64("parent_id")
    start, end = np64("start_ns"), np64("end_ns")
    total = np.maximum(end - start, 0)
    host_child = (np64("tid") >= 0) & (parent >= 0)
    kids = np.bincount(parent[host_child], weights=total[host_child], minlength=n)[:n] if n else np.zeros(0)
    self_ns = np.maximum(total - np.rint(kids).astype(np.int64), 0)

    lcode, ldict = dict_col("layer")
    ncode, ndict = dict_col("name")
    ldict = [x if x in LAYERS else (x or "OTHER") for x in ldict]
    pair = lcode * (len(ndict) + 1) + ncode
    uniq, inv = np.unique(pair, return_inverse=True)
    ul, un = uniq // (len(ndict) + 1), uniq % (len(ndict) + 1)
    syms = norm.symbols([ldict[i] for i in ul.tolist()], [ndict[i] if ndict[i] is not None else "" for i in un.tolist()])
    table_syms, sym_code = np.unique(np.asarray(syms, dtype=object).astype(str), return_inverse=True)
    codes = sym_code[inv].astype(np.int32) if n else np.zeros(0, np.int32)
    return Forest(parent, np64("depth").astype(np.int32), np64("size"), self_ns, total, codes, [str(s) for s in table_syms], steps, path)


def load_forest(run: str | os.PathLike, normalizer: Normalizer | None = None) -> Forest:
    """Read ``RUN/forest.parquet`` and ``RUN/steps.parquet``."""
    rd = RunDir(run)
    if not rd.path.is_dir():
        raise TellerError(f"{rd.path}: no such run directory; make one with `teller ingest` or `teller record`, then `teller reconstruct`")
    hint = f"run `teller reconstruct {rd.path}` first"
    forest = rd.read_table("forest", hint)
    steps = rd.read_table("steps", hint) if rd.has_table("steps") else None
    return forest_from_table(forest, normalizer, steps, str(Path(rd.path) / "forest.parquet"))


def _pack(forest: Forest, rows: np.ndarray, offsets: np.ndarray, parent: np.ndarray, depth: np.ndarray, key: np.ndarray, duration: str) -> Sequences:
    if duration not in DURATIONS:
        raise ValueError(f"duration must be one of {DURATIONS}, not {duration!r}")
    dur = forest.self_ns if duration == "self" else forest.total_ns
    check_preorder(parent, depth, offsets, forest.path)
    return Sequences(forest.symbols, forest.codes[rows], parent.astype(np.int32), depth.astype(np.int32),
                     dur[rows].astype(np.int64), offsets, rows.astype(np.int64), key.astype(np.int64), checked=True)


def serialize_steps(forest: Forest, step_ids: Sequence[int] | np.ndarray | None = None, duration: str = "self") -> Sequences:
    """One sequence per step: the step node's subtree in forest row order (its DFS preorder).

    ``step_ids`` are node ids of STEP nodes (``steps.parquet``'s ``step_id``); default: all steps.
    Any node id works (its subtree is serialized), which is how non-STEP roots are encoded.
    """
    sid = forest.step_ids() if step_ids is None else np.asarray(step_ids, dtype=np.int64)
    n = len(forest)
    if sid.size and (sid.min() < 0 or sid.max() >= n):
        bad = int(sid[(sid < 0) | (sid >= n)][0])
        raise TellerError(f"{forest.path or 'forest'}: node {bad} does not exist (the forest has {n} rows); pick a step_id from steps.parquet")
    size = forest.size[sid]
    offsets = np.zeros(len(sid) + 1, dtype=np.int64)
    np.cumsum(size, out=offsets[1:])
    rows = ranges(sid, sid + size)
    base = np.repeat(sid, size)
    parent = forest.parent[rows] - base
    parent[offsets[:-1][size > 0]] = -1
    depth = forest.depth[rows].astype(np.int64) - forest.depth[base]
    return _pack(forest, rows, offsets, parent, depth, sid, duration)


def serialize_nodes(forest: Forest, node_sets: Sequence[np.ndarray], duration: str = "self") -> Sequences:
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
    return _pack(forest, rows, offsets, parent, depth, keys, duration)


def serialize_run(run: str | os.PathLike, step_ids: Sequence[int] | None = None, duration: str = "self", normalizer: Normalizer | None = None) -> Sequences:
    """Every step of a reconstructed run (or the given ones) as a batch."""
    forest = load_forest(run, normalizer)
    if step_ids is None and not forest.step_ids().size:
        raise TellerError(f"{run}: the run has no STEP ranges (steps.parquet is empty); serialize chosen subtrees with serialize_steps(forest, node_ids)")
    return serialize_steps(forest, step_ids, duration)
