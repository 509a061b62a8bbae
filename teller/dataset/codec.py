"""Compact storage of forest rows in a dataset (``subtrees/part-NNNNN.parquet``), restored exactly on read.

Format ``teller-subtrees/2`` (written). Most of a forest row's bytes are its two times, whose low
bits are measurement jitter; the rest is structure that the rows already imply. A file stores:

- the tree once: ``node_id`` as the difference from the previous row, ``parent_id`` as
  ``node_id - parent_id`` (``-1`` stays ``-1``). Rows are DFS preorder, so the parent of row ``i``
  is row ``i - (node_id - parent_id)`` when that row holds the parent's id (:func:`_parents`);
  the previous sibling and last child follow from it;
- ``start_ns`` against the end of the previous sibling (the gap between two ops), or the start of
  the parent for a first child, or the start of the previous root for a root;
- ``end_ns`` against the end of the last child when that child runs on the host (the tail of a
  range after its last call), else against the row's own start (its duration). Both time columns
  are stored grouped by ``name`` (the stable order of the stored name codes, which the reader
  computes from the same codes): rows of one op have durations and gaps of one size, which zstd codes in
  fewer bits than the same values in tree order;
- ``corr_id``: null where the row's id is its parent's (a kernel and its launch), else the
  difference from the previous row that is not; ``corr_id_valid`` only when some id is null;
- ``depth`` and ``size`` as the difference from what the tree implies (zero unless the file holds
  a step only in part);
- dictionary and string columns other than ``run_id`` (``name``, ``layer``, ``kind``, ``args``)
  as codes plus their distinct values in a companion column ``<name>.values`` padded with nulls
  (Parquet's own dictionary pages code them worse); a dictionary keeps only the entries the
  file's rows use, in their order, so the values read back are the same while the codes may not
  be (:func:`differing_columns` compares by value);

with BYTE_STREAM_SPLIT for the numbers of varying width, all under zstd. Every transform is exact
in 64-bit two's complement (differences wrap as the sums that undo them do), and a column that
does not fit its transform (nulls, a missing partner column) is stored as it is. On the H200
recordings of dataset v1 (``data/h200_v1``, where it was measured; in git history: ``git checkout
644acca -- data/h200_v1``) this stores a row in 4.05 bytes instead of 5.55 (v1; 10.5 as plain
Parquet), 3.4 of them the two times, whose nanosecond jitter no lossless transform removes
(``benchmarks/dataset_codec.py``, ``benchmarks/README.md``). Reading costs a few numpy passes per
tree level (:func:`_decode_times`).

Format ``teller-subtrees/1`` (read only; dataset v1 was stored in it, ``data/h200_v2`` is in
format 2; ``tests/data/subtrees_v1_part7_head.parquet`` keeps a small file of it): ``start_ns``,
``node_id`` and ``corr_id`` as differences from the previous row, ``end_ns`` as the duration,
``parent_id`` as above, ``corr_id_valid`` always. ``teller dataset recode SRC -o DST`` rewrites
a dataset's subtrees in the current format.

A dataset's rows are cut into parts of at most :data:`PART_ROWS` rows, at step boundaries where
possible, each part encoded on its own, so no file of a committed dataset grows large.
:func:`read_subtrees` returns the forest columns value for value, whatever the format of each part
(``tests/test_dataset_codec.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.errors import InputError

#: the format marker of the files written
CODEC = "teller-subtrees/2"
#: the first format (still read)
CODEC_V1 = "teller-subtrees/1"
_DELTA = ("start_ns", "node_id", "corr_id")
#: rows per part file of a dataset's subtrees
PART_ROWS = 1_000_000
#: forest kinds that run on a device (their times are not on the host's call stack)
_DEVICE_KINDS = ("KERNEL", "MEMCPY", "MEMSET")
#: columns kept as Parquet dictionary columns (``run_id`` is read alone by run filters)
_KEEP_DICT = ("run_id",)
_SPLIT = ("start_ns", "end_ns", "node_id", "parent_id", "corr_id")
#: zstd level: 19 is 1% smaller and 3x slower to write (benchmarks/README.md)
COMPRESSION, LEVEL = "zstd", 15


def _prev_diff(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    if len(x):
        out[0] = x[0]
        np.subtract(x[1:], x[:-1], out=out[1:])
    return out


def _i64(col) -> np.ndarray | None:
    """A null-free integer column as int64, or None (the column is then stored as it is)."""
    if col is None or col.null_count or not pa.types.is_integer(col.type):
        return None
    return np.asarray(col.to_numpy(), dtype=np.int64)


def _chain(const: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """``x[i] = const[i] + x[ref[i]]`` (``ref[i] == -1``: ``x[i] = const[i]``) for references that
    form a forest, by pointer jumping: log2(longest chain) passes over the rows still linked."""
    x = const.astype(np.int64, copy=True)
    r = ref.astype(np.int32 if len(ref) < 2**31 else np.int64, copy=True)
    act = np.flatnonzero(r >= 0).astype(r.dtype)
    with np.errstate(over="ignore"):
        while act.size:
            ra = r[act]
            x[act] += x[ra]
            ra = r[ra]
            r[act] = ra
            act = act[ra >= 0]
    return x


def _parents(nid: np.ndarray, par: np.ndarray) -> np.ndarray:
    """Row of each row's parent in the file (-1: a root, or a parent outside the file)."""
    n = len(nid)
    with np.errstate(over="ignore"):
        off = nid - par
    p = np.arange(n, dtype=np.int64) - off
    ok = (par >= 0) & (off > 0) & (p >= 0)
    idx = np.flatnonzero(ok)
    ok[idx] = nid[p[idx]] == par[idx]
    return np.where(ok, p, -1)


def _siblings(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Previous row with the same parent row (roots: the previous root), and each row's last child."""
    n = len(p)
    o = np.argsort(p, kind="stable")
    ps = p[o]
    prev = np.full(n, -1, np.int64)
    last = np.full(n, -1, np.int64)
    if n:
        same = ps[1:] == ps[:-1]
        prev[o[1:][same]] = o[:-1][same]
        end = np.r_[~same, True] & (ps >= 0)
        last[ps[end]] = o[end]
    return prev, last


def _tree_size(p: np.ndarray, levels: list[np.ndarray] | None = None) -> np.ndarray:
    """Rows in each row's subtree, counting only rows in the file."""
    n = len(p)
    cnt = np.ones(n, np.int64)
    for rows in (_levels(p) if levels is None else levels)[:0:-1]:
        cnt += np.bincount(p[rows], weights=cnt[rows], minlength=n).astype(np.int64)
    return cnt


def _device_rows(kind) -> np.ndarray | None:
    """Rows whose ``kind`` runs on a device (None without a string ``kind`` column)."""
    if kind is None:
        return None
    if isinstance(kind, pa.ChunkedArray):
        kind = kind.combine_chunks()
    vals = kind.dictionary if pa.types.is_dictionary(kind.type) else kind
    if not (pa.types.is_string(vals.type) or pa.types.is_large_string(vals.type)):
        return None
    dev = pc.fill_null(pc.is_in(vals, value_set=pa.array(_DEVICE_KINDS, vals.type)), False).to_numpy(zero_copy_only=False)
    if pa.types.is_dictionary(kind.type):
        codes = kind.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        dev = np.r_[dev, False][np.where(kind.is_valid().to_numpy(zero_copy_only=False), codes, len(dev))]
    return dev


def _time_refs(p: np.ndarray, device: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """References of the 2n times (start of row i: node i, end of row i: node n + i)."""
    n = len(p)
    prev, last = _siblings(p)
    has_p = p >= 0
    sref = np.where(has_p & (prev >= 0), n + prev, np.where(has_p, p, prev))
    host_last = last >= 0
    if device is not None:
        host_last[host_last] = ~device[last[host_last]]
    else:
        host_last[:] = False
    eref = np.where(host_last, n + last, np.arange(n))
    return sref, eref


def _levels(p: np.ndarray) -> list[np.ndarray]:
    """Rows of each tree level (0: rows without a parent in the file), each level's rows grouped by
    parent, in row order within a parent."""
    if not len(p):
        return [np.zeros(0, np.int64)]
    lvl = _chain((p >= 0).astype(np.int64), p)
    o = np.lexsort((np.arange(len(p)), p, lvl))
    bounds = np.searchsorted(lvl[o], np.arange(int(lvl.max()) + 2))
    return [o[bounds[k]:bounds[k + 1]] for k in range(len(bounds) - 1)]


def _decode_times(g: np.ndarray, c: np.ndarray, p: np.ndarray, levels: list[np.ndarray],
                  device: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Undo the references of :func:`_time_refs` level by level: each row's extent ``end - start``
    from its children (deepest level first: a sibling's start is the previous sibling's end plus
    its gap, a segmented running sum), then the starts from the roots down."""
    n = len(p)
    _, last = _siblings(p)
    host_last = last >= 0
    if device is not None:
        host_last[host_last] = ~device[last[host_last]]
    else:
        host_last[:] = False
    ext = c.copy()  # end - start; rows whose end refers to their own start are done
    rel = np.zeros(n, np.int64)  # start - parent's start
    with np.errstate(over="ignore"):
        for rows in levels[:0:-1]:
            par = p[rows]
            first = np.r_[True, par[1:] != par[:-1]]
            a = g[rows].copy()
            a[~first] += ext[rows[:-1][~first[1:]]]  # after a sibling: its extent, then the gap
            cs = np.cumsum(a)
            starts = np.flatnonzero(first)
            base = np.repeat(cs[starts] - a[starts], np.diff(np.r_[starts, len(rows)]))
            rel[rows] = cs - base
            pp = par[first]  # each parent once; its end refers to its last child's end
            hl = pp[host_last[pp]]
            ext[hl] = c[hl] + rel[last[hl]] + ext[last[hl]]
        s = np.zeros(n, np.int64)
        roots = levels[0]
        s[roots] = np.cumsum(g[roots])  # a root refers to the previous root's start
        for rows in levels[1:]:
            s[rows] = s[p[rows]] + rel[rows]
        e = s + ext
    return s, e


def _name_order(codes) -> np.ndarray:
    """The stable order of the stored name codes (the same array on write and on read)."""
    return np.argsort(codes.fill_null(-1).to_numpy(zero_copy_only=False), kind="stable")


def _used_entries(a: pa.DictionaryArray) -> pa.DictionaryArray:
    """The same values with a dictionary of only the entries in use (in the dictionary's order)."""
    codes = a.indices.to_numpy(zero_copy_only=False)
    valid = a.is_valid().to_numpy(zero_copy_only=False)
    used = np.unique(codes[valid].astype(np.int64))
    if len(used) == len(a.dictionary):
        return a
    new = np.searchsorted(used, np.where(valid, codes, 0).astype(np.int64)).astype(np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(new, mask=~valid).cast(a.indices.type), a.dictionary.take(pa.array(used)))


def _codes_type(k: int) -> pa.DataType:
    return pa.int8() if k <= 127 else pa.int16() if k <= 32767 else pa.int32()


def encode(forest: pa.Table) -> pa.Table:
    """The storage form of forest rows (format ``teller-subtrees/2``, see the module docstring)."""
    t = forest.unify_dictionaries().combine_chunks() if forest.num_columns else forest
    n = t.num_rows
    cols = {c: t.column(c).combine_chunks() for c in t.column_names}
    done: list[str] = []
    # dictionary columns keep the entries they use (in their order); other than run_id, and string
    # columns, are stored as codes plus their dictionary padded with nulls to the table's length
    for c in list(cols):
        a = cols[c]
        if pa.types.is_dictionary(a.type):
            a = cols[c] = _used_entries(a)
        elif pa.types.is_string(a.type) or pa.types.is_large_string(a.type):
            a = pc.dictionary_encode(a)
            done.append("str:" + c)
        else:
            continue
        if c not in _KEEP_DICT and not pa.types.is_dictionary(a.dictionary.type):
            cols[c] = a.indices.cast(_codes_type(len(a.dictionary)))
            cols[c + ".values"] = pa.concat_arrays([a.dictionary, pa.nulls(n - len(a.dictionary), a.dictionary.type)])
            done.append(f"dict:{c}:{len(a.dictionary)}")
        elif not pa.types.is_dictionary(t.schema.field(c).type):
            cols[c] = a  # a string column kept as a Parquet dictionary column
    nid, par = _i64(cols.get("node_id")), _i64(cols.get("parent_id"))
    p = _parents(nid, par) if nid is not None and par is not None else None
    s, e = _i64(cols.get("start_ns")), _i64(cols.get("end_ns"))
    if p is not None and s is not None and e is not None:
        sref, eref = _time_refs(p, _device_rows(t.column("kind") if "kind" in t.column_names else None))
        val = np.concatenate([s, e])
        ref = np.concatenate([sref, eref])
        with np.errstate(over="ignore"):
            const = val - np.where(ref >= 0, val[np.maximum(ref, 0)], 0)
        o = _name_order(cols["name"]) if any(d.startswith("dict:name:") for d in done) else None
        sc, ec = (const[:n], const[n:]) if o is None else (const[:n][o], const[n:][o])
        cols["start_ns"], cols["end_ns"] = pa.array(sc), pa.array(ec)
        done.append("times" if o is None else "times:name")
    cid = cols.get("corr_id")
    if p is not None and cid is not None and pa.types.is_integer(cid.type):
        valid = cid.is_valid()
        cv = np.asarray(cid.fill_null(0).to_numpy(), dtype=np.int64)
        inherit = p >= 0
        inherit[inherit] = cv[inherit] == cv[p[inherit]]
        own = np.flatnonzero(~inherit)
        d = np.zeros(n, np.int64)
        with np.errstate(over="ignore"):
            d[own] = _prev_diff(cv[own])
        cols["corr_id"] = pa.array(d, mask=inherit)
        if cid.null_count:
            cols["corr_id_valid"] = valid
        done.append("corr")
    depth = _i64(cols.get("depth"))
    if p is not None and depth is not None:
        up = np.where(p >= 0, depth[np.maximum(p, 0)] + 1, 0)
        cols["depth"] = pa.array(depth - up)  # int64: exact whatever the values
        done.append("depth")
    size = _i64(cols.get("size"))
    if p is not None and size is not None:
        cols["size"] = pa.array(size - _tree_size(p))
        done.append("size")
    if nid is not None:
        cols["node_id"] = pa.array(_prev_diff(nid))
        done.append("node_id")
    if nid is not None and par is not None:
        cols["parent_id"] = pa.array(np.where(par < 0, -1, nid - par))
        done.append("parent_id")
    out = pa.table(cols)
    meta = {b"teller.codec": CODEC.encode(), b"teller.rows": str(n).encode(),
            b"teller.transforms": json.dumps(done).encode(),
            b"teller.schema": forest.schema.remove_metadata().serialize().to_pybytes().hex().encode()}
    return out.replace_schema_metadata(meta)


def write_subtrees(forest: pa.Table, path: str | Path) -> None:
    """Write forest rows in the storage form (the current format)."""
    t = encode(forest)
    ints = [f.name for f in t.schema if pa.types.is_integer(f.type)]
    split = [c for c in _SPLIT if c in ints]
    plain = [c for c in ints if c not in split and (c + ".values") in t.column_names]  # dictionary codes
    dict_cols = [f.name for f in t.schema if f.name not in split and f.name not in plain
                 and not f.name.endswith(".values")]
    enc = {c: "BYTE_STREAM_SPLIT" for c in split} | {c: "PLAIN" for c in plain}
    pq.write_table(t, path, compression=COMPRESSION, compression_level=LEVEL, use_dictionary=dict_cols,
                   column_encoding=enc)


def _schema(meta: dict) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(meta[b"teller.schema"].decode()))).remove_metadata()


def _decode_v1(t: pa.Table, schema: pa.Schema) -> pa.Table:
    cols = {c: t.column(c) for c in t.column_names}
    for c in _DELTA:
        if c in cols:
            cols[c] = pa.array(np.cumsum(cols[c].to_numpy().astype(np.int64)))
    if "end_ns" in cols and "start_ns" in cols:
        cols["end_ns"] = pa.array(cols["start_ns"].to_numpy() + cols["end_ns"].to_numpy().astype(np.int64))
    if "parent_id" in cols and "node_id" in cols:
        off = cols["parent_id"].to_numpy().astype(np.int64)
        cols["parent_id"] = pa.array(np.where(off < 0, -1, cols["node_id"].to_numpy() - off))
    if "corr_id" in cols:
        valid = cols.pop("corr_id_valid").to_numpy(zero_copy_only=False).astype(bool)
        cols["corr_id"] = pa.array(cols["corr_id"].to_numpy(), mask=~valid)
    return pa.table([cols[f.name].cast(f.type) for f in schema], schema=schema)


def _decode_v2(t: pa.Table, schema: pa.Schema, done: list[str]) -> pa.Table:
    cols = {c: t.column(c).combine_chunks() for c in t.column_names}
    n = t.num_rows
    if "node_id" in done:
        cols["node_id"] = pa.array(np.cumsum(cols["node_id"].to_numpy().astype(np.int64)))
    if "parent_id" in done:
        off = cols["parent_id"].to_numpy().astype(np.int64)
        cols["parent_id"] = pa.array(np.where(off < 0, -1, cols["node_id"].to_numpy() - off))
    tree = "node_id" in done and "parent_id" in done
    p = _parents(cols["node_id"].to_numpy(), cols["parent_id"].to_numpy()) if tree else None
    levels = _levels(p) if tree else None
    o = _name_order(cols["name"]) if "times:name" in done else None
    strings = {d[4:] for d in done if d.startswith("str:")}
    for c, k in [d[5:].rsplit(":", 1) for d in done if d.startswith("dict:")]:
        typ = schema.field(c).type
        vals = cols.pop(c + ".values").slice(0, int(k))
        index_type = pa.int32() if c in strings else typ.index_type
        value_type = typ if c in strings else typ.value_type
        cols[c] = pa.DictionaryArray.from_arrays(cols[c].cast(index_type), vals.cast(value_type))
    for c in strings:
        cols[c] = cols[c].dictionary.take(cols[c].indices)
    if "times" in done or "times:name" in done:
        const = np.empty(2 * n, np.int64)
        sl = slice(None) if o is None else o
        const[:n][sl] = cols["start_ns"].to_numpy()
        const[n:][sl] = cols["end_ns"].to_numpy()
        start, end = _decode_times(const[:n], const[n:], p, levels, _device_rows(cols.get("kind")))
        cols["start_ns"], cols["end_ns"] = pa.array(start), pa.array(end)
    if "corr" in done:
        stored = cols["corr_id"]
        inherit = stored.is_null().to_numpy(zero_copy_only=False)
        own = np.flatnonzero(~inherit)
        const = np.zeros(n, np.int64)
        with np.errstate(over="ignore"):
            const[own] = np.cumsum(stored.drop_null().to_numpy())
        cv = const
        for rows in levels[1:]:  # a row that takes its parent's id: top down
            rows = rows[inherit[rows]]
            cv[rows] = cv[p[rows]]
        valid = cols.pop("corr_id_valid").to_numpy(zero_copy_only=False).astype(bool) if "corr_id_valid" in cols else None
        cols["corr_id"] = pa.array(cv, mask=None if valid is None else ~valid)
    if "depth" in done:
        depth = cols["depth"].to_numpy().astype(np.int64)
        for rows in levels[1:]:
            depth[rows] += depth[p[rows]] + 1
        cols["depth"] = pa.array(depth)
    if "size" in done:
        cols["size"] = pa.array(cols["size"].to_numpy().astype(np.int64) + _tree_size(p, levels))
    return pa.table([cols[f.name].cast(f.type) for f in schema], schema=schema)


def decode(t: pa.Table, where: str = "subtrees") -> pa.Table:
    """Forest rows from their storage form (the exact columns and types that were encoded), in
    either format."""
    meta = t.schema.metadata or {}
    codec = meta.get(b"teller.codec", b"none").decode()
    if codec == CODEC_V1:
        return _decode_v1(t, _schema(meta))
    if codec == CODEC:
        return _decode_v2(t, _schema(meta), json.loads(meta[b"teller.transforms"].decode()))
    raise InputError(where, f"not a TELLER subtree file (codec {codec!r}, expected {CODEC!r} or {CODEC_V1!r})",
                     "rebuild the dataset with `teller dataset build`")


def codec_of(path: str | Path) -> str:
    """The format marker of one subtree file (``'none'`` for another Parquet file)."""
    meta = pq.read_schema(path).metadata or {}
    return meta.get(b"teller.codec", b"none").decode()


def _cuts(forest: pa.Table, part_rows: int) -> list[int]:
    """Row offsets where parts start: at most ``part_rows`` rows each, cut before a root row
    (``parent_id == -1``) where the part holds one; a step longer than a part is cut inside."""
    n = forest.num_rows
    if "parent_id" in forest.column_names:
        roots = np.flatnonzero(pc.fill_null(pc.equal(forest.column("parent_id"), -1), False).to_numpy(zero_copy_only=False))
    else:
        roots = np.arange(n)
    cuts = [0]
    while n - cuts[-1] > part_rows:
        a = cuts[-1]
        k = np.searchsorted(roots, a + part_rows, side="right") - 1
        cuts.append(int(roots[k]) if k >= 0 and roots[k] > a else a + part_rows)
    return cuts


def write_subtree_parts(forest: pa.Table, folder: str | Path, part_rows: int = PART_ROWS) -> list[Path]:
    """Write forest rows as ``folder/part-NNNNN.parquet`` files of at most ``part_rows`` rows, cut
    at step boundaries where possible."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("part-*.parquet"):
        old.unlink()
    cuts = _cuts(forest, part_rows)
    paths = [folder / f"part-{k:05d}.parquet" for k in range(len(cuts))]
    ends = cuts[1:] + [forest.num_rows]
    jobs = [(forest.slice(a, b - a), path) for a, b, path in zip(cuts, ends, paths, strict=False)]
    # parts are independent: encoded and compressed on several cores (numpy and Parquet release the GIL)
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1, 8))) as pool:
        list(pool.map(lambda job: write_subtrees(*job), jobs))
    return paths


def _subtree_source(ds: str | Path) -> Path:
    p = Path(ds)
    if p.is_dir() and (p / "subtrees").is_dir():
        p = p / "subtrees"
    elif p.is_dir() and not sorted(p.glob("part-*.parquet")):
        p = p / "subtrees.parquet"
    return p


def read_subtrees(ds: str | Path) -> pa.Table:
    """The forest rows of a dataset's steps (``DS/subtrees/`` parts, or one subtree file), with ``run_id``."""
    p = _subtree_source(ds)
    if p.is_dir():
        parts = sorted(p.glob("part-*.parquet"))
        return pa.concat_tables([decode(pq.read_table(f), str(f)) for f in parts])
    if not p.is_file():
        raise InputError(p, "no such file", "give a dataset folder written by `teller dataset build`")
    return decode(pq.read_table(p), str(p))


def differing_columns(a: pa.Table, b: pa.Table) -> list[str]:
    """Columns whose values differ between two forest tables (all of them when the schemas or row
    counts differ). Dictionary columns are compared by value: a subtree file keeps only the
    dictionary entries its rows use, so codes may differ while the values are the same."""
    if not a.schema.remove_metadata().equals(b.schema.remove_metadata()) or a.num_rows != b.num_rows:
        return list(dict.fromkeys(a.column_names + b.column_names))
    out = []
    for c in a.column_names:
        x, y = a.column(c), b.column(c)
        if pa.types.is_dictionary(x.type):
            x, y = x.cast(x.type.value_type), y.cast(y.type.value_type)
        if not x.equals(y):
            out.append(c)
    return out


def recode_dataset(src: str | Path, dst: str | Path, part_rows: int = PART_ROWS) -> dict:
    """Copy dataset ``src`` to ``dst`` with its subtrees rewritten in the current format (the other
    files copied as they are), and check that ``dst``'s subtrees read back equal to ``src``'s.
    Returns the row count and the subtree bytes before and after."""
    src, dst = Path(src), Path(dst)
    if not (src / "subtrees").is_dir():
        raise InputError(src, "no subtrees/ folder", "give a dataset folder written by `teller dataset build`")
    if dst.resolve() == src.resolve():
        raise InputError(dst, "is the source dataset", "write the recoded dataset to another folder (-o)")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "subtrees":
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, dst / f.name)
    before = read_subtrees(src)
    write_subtree_parts(before, dst / "subtrees", part_rows)
    after = read_subtrees(dst)
    if differing_columns(before, after):
        raise InputError(dst / "subtrees", "the recoded subtrees do not read back equal to the source's",
                         "report this with the dataset; the source is unchanged")
    size = lambda d: sum(f.stat().st_size for f in (d / "subtrees").glob("part-*.parquet"))  # noqa: E731
    return {"rows": before.num_rows, "bytes_before": size(src), "bytes_after": size(dst),
            "parts": len(list((dst / "subtrees").glob("part-*.parquet")))}
