"""The call forest (``forest.parquet``, docs/design.md §5) and its one reader, :class:`Forest`.

``teller reconstruct`` writes one row per node in depth-first preorder: ``node_id`` is the row,
``parent_id`` the parent's node id (-1 for a root), ``depth`` the number of ancestors and ``size``
the nodes of the subtree (itself included), so every subtree is the row block
``[node_id, node_id + size)``. Every later stage reads the forest through :class:`Forest`, which
gives the columns as numpy arrays on *row positions* and the derived quantities, each defined once:

- ``parent``: row of the parent, -1 for a root (node ids need not be ``0..n-1``: a dataset's
  subtrees, a hand-built table);
- ``is_gpu_work``: kernels, copies and sets (:data:`teller.rundir.GPU_KINDS`; by the ``K``/``MEM``
  layer tags when the table has no ``kind``); ``is_gpu``: those plus the rows without a host thread
  (``tid < 0``) that sit on a device or are synchronization records: what reconstruction does not
  nest as a host call;
- ``self_ns``: a node's span minus the spans of its direct *host* children (children that are not
  ``is_gpu``), at least 0. A kernel's time is not its launcher's own work, so GPU children are not
  subtracted; a GPU row's self time is its span;
- ``family``: the operator family of a row, ``LAYER normalized-name`` (:func:`family_name`), coded
  into the sorted list ``families``;
- subtree sums in one prefix sum when the rows are a depth-first layout, else level by level
  (tables whose parents merely precede, or even follow, their children give the same numbers).

Everything derived is computed on first use, and columns a table lacks read as -1 (``flags`` 0).
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from teller.errors import TellerError
from teller.rundir import (
    EVENT_SCHEMA,
    IS_GPU_KIND,
    KIND_CODE,
    LAYER_CODE,
    LAYERS,
    RunDir,
    dict_codes,
)

__all__ = ["FOREST_SCHEMA", "FOREST_COLUMNS", "COLD_STEPS", "Forest", "family_name", "family_names", "gpu_rows", "ranges",
           "step_blocks", "warmup_steps"]

_E = EVENT_SCHEMA
#: ``forest.parquet``: the event columns a node keeps, plus its place in the forest.
FOREST_SCHEMA = pa.schema([
    pa.field("node_id", pa.int64()),
    pa.field("parent_id", pa.int64()),
    *(_E.field(c) for c in ("layer", "name", "start_ns", "end_ns", "node", "rank", "pid", "tid", "device", "stream",
                            "corr_id")),
    pa.field("step_id", pa.int64()),  # node id of the innermost enclosing STEP, -1 none
    pa.field("step_idx", pa.int64()),  # row of the node's step in steps.parquet, -1 none (reconstruct decides)
    _E.field("flags"),
    pa.field("depth", pa.int32()),
    pa.field("size", pa.int64()),
    *(_E.field(c) for c in ("kind", "graph_id", "bytes", "args")),
])
FOREST_COLUMNS = tuple(FOREST_SCHEMA.names)
#: Columns without which a table is not a forest (and ``parent_id``, or ``size`` in a depth-first layout).
REQUIRED_COLUMNS = ("layer", "name", "start_ns", "end_ns")
#: Read by :meth:`Forest.read` whatever else is asked for (``depth``/``size`` spare recomputing).
_BASE_COLUMNS = ("node_id", "parent_id", *REQUIRED_COLUMNS, "depth", "size")



def ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, e)`` for each pair, vectorized (subtree blocks → rows)."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(ends, dtype=np.int64) - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    shift = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return shift + np.arange(total, dtype=np.int64)


def with_iterations(keep: np.ndarray, is_step: np.ndarray, step_id: np.ndarray, step_idx: np.ndarray,
                    run: np.ndarray | None = None) -> np.ndarray:
    """``keep`` (bool per row: rows of kept STEP subtrees) with the rows of those steps' engine
    iterations outside every STEP subtree: ``step_id < 0`` and the ``step_idx`` of a kept STEP row
    (``is_step``) of the same ``run`` (int codes; None: one run). The schedule/update ranges and
    GAP rows an iteration holds beside its STEP (docs/design.md §5.7)."""
    six = np.asarray(step_idx, np.int64)
    r = np.zeros(len(six), np.int64) if run is None else np.asarray(run, np.int64)
    key = r << 40 | np.maximum(six, 0)
    kept = np.unique(key[keep & is_step & (six >= 0)])
    return keep | ((np.asarray(step_id) < 0) & (six >= 0) & np.isin(key, kept))


def gpu_rows(gpu_work: np.ndarray, tid: np.ndarray, device: np.ndarray, sync: np.ndarray) -> np.ndarray:
    """The GPU-row rule (:attr:`Forest.is_gpu`, and reconstruction's before the forest is
    written): GPU work, and rows without a host thread (``tid < 0``) that sit on a device or are
    synchronization records."""
    return gpu_work | ((tid < 0) & ((device >= 0) | sync))


def _parents_from_sizes(size: np.ndarray) -> np.ndarray:
    """Parent rows of a depth-first layout given by subtree sizes: a row's ancestors are the earlier
    rows whose block ``[p, p + size)`` holds it, its parent the last of them (one pass per depth)."""
    n = len(size)
    rows = np.arange(n, dtype=np.int64)
    end = np.clip(rows + np.maximum(size, 1), rows + 1, n)
    depth = np.cumsum(np.bincount(rows + 1, minlength=n + 1) - np.bincount(end, minlength=n + 1))[:n]
    parent = np.full(n, -1, np.int64)
    for d in range(1, int(depth.max(initial=0)) + 1):
        kids, ups = np.flatnonzero(depth == d), np.flatnonzero(depth == d - 1)
        parent[kids] = ups[np.maximum(np.searchsorted(ups, kids) - 1, 0)]
    return parent


# ---------------------------------------------------------------------------------------------
# families

_KV = re.compile(r"(?:^|\s)[\w.\-]+=\S*")
_NUM = re.compile(r"(?<![\w.])\d+(?![\w])|(?<=\.)\d+(?=\.|$)")


def family_name(layer: str, name: str) -> str:
    """Operator family of a node: its layer tag and its name with ``key=value`` words removed and
    stand-alone numbers replaced by ``#`` (``COMM all_reduce bytes=8192 seq=3`` → ``COMM all_reduce``,
    ``FE model.layers.3.mlp`` → ``FE model.layers.#.mlp``)."""
    t = _NUM.sub("#", _KV.sub(" ", name))
    t = " ".join(t.split()) or name.strip() or "?"
    return f"{layer} {t}"


def family_names(layer: str, names: Sequence[str]) -> list[str]:
    """:func:`family_name` of each name, all of one layer."""
    return [family_name(layer, s) for s in names]


def _pair_families(layers: list[str], names: list[str]) -> list[str]:
    return [family_name(lay, s) for lay, s in zip(layers, names, strict=True)]


# ---------------------------------------------------------------------------------------------
# the forest


class _Column:
    """A forest column as a numpy array, converted on first access (-1 / ``fill`` when absent)."""

    def __init__(self, column: str, dtype: Any = np.int64, fill: int = -1):
        self.column, self.dtype, self.fill = column, dtype, fill

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj: "Forest | None", owner: type) -> Any:
        if obj is None:
            return self
        v = obj._np(self.column, self.dtype, self.fill)
        obj.__dict__[self.attr] = v
        return v


class Forest:
    """A call forest as numpy arrays on row positions (module docstring)."""

    node: np.ndarray = _Column("node", np.int32)
    rank: np.ndarray = _Column("rank", np.int32)
    pid: np.ndarray = _Column("pid")
    tid: np.ndarray = _Column("tid")
    device: np.ndarray = _Column("device", np.int32)
    stream: np.ndarray = _Column("stream")
    corr_id: np.ndarray = _Column("corr_id")
    step_id: np.ndarray = _Column("step_id")  # node id of the innermost enclosing STEP, -1 none
    step_idx: np.ndarray = _Column("step_idx")  # row of the node's step in steps.parquet, -1 none
    flags: np.ndarray = _Column("flags", np.int32, 0)
    nbytes: np.ndarray = _Column("bytes")

    def __init__(self, table: pa.Table, path: str = ""):
        """Use :meth:`from_table` or :meth:`read`."""
        self.table = table
        self.path = path
        self.n = table.num_rows
        n = self.n
        self.node_id = self._np("node_id") if "node_id" in table.column_names else np.arange(n, dtype=np.int64)
        if "parent_id" not in table.column_names:  # a bare depth-first layout: subtree sizes only
            self.parent = _parents_from_sizes(self._np("size"))
            self._pair_maps: dict[Any, tuple[np.ndarray, list[str]]] = {}
            return
        parent_id = self._np("parent_id")
        node_id = self.node_id
        if n and np.array_equal(node_id, np.arange(n)):
            parent = np.where((parent_id >= 0) & (parent_id < n), parent_id, -1)
        elif n:
            # ids ascending (a depth-first table) are searched as they are; else their sorted copy
            # (a search through ``sorter`` reads them at random), mapped back through the order
            order = None if (node_id[1:] > node_id[:-1]).all() else np.argsort(node_id, kind="stable")
            pos = np.clip(np.searchsorted(node_id if order is None else node_id[order], parent_id), 0, n - 1)
            hit = pos if order is None else order[pos]
            parent = np.where((parent_id >= 0) & (node_id[hit] == parent_id), hit, -1)
        else:
            parent = parent_id
        self.parent = parent.astype(np.int64)
        self._pair_maps = {}

    @classmethod
    def from_table(cls, table: pa.Table, path: str = "") -> "Forest":
        """A forest from a table with the forest's columns (at least :data:`REQUIRED_COLUMNS` and
        ``parent_id``; rows in any order, node ids any distinct integers). Without ``parent_id`` the
        rows must be a depth-first layout with a ``size`` column, node ids the rows."""
        have = table.column_names
        missing = [c for c in REQUIRED_COLUMNS if c not in have]
        missing += [] if "parent_id" in have or "size" in have else ["parent_id"]
        if missing:
            raise TellerError(f"{path or 'forest table'}: lacks columns {missing}; write it with `teller reconstruct RUN`")
        return cls(table, path)

    @classmethod
    def read(cls, run: str | os.PathLike, columns: Sequence[str] | None = None) -> "Forest":
        """``RUN/forest.parquet``: every column but ``args`` (the only wide one), or with ``columns``
        only those (plus node ids, parents, layers, names, times, depths and sizes)."""
        rd = RunDir(run)
        if not rd.path.is_dir():
            rd.require()  # says how to make one
        p = rd.path / "forest.parquet"
        if not p.is_file():
            raise TellerError(f"{p}: missing; run `teller reconstruct {rd.path}` first")
        try:
            have = set(pq.ParquetFile(p).schema_arrow.names)
            want = set(_BASE_COLUMNS) | (set(FOREST_COLUMNS) - {"args"} if columns is None else set(columns))
            cols = [c for c in FOREST_COLUMNS if c in want and c in have]
            cols += [c for c in (columns or ()) if c in have and c not in cols]
            table = pq.read_table(p, columns=cols)
        except (pa.ArrowInvalid, OSError) as e:
            raise TellerError(f"{p}: unreadable Parquet ({e}); re-run `teller reconstruct {rd.path}`") from e
        return cls.from_table(table, str(p))

    def __len__(self) -> int:
        return self.n

    def _np(self, name: str, dtype: Any = np.int64, fill: int = -1) -> np.ndarray:
        if name not in self.table.column_names:
            return np.full(self.n, fill, dtype)
        col = self.table.column(name)
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if col.null_count:
            col = col.fill_null(fill)
        return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)

    # -- columns -----------------------------------------------------------------------------
    @cached_property
    def start(self) -> np.ndarray:
        return self._np("start_ns")

    @cached_property
    def end(self) -> np.ndarray:
        """``end_ns``, never before ``start_ns``."""
        return np.maximum(self._np("end_ns"), self.start)

    @cached_property
    def layer(self) -> np.ndarray:
        """Codes into :data:`LAYERS` (tags it does not know read as ``OTHER``)."""
        codes, dictionary = dict_codes(self.table, "layer")
        remap = np.array([LAYER_CODE.get(x, LAYER_CODE["OTHER"]) for x in dictionary] or [0], dtype=np.int8)
        return remap[codes] if self.n else codes.astype(np.int8)

    @cached_property
    def _names(self) -> tuple[np.ndarray, list[str]]:
        return dict_codes(self.table, "name")

    @property
    def name_codes(self) -> np.ndarray:
        return self._names[0]

    @property
    def names(self) -> list[str]:
        return self._names[1]

    def name(self, row: int) -> str:
        return self.names[self.name_codes[row]]

    @cached_property
    def kind(self) -> np.ndarray:
        """Codes into :data:`teller.rundir.KINDS`, -1 unknown (or no ``kind`` column)."""
        if "kind" not in self.table.column_names:
            return np.full(self.n, -1, np.int8)
        codes, dictionary = dict_codes(self.table, "kind")
        remap = np.array([KIND_CODE.get(x, -1) for x in dictionary] or [0], dtype=np.int8)
        return remap[codes] if self.n else codes.astype(np.int8)

    @cached_property
    def dur_ns(self) -> np.ndarray:
        """``end - start`` of every row."""
        return self.end - self.start

    # -- node classes ------------------------------------------------------------------------
    def kind_or_layer(self, kind: str, layer: str) -> np.ndarray:
        """Rows of event kind ``kind`` (by the ``kind`` column, else by the layer tag)."""
        known = self.kind >= 0
        return np.where(known, self.kind == KIND_CODE[kind], self.layer == LAYER_CODE[layer])

    @cached_property
    def is_gpu_work(self) -> np.ndarray:
        """Kernels, copies and sets (by kind; by the ``K``/``MEM`` tags where the kind is unknown)."""
        return np.where(self.kind >= 0, IS_GPU_KIND[np.maximum(self.kind, 0)],
                        np.isin(self.layer, [LAYER_CODE["K"], LAYER_CODE["MEM"]]))

    @cached_property
    def is_gpu(self) -> np.ndarray:
        """Rows that are not host calls: GPU work, and rows without a host thread (``tid < 0``) that
        sit on a device (GPU annotations) or are synchronization records (CUPTI's, bound to the
        runtime call that waited), as reconstruction decides it when it nests host calls."""
        return gpu_rows(self.is_gpu_work, self.tid, self.device, self.kind_or_layer("SYNC", "SYNC"))

    @cached_property
    def self_ns(self) -> np.ndarray:
        """Span minus the spans of the direct host (not :attr:`is_gpu`) children, at least 0."""
        host_child = np.flatnonzero((self.parent >= 0) & ~self.is_gpu)
        dur = self.dur_ns
        kids = np.bincount(self.parent[host_child], weights=dur[host_child], minlength=self.n) if self.n else np.zeros(0)
        return np.maximum(dur - np.rint(kids).astype(np.int64), 0)

    # -- families ----------------------------------------------------------------------------
    def pair_map(self, fn: Callable[[list[str], list[str]], list[str]]) -> tuple[np.ndarray, list[str]]:
        """Codes (int32) into a sorted string table of ``fn(layers, names)`` per row, ``fn`` called once
        per distinct (layer, name) pair and the result kept per ``fn``."""
        got = self._pair_maps.get(fn)
        if got is not None:
            return got
        width = len(self.names) + 1
        key = self.layer.astype(np.int64) * width + self.name_codes
        span = (int(self.layer.max(initial=0)) + 1) * width
        if span <= max(4 * self.n, 1 << 20):  # a dense table of the keys: no sort of the rows
            seen = np.zeros(span, bool)
            seen[key] = True
            ukey = np.flatnonzero(seen)
            slot = np.cumsum(seen) - 1
            inv = slot[key]
        else:
            ukey, inv = np.unique(key, return_inverse=True)
        lay, nc = np.divmod(ukey, width)
        strings = fn([LAYERS[i] for i in lay.tolist()], [self.names[i] for i in nc.tolist()])
        if strings:
            table, code = np.unique(np.asarray(strings, dtype=object).astype(str), return_inverse=True)
        else:
            table, code = np.zeros(0, str), np.zeros(0, np.int64)
        codes = code[inv.reshape(-1)].astype(np.int32) if self.n else np.zeros(0, np.int32)
        got = (codes, [str(x) for x in table])
        self._pair_maps[fn] = got
        return got

    @property
    def family(self) -> np.ndarray:
        """Family code of every row (into :attr:`families`)."""
        return self.pair_map(_pair_families)[0]

    @property
    def families(self) -> list[str]:
        """The forest's operator families, sorted."""
        return self.pair_map(_pair_families)[1]

    # -- structure ---------------------------------------------------------------------------
    @cached_property
    def depth(self) -> np.ndarray:
        """Ancestors of every row (the ``depth`` column when it agrees with the parents)."""
        parent, has = self.parent, self.parent >= 0
        if "depth" in self.table.column_names:
            d = self._np("depth", np.int32)
            if np.all(d[has] == d[parent[has]] + 1) and np.all(d[~has] == 0):
                return d
        d = np.zeros(self.n, np.int32)
        for _ in range(self.n + 1):
            nd = np.where(has, d[np.maximum(parent, 0)] + 1, 0).astype(np.int32)
            if np.array_equal(nd, d):
                return d
            d = nd
        r = int(np.flatnonzero(d > self.n)[0]) if (d > self.n).any() else 0
        raise TellerError(f"{self.path or 'forest'}: row {r} (node {int(self.node_id[r])}) is its own ancestor; "
                          "re-run `teller reconstruct`")

    def _is_preorder(self, size: np.ndarray) -> bool:
        n = self.n
        if len(size) != n:
            return False
        if n == 0:
            return True
        if np.any(size < 1) or np.any(np.arange(n) + size > n):
            return False
        c = np.flatnonzero(self.parent >= 0)
        p = self.parent[c]
        return bool(np.all((p < c) & (c + size[c] <= p + size[p])))

    @cached_property
    def size(self) -> np.ndarray:
        """Nodes of every row's subtree, itself included (the ``size`` column when it is a valid
        depth-first layout)."""
        if "size" in self.table.column_names:
            s = self._np("size")
            if self._is_preorder(s):
                return s
        return self._level_sums(np.ones(self.n, np.int64))

    @cached_property
    def preorder(self) -> bool:
        """Every subtree is the row block ``[row, row + size)``."""
        return self._is_preorder(self.size)

    @cached_property
    def levels(self) -> list[np.ndarray]:
        """Rows grouped by depth, shallowest first."""
        order = np.argsort(self.depth, kind="stable")
        bounds = np.searchsorted(self.depth[order], np.arange(int(self.depth.max(initial=-1)) + 2))
        return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def _level_sums(self, values: np.ndarray) -> np.ndarray:
        total = values.copy()
        for rows in self.levels[:0:-1]:  # deepest first, roots excluded
            p = self.parent[rows]
            if total.dtype.kind == "f":
                total += np.bincount(p, weights=total[rows], minlength=self.n)
            else:
                np.add.at(total, p, total[rows])
        return total

    def subtree_sums(self, values: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Σ ``values`` over each node's subtree (itself included), for ``rows`` (default all);
        int64 for integer or boolean values, else float64."""
        values = np.asarray(values)
        dtype = np.int64 if values.dtype.kind in "iub" else np.float64
        if self.preorder:
            rows = np.arange(self.n) if rows is None else rows
            c = np.empty(len(values) + 1, dtype)
            c[0] = 0
            np.cumsum(values, dtype=dtype, out=c[1:])
            return c[rows + self.size[rows]] - c[rows]
        total = self._level_sums(values.astype(dtype))
        return total if rows is None else total[rows]

    def subtree_sums_sparse(self, mask: np.ndarray, values: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
        """:meth:`subtree_sums` of ``values`` (default 1) where ``mask`` is set, 0 elsewhere, for
        a few ``rows``: with the preorder layout, from the set rows' positions alone (a search
        per row, not a pass over the forest); int64 for integer values."""
        pos = np.flatnonzero(mask)
        if not self.preorder:
            v = np.zeros(self.n, np.int64 if values is None else np.asarray(values).dtype)
            v[pos] = 1 if values is None else np.asarray(values)[pos]
            return self.subtree_sums(v, rows)
        lo = np.searchsorted(pos, rows)
        hi = np.searchsorted(pos, rows + self.size[rows])
        if values is None:
            return (hi - lo).astype(np.int64)
        v = np.asarray(values)[pos]
        dtype = np.int64 if v.dtype.kind in "iub" else np.float64
        c = np.zeros(len(v) + 1, dtype)
        np.cumsum(v, dtype=dtype, out=c[1:])
        return c[hi] - c[lo]

    def subtree_counts(self, mask: np.ndarray) -> np.ndarray:
        """Nodes of each subtree (itself included) with ``mask`` set."""
        return self.subtree_sums(np.asarray(mask, bool))

    def propagate_down(self, value: np.ndarray, source: np.ndarray) -> np.ndarray:
        """``out[v] = value[v]`` where ``source[v]``, else ``out[parent(v)]`` (roots keep ``value``):
        every node inherits from its nearest source ancestor-or-self."""
        out = value.copy()
        for rows in self.levels[1:]:
            take = rows[~source[rows]]
            out[take] = out[self.parent[take]]
        return out

    def nearest_ancestor(self, mask: np.ndarray) -> np.ndarray:
        """Row of each node's nearest proper ancestor with ``mask`` set, -1 if none."""
        own = np.where(mask, np.arange(self.n), -1)
        anc_or_self = self.propagate_down(own, mask)
        p = self.parent
        return np.where(p >= 0, anc_or_self[np.maximum(p, 0)], -1)

    # -- children and lookup -----------------------------------------------------------------
    @cached_property
    def _children(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        order = np.lexsort((self.start, self.parent))
        has_parent = self.parent[order] >= 0
        child_rows = order[has_parent]
        counts = np.bincount(self.parent[child_rows], minlength=self.n)
        return child_rows, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), order[~has_parent]

    @property
    def child_rows(self) -> np.ndarray:
        """Every row with a parent, grouped by parent and by start time within (CSR with :attr:`child_ptr`)."""
        return self._children[0]

    @property
    def child_ptr(self) -> np.ndarray:
        """Children of row ``r`` are ``child_rows[child_ptr[r]:child_ptr[r + 1]]``."""
        return self._children[1]

    @property
    def roots(self) -> np.ndarray:
        """Rows without a parent, by start time."""
        return self._children[2]

    def children(self, row: int) -> np.ndarray:
        """Child rows of ``row``, by start time."""
        return self.child_rows[self.child_ptr[row]:self.child_ptr[row + 1]]

    @cached_property
    def _id_order(self) -> np.ndarray | None:
        return None if np.array_equal(self.node_id, np.arange(self.n)) else np.argsort(self.node_id, kind="stable")

    def rows_of(self, node_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Row of each node id, -1 for ids not in the forest."""
        ids = np.asarray(node_ids, dtype=np.int64)
        if self._id_order is None:
            return np.where((ids >= 0) & (ids < self.n), ids, -1)
        if not self.n:
            return np.full(ids.shape, -1, np.int64)
        o = self._id_order
        pos = np.clip(np.searchsorted(self.node_id, ids, sorter=o), 0, self.n - 1)
        return np.where(self.node_id[o[pos]] == ids, o[pos], -1)

    def step_of(self, node_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """``step_id`` of each node id (-1 for ids not in the forest)."""
        r = self.rows_of(node_ids)
        return np.where(r >= 0, self.step_id[np.maximum(r, 0)], -1) if self.n else np.full(r.shape, -1, np.int64)

    def row(self, node_id: int) -> int:
        """Row of a node id, -1 when the forest has no such node."""
        return int(self.rows_of(np.array([node_id]))[0])


def step_blocks(fa: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Steps of a forest whose steps are its STEP nodes' subtrees, by the ``step_id`` column alone
    (a dataset's subtrees: each block is one step, ``step_id`` its STEP node; no ``steps.parquet``):
    the step index of every row (-1: in no step) and the STEP node id of each step, ascending."""
    sid = fa.step_id
    ids = np.unique(fa.node_id[fa.layer == LAYER_CODE["STEP"]])
    pos = np.clip(np.searchsorted(ids, sid), 0, max(len(ids) - 1, 0))
    hit = (sid >= 0) & (ids[pos] == sid) if len(ids) else np.zeros(fa.n, bool)
    return np.where(hit, pos, -1).astype(np.int64), ids.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# warm-up steps

#: a process's first steps pay one-off costs (CUDA context, lazy kernel loading, allocator growth)
COLD_STEPS = 2
_WARMUP_RE = r"reqs=warmup_[^,\s]*(,warmup_[^,\s]*)*(\s|$)"


def warmup_steps(steps: pa.Table) -> np.ndarray:
    """Steps kept out of every reference (the labeller's and the numeric stage's): those serving
    only the workload's warm-up requests (a STEP name ``... reqs=warmup_0,warmup_1``) and the
    first :data:`COLD_STEPS` steps of each process. ``steps`` needs ``name``, ``pid`` and
    ``start_ns`` (a ``steps.parquet`` table, or any table of step rows)."""
    import pyarrow.compute as pc

    n = steps.num_rows
    if not n:
        return np.zeros(0, bool)
    missing = [c for c in ("name", "pid", "start_ns") if c not in steps.column_names]
    if missing:
        raise TellerError(f"step table lacks columns {missing} (needs name, pid, start_ns, as steps.parquet has); "
                          "re-run `teller reconstruct RUN`")
    name = steps.column("name").cast(pa.string())
    warm = pc.match_substring_regex(name, _WARMUP_RE).fill_null(False)
    warm = np.asarray(warm.to_numpy(zero_copy_only=False), bool)
    pid = steps.column("pid").to_numpy().astype(np.int64)
    start = steps.column("start_ns").to_numpy().astype(np.int64)
    order = np.lexsort((start, pid))
    first = np.r_[True, pid[order][1:] != pid[order][:-1]]
    grp_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    rank_in_pid = np.empty(n, np.int64)
    rank_in_pid[order] = np.arange(n) - grp_start
    return warm | (rank_in_pid < COLD_STEPS)
