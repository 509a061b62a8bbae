"""Compact storage of forest rows in a dataset (``subtrees/part-NNNNN.parquet``), restored exactly on read.

Most of a forest row's bytes are its times. Stored as written by reconstruction, ``start_ns`` and
``end_ns`` are large, nearly random 64-bit numbers; the dataset stores instead:

- ``start_ns`` as the difference from the previous row's start (rows are DFS preorder, so a
  child starts soon after the row before it),
- ``end_ns`` as the duration ``end_ns - start_ns``,
- ``node_id`` and ``corr_id`` as differences from the previous row (``corr_id`` nulls kept in
  ``corr_id_valid``), ``parent_id`` as ``node_id - parent_id`` (``-1`` stays ``-1``),

each with Parquet's BYTE_STREAM_SPLIT encoding under zstd, which suits small integers of varying
width. On the H200 recordings this stores a row in about 5.5 bytes instead of 10.5. Every other
column is kept as it is. A dataset's rows are cut into parts of at most :data:`PART_ROWS` rows
(each part encoded on its own: about 6 MB), so no file of a committed dataset grows large.
:func:`read_subtrees` returns the forest columns bit for bit (``tests/test_dataset_codec.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from teller.errors import InputError

#: the format marker in the file's metadata
CODEC = "teller-subtrees/1"
_DELTA = ("start_ns", "node_id", "corr_id")
#: rows per part file of a dataset's subtrees
PART_ROWS = 1_000_000


def _prev_diff(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    if len(x):
        out[0] = x[0]
        np.subtract(x[1:], x[:-1], out=out[1:])
    return out


def encode(forest: pa.Table) -> pa.Table:
    """The storage form of forest rows (see the module docstring)."""
    t = forest
    cols = {c: t.column(c) for c in t.column_names}
    n = t.num_rows
    if "end_ns" in cols and "start_ns" in cols:
        start = t.column("start_ns").to_numpy().astype(np.int64)
        cols["end_ns"] = pa.array(t.column("end_ns").to_numpy().astype(np.int64) - start)
    if "parent_id" in cols and "node_id" in cols:
        nid = t.column("node_id").to_numpy().astype(np.int64)
        par = t.column("parent_id").to_numpy(zero_copy_only=False).astype(np.int64)
        cols["parent_id"] = pa.array(np.where(par < 0, -1, nid - par))
    if "corr_id" in cols:
        cid = t.column("corr_id").combine_chunks()
        cols["corr_id_valid"] = cid.is_valid()
        cols["corr_id"] = pa.array(cid.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64))
    for c in _DELTA:
        if c in cols:
            cols[c] = pa.array(_prev_diff(np.asarray(cols[c].to_numpy(zero_copy_only=False), dtype=np.int64)))
    out = pa.table(cols)
    meta = {b"teller.codec": CODEC.encode(), b"teller.rows": str(n).encode(),
            b"teller.schema": forest.schema.serialize().to_pybytes().hex().encode()}
    return out.replace_schema_metadata(meta)


def write_subtrees(forest: pa.Table, path: str | Path) -> None:
    """Write forest rows in the storage form."""
    t = encode(forest)
    split = [c for c in ("start_ns", "end_ns", "node_id", "parent_id", "corr_id") if c in t.column_names]
    dict_cols = [f.name for f in t.schema if f.name not in split]
    pq.write_table(t, path, compression="zstd", compression_level=15, use_dictionary=dict_cols,
                   column_encoding={c: "BYTE_STREAM_SPLIT" for c in split})


def decode(t: pa.Table, where: str = "subtrees") -> pa.Table:
    """Forest rows from their storage form (the exact columns and types that were encoded)."""
    meta = t.schema.metadata or {}
    if meta.get(b"teller.codec") != CODEC.encode():
        raise InputError(where, f"not a TELLER subtree file (codec {meta.get(b'teller.codec', b'none').decode()!r}, "
                         f"expected {CODEC!r})", "rebuild the dataset with `teller dataset build`")
    schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(meta[b"teller.schema"].decode())))
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
    return pa.table([cols[f.name].cast(f.type) for f in schema], schema=schema.remove_metadata())


def write_subtree_parts(forest: pa.Table, folder: str | Path, part_rows: int = PART_ROWS) -> list[Path]:
    """Write forest rows as ``folder/part-NNNNN.parquet`` files of at most ``part_rows`` rows."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("part-*.parquet"):
        old.unlink()
    paths = []
    for k, a in enumerate(range(0, max(forest.num_rows, 1), part_rows)):
        paths.append(folder / f"part-{k:05d}.parquet")
        write_subtrees(forest.slice(a, part_rows), paths[-1])
    return paths


def read_subtrees(ds: str | Path) -> pa.Table:
    """The forest rows of a dataset's steps (``DS/subtrees/`` parts, or one subtree file), with ``run_id``."""
    p = Path(ds)
    if p.is_dir() and (p / "subtrees").is_dir():
        p = p / "subtrees"
    elif p.is_dir() and not sorted(p.glob("part-*.parquet")):
        p = p / "subtrees.parquet"
    if p.is_dir():
        parts = sorted(p.glob("part-*.parquet"))
        return pa.concat_tables([decode(pq.read_table(f), str(f)) for f in parts])
    if not p.is_file():
        raise InputError(p, "no such file", "give a dataset folder written by `teller dataset build`")
    return decode(pq.read_table(p), str(p))
