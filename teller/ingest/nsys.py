"""Nsight Systems SQLite export → canonical events (docs/design.md §3, §14).

Tables read (each only if present; columns only if present, since schemas differ between
nsys versions):

=====================================  ==========================================================
``NVTX_EVENTS``                         eventType 59 push/pop and 60 start/end → RANGE (nsys has
                                        already paired them; a NULL ``end`` is a range still open
                                        when the capture stopped: end = last time in the file,
                                        FLAG_TRUNCATED), 34 mark → MARKER. Other event types
                                        (domain/category declarations) are metadata: counted in
                                        ``skipped``, not emitted.
``CUPTI_ACTIVITY_KIND_RUNTIME``         eventClass 0 → RUNTIME, 1 → DRIVER; without the column (or
                                        for another class) by name: ``cuda*`` RUNTIME, ``cu*``
                                        DRIVER.
``CUPTI_ACTIVITY_KIND_KERNEL``          KERNEL (name = demangled name)
``CUPTI_ACTIVITY_KIND_MEMCPY``          MEMCPY, named as Kineto names them:
                                        ``Memcpy HtoD (Pageable -> Device)``
``CUPTI_ACTIVITY_KIND_MEMSET``          MEMSET, ``Memset (Device)``
``CUPTI_ACTIVITY_KIND_SYNCHRONIZATION`` SYNC, ``Context Sync`` / ``Stream Sync`` / ...
=====================================  ==========================================================

Decisions written down here:

- API names lose one trailing ``_v\\d+`` (the CUPTI API version nsys appends), so
  ``cudaMalloc_v3020`` → ``cudaMalloc`` and ``cudaGetDeviceProperties_v2_v12000`` →
  ``cudaGetDeviceProperties_v2``, the names Kineto shows for the same calls.
- Times in the export are ns since the session start; ``TARGET_INFO_SESSION_START_TIME.utcEpochNs``
  is the wall-clock instant of that start, so ``t0_unix_ns = utcEpochNs + earliest event``
  (consistent with ``EXPORT_TIME_UTC`` in both sample files). Without that table, or when that
  sum is not a time of 2000..2100 (a damaged event time; with a warning),
  ``t0_unix_ns`` is null.
- Duplicate correlation ids are flagged (FLAG_DUPLICATE, on all but the earliest) among host
  calls of one process, and among kernels of one process that were not launched by a CUDA
  graph (one graph launch legitimately yields many kernels with one id; one memcpy call may yield
  several copy records).
- Text or blobs in integer columns (SQLite's CAST would read them as 0 and move t0): rows whose
  ``start``/``end`` is not a number are left out and counted in ``skipped``
  (``TABLE: start/end not an integer``); in id/device/stream columns the value reads as unknown
  and the row is flagged FLAG_REPAIRED. One extra scan per table finds them. A ``utcEpochNs``
  outside 2000..2100 is ignored with a warning (the run then has no wall clock).
- ``node`` and ``rank`` come from the caller (0 for a single file); a folder of ``*.sqlite``
  gives one rank per file in name order, on a common time base when every file has the
  session start time.
- Output: ``events/nsys_<file stem>.parquet`` and ``run.json`` (``collector.reader = "nsys"``,
  counts per source table in, per kind out, per flag, and skipped metadata rows). Events of an
  earlier ``teller ingest`` into the same directory are replaced; a recorded run is never
  overwritten.

The file is opened read-only (``file:...?mode=ro``). Everything is read column-wise: one SQL
query per table, fetched in chunks that become one numpy block each (transposed with ``zip``
where text columns are mixed in); string ids are resolved with a sorted-id lookup in numpy, and
the ``args`` JSON is assembled with Arrow compute kernels. About 3.5 µs per event on one CPU
core (2 M runtime + kernel rows in 7 s), most of it in sqlite3 building Python ints.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.errors import InputError
from teller.ingest.common import prepare_out
from teller.rundir import (
    FLAG_DUPLICATE,
    FLAG_REPAIRED,
    FLAG_TRUNCATED,
    KINDS,
    RunDir,
    RunInfo,
    concat_events,
    events_table,
    flag_counts,
    kind_counts,
    np_col,
    strip_api_version,
)

NVTX = "NVTX_EVENTS"
RUNTIME = "CUPTI_ACTIVITY_KIND_RUNTIME"
KERNEL = "CUPTI_ACTIVITY_KIND_KERNEL"
MEMCPY = "CUPTI_ACTIVITY_KIND_MEMCPY"
MEMSET = "CUPTI_ACTIVITY_KIND_MEMSET"
SYNC = "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"
#: Event tables this reader understands, in reading order.
EVENT_TABLES = (NVTX, RUNTIME, KERNEL, MEMCPY, MEMSET, SYNC)

NVTX_PUSHPOP, NVTX_STARTEND, NVTX_MARK = 59, 60, 34
NVTX_DOMAIN_CREATE, NVTX_CATEGORY = 75, 33
_NVTX_TYPE = {NVTX_PUSHPOP: "push/pop", NVTX_STARTEND: "start/end", NVTX_MARK: "mark"}

_FIX = "re-export it with `nsys export --type sqlite <report>.nsys-rep`"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_NULL = -9223372036854775807  # SQL NULL after CAST(... AS INTEGER); an integer literal SQLite keeps
_U32_INVALID = 0xFFFFFFFF  # CUPTI "no stream" / "no event"
_CHUNK = 262_144

# CUPTI enums (stable across CUDA versions; the export's ENUM_* tables agree), Kineto spelling.
_COPY_KIND = {
    0: "Unknown",
    1: "HtoD",
    2: "DtoH",
    3: "HtoA",
    4: "AtoH",
    5: "AtoA",
    6: "AtoD",
    7: "DtoA",
    8: "DtoD",
    9: "HtoH",
    10: "PtoP",
    11: "UVM HtoD",
    12: "UVM DtoH",
    13: "UVM DtoD",
}
_MEM_KIND = {
    0: "Pageable",
    1: "Pinned",
    2: "Device",
    3: "Array",
    4: "Managed",
    5: "Device Static",
    6: "Managed Static",
    7: "Unknown",
}
_SYNC_TYPE = {
    0: "Unknown Sync",
    1: "Event Sync",
    2: "Stream Wait Event",
    3: "Stream Sync",
    4: "Context Sync",
}


# --------------------------------------------------------------------------------------------
# small columnar helpers


def _small_dict(keys: np.ndarray, label: Callable[[int], str]) -> pa.DictionaryArray:
    """Dictionary array of ``label(key)``, calling ``label`` once per distinct key."""
    uniq, inv = np.unique(keys, return_inverse=True)
    return _dedupe(inv, pa.array([label(int(k)) for k in uniq], pa.string()))


def _dedupe(codes: np.ndarray, values: pa.Array) -> pa.DictionaryArray:
    """Dictionary array from codes into ``values``, merging equal values."""
    enc = values.dictionary_encode()
    remap = enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)
    if len(values) == 0:
        remap = np.zeros(1, np.int32)
        enc = pa.array([""]).dictionary_encode()
    return pa.DictionaryArray.from_arrays(remap[codes.reshape(-1)], enc.dictionary)


def _int_str(v: np.ndarray, null: np.ndarray | None = None) -> pa.Array:
    """An integer column as JSON number text; ``null`` rows stay null (left out of args)."""
    return pa.array(v, pa.int64(), mask=null).cast(pa.string())


def _masked(arr: pa.Array, null: np.ndarray) -> pa.Array:
    """``arr`` with the ``null`` rows set to null."""
    return pc.if_else(pa.array(null, pa.bool_()), pa.scalar(None, arr.type), arr)


def _json_str(arr: pa.DictionaryArray) -> pa.Array:
    """A dictionary string column as JSON string literals (escaping each distinct value once)."""
    lit = pa.array([json.dumps(s) for s in arr.dictionary.to_pylist()], pa.string())
    return pa.DictionaryArray.from_arrays(arr.indices, lit).cast(pa.string())


def _json_args(n: int, fields: Sequence[tuple[str, pa.Array | None]]) -> pa.Array:
    """Assemble one JSON object per row from ``(key, value-text)`` columns; null values are
    left out, and a row with no values gets a null ``args``."""
    pieces = [
        pc.binary_join_element_wise(json.dumps(k) + ":", v, ",", "")
        for k, v in fields
        if v is not None
    ]
    if not pieces or n == 0:
        return pa.nulls(n, pa.string())
    body = pc.binary_join_element_wise(*pieces, "", null_handling="replace", null_replacement="")
    body = pc.utf8_slice_codeunits(body, 0, -1)  # the last piece's trailing comma
    obj = pc.binary_join_element_wise("{", body, "}", "")
    return pc.if_else(pc.equal(body, ""), pa.scalar(None, pa.string()), obj)


def _split_global_id(gid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """nsys serialized global ids → (pid, tid); NULL → -1."""
    null = gid == _NULL
    pid = np.where(null, -1, (gid // 0x1000000) % 0x1000000)
    tid = np.where(null, -1, gid % 0x1000000)
    return pid, tid


def _nullable(v: np.ndarray, invalid: Sequence[int] = ()) -> np.ndarray:
    """Replace SQL NULL (and the given invalid markers) by -1."""
    bad = v == _NULL
    for x in invalid:
        bad |= v == x
    return np.where(bad, -1, v)


def _flag_duplicates(
    pid: np.ndarray, corr: np.ndarray, start: np.ndarray, eligible: np.ndarray
) -> np.ndarray:
    """Mask of rows whose (pid, corr_id) was already seen at an earlier start."""
    dup = np.zeros(len(corr), bool)
    idx = np.flatnonzero(eligible & (corr > 0))
    if len(idx) < 2:
        return dup
    order = idx[np.lexsort((start[idx], corr[idx], pid[idx]))]
    same = (pid[order][1:] == pid[order][:-1]) & (corr[order][1:] == corr[order][:-1])
    dup[order[1:][same]] = True
    return dup


# --------------------------------------------------------------------------------------------
# reading SQLite


class _Db:
    """A read-only connection plus what the export holds: tables, their columns, strings."""

    def __init__(self, path: Path):
        self.path = path
        uri = path.resolve().as_uri() + "?mode=ro"
        self.con = sqlite3.connect(uri, uri=True)
        self.con.text_factory = lambda b: b.decode("utf-8", "replace")
        rows = self.con.execute(
            "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
        ).fetchall()
        self.tables = {r[0] for r in rows}
        self._cols: dict[str, dict[str, str]] = {}
        self.rejected: Counter[str] = Counter()  # rows left out, by reason
        self.repaired: Counter[str] = Counter()  # tables where values were nulled
        self._strings: tuple[np.ndarray, np.ndarray, pa.Array] | None = None

    def close(self) -> None:
        self.con.close()

    def columns(self, table: str) -> dict[str, str]:
        """Column name → declared type (upper case)."""
        if table not in self._cols:
            rows = self.con.execute(f'PRAGMA table_info("{table}")').fetchall()
            self._cols[table] = {r[1]: (r[2] or "").upper() for r in rows}
        return self._cols[table]

    def count(self, table: str) -> int:
        return int(self.con.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0])

    def select(
        self, table: str, spec: dict[str, str], where: str = "", joins: str = ""
    ) -> dict[str, np.ndarray | list]:
        """Fetch whole columns. ``spec`` maps output name → "int" (a column name of ``table``,
        NULL/missing → ``_NULL``), "text" (TEXT, NULL → None), or "sql:<expr>" (an integer
        expression used as is). Returns numpy int64 arrays and lists of str."""
        cols = self.columns(table)
        spec, where = self._guard_types(table, cols, spec, where)
        exprs, kinds = [], []
        for name, how in spec.items():
            if how == "str":
                how = "text" if "TEXT" in cols.get(name, "") else "int"
            if how.startswith("sql:"):
                exprs.append(f"coalesce(CAST({how[4:]} AS INTEGER), {_NULL})")
                kinds.append("int")
            elif how == "text":
                exprs.append(f'CAST(t."{name}" AS TEXT)' if name in cols else "NULL")
                kinds.append("text")
            elif how.startswith("textsql:"):
                exprs.append(how[8:])
                kinds.append("text")
            else:
                exprs.append(
                    f'coalesce(CAST(t."{name}" AS INTEGER), {_NULL})'
                    if name in cols
                    else str(_NULL)
                )
                kinds.append("int")
        cur = self.con.execute(f'SELECT {", ".join(exprs)} FROM "{table}" AS t {joins} {where}')
        parts: list[list] = [[] for _ in spec]
        all_int = all(k == "int" for k in kinds)
        while True:
            rows = cur.fetchmany(_CHUNK)
            if not rows:
                break
            if all_int:  # one C-level conversion for the whole chunk
                block = np.array(rows, np.int64).reshape(len(rows), len(kinds))
                for i in range(len(kinds)):
                    parts[i].append(block[:, i])
                continue
            for i, col in enumerate(zip(*rows, strict=True)):
                parts[i].append(np.array(col, np.int64) if kinds[i] == "int" else list(col))
        out: dict[str, np.ndarray | list] = {}
        for (name, _), kind, chunks in zip(spec.items(), kinds, parts, strict=True):
            if kind == "int":
                out[name] = np.concatenate(chunks) if chunks else np.empty(0, np.int64)
            else:
                out[name] = (
                    [s for c in chunks for s in c]
                    if len(chunks) > 1
                    else (chunks[0] if chunks else [])
                )
        return out

    def _guard_types(
        self, table: str, cols: dict[str, str], spec: dict[str, str], where: str
    ) -> tuple[dict[str, str], str]:
        """Text or blobs where integers belong (a damaged page, a hand-edited export): SQLite's
        CAST would read them as 0 and move t0 without a word.

        One scan counts them. Rows whose ``start``/``end`` is not a number are left out and
        counted in :attr:`rejected`; in the other columns read as integers (ids, devices,
        streams) such a value becomes NULL and its row is flagged repaired (column
        ``_repaired`` of the result). Returns the spec and WHERE clause to use.
        """
        checked = [n for n, how in spec.items() if how == "int" and n in cols]
        checked += [n for n in ("start", "end") if n in cols and n not in checked]
        if not checked:
            return spec, where
        bad = {c: f"""typeof(t."{c}") IN ('text', 'blob')""" for c in checked}
        times = [bad[c] for c in ("start", "end") if c in bad]
        others = [c for c in checked if c not in ("start", "end")]
        any_time = " OR ".join(times) if times else "0"
        q = ", ".join([f"coalesce(sum({any_time}), 0)"] + [f"coalesce(sum({bad[c]}), 0)" for c in checked])
        row = self.con.execute(f'SELECT {q} FROM "{table}" AS t {where}').fetchone()
        n_time, per_col = int(row[0]), dict(zip(checked, (int(x) for x in row[1:]), strict=True))
        if not n_time and not any(per_col.values()):
            return spec, where
        spec = dict(spec)
        if n_time:
            self.rejected[f"{table}: start/end not an integer"] += n_time
            keep = f"NOT ({any_time})"
            where = f"{where} AND {keep}" if where.strip() else f"WHERE {keep}"
        nulled = [c for c in others if per_col[c]]
        for c in nulled:
            spec[c] = (
                f"""sql:CASE WHEN {bad[c]} THEN NULL ELSE t."{c}" END"""
            )
        if nulled:
            spec["_repaired"] = "sql:(" + " OR ".join(bad[c] for c in nulled) + ")"
            self.repaired[table] += 1
        return spec, where

    def strings(self) -> tuple[np.ndarray, np.ndarray, pa.Array]:
        """StringIds as (sorted ids, order, values + a trailing "" for unknown ids)."""
        if self._strings is None:
            ids: Sequence[int] = ()
            vals: Sequence[str] = ()
            if "StringIds" in self.tables:
                rows = self.con.execute(
                    "SELECT CAST(id AS INTEGER), CAST(value AS TEXT) FROM StringIds"
                ).fetchall()
                if rows:
                    ids, vals = zip(*rows, strict=True)
            id_arr = np.array(
                [(-1 if i is None else i) for i in ids] if None in ids else ids, np.int64
            )
            order = np.argsort(id_arr, kind="stable")
            values = pa.array(list(vals) + [""], pa.string()).fill_null("")
            self._strings = (id_arr[order], order, values)
        return self._strings

    def lookup(
        self, ids: np.ndarray, strip_version: bool = False
    ) -> tuple[pa.DictionaryArray, np.ndarray]:
        """Resolve string ids to a compact dictionary array; returns it and the mask of ids that
        were NULL or absent from StringIds (those get "")."""
        sorted_ids, order, values = self.strings()
        n_str = len(sorted_ids)
        pos = np.searchsorted(sorted_ids, ids)
        pos_c = np.minimum(pos, max(n_str - 1, 0))
        found = (pos < n_str) & (sorted_ids[pos_c] == ids) if n_str else np.zeros(len(ids), bool)
        idx = np.where(found, order[pos_c] if n_str else 0, n_str)  # n_str → the trailing ""
        used, inv = np.unique(idx, return_inverse=True)
        dictionary = values.take(pa.array(used))
        if strip_version:
            dictionary = strip_api_version(dictionary)
        return _dedupe(inv, dictionary), ~found

    def resolve(
        self, values: np.ndarray | list, strip_version: bool = False
    ) -> tuple[pa.DictionaryArray, np.ndarray]:
        """A string column read with spec "str": StringIds references (most versions) or TEXT."""
        if isinstance(values, np.ndarray):
            return self.lookup(values, strip_version)
        arr = pa.array(values, pa.string())
        missing = arr.is_null().to_numpy(zero_copy_only=False)
        return arr.fill_null("").dictionary_encode(), missing


@dataclass
class _Part:
    """Columns read from one source table (times still on the session clock)."""

    table: str
    cols: dict[str, Any]
    rows_in: int
    open_end: np.ndarray | None = None  # rows whose end is to be set to the file's last time
    skipped: dict[str, int] = field(default_factory=dict)


def _times(v: dict, flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """start/end with one NULL or end < start repaired (FLAG_REPAIRED): the missing time is
    the other one, a negative duration becomes zero. Both NULL stays for :func:`_assemble`."""
    start, end = v["start"], v["end"]
    if "_repaired" in v:  # a non-integer id/device/stream read as NULL (_Db._guard_types)
        flags |= np.where(v["_repaired"] > 0, FLAG_REPAIRED, 0).astype(np.int32)
    no_start, no_end = start == _NULL, end == _NULL
    start = np.where(no_start, end, start)
    end = np.where(no_end, start, end)
    bad = ~no_start & ~no_end & (end < start)
    end = np.where(bad, start, end)
    flags |= np.where(no_start | no_end | bad, FLAG_REPAIRED, 0).astype(np.int32)
    return start, end


def _read_nvtx(db: _Db) -> _Part:
    cols = db.columns(NVTX)
    n_all = db.count(NVTX)
    keep = f"WHERE t.eventType IN ({NVTX_PUSHPOP}, {NVTX_STARTEND}, {NVTX_MARK})"
    skipped = {}
    if "eventType" in cols:
        other = (
            f'SELECT eventType, count(*) FROM "{NVTX}" AS t '
            f"WHERE t.eventType IS NULL OR NOT ({keep[6:]}) GROUP BY eventType"
        )
        for et, k in db.con.execute(other):
            skipped[f"{NVTX}.eventType={et}"] = int(k)
    else:
        keep = "WHERE 0"
        if n_all:
            skipped[f"{NVTX} (no eventType column)"] = n_all
    # text: the row's own text, else its textId in StringIds (joined in SQL)
    has_text, has_tid = "text" in cols, "textId" in cols and "StringIds" in db.tables
    text_expr = {
        (True, True): "coalesce(CAST(t.text AS TEXT), CAST(s.value AS TEXT))",
        (True, False): "CAST(t.text AS TEXT)",
        (False, True): "CAST(s.value AS TEXT)",
        (False, False): "NULL",
    }[(has_text, has_tid)]
    joins = "LEFT JOIN StringIds AS s ON s.id = t.textId" if has_tid else ""
    spec = {
        k: "int"
        for k in (
            "start",
            "end",
            "eventType",
            "rangeId",
            "globalTid",
            "endGlobalTid",
            "domainId",
            "category",
        )
    }
    spec["end"] = 'sql:t."end"' if "end" in cols else "sql:NULL"
    spec["text"] = "textsql:" + text_expr
    v = db.select(NVTX, spec, where=keep, joins=joins)
    texts = v["text"]
    n = len(v["start"])
    flags = np.zeros(n, np.int32)
    et = v["eventType"]
    is_mark = et == NVTX_MARK
    open_end = ~is_mark & (v["end"] == _NULL)
    v["end"] = np.where(is_mark | open_end, v["start"], v["end"])
    start, end = _times(v, flags)
    pid, tid = _split_global_id(v["globalTid"])
    _, end_tid = _split_global_id(v["endGlobalTid"])
    # domain and category names are declared by rows of other event types
    names = {}
    if "eventType" in cols and "text" in cols:
        for kind, sel in (("domain", "domainId"), ("category", "category")):
            if sel in cols:
                et_decl = NVTX_DOMAIN_CREATE if kind == "domain" else NVTX_CATEGORY
                q = (
                    f'SELECT CAST("{sel}" AS INTEGER), CAST(text AS TEXT) FROM "{NVTX}" '
                    f"WHERE eventType = {et_decl} AND text IS NOT NULL"
                )
                names[kind] = dict(db.con.execute(q).fetchall())
    dom, cat = v["domainId"], v["category"]
    dom_null = (dom == _NULL) | (dom == 0)
    cat_null = (cat == _NULL) | (cat == 0)
    dmap, cmap = names.get("domain", {}), names.get("category", {})
    args = _json_args(
        n,
        [
            (
                "nvtx",
                _small_dict(et, lambda e: json.dumps(_NVTX_TYPE.get(e, str(e)))).cast(pa.string()),
            ),
            (
                "domain",
                _masked(
                    _small_dict(dom, lambda d: json.dumps(dmap.get(d, d))).cast(pa.string()),
                    dom_null,
                ),
            ),
            (
                "category",
                _masked(
                    _small_dict(cat, lambda c: json.dumps(cmap.get(c, c))).cast(pa.string()),
                    cat_null,
                ),
            ),
            ("end tid", _int_str(end_tid, (end_tid == tid) | (end_tid < 0))),
        ],
    )
    name = pa.array(texts, pa.string()).fill_null("").dictionary_encode()
    kind = np.where(is_mark, KINDS.index("MARKER"), KINDS.index("RANGE")).astype(np.int8)
    out = dict(
        kind=kind,
        name=name,
        pid=pid,
        tid=tid,
        start_ns=start,
        end_ns=end,
        range_id=_nullable(v["rangeId"]),
        flags=flags,
        args=args,
    )
    return _Part(NVTX, out, n_all, open_end=open_end, skipped=skipped)


def _read_runtime(db: _Db) -> _Part:
    spec = {
        k: "int"
        for k in (
            "start",
            "end",
            "eventClass",
            "globalTid",
            "correlationId",
            "nameId",
            "returnValue",
        )
    }
    v = db.select(RUNTIME, spec)
    n = len(v["start"])
    flags = np.zeros(n, np.int32)
    start, end = _times(v, flags)
    name, missing = db.lookup(v["nameId"], strip_version=True)
    flags |= np.where(missing, FLAG_REPAIRED, 0).astype(np.int32)
    # by name where the class does not say: cuda* runtime, other cu* driver
    by_name = np.array(
        [
            KINDS.index("DRIVER")
            if (s.startswith("cu") and not s.startswith("cuda"))
            else KINDS.index("RUNTIME")
            for s in name.dictionary.to_pylist()
        ]
        or [0],
        np.int8,
    )[name.indices.to_numpy(zero_copy_only=False)]
    ec = v["eventClass"]
    kind = np.where(
        ec == 0, KINDS.index("RUNTIME"), np.where(ec == 1, KINDS.index("DRIVER"), by_name)
    ).astype(np.int8)
    pid, tid = _split_global_id(v["globalTid"])
    corr = _nullable(v["correlationId"])
    flags |= np.where(
        _flag_duplicates(pid, corr, start, np.ones(n, bool)), FLAG_DUPLICATE, 0
    ).astype(np.int32)
    rv = v["returnValue"]
    args = _json_args(n, [("return value", _int_str(rv, (rv == 0) | (rv == _NULL)))])
    out = dict(
        kind=kind,
        name=name,
        pid=pid,
        tid=tid,
        start_ns=start,
        end_ns=end,
        corr_id=corr,
        flags=flags,
        args=args,
    )
    return _Part(RUNTIME, out, n)


def _gpu_common(
    db: _Db, table: str, extra: dict[str, str]
) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """Columns every GPU activity table shares; returns (raw values, canonical columns, flags,
    graph-launched mask)."""
    spec = {
        k: "int"
        for k in (
            "start",
            "end",
            "deviceId",
            "contextId",
            "streamId",
            "correlationId",
            "globalPid",
            "graphId",
            "graphNodeId",
        )
    }
    spec.update(extra)
    v = db.select(table, spec)
    n = len(v["start"])
    flags = np.zeros(n, np.int32)
    start, end = _times(v, flags)
    pid, _ = _split_global_id(v["globalPid"])
    graph = _nullable(v["graphId"], invalid=(0,))
    graph_launched = (graph > 0) | (v["graphNodeId"] != _NULL)
    out = dict(
        pid=pid,
        tid=np.full(n, -1, np.int64),
        device=_nullable(v["deviceId"]),
        stream=_nullable(v["streamId"], invalid=(_U32_INVALID,)),
        start_ns=start,
        end_ns=end,
        corr_id=_nullable(v["correlationId"]),
        graph_id=graph,
    )
    return v, out, flags, graph_launched


def _common_args(v: dict) -> list[tuple[str, pa.Array]]:
    ctx, node = v["contextId"], v["graphNodeId"]
    return [
        ("context", _int_str(ctx, ctx == _NULL)),
        ("graph node id", _int_str(node, node == _NULL)),
    ]


def _read_kernel(db: _Db) -> _Part:
    cols = db.columns(KERNEL)
    extra = {
        k: "int"
        for k in (
            "registersPerThread",
            "gridX",
            "gridY",
            "gridZ",
            "blockX",
            "blockY",
            "blockZ",
            "staticSharedMemory",
            "dynamicSharedMemory",
        )
    }
    extra.update({k: "str" for k in ("demangledName", "shortName", "mangledName") if k in cols})
    v, out, flags, graph_launched = _gpu_common(db, KERNEL, extra)
    n = len(v["start"])
    # name: demangled, else short, else mangled (per row, where a reference dangles)
    name, missing, preferred_missing = pa.array([""] * n, pa.string()), np.ones(n, bool), None
    short = None
    for c in ("demangledName", "shortName", "mangledName"):
        if c not in cols:
            continue
        s, s_missing = db.resolve(v[c])
        if c == "shortName":
            short = _masked(_json_str(s), s_missing)
        name = pc.if_else(pa.array(missing & ~s_missing), s.cast(pa.string()), name)
        missing &= s_missing
        preferred_missing = s_missing if preferred_missing is None else preferred_missing
    name = name.dictionary_encode()
    flags |= np.where(
        missing if preferred_missing is None else preferred_missing, FLAG_REPAIRED, 0
    ).astype(np.int32)
    flags |= np.where(
        _flag_duplicates(out["pid"], out["corr_id"], out["start_ns"], ~graph_launched),
        FLAG_DUPLICATE,
        0,
    ).astype(np.int32)

    def triple(a: str, b: str, c: str) -> pa.Array | None:
        if not all(x in cols for x in (a, b, c)):
            return None
        return pc.binary_join_element_wise(
            "[", _int_str(v[a]), ",", _int_str(v[b]), ",", _int_str(v[c]), "]", ""
        )

    smem = v["staticSharedMemory"], v["dynamicSharedMemory"]
    smem_null = (smem[0] == _NULL) & (smem[1] == _NULL)
    smem_total = np.where(smem[0] == _NULL, 0, smem[0]) + np.where(smem[1] == _NULL, 0, smem[1])
    reg = v["registersPerThread"]
    args = _json_args(
        n,
        [
            ("short name", short),
            ("grid", triple("gridX", "gridY", "gridZ")),
            ("block", triple("blockX", "blockY", "blockZ")),
            ("registers per thread", _int_str(reg, reg == _NULL)),
            ("shared memory", _int_str(smem_total, smem_null)),
            ("static shared memory", _int_str(smem[0], smem[0] == _NULL)),
            ("dynamic shared memory", _int_str(smem[1], smem[1] == _NULL)),
            *_common_args(v),
        ],
    )
    out.update(kind=np.full(n, KINDS.index("KERNEL"), np.int8), name=name, flags=flags, args=args)
    return _Part(KERNEL, out, n)


def _label(table: dict[int, str]) -> Callable[[int], str]:
    return lambda k: table.get(k, "Unknown" if k == _NULL else str(k))


def _read_memcpy(db: _Db) -> _Part:
    extra = {
        k: "int" for k in ("bytes", "copyKind", "srcKind", "dstKind", "srcDeviceId", "dstDeviceId")
    }
    v, out, flags, _ = _gpu_common(db, MEMCPY, extra)
    n = len(v["start"])
    ck, sk, dk = v["copyKind"], v["srcKind"], v["dstKind"]
    kinds3 = np.stack([ck, sk, dk], axis=1) if n else np.empty((0, 3), np.int64)
    uniq, inv = np.unique(kinds3, axis=0, return_inverse=True)
    ckl, mkl = _label(_COPY_KIND), _label(_MEM_KIND)
    names = [f"Memcpy {ckl(int(c))} ({mkl(int(s))} -> {mkl(int(d))})" for c, s, d in uniq]
    name = _dedupe(np.asarray(inv).reshape(-1), pa.array(names, pa.string()))
    src_dev, dst_dev = v["srcDeviceId"], v["dstDeviceId"]
    args = _json_args(
        n,
        [
            ("copy kind", _small_dict(ck, lambda c: json.dumps(ckl(c))).cast(pa.string())),
            ("src kind", _small_dict(sk, lambda c: json.dumps(mkl(c))).cast(pa.string())),
            ("dst kind", _small_dict(dk, lambda c: json.dumps(mkl(c))).cast(pa.string())),
            ("src device", _int_str(src_dev, src_dev == _NULL)),
            ("dst device", _int_str(dst_dev, dst_dev == _NULL)),
            *_common_args(v),
        ],
    )
    out.update(
        kind=np.full(n, KINDS.index("MEMCPY"), np.int8),
        name=name,
        bytes=_nullable(v["bytes"]),
        flags=flags,
        args=args,
    )
    return _Part(MEMCPY, out, n)


def _read_memset(db: _Db) -> _Part:
    v, out, flags, _ = _gpu_common(db, MEMSET, {"bytes": "int", "value": "int", "memKind": "int"})
    n = len(v["start"])
    mkl = _label(_MEM_KIND)
    name = _small_dict(v["memKind"], lambda k: f"Memset ({mkl(k)})")
    val = v["value"]
    args = _json_args(n, [("value", _int_str(val, val == _NULL)), *_common_args(v)])
    out.update(
        kind=np.full(n, KINDS.index("MEMSET"), np.int8),
        name=name,
        bytes=_nullable(v["bytes"]),
        flags=flags,
        args=args,
    )
    return _Part(MEMSET, out, n)


def _read_sync(db: _Db) -> _Part:
    cols = db.columns(SYNC)
    st = "syncType" if "syncType" in cols else "deprecatedSyncType"
    v, out, flags, _ = _gpu_common(
        db, SYNC, {"sync": f'sql:t."{st}"' if st in cols else "sql:NULL", "eventId": "int"}
    )
    n = len(v["start"])
    stl = _label(_SYNC_TYPE)
    name = _small_dict(v["sync"], stl)
    ev = v["eventId"]
    args = _json_args(
        n,
        [
            ("sync type", _small_dict(v["sync"], lambda k: json.dumps(stl(k))).cast(pa.string())),
            ("event", _int_str(ev, (ev == _NULL) | (ev == _U32_INVALID))),
            *_common_args(v),
        ],
    )
    out.update(kind=np.full(n, KINDS.index("SYNC"), np.int8), name=name, flags=flags, args=args)
    return _Part(SYNC, out, n)


_READERS = {
    NVTX: _read_nvtx,
    RUNTIME: _read_runtime,
    KERNEL: _read_kernel,
    MEMCPY: _read_memcpy,
    MEMSET: _read_memset,
    SYNC: _read_sync,
}


# --------------------------------------------------------------------------------------------
# one file


@dataclass
class NsysRead:
    """Events of one export on its session clock, with what is needed to place and report them."""

    path: Path
    events: pa.Table  # start_ns/end_ns: ns since the nsys session start
    rows_in: dict[str, int]
    skipped: dict[str, int]
    session_start_unix_ns: int | None
    meta: dict[str, Any]
    processes: dict[int, str]
    warnings: list[str] = field(default_factory=list)


def _check_file(path: Path) -> None:
    if not path.exists():
        raise InputError(path, "no such file", "check the path")
    if path.is_dir():
        raise InputError(
            path, "is a folder, not an Nsight Systems SQLite export", "pass the .sqlite file"
        )
    size = path.stat().st_size
    if size == 0:
        raise InputError(path, "empty file", _FIX)
    with open(path, "rb") as f:
        head = f.read(len(_SQLITE_MAGIC))
    if head != _SQLITE_MAGIC:
        raise InputError(path, "not a SQLite database", _FIX)


#: Session start times outside 2000-01-01 .. 2100-01-01 are damage, not a clock.
_EPOCH_RANGE_NS = (946_684_800 * 10**9, 4_102_444_800 * 10**9)


def _session_start(db: _Db, warnings: list[str]) -> int | None:
    """``TARGET_INFO_SESSION_START_TIME.utcEpochNs``, or None (with a warning) when it is not
    an integer wall-clock time between 2000 and 2100: a garbage anchor would overflow every
    later ``τ ↔ wall clock`` conversion (log alignment)."""
    t = "TARGET_INFO_SESSION_START_TIME"
    if t not in db.tables or "utcEpochNs" not in db.columns(t):
        return None
    row = db.con.execute(
        f'SELECT utcEpochNs, typeof(utcEpochNs) FROM "{t}" WHERE utcEpochNs IS NOT NULL LIMIT 1'
    ).fetchone()
    if not row:
        return None
    v, typ = row
    lo, hi = _EPOCH_RANGE_NS
    if typ == "integer" and lo <= v < hi:
        return int(v)
    if typ == "real" and lo <= v < hi:
        return int(v)
    warnings.append(
        f"{db.path.name}: {t}.utcEpochNs {str(v)[:40]!r} is not a wall-clock time in ns "
        "(2000..2100); ignored, so the run has no wall clock (t0_unix_ns null)"
    )
    return None


def _meta(db: _Db) -> dict[str, Any]:
    for t in ("META_DATA_EXPORT", "EXPORT_META_DATA"):
        if t in db.tables:
            d = dict(
                db.con.execute(
                    f'SELECT CAST(name AS TEXT), CAST(value AS TEXT) FROM "{t}"'
                ).fetchall()
            )
            return {
                k: d[key]
                for k, key in (
                    ("nsys_version", "EXPORT_PRODUCT_VERSION"),
                    ("export_schema_version", "EXPORT_SCHEMA_VERSION"),
                )
                if key in d
            }
    return {}


def _processes(db: _Db, pids: np.ndarray) -> dict[int, str]:
    if "PROCESSES" not in db.tables or not {"pid", "name"} <= set(db.columns("PROCESSES")):
        return {}
    want = {int(p) for p in np.unique(pids) if p >= 0}
    rows = db.con.execute(
        "SELECT CAST(pid AS INTEGER), CAST(name AS TEXT) FROM PROCESSES"
    ).fetchall()
    return {p: n for p, n in rows if p in want and n is not None}


def read_nsys_raw(path: str | os.PathLike, node: int = 0, rank: int = 0) -> NsysRead:
    """Read one export without shifting its clock (``read_nsys`` and ``ingest_nsys`` use this)."""
    path = Path(path)
    _check_file(path)
    try:
        db = _Db(path)
        try:
            present = [t for t in EVENT_TABLES if t in db.tables]
            if not present:
                raise InputError(
                    path,
                    "no CUPTI/NVTX tables; was this exported from an nsys report?",
                    "profile with `nsys profile -t cuda,nvtx` and " + _FIX,
                )
            parts = [_READERS[t](db) for t in present]
            warnings: list[str] = []
            for p in parts:
                rej = {k: v for k, v in db.rejected.items() if k.startswith(p.table + ":")}
                p.skipped.update(rej)
                if p.table != NVTX:  # NVTX counts its rows in SQL; the others count rows read
                    p.rows_in += sum(rej.values())
                for k, v in rej.items():
                    warnings.append(f"{path.name}: {v} rows of {k}; left out")
                if db.repaired[p.table]:
                    warnings.append(
                        f"{path.name}: {p.table} holds text where ids/devices/streams belong; "
                        "those values read as unknown, rows flagged repaired"
                    )
            pids = (
                np.concatenate([p.cols["pid"] for p in parts]) if parts else np.empty(0, np.int64)
            )
            start = _session_start(db, warnings)
            r = _assemble(path, parts, node, rank, start, _meta(db), _processes(db, pids))
            r.warnings = warnings
            return r
        finally:
            db.close()
    except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
        # UnicodeDecodeError: sqlite3 decodes names and messages strictly; garbage there is damage
        raise InputError(path, f"damaged or unreadable SQLite database ({e})", _FIX) from None
    except (ValueError, OverflowError, pa.ArrowException) as e:
        raise InputError(
            path, f"unexpected values in the export ({type(e).__name__}: {e})", _FIX
        ) from None


def _assemble(
    path: Path,
    parts: list[_Part],
    node: int,
    rank: int,
    session_start: int | None,
    meta: dict[str, Any],
    processes: dict[int, str],
) -> NsysRead:
    # the last time seen in the file closes ranges left open at capture end
    ends = [np.concatenate([p.cols["start_ns"], p.cols["end_ns"]]) for p in parts]
    ends = np.concatenate(ends) if ends else np.empty(0, np.int64)
    ends = ends[ends != _NULL]
    last = int(ends.max()) if len(ends) else 0
    tables, rows_in, skipped = [], {}, {}
    for p in parts:
        c = p.cols
        if p.open_end is not None and p.open_end.any():
            c["end_ns"] = np.where(p.open_end, np.maximum(last, c["start_ns"]), c["end_ns"])
            c["flags"] = c["flags"] | np.where(p.open_end, FLAG_TRUNCATED, 0).astype(np.int32)
        # rows with neither start nor end: place them at the file end, flagged
        for k in ("start_ns", "end_ns"):
            bad = c[k] == _NULL
            if bad.any():
                c[k] = np.where(bad, last, c[k])
                c["flags"] = c["flags"] | np.where(bad, FLAG_REPAIRED, 0).astype(np.int32)
        n = len(c["start_ns"])
        c["node"] = np.full(n, node, np.int32)
        c["rank"] = np.full(n, rank, np.int32)
        tables.append(events_table(c, n))
        rows_in[p.table] = p.rows_in
        skipped.update(p.skipped)
    events = concat_events(tables)
    if events.num_rows:  # garbage times (a damaged page) would overflow τ arithmetic
        lo, hi = int(np_col(events, "start_ns").min()), int(np_col(events, "end_ns").max())
        if hi - lo >= 2**62:
            raise InputError(path, f"event times {lo}..{hi} ns do not fit one capture", _FIX)
    return NsysRead(path, events, rows_in, skipped, session_start, meta, processes)


def _shift(events: pa.Table, t0: int) -> pa.Table:
    for k in ("start_ns", "end_ns"):
        i = events.schema.get_field_index(k)
        events = events.set_column(i, k, pa.array(np_col(events, k) - t0, pa.int64()))
    return events


def _t_min(events: pa.Table) -> int:
    return int(np_col(events, "start_ns").min()) if events.num_rows else 0


def read_nsys(path: str | os.PathLike, node: int = 0, rank: int = 0) -> pa.Table:
    """Canonical events of one Nsight Systems SQLite export, τ = ns since its earliest event."""
    r = read_nsys_raw(path, node, rank)
    return _shift(r.events, _t_min(r.events))


# --------------------------------------------------------------------------------------------
# ingest


def ingest_nsys(
    src: Path, out: Path, node: int = 0, rank: int = 0, **options: Any
) -> dict[str, Any]:
    """Read an nsys SQLite export (or a folder of them, one rank per file) into run directory
    ``out``; returns counts per source table in and per kind out."""
    src, out = Path(src), Path(out)
    if src.is_dir():
        files = sorted(src.glob("*.sqlite"))
        if not files:
            raise InputError(
                src,
                "folder holds no .sqlite files",
                "export each report with `nsys export --type sqlite`",
            )
    else:
        files = [src]
    reads = [read_nsys_raw(f, node, rank + i) for i, f in enumerate(files)]
    warnings = [w for r in reads for w in r.warnings]
    anchored = all(r.session_start_unix_ns is not None for r in reads)
    # one time base: wall clock when every file has it, else each file on its own
    if anchored:
        starts = [r.session_start_unix_ns + _t_min(r.events) for r in reads if r.events.num_rows]
        t0_unix = min(starts) if starts else (reads[0].session_start_unix_ns if reads else None)
        lo, hi = _EPOCH_RANGE_NS
        if t0_unix is not None and not lo <= t0_unix < hi:
            # an event time far from the session start (a damaged row: SQLite reads a REAL such
            # as 1e300 as the largest integer) would put the run beyond 2100
            warnings.append(
                f"{src.name}: the session start plus the earliest event time ({t0_unix} ns) is not a "
                "wall-clock time (2000..2100); the run has no wall clock (t0_unix_ns null)"
            )
            anchored = False
    if anchored:
        offsets = [t0_unix - r.session_start_unix_ns for r in reads]
    else:
        t0_unix = None
        offsets = [_t_min(r.events) for r in reads]
    shifted = [_shift(r.events, off) for r, off in zip(reads, offsets, strict=True)]
    prepare_out(out)
    rd = RunDir(out)
    for f, ev in zip(files, shifted, strict=True):
        rd.write_events(ev, name=f"nsys_{f.stem}")
    events = concat_events(shifted)
    rows_in: dict[str, int] = {}
    skipped: dict[str, int] = {}
    for r in reads:
        for k, v in r.rows_in.items():
            rows_in[k] = rows_in.get(k, 0) + v
        for k, v in r.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
    kinds = kind_counts(events)
    flags = flag_counts(np_col(events, "flags"))
    counts = {"tables": rows_in, "kinds": kinds, "flags": flags, "skipped": skipped}
    end_ns = int(np_col(events, "end_ns").max()) if events.num_rows else 0
    ranks = []
    for i, r in enumerate(reads):
        for p in np.unique(np_col(r.events, "pid")) if r.events.num_rows else []:
            if p >= 0:
                ranks.append(
                    {
                        "node": node,
                        "rank": rank + i,
                        "pid": int(p),
                        "name": r.processes.get(int(p), ""),
                        "file": str(r.path.resolve()),
                    }
                )
    clock = {
        "time_base": "nsys session clock (ns)"
        + ("" if anchored else "; files not aligned (no session start time)"),
        "t0_unix_ns": t0_unix,
        "session_start_unix_ns": [r.session_start_unix_ns for r in reads]
        if len(reads) > 1
        else reads[0].session_start_unix_ns,
        "t0_session_ns": offsets if len(reads) > 1 else offsets[0],
    }
    info = RunInfo(
        source=str(src),
        ranks=ranks,
        clock=clock,
        collector={
            "reader": "nsys",
            "files": [{"file": str(r.path.resolve()), **r.meta} for r in reads],
        },
        counts=counts,
        start_wall=t0_unix / 1e9 if t0_unix is not None else None,
        end_wall=(t0_unix + end_ns) / 1e9 if t0_unix is not None else None,
        extra={"warnings": warnings},
    )
    rd.write_info(info)
    return {
        "format": "nsys",
        "files": len(files),
        "rows_in": sum(rows_in.values()),
        "skipped": sum(skipped.values()),
        "events": events.num_rows,
        "out": str(out),
        "tables": rows_in,
        "kinds": kinds,
        "flags": flags,
        "skipped_rows": skipped,
        "t0_unix_ns": t0_unix,
        "warnings": warnings,
    }
