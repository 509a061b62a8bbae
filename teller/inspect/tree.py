"""Vectorized helpers over a call forest (``forest.parquet``) shared by `show` and `stats`."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from teller.rundir import LAYERS, dict_codes, np_col


class Forest:
    """Column arrays of a forest table plus child lists, built once (no per-node objects)."""

    def __init__(self, table: pa.Table):
        self.table = table
        self.n = table.num_rows
        self.node_id = np_col(table, "node_id").astype(np.int64)
        parent = np_col(table, "parent_id").astype(np.int64)
        # work on row positions: node ids may not be 0..n-1 in a foreign forest
        pos = np.full(int(self.node_id.max()) + 1 if self.n else 0, -1, dtype=np.int64)
        pos[self.node_id] = np.arange(self.n)
        self._pos = pos
        self.parent = np.where(parent >= 0, pos[np.clip(parent, 0, None)] if self.n else parent, -1)
        lcodes, ldict = dict_codes(table, "layer")
        remap = np.array([LAYERS.index(x) if x in LAYERS else LAYERS.index("OTHER") for x in ldict] or [0])
        self.layer = remap[lcodes] if self.n else lcodes
        self.name_codes, self.names = dict_codes(table, "name")
        self.start = np_col(table, "start_ns")
        self.end = np_col(table, "end_ns")
        self.step_id = np_col(table, "step_id").astype(np.int64)
        self.flags = np_col(table, "flags") if "flags" in table.column_names else np.zeros(self.n, np.int32)
        # children in CSR form, ordered by start time
        order = np.lexsort((self.start, self.parent))
        has_parent = self.parent[order] >= 0
        self._child_order = order[has_parent]
        counts = np.bincount(self.parent[self._child_order], minlength=self.n)
        self._child_ptr = np.concatenate([[0], np.cumsum(counts)])
        self.roots = order[~has_parent]
        self._depth = None
        self._shapes = None

    def row(self, node_id: int) -> int:
        return int(self._pos[node_id])

    def children(self, row: int) -> np.ndarray:
        return self._child_order[self._child_ptr[row]:self._child_ptr[row + 1]]

    @property
    def depth(self) -> np.ndarray:
        if self._depth is None:
            d = np.zeros(self.n, dtype=np.int32)
            frontier = self.roots
            level = 0
            while len(frontier):
                d[frontier] = level
                level += 1
                # all children of the frontier, vectorized via the CSR pointers
                starts, stops = self._child_ptr[frontier], self._child_ptr[frontier + 1]
                lens = stops - starts
                if lens.sum() == 0:
                    break
                idx = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(lens.sum())
                frontier = self._child_order[idx]
            self._depth = d
        return self._depth

    def subtree_counts(self, mask: np.ndarray) -> np.ndarray:
        """For every node, how many nodes in its subtree (itself included) satisfy ``mask``."""
        count = mask.astype(np.int64)
        depth = self.depth
        for lv in range(int(depth.max()) if self.n else 0, 0, -1):
            idx = np.nonzero(depth == lv)[0]
            np.add.at(count, self.parent[idx], count[idx])
        return count

    def subtree_sums(self, values: np.ndarray) -> np.ndarray:
        total = values.astype(np.float64).copy()
        depth = self.depth
        for lv in range(int(depth.max()) if self.n else 0, 0, -1):
            idx = np.nonzero(depth == lv)[0]
            np.add.at(total, self.parent[idx], total[idx])
        return total

    def shapes(self) -> np.ndarray:
        """A 64-bit signature per node of its subtree's shape (layers, names, child order; not
        times): equal signatures mean identical call trees, e.g. repeated launch → kernel pairs."""
        if self._shapes is not None:
            return self._shapes
        mult = np.uint64(0x9E3779B97F4A7C15)
        with np.errstate(over="ignore"):
            sig = (self.layer.astype(np.uint64) * np.uint64(1_000_003) + self.name_codes.astype(np.uint64) + np.uint64(1)) * mult
            # a child's position among its siblings weighs its signature, so order matters
            pos = np.empty(self.n, dtype=np.uint64)
            if len(self._child_order):
                parent_of = self.parent[self._child_order]
                pos[self._child_order] = np.arange(len(self._child_order)) - self._child_ptr[parent_of]
            weight = (pos * np.uint64(2) + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9)
            depth = self.depth
            for lv in range(int(depth.max()) if self.n else 0, 0, -1):
                idx = np.nonzero(depth == lv)[0]
                mixed = (sig[idx] ^ (sig[idx] >> np.uint64(31))) * weight[idx]
                np.add.at(sig, self.parent[idx], mixed)
        self._shapes = sig
        return sig

    def name(self, row: int) -> str:
        return self.names[self.name_codes[row]]


def fmt_ns(ns: float) -> str:
    """Human duration: 12.3 ms, 45.6 µs, 789 ns."""
    ns = float(ns)
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.0f} ns"
