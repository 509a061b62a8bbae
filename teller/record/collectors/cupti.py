"""CUPTI collector: host API calls, kernels, copies, syncs and NVTX ranges through ``cupti-python``.

Runs inside the recorded process (docs/design.md §12). CUPTI hands over activity records in buffers;
``cupti-python`` turns each record into a Python object before our completion callback runs, so the
callback does as little per record as it can: one C-level ``attrgetter`` call pulls all numeric
fields of a record into a tuple, the tuples become one numpy array per kind, and names, times,
flags and ``args`` are computed on whole columns (API names through a cbid → name cache, kernel
names interned by Arrow's dictionary encoding and demangled once per distinct name, ``args`` JSON
built once per distinct launch configuration).

CUPTI's clock is not τ. The collector takes (CUPTI timestamp, τ) anchor pairs at start, at every
completed buffer and at every flush, and maps record times piecewise-linearly between anchors
(:class:`~teller.record.clock.ClockMap`), so drift between the two clocks is corrected; the
anchors are reported in ``info()``.

NVTX ranges arrive as MARKER records when ``NVTX_INJECTION64_PATH`` points at libcupti (the
launcher sets it): a start record (flags 2) carries the message, an end record (flags 4) the same
id; they are paired here, across buffers, into RANGE events whose ``tid`` is the pushing thread.

Decoding runs in CUPTI's buffer-completed callback (``inline``, the default) or, with
``TELLER_CUPTI_DECODE=deferred``, after the run: the callback then copies the buffer aside
(:class:`PendingBuffers`) and :meth:`CuptiCollector.stop` decodes the copies (kernel and marker
names are read then through the pointers in the records, which CUPTI keeps in the process, as
Kineto reads them after a session; the clock anchors taken at every buffer bracket the records
as they would inline). What a crash loses in each mode is in
:class:`CuptiCollector`'s docstring.

The decode logic (:class:`RecordDecoder`) does not import CUPTI, so it is tested on synthetic
records on machines without a GPU. :class:`CuptiCollector` never raises into the engine: a missing
``cupti`` module, a CUPTI error or a decode bug lands in ``info()["errors"]`` and the collector
degrades to doing nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import sys
import threading
import time
from operator import attrgetter
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa

from teller.record.clock import ClockMap, take_anchor
from teller.rundir import FLAG_REPAIRED, FLAG_TRUNCATED, strip_api_version

# ----------------------------------------------------------------------------------------------
# constants (values of the CUPTI C enums; the live collector rebuilds them from cupti's enums)

#: CUpti_ActivityKind values of the kinds we decode (cupti_activity.h; stable ABI).
DEFAULT_KIND_VALUES = {
    "MEMCPY": 1,
    "MEMSET": 2,
    "KERNEL": 3,
    "DRIVER": 4,
    "RUNTIME": 5,
    "CONCURRENT_KERNEL": 10,
    "MARKER": 12,
    "SYNCHRONIZATION": 38,
}
#: Activity kinds enabled by default (``TELLER_CUPTI_KINDS`` overrides, comma separated).
DEFAULT_KINDS = ("RUNTIME", "DRIVER", "CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "SYNCHRONIZATION", "MARKER")

MEMCPY_KIND = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD",
               7: "DtoA", 8: "DtoD", 9: "HtoH", 10: "PtoP"}
MEMORY_KIND = {0: "Unknown", 1: "Pageable", 2: "Pinned", 3: "Device", 4: "Array", 5: "Managed",
               6: "DeviceStatic", 7: "ManagedStatic"}
SYNC_TYPE = {0: "Unknown Synchronize", 1: "Event Synchronize", 2: "Stream Wait Event",
             3: "Stream Synchronize", 4: "Context Synchronize"}

#: CUpti_ActivityFlag bits of MARKER records.
MARKER_INSTANT, MARKER_START, MARKER_END = 1, 2, 4
_U32_NONE = 0xFFFFFFFF

# Numeric fields pulled per record, in column order (one attrgetter call per record).
_API_FIELDS = ("cbid", "start", "end", "process_id", "thread_id", "correlation_id", "return_value")
_KERNEL_FIELDS = ("start", "end", "device_id", "stream_id", "correlation_id", "graph_id",
                  "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
                  "registers_per_thread", "static_shared_memory", "dynamic_shared_memory")
_MEMCPY_FIELDS = ("start", "end", "device_id", "stream_id", "correlation_id", "graph_id", "bytes",
                  "copy_kind", "src_kind", "dst_kind")
_MEMSET_FIELDS = ("start", "end", "device_id", "stream_id", "correlation_id", "graph_id", "bytes",
                  "value", "memory_kind")
_SYNC_FIELDS = ("start", "end", "stream_id", "correlation_id", "type", "cuda_event_id")
_MARKER_FIELDS = ("flags_", "timestamp", "id")


def strip_version(name: str) -> str:
    """``cudaLaunchKernel_v7000`` → ``cudaLaunchKernel`` (one trailing ``_v<digits>``)."""
    return strip_api_version(name)


@functools.lru_cache(maxsize=1)
def _cxa_demangle() -> Callable[[str], str] | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        fn = lib.__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t),
                   ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_void_p
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]

    def demangle(name: str) -> str:
        status = ctypes.c_int(1)
        ptr = fn(name.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not ptr:
            return name
        try:
            return ctypes.string_at(ptr).decode("utf-8", "replace")
        finally:
            libc.free(ptr)

    return demangle


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """Demangle an Itanium C++ symbol (kernel names); other names pass through unchanged."""
    if not name.startswith("_Z"):
        return name
    fn = _cxa_demangle()
    return fn(name) if fn is not None else name


# ----------------------------------------------------------------------------------------------
# record decoding (no CUPTI import: testable on synthetic records)


def _dict_array(codes: np.ndarray, dictionary: Sequence[str]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(np.asarray(codes, dtype=np.int32)),
                                          pa.array(list(dictionary), pa.string()))


def _const_dict(value: str, n: int) -> pa.DictionaryArray:
    return _dict_array(np.zeros(n, np.int32), [value])


#: odd 64-bit multipliers of :func:`unique_rows`'s row hash, one per column (wrapping arithmetic)
_ROW_MULT = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                      0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x27D4EB2F165667C5, 0x94D049BB133111EB,
                      0xBF58476D1CE4E5B9, 0x2545F4914F6CDD1D, 0x9FB21C651E98DF25, 0x5851F42D4C957F2D],
                     dtype=np.uint64)


def unique_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of a 2-D integer array and, per row, the index of its distinct row.

    The same sets as ``np.unique(keys, axis=0, return_inverse=True)`` (the distinct rows may come
    in another order), through one 64-bit hash per row and a sort of the hashes, which is several
    times faster than numpy's row sort; a hash shared by two different rows is detected and the
    call falls back to ``np.unique``.
    """
    keys = np.asarray(keys)
    n, m = keys.shape
    if n and m <= len(_ROW_MULT):
        with np.errstate(over="ignore"):
            h = (keys.astype(np.int64).view(np.uint64) * _ROW_MULT[:m]).sum(axis=1, dtype=np.uint64)
        _, first, inv = np.unique(h, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        uniq = keys[first]
        if np.array_equal(uniq[inv], keys):
            return uniq, inv
    # no rows, too many columns, or two rows sharing a hash: the exact way
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    return uniq, inv.reshape(-1)


def _unique_json(keys: np.ndarray, make: Callable[[tuple], str | None]) -> pa.Array:
    """``args`` for rows whose JSON depends only on a few integer columns: built once per distinct row."""
    if len(keys) == 0:
        return pa.array([], pa.string())
    uniq, inv = unique_rows(keys)
    texts = [make(tuple(int(v) for v in row)) for row in uniq]
    return pa.array(texts, pa.string()).take(pa.array(inv.astype(np.int32)))


def _none_u32(a: np.ndarray) -> np.ndarray:
    """CUPTI's ``0xffffffff`` "no id" → -1."""
    a = a.astype(np.int64, copy=True)
    a[a == _U32_NONE] = -1
    return a



#: CUPTI kind → decode group, the numeric and string fields pulled per record, and the
#: cupti-python dtype that describes the record's C layout (raw decoding).
GROUP = {"RUNTIME": "API", "DRIVER": "API", "CONCURRENT_KERNEL": "KERNEL", "KERNEL": "KERNEL",
         "MEMCPY": "MEMCPY", "MEMSET": "MEMSET", "SYNCHRONIZATION": "SYNC", "MARKER": "MARKER"}
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "API": (_API_FIELDS, ()),
    "KERNEL": (_KERNEL_FIELDS, ("name",)),
    "MEMCPY": (_MEMCPY_FIELDS, ()),
    "MEMSET": (_MEMSET_FIELDS, ()),
    "SYNC": (_SYNC_FIELDS, ()),
    "MARKER": (_MARKER_FIELDS, ("name", "domain")),
}
LAYOUT_DTYPES = {"API": "activity_api_dtype", "KERNEL": "activity_kernel10_dtype",
                 "MEMCPY": "activity_memcpy6_dtype", "MEMSET": "activity_memset4_dtype",
                 "SYNC": "activity_synchronization2_dtype", "MARKER": "activity_marker2_dtype"}


# ----------------------------------------------------------------------------------------------
# raw record layouts (decode straight from CUPTI's buffer memory, no Python object per record)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


class RawLayout:
    """Where our fields sit inside one CUPTI record struct: a numpy dtype with our field names.

    Built from a dtype that describes the C struct (cupti-python's ``activity_*_dtype``), looking
    each field up by its Python attribute name, without a trailing ``_``, or in camelCase. String
    fields must be pointers (integers). For MARKER, ``pid``/``tid`` are the two uint32 at the start
    of the ``object_id`` union (``pt.processId``, ``pt.threadId``).
    """

    def __init__(self, group: str, struct: np.dtype) -> None:
        num, strs = FIELDS[group]
        fields = struct.fields or {}
        names, formats, offsets = [], [], []

        def find(attr: str) -> tuple[np.dtype, int]:
            for cand in (attr, attr.rstrip("_"), _camel(attr), _camel(attr.rstrip("_"))):
                if cand in fields:
                    return fields[cand][0], fields[cand][1]
            raise KeyError(f"{group}: field {attr!r} not in record layout ({', '.join(fields)})")

        for attr in ("kind",) + num + strs:
            dt, off = find(attr)
            if dt.kind not in "iu":
                raise TypeError(f"{group}: field {attr!r} has type {dt}, expected an integer/pointer")
            names.append(attr)
            formats.append(dt)
            offsets.append(off)
        if group == "MARKER":
            _, off = find("object_id")
            names += ["pid", "tid"]
            formats += [np.dtype("<u4"), np.dtype("<u4")]
            offsets += [off, off + 4]
        self.group = group
        self.itemsize = struct.itemsize
        self.stride = (struct.itemsize + 7) & ~7  # CUPTI aligns records to 8 bytes
        self.dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets,
                               "itemsize": self.itemsize})

    def gather(self, words: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Records at byte ``offsets`` of a buffer viewed as uint64 ``words`` → structured array."""
        nw = (self.itemsize + 7) // 8
        idx = (offsets // 8)[:, None] + np.arange(nw)
        rows = np.ascontiguousarray(words[idx]).view(np.uint8)[:, : self.itemsize]
        return np.ascontiguousarray(rows).view(self.dtype).reshape(-1)


def walk_records(buf: np.ndarray, valid: int, sizes: dict[int, int]) -> tuple[np.ndarray, np.ndarray, int]:
    """Offsets and kinds of the records packed in ``buf[:valid]``.

    Every record starts with its 32-bit kind; its size follows from the kind. One cheap loop
    over records (an int read per record), the only per-record Python in the raw path. Returns
    (offsets, kinds, bytes consumed); consumed < valid means an unknown kind stopped the walk.
    """
    mv = memoryview(buf[: valid & ~3]).cast("I")
    offs: list[int] = []
    kinds: list[int] = []
    off = 0
    get = sizes.get
    while off + 4 <= valid:
        k = mv[off >> 2]
        s = get(k)
        if s is None:
            break
        offs.append(off)
        kinds.append(k)
        off += s
    return np.array(offs, np.int64), np.array(kinds, np.int64), off


def _c_strings(ptrs: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Codes and dictionary for C string pointers (one read per distinct pointer)."""
    uniq, inv = np.unique(ptrs, return_inverse=True)
    texts = ["" if not p else ctypes.string_at(int(p)).decode("utf-8", "replace") for p in uniq.tolist()]
    return inv.reshape(-1), texts


def _py_strings(values: list) -> tuple[np.ndarray, list[str]]:
    enc = pa.array([v or "" for v in values], pa.string()).dictionary_encode()
    return enc.indices.to_numpy(zero_copy_only=False), enc.dictionary.to_pylist()


def _strings(values: Any) -> tuple[np.ndarray, list[str]]:
    return _c_strings(values) if isinstance(values, np.ndarray) else _py_strings(values)


# ----------------------------------------------------------------------------------------------
# record decoding (no CUPTI import: testable on synthetic records)


class RecordDecoder:
    """Turns CUPTI activity records into canonical event columns on τ.

    Two entry points share the per-kind logic: :meth:`decode` takes the record objects
    ``cupti-python`` builds (one C-level ``attrgetter`` call per record), :meth:`decode_raw` takes
    the raw activity buffer and reads fields straight from memory through :class:`RawLayout`
    (no Python object per record). ``kind_values`` maps CUPTI kind names to their integer
    values; ``api_name(kind, cbid)`` returns the raw callback name of a RUNTIME/DRIVER record;
    ``clockmap`` maps CUPTI ns to τ. Counts of records in and events out are kept so they can be
    reconciled in ``run.json``.
    """

    def __init__(self, kind_values: dict[str, int] | None = None,
                 api_name: Callable[[str, int], str] | None = None,
                 clockmap: ClockMap | None = None,
                 layouts: dict[str, np.dtype] | None = None) -> None:
        values = dict(DEFAULT_KIND_VALUES if kind_values is None else kind_values)
        self.kind_of: dict[int, str] = {int(v): k for k, v in values.items()}
        self.api_name_raw = api_name or (lambda kind, cbid: f"{kind.lower()}_cbid_{cbid}")
        self.clock = clockmap if clockmap is not None else ClockMap()
        self.raw: dict[int, RawLayout] = {}
        for kind, value in values.items():
            group = GROUP.get(kind)
            if layouts and group in layouts:
                self.raw[int(value)] = RawLayout(group, layouts[group])
        self.raw_sizes = {v: lay.stride for v, lay in self.raw.items()}
        self._api_names: dict[tuple[str, int], str] = {}
        self._open_markers: dict[int, tuple[int, str, int, int, str]] = {}
        self.records_in: dict[str, int] = {}
        self.events_out: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        self.repaired = 0
        self.unwalked_bytes = 0
        self.last_ts = 0
        self.decode_ns = 0
        self.decode_cpu_ns = 0

    # -- public ---------------------------------------------------------------------------------

    def decode(self, records: Sequence[Any]) -> list[dict[str, Any]]:
        """Decode one buffer's record objects; returns one column dict per kind present."""
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        n = len(records)
        out: list[dict[str, Any]] = []
        if n:
            kinds = np.fromiter(map(attrgetter("kind"), records), dtype=np.int64, count=n)
            for value in np.unique(kinds).tolist():
                name = self.kind_of.get(value, f"kind_{value}")
                idx = np.flatnonzero(kinds == value)
                group = [records[i] for i in idx]
                self.records_in[name] = self.records_in.get(name, 0) + len(group)
                g = GROUP.get(name)
                if g is None:
                    self.skipped[name] = self.skipped.get(name, 0) + len(group)
                    continue
                self._emit(out, name, g, self._fields_from_objects(g, group))
        self.decode_ns += time.perf_counter_ns() - t0
        self.decode_cpu_ns += time.thread_time_ns() - c0
        return out

    def decode_raw(self, buf: np.ndarray, valid: int) -> list[dict[str, Any]]:
        """Decode a raw activity buffer (``buf[:valid]`` holds packed records)."""
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        out: list[dict[str, Any]] = []
        offs, kinds, used = walk_records(buf, valid, self.raw_sizes)
        if used < valid:
            self.unwalked_bytes += valid - used
            k = int(np.frombuffer(buf[used:used + 4], np.uint32)[0]) if used + 4 <= valid else -1
            self.skipped[f"kind_{k}"] = self.skipped.get(f"kind_{k}", 0) + 1
        if len(offs):
            words = buf[: (valid + 7) & ~7].view(np.uint64) if valid % 8 == 0 else \
                np.frombuffer(bytes(buf[:valid]) + b"\0" * (8 - valid % 8), np.uint64)
            for value in np.unique(kinds).tolist():
                layout = self.raw[value]
                name = self.kind_of.get(value, f"kind_{value}")
                rec = layout.gather(words, offs[kinds == value])
                self.records_in[name] = self.records_in.get(name, 0) + len(rec)
                self._emit(out, name, layout.group, self._fields_from_struct(layout.group, rec))
        self.decode_ns += time.perf_counter_ns() - t0
        self.decode_cpu_ns += time.thread_time_ns() - c0
        return out

    def close_open_ranges(self) -> dict[str, Any] | None:
        """Ranges whose end never arrived: emitted with end = last seen time, flagged truncated."""
        if not self._open_markers:
            return None
        items = sorted(self._open_markers.items())
        self._open_markers.clear()
        ids = np.array([k for k, _ in items], np.int64)
        ts = np.array([v[0] for _, v in items], np.int64)
        end = np.maximum(ts, self.last_ts)
        cols = {
            "kind": _const_dict("RANGE", len(ids)),
            "name": pa.array([v[1] for _, v in items], pa.string()),
            "pid": np.array([v[2] for _, v in items], np.int64),
            "tid": np.array([v[3] for _, v in items], np.int64),
            "start_ns": self.clock.map(ts),
            "end_ns": self.clock.map(end),
            "range_id": ids,
            "flags": np.full(len(ids), FLAG_TRUNCATED, np.int32),
            "args": pa.array([json.dumps({"domain": v[4]}) if v[4] else None for _, v in items],
                             pa.string()),
        }
        self._count(cols)
        return cols

    @property
    def open_ranges(self) -> int:
        return len(self._open_markers)

    def counts(self) -> dict[str, Any]:
        return {"records_in": dict(self.records_in), "events_out": dict(self.events_out),
                "skipped_records": dict(self.skipped), "repaired": self.repaired,
                "open_ranges": len(self._open_markers), "unwalked_bytes": self.unwalked_bytes}

    # -- field extraction -----------------------------------------------------------------------

    @staticmethod
    def _fields_from_objects(group: str, recs: list) -> dict[str, Any]:
        num, strs = FIELDS[group]
        a = np.array(list(map(attrgetter(*num), recs)), dtype=np.int64).reshape(-1, len(num))
        f: dict[str, Any] = {k: a[:, i] for i, k in enumerate(num)}
        for k in strs:
            f[k] = list(map(attrgetter(k), recs))
        if group == "MARKER":
            pt = [_marker_thread(r) for r in recs]
            f["pid"] = np.array([p for p, _ in pt], np.int64)
            f["tid"] = np.array([t for _, t in pt], np.int64)
        return f

    @staticmethod
    def _fields_from_struct(group: str, rec: np.ndarray) -> dict[str, Any]:
        num, strs = FIELDS[group]
        f: dict[str, Any] = {k: rec[k].astype(np.int64) for k in num}
        for k in strs:
            f[k] = rec[k].astype(np.uint64)
        if group == "MARKER":
            f["pid"], f["tid"] = rec["pid"].astype(np.int64), rec["tid"].astype(np.int64)
        return f

    # -- helpers --------------------------------------------------------------------------------

    def _emit(self, out: list, name: str, group: str, f: dict[str, Any]) -> None:
        cols = self._HANDLERS[group](self, name, f)
        if cols is not None:
            self._count(cols)
            out.append(cols)

    def _count(self, cols: dict[str, Any]) -> None:
        kind = cols["kind"]
        names = kind.dictionary.to_pylist()
        codes = kind.indices.to_numpy(zero_copy_only=False)
        for code, c in zip(*np.unique(codes, return_counts=True), strict=True):
            self.events_out[names[code]] = self.events_out.get(names[code], 0) + int(c)

    def _times(self, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Map start/end to τ; an incomplete record (end 0 or before start) gets end = start, flagged."""
        bad = (end < start) | (end == 0)
        flags = np.where(bad, FLAG_REPAIRED, 0).astype(np.int32)
        if bad.any():
            end = np.where(bad, start, end)
            self.repaired += int(bad.sum())
        if len(end):
            self.last_ts = max(self.last_ts, int(end.max()))
        return self.clock.map(start), self.clock.map(end), flags

    def _api_names_for(self, kind: str, cbids: np.ndarray) -> pa.DictionaryArray:
        uniq, inv = np.unique(cbids, return_inverse=True)
        names = []
        for c in uniq.tolist():
            key = (kind, c)
            nm = self._api_names.get(key)
            if nm is None:
                try:
                    nm = strip_version(str(self.api_name_raw(kind, c)))
                except Exception:  # unknown cbid in this CUPTI version
                    nm = f"{kind.lower()}_cbid_{c}"
                self._api_names[key] = nm
            names.append(nm)
        return _dict_array(inv.reshape(-1), names)

    @staticmethod
    def _graph(g: np.ndarray) -> np.ndarray:
        g = g.copy()
        g[g == 0] = -1  # 0: not launched from a CUDA graph
        return g

    # -- per kind -------------------------------------------------------------------------------

    def _api(self, kind: str, f: dict[str, Any]) -> dict[str, Any]:
        n = len(f["start"])
        start, end, flags = self._times(f["start"], f["end"])
        ret = f["return_value"]
        args = None
        if (ret != 0).any():
            args = _unique_json(ret.reshape(-1, 1), lambda r: json.dumps({"ret": r[0]}) if r[0] else None)
        label = "DRIVER" if kind == "DRIVER" else "RUNTIME"
        return {"kind": _const_dict(label, n), "name": self._api_names_for(label, f["cbid"]),
                "pid": f["process_id"], "tid": f["thread_id"], "start_ns": start, "end_ns": end,
                "corr_id": f["correlation_id"], "flags": flags, "args": args}

    def _kernel(self, kind: str, f: dict[str, Any]) -> dict[str, Any]:
        n = len(f["start"])
        start, end, flags = self._times(f["start"], f["end"])
        codes, texts = _strings(f["name"])
        names = _dict_array(codes, [demangle(t) for t in texts])
        launch = np.stack([f[k] for k in _KERNEL_FIELDS[6:]], axis=1)

        def launch_args(r: tuple) -> str:
            return json.dumps({"grid": list(r[0:3]), "block": list(r[3:6]), "registers": r[6],
                               "shared_static": r[7], "shared_dynamic": r[8]}, separators=(",", ":"))

        return {"kind": _const_dict("KERNEL", n), "name": names, "tid": np.full(n, -1, np.int64),
                "device": f["device_id"], "stream": _none_u32(f["stream_id"]), "start_ns": start,
                "end_ns": end, "corr_id": f["correlation_id"], "graph_id": self._graph(f["graph_id"]),
                "flags": flags, "args": _unique_json(launch, launch_args)}

    def _memcpy(self, kind: str, f: dict[str, Any]) -> dict[str, Any]:
        n = len(f["start"])
        start, end, flags = self._times(f["start"], f["end"])
        ck_uniq, ck_inv = np.unique(f["copy_kind"], return_inverse=True)
        names = _dict_array(ck_inv.reshape(-1), [f"Memcpy {MEMCPY_KIND.get(int(k), k)}" for k in ck_uniq])
        keys = np.stack([f["copy_kind"], f["src_kind"], f["dst_kind"]], axis=1)
        args = _unique_json(keys, lambda r: json.dumps(
            {"copy_kind": MEMCPY_KIND.get(r[0], r[0]), "src_kind": MEMORY_KIND.get(r[1], r[1]),
             "dst_kind": MEMORY_KIND.get(r[2], r[2])}))
        return {"kind": _const_dict("MEMCPY", n), "name": names, "tid": np.full(n, -1, np.int64),
                "device": f["device_id"], "stream": _none_u32(f["stream_id"]), "start_ns": start,
                "end_ns": end, "corr_id": f["correlation_id"], "graph_id": self._graph(f["graph_id"]),
                "bytes": f["bytes"], "flags": flags, "args": args}

    def _memset(self, kind: str, f: dict[str, Any]) -> dict[str, Any]:
        n = len(f["start"])
        start, end, flags = self._times(f["start"], f["end"])
        keys = np.stack([f["value"], f["memory_kind"]], axis=1)
        args = _unique_json(keys, lambda r: json.dumps(
            {"value": r[0], "memory_kind": MEMORY_KIND.get(r[1], r[1])}))
        return {"kind": _const_dict("MEMSET", n), "name": _const_dict("Memset", n),
                "tid": np.full(n, -1, np.int64), "device": f["device_id"],
                "stream": _none_u32(f["stream_id"]), "start_ns": start, "end_ns": end,
                "corr_id": f["correlation_id"], "graph_id": self._graph(f["graph_id"]),
                "bytes": f["bytes"], "flags": flags, "args": args}

    def _sync(self, kind: str, f: dict[str, Any]) -> dict[str, Any]:
        n = len(f["start"])
        start, end, flags = self._times(f["start"], f["end"])
        t_uniq, t_inv = np.unique(f["type"], return_inverse=True)
        names = _dict_array(t_inv.reshape(-1), [SYNC_TYPE.get(int(t), f"Synchronize {t}") for t in t_uniq])
        ev = _none_u32(f["cuda_event_id"])
        args = _unique_json(ev.reshape(-1, 1), lambda r: json.dumps({"cuda_event_id": r[0]}) if r[0] >= 0 else None)
        return {"kind": _const_dict("SYNC", n), "name": names, "tid": np.full(n, -1, np.int64),
                "stream": _none_u32(f["stream_id"]), "start_ns": start, "end_ns": end,
                "corr_id": f["correlation_id"], "flags": flags, "args": args}

    def _marker(self, kind: str, f: dict[str, Any]) -> dict[str, Any] | None:
        """Pair start/end MARKER records by id into RANGE rows; instants become MARKER rows.

        Markers are few next to API records (one pair per NVTX range), so this loop over them
        keeps a dict of open ranges across buffers.
        """
        ts_all = f["timestamp"]
        if len(ts_all):
            self.last_ts = max(self.last_ts, int(ts_all.max()))
        ncodes, ntexts = _strings(f["name"])
        dcodes, dtexts = _strings(f["domain"])
        rows: list[tuple] = []  # kind, name, pid, tid, start, end, id, flags, domain
        open_ = self._open_markers
        for flag, ts, mid, nc, dc, pid, tid in zip(f["flags_"].tolist(), ts_all.tolist(), f["id"].tolist(),
                                                    ncodes.tolist(), dcodes.tolist(), f["pid"].tolist(),
                                                    f["tid"].tolist(), strict=True):
            if flag & MARKER_START:
                open_[mid] = (ts, ntexts[nc], pid, tid, dtexts[dc])
            elif flag & MARKER_END:
                st = open_.pop(mid, None)
                if st is None:  # end without a start: keep it as a repaired point
                    rows.append(("MARKER", "", pid, tid, ts, ts, mid, FLAG_REPAIRED, "unpaired end"))
                    self.repaired += 1
                else:
                    fl = 0
                    if ts < st[0]:
                        ts, fl = st[0], FLAG_REPAIRED
                        self.repaired += 1
                    rows.append(("RANGE", st[1], st[2], st[3], st[0], ts, mid, fl, st[4]))
            else:  # instantaneous mark or sync-object marker
                dom = dtexts[dc] or ("" if flag == MARKER_INSTANT else f"flags={flag}")
                rows.append(("MARKER", ntexts[nc], pid, tid, ts, ts, mid, 0, dom))
        if not rows:
            return None
        kinds, names, pids, tids, st_, en, ids, flags, doms = zip(*rows, strict=True)
        k_uniq = sorted(set(kinds))
        return {"kind": _dict_array([k_uniq.index(k) for k in kinds], k_uniq),
                "name": pa.array(names, pa.string()), "pid": np.array(pids, np.int64),
                "tid": np.array(tids, np.int64), "start_ns": self.clock.map(np.array(st_, np.int64)),
                "end_ns": self.clock.map(np.array(en, np.int64)), "range_id": np.array(ids, np.int64),
                "flags": np.array(flags, np.int32),
                "args": pa.array([json.dumps({"domain": d}) if d else None for d in doms], pa.string())}

    _HANDLERS: dict[str, Callable[..., dict[str, Any] | None]] = {
        "API": _api, "KERNEL": _kernel, "MEMCPY": _memcpy, "MEMSET": _memset, "SYNC": _sync,
        "MARKER": _marker,
    }


def _marker_thread(rec: Any) -> tuple[int, int]:
    """(pid, tid) of a MARKER record object: ``object_id.pt`` (thread/process object kinds)."""
    try:
        pt = rec.object_id.pt
        return int(pt.process_id), int(pt.thread_id)
    except Exception:
        return -1, -1


# ----------------------------------------------------------------------------------------------
# API filter: query calls that fire many times per launch and carry no timing information

#: Runtime/driver API calls not recorded by default (``TELLER_CUPTI_API_FILTER=0`` records all).
#: Measured on the H200 (torch 2.11): cudaGetDevice alone was about 9 records per kernel launch;
#: with this filter a workload step went from 9,218 to 1,285 records.
QUIET_APIS = frozenset("""
cudaGetDevice cudaGetLastError cudaPeekAtLastError cudaGetDeviceCount cudaDeviceGetAttribute
cudaGetDeviceProperties cudaFuncGetAttributes cudaOccupancyMaxActiveBlocksPerMultiprocessor
cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags cudaOccupancyMaxActiveClusters
cudaOccupancyAvailableDynamicSMemPerBlock cudaOccupancyMaxPotentialClusterSize cudaDriverGetVersion
cudaRuntimeGetVersion cudaGetDriverEntryPoint cudaGetDriverEntryPointByVersion
cudaDeviceGetStreamPriorityRange cudaStreamGetPriority cudaStreamGetFlags cudaStreamGetId
cudaStreamGetDevice cudaPointerGetAttributes cudaGetSymbolAddress cudaStreamIsCapturing
cudaThreadExchangeStreamCaptureMode cudaStreamGetCaptureInfo cudaGetErrorString cudaGetErrorName
cuDevicePrimaryCtxGetState cuGetProcAddress cuCtxGetCurrent cuCtxGetDevice cuKernelGetName
cuKernelGetAttribute cuFuncGetAttribute cuFuncGetName cuDeviceGetAttribute cuDeviceGet
cuDeviceGetCount cuDeviceGetName cuDriverGetVersion cuPointerGetAttribute cuPointerGetAttributes
cuGetErrorString cuGetErrorName cuCtxGetLimit cuCtxGetStreamPriorityRange cuStreamGetCtx
cuStreamGetId cuStreamGetPriority cuStreamGetFlags cuDeviceGetUuid cuCtxGetApiVersion cuCtxGetId
cuStreamIsCapturing cuStreamGetCaptureInfo
""".split())


def quiet_cbids(members: dict[str, int], runtime: bool) -> list[int]:
    """cbids of :data:`QUIET_APIS` among an API's ``{callback name: cbid}`` members."""
    out = []
    for name, cbid in members.items():
        base = strip_version(name).removesuffix("_ptsz").removesuffix("_ptds")
        if base in QUIET_APIS and base.startswith("cuda") == runtime:
            out.append(int(cbid))
    return sorted(set(out))


# ----------------------------------------------------------------------------------------------
# raw buffers through ctypes (no cupti-python object per record)


def find_libcupti() -> str:
    """Path of the libcupti already mapped into this process (the one cupti-python loaded)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                i = line.find("/")
                if i >= 0 and "libcupti.so" in line:
                    return line[i:].strip()
    except OSError:
        pass
    path = os.environ.get("NVTX_INJECTION64_PATH", "")
    if "cupti" in path:
        return path
    return ctypes.util.find_library("cupti") or ""


_REQ = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                        ctypes.POINTER(ctypes.c_size_t))
_DONE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_size_t)


#: the first CUDA version whose CUPTI teardown (``cuptiFinalize``) is safe with CUDA graphs
TEARDOWN_SAFE_CUDA = (12, 6)


def teardown_safe() -> tuple[bool, str]:
    """Whether detaching CUPTI between detail windows is safe in this process: the CUDA version
    torch was built with is 12.6 or later (before it, CUPTI's teardown could crash a process that
    uses CUDA graphs). Unknown (no torch, a CPU build): not safe. Returns (safe, why)."""
    torch = sys.modules.get("torch")
    ver = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    try:
        parts = tuple(int(x) for x in str(ver).split(".")[:2]) if ver else None
    except ValueError:
        parts = None
    if parts is None:
        return False, f"CUDA version unknown ({ver!r}): CUPTI's kinds disabled between detail windows, not detached"
    if parts < TEARDOWN_SAFE_CUDA:
        return False, (f"CUDA {ver} < 12.6 (CUPTI's teardown crashes with CUDA graphs there): its kinds disabled "
                       "between detail windows, not detached")
    return True, f"CUDA {ver}: CUPTI detached between detail windows"


class RawBuffers:
    """Activity buffers handed to CUPTI through its C API; completed ones go to ``on_done``.

    ``on_done(buf, valid)`` gets the numpy array CUPTI filled; the array returns to a free list
    afterwards. Dropped-record counts CUPTI reports per completed buffer are summed in ``dropped``.
    """

    def __init__(self, lib: Any, size: int, on_done: Callable[[np.ndarray, int], None]) -> None:
        self.lib = ctypes.CDLL(lib) if isinstance(lib, str) else lib
        self.size = size
        self.on_done = on_done
        self.dropped = 0
        self.errors: list[str] = []
        self._live: dict[int, np.ndarray] = {}
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._req_cb = _REQ(self._request)
        self._done_cb = _DONE(self._completed)
        self.lib.cuptiActivityRegisterCallbacks.argtypes = [_REQ, _DONE]
        self.lib.cuptiActivityGetNumDroppedRecords.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                                               ctypes.POINTER(ctypes.c_size_t)]

    def register(self) -> None:
        rc = self.lib.cuptiActivityRegisterCallbacks(self._req_cb, self._done_cb)
        if rc != 0:
            raise RuntimeError(f"cuptiActivityRegisterCallbacks returned {rc}")

    def _request(self, buffer, size, max_records) -> None:
        try:
            with self._lock:
                arr = self._free.pop() if self._free else np.empty(self.size, np.uint8)
                addr = arr.ctypes.data
                self._live[addr] = arr
            buffer[0] = addr
            size[0] = self.size
            max_records[0] = 0
        except Exception as e:  # CUPTI then records nothing for lack of a buffer
            buffer[0] = None
            size[0] = 0
            self._error(f"buffer request: {type(e).__name__}: {e}")

    def _completed(self, ctx, stream, buffer, size, valid) -> None:
        try:
            with self._lock:
                arr = self._live.pop(int(buffer or 0), None)
            if arr is None:
                self._error("completed buffer not handed out by us")
                return
            try:
                n = ctypes.c_size_t(0)
                if self.lib.cuptiActivityGetNumDroppedRecords(ctx, stream, ctypes.byref(n)) == 0:
                    self.dropped += int(n.value)
                if valid:
                    self.on_done(arr, int(valid))
            finally:
                with self._lock:
                    self._free.append(arr)
        except Exception as e:
            self._error(f"buffer completed: {type(e).__name__}: {e}")

    def _error(self, msg: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(msg)


# ----------------------------------------------------------------------------------------------
# deferred decoding: completed buffers copied aside, decoded at stop (or when too many are held)

#: ``TELLER_CUPTI_DECODE`` values: where raw buffers are decoded, or cupti-python's objects
DECODE_CHOICES = ("inline", "deferred", "objects")
#: raw bytes held for deferred decoding before the oldest buffers are decoded as they come
#: (``TELLER_CUPTI_PENDING_MB``)
DEFAULT_PENDING_MB = 256.0


def parse_decode(value: str | None) -> tuple[str, str]:
    """``TELLER_CUPTI_DECODE`` → (record path, when): ``inline``/``raw`` → (raw, inline),
    ``deferred`` → (raw, deferred), ``objects`` → (objects, inline)."""
    v = (value or "inline").strip().lower()
    if v in ("", "inline", "raw"):
        return "raw", "inline"
    if v == "deferred":
        return "raw", "deferred"
    if v == "objects":
        return "objects", "inline"
    raise ValueError(f"CUPTI decode {value!r}: expected one of {', '.join(DECODE_CHOICES)}")


class PendingBuffers:
    """Copies of completed raw activity buffers, held in arrival order until they are decoded.

    ``add`` copies ``buf[:valid]`` (one memcpy; CUPTI gets its buffer back at once) and returns
    the copies that must be decoded now, oldest first, so that the bytes held stay at most
    ``cap_bytes`` (one buffer is always held, whatever its size). ``take`` hands over everything
    held. Nothing here decodes, so the order and bounds are tested without CUPTI.
    """

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = max(0, int(cap_bytes))
        self._held: list[np.ndarray] = []
        self.bytes = 0
        self.peak_bytes = 0
        self.buffers_in = 0
        self.bytes_in = 0
        self.released_early = 0  # buffers handed back by add() (decoded before stop)
        self.copy_ns = 0

    def __len__(self) -> int:
        return len(self._held)

    def add(self, buf: np.ndarray, valid: int) -> list[np.ndarray]:
        t0 = time.perf_counter_ns()
        arr = np.array(buf[:valid], dtype=np.uint8, copy=True)
        self.copy_ns += time.perf_counter_ns() - t0
        self._held.append(arr)
        self.bytes += arr.nbytes
        self.buffers_in += 1
        self.bytes_in += arr.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        out: list[np.ndarray] = []
        while self.bytes > self.cap_bytes and len(self._held) > 1:
            old = self._held.pop(0)
            self.bytes -= old.nbytes
            out.append(old)
        self.released_early += len(out)
        return out

    def take(self) -> list[np.ndarray]:
        out, self._held, self.bytes = self._held, [], 0
        return out

    def info(self) -> dict[str, Any]:
        return {"cap_bytes": self.cap_bytes, "held_bytes": self.bytes, "held_buffers": len(self._held),
                "peak_bytes": self.peak_bytes, "buffers_in": self.buffers_in, "bytes_in": self.bytes_in,
                "decoded_before_stop": self.released_early, "copy_s": self.copy_ns / 1e9}


# ----------------------------------------------------------------------------------------------
# the collector


def _env_kinds() -> tuple[str, ...]:
    raw = os.environ.get("TELLER_CUPTI_KINDS", "")
    kinds = tuple(k.strip().upper() for k in raw.split(",") if k.strip())
    return kinds or DEFAULT_KINDS


class CuptiCollector:
    """Collector over CUPTI's activity API (see module docstring).

    ``kinds``: activity kinds to enable (default :data:`DEFAULT_KINDS`, or ``TELLER_CUPTI_KINDS``);
    ``buffer_bytes``: size of each activity buffer (``TELLER_CUPTI_BUFFER_MB``, default 4);
    ``decode`` (``TELLER_CUPTI_DECODE``, ``teller record --cupti-decode``): ``inline`` (default;
    ``raw`` is the same) reads records straight from CUPTI's buffers in the buffer-completed
    callback; ``deferred`` only copies each completed buffer there (one memcpy, plus the clock
    anchor taken as inline) and decodes the copies at :meth:`stop`, after the final flush, and
    earlier only for the oldest copies once more than ``pending_mb`` (``TELLER_CUPTI_PENDING_MB``,
    default 256) are held, so memory stays bounded and a long recording decodes, past the cap, one
    buffer per buffer like inline; ``objects`` takes the Python objects cupti-python builds per
    record (slower; also the fallback when raw setup fails, then always inline).
    What a crash loses: the event sink writes what was decoded at every flush (``--flush-interval``,
    2 s), so inline decoding loses at most the last interval's records on a SIGKILL. Deferred
    decoding on a SIGKILL loses every CUPTI record still held (all of them on a recording shorter
    than the cap: the bundled GPU workload with every request queued filled 213 MB of raw
    buffers in 1,058 steps, about 200 kB a step, so 256 MiB is about 1,300 such steps), while the hooks' ranges and the logs are kept as inline;
    exit, SIGTERM and SIGINT decode everything first (a launcher deadline's SIGKILL follows its
    SIGTERM after 10 s: a longer decode at stop is cut and loses what was held).
    ``api_filter``: leave out the query calls of
    :data:`QUIET_APIS` (``TELLER_CUPTI_API_FILTER=0`` records them); ``runtime``: the recording
    runtime, whose range backend becomes NVTX with ``TELLER_CUPTI_RANGES=nvtx``.
    """

    name = "cupti"

    def __init__(self, kinds: Iterable[str] | None = None, buffer_bytes: int | None = None,
                 decode: str | None = None, api_filter: bool | None = None, runtime: Any = None,
                 pending_mb: float | None = None) -> None:
        self.rt = runtime
        self.kinds = tuple(k.upper() for k in kinds) if kinds is not None else _env_kinds()
        mb = os.environ.get("TELLER_CUPTI_BUFFER_MB")
        self.buffer_bytes = int(buffer_bytes or (float(mb) * 2**20 if mb else 4 * 2**20))
        self.errors: list[str] = []
        try:
            self.decode_mode, self.decode_at = parse_decode(decode or os.environ.get("TELLER_CUPTI_DECODE"))
        except ValueError as e:
            self.decode_mode, self.decode_at = "raw", "inline"
            self._error(f"{e}; decoding inline")
        if pending_mb is None:
            try:
                pending_mb = float(os.environ.get("TELLER_CUPTI_PENDING_MB") or DEFAULT_PENDING_MB)
            except ValueError:
                pending_mb = DEFAULT_PENDING_MB
        self.pending = PendingBuffers(int(pending_mb * 2**20)) if self.decode_at == "deferred" else None
        self.stop_decode_ns = 0
        self.stop_decode_cpu_ns = 0
        self.api_filter = (os.environ.get("TELLER_CUPTI_API_FILTER", "1") not in ("0", "false", "no")
                           if api_filter is None else api_filter)
        # where the hooks' ranges go: "cpu" (TELLER's range recorder, default) or "nvtx"
        # (torch.cuda.nvtx → MARKER records on CUPTI's own clock; needs NVTX_INJECTION64_PATH)
        self.ranges = os.environ.get("TELLER_CUPTI_RANGES", "cpu").lower()
        # overhead studies only: take buffers from CUPTI but do not decode them (no events)
        self.skip_decode = os.environ.get("TELLER_CUPTI_SKIP_DECODE", "") not in ("", "0")
        self.sink = None
        self.clockmap = ClockMap()
        self.decoder: RecordDecoder | None = None
        self._cupti: Any = None
        self._raw: RawBuffers | None = None
        self._enabled: list[Any] = []
        self._detail_on = True
        self._detached = False
        self._switch_lock = threading.Lock()
        self.detail_switches = 0
        self.detail_ns_on_off = [0, 0]
        # between detail windows CUPTI is detached (cuptiFinalize) or its kinds only disabled;
        # TELLER_CUPTI_TEARDOWN auto (default): detached when the engine's CUDA is 12.6 or later,
        # where CUPTI's teardown no longer crashes processes that use CUDA graphs (PyTorch's
        # profiler gates it the same way); 1: always; 0: never (overhead studies)
        self.teardown_setting = os.environ.get("TELLER_CUPTI_TEARDOWN", "auto").lower()
        self.teardown: bool | None = None if self.teardown_setting == "auto" else \
            self.teardown_setting not in ("0", "false", "no")
        self.teardown_note = ""
        # TELLER_CUPTI_ATTACH=first-window: CUPTI is not touched when the collector starts (before
        # the engine creates its CUDA context) but at the detail gate's first window
        self.attach_lazily = os.environ.get("TELLER_CUPTI_ATTACH", "start").lower() == "first-window"
        self._pending_setup: tuple | None = None
        self._lock = threading.Lock()
        self._active = False
        self._stopped = False
        self.available = False
        self.reason = ""
        self.buffers = 0
        self.records = 0
        self.lost_records = 0
        self.lost_buffers = 0
        self.dropped_records: int | None = None
        self.thread_id_type = ""
        self.clock_source = ""
        self.quiet_apis = 0
        self.callback_ns = 0
        self.callback_tids: list[int] = []
        self.skipped_bytes = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, sink) -> None:
        """Register buffer callbacks and enable the activity kinds; degrade on any failure."""
        self.sink = sink
        try:
            from cupti import cupti  # type: ignore[import-not-found]
        except Exception as e:  # not installed, or libcupti / cuda-bindings missing
            self.reason = (f"cupti-python not importable ({type(e).__name__}: {e}); install "
                           "cupti-python matching the CUDA version (pip install 'teller[cupti]')")
            self._error(self.reason)
            return
        self._cupti = cupti
        try:
            values = {k: int(getattr(cupti.ActivityKind, k)) for k in DEFAULT_KIND_VALUES
                      if hasattr(cupti.ActivityKind, k)}
            domains = {"RUNTIME": cupti.CallbackDomain.RUNTIME_API, "DRIVER": cupti.CallbackDomain.DRIVER_API}

            def api_name(kind: str, cbid: int) -> str:
                return cupti.get_callback_name(domains[kind], cbid)

            if self.attach_lazily and self.ranges != "nvtx":
                # nothing of CUPTI runs until the detail gate's first window (set_detail(True))
                self._pending_setup = (values, api_name)
                self._enabled = [getattr(cupti.ActivityKind, k) for k in self.kinds
                                 if getattr(cupti.ActivityKind, k, None) is not None and GROUP.get(k) is not None]
                self._active = self.available = bool(self._enabled)
                self._detached, self._detail_on = True, False
                if not self._active:
                    self.reason = "no activity kind could be enabled"
                return
            self._setup(cupti, values, api_name)
            for k in self.kinds:
                kind = getattr(cupti.ActivityKind, k, None)
                if kind is None or (self._raw is not None and GROUP.get(k) is None):
                    self._error(f"activity kind {k!r} unknown or not decodable; skipped")
                    continue
                try:
                    cupti.activity_enable(kind)
                    self._enabled.append(kind)
                except Exception as e:
                    self._error(f"activity_enable({k}): {type(e).__name__}: {e}")
            if self.api_filter:
                self._quiet(cupti)
            self._active = bool(self._enabled)
            self.available = self._active
            if not self._active:
                self.reason = "no activity kind could be enabled"
            elif self.ranges == "nvtx":
                self._route_ranges_through_nvtx()
        except Exception as e:
            self.reason = f"CUPTI start failed: {type(e).__name__}: {e}"
            self._error(self.reason)
            self._disable()

    def _setup(self, cupti: Any, values: dict[str, int], api_name: Callable[[str, int], str]) -> None:
        """CUPTI's first use: clock, buffer callbacks and decoder, thread ids."""
        self._anchor()  # also makes cupti-python load libcupti
        self.clock_source = self._guess_clock()
        self._register(cupti, values, api_name)
        try:  # thread ids as the kernel's tid (threading.get_native_id), like the range recorder
            cupti.set_thread_id_type(cupti.ActivityThreadIdType.SYSTEM)
            self.thread_id_type = "SYSTEM"
        except Exception as e:
            self.thread_id_type = "DEFAULT"
            self._error(f"set_thread_id_type(SYSTEM): {type(e).__name__}: {e}; tids are pthread ids")

    @property
    def detail_on(self) -> bool:
        """Whether activity is being recorded now (False before a lazy attach and between detail
        windows); the recording runtime's detail gate starts from it."""
        return self._detail_on

    def set_detail(self, on: bool) -> None:
        """Detach CUPTI from the process (``on`` False) or attach it again: the recording
        runtime's detail gate calls it around the steps it records in detail
        (``TELLER_DETAIL_EVERY``). Disabling the activity kinds alone leaves CUPTI's
        instrumentation of every launch in place (measured: a run with one step in 16 recorded
        lost 18% of its throughput), so detaching flushes every buffer, disables the kinds and
        calls ``cuptiFinalize``; attaching registers the buffer callbacks again, enables the kinds
        and the query-API filter and takes a clock anchor. Records of work already launched are
        flushed before the detach, and the decoder keeps its state across windows."""
        if (not self._active or self._stopped or on == self._detail_on or self._cupti is None
                or self.ranges == "nvtx"):  # the hooks' ranges are MARKER records: keep CUPTI on
            return
        with self._switch_lock:  # not while the flusher thread flushes
            self._switch(on)

    def _switch(self, on: bool) -> None:
        cupti = self._cupti
        t0 = time.perf_counter_ns()
        try:
            if not on:
                self._anchor()
                cupti.activity_flush_all(1)
                self._read_dropped()
                for kind in self._enabled:
                    cupti.activity_disable(kind)
                if self.teardown is None:
                    self.teardown, self.teardown_note = teardown_safe()
                if self.teardown:
                    cupti.finalize()
                    self._detached = True
            else:
                if self._pending_setup is not None:  # attached lazily: its first window
                    values, api_name = self._pending_setup
                    self._pending_setup = None
                    self._setup(cupti, values, api_name)
                elif self._detached:
                    if self._raw is not None:
                        self._raw.register()
                    else:
                        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
                    if self.thread_id_type == "SYSTEM":
                        cupti.set_thread_id_type(cupti.ActivityThreadIdType.SYSTEM)
                self._detached = False
                for kind in self._enabled:
                    cupti.activity_enable(kind)
                if self.api_filter:
                    quiet, self.quiet_apis = self.quiet_apis, 0
                    self._quiet(cupti)  # enabling a kind again turns every call of it back on
                    self.quiet_apis = max(quiet, self.quiet_apis)
                self._anchor()
        except Exception as e:  # the gate counts the failure
            self._error(f"detail {'on' if on else 'off'}: {type(e).__name__}: {e}")
            if not on:  # kinds may be off already: the next window attaches again from scratch
                self._detail_on = False
            raise
        finally:
            dt = time.perf_counter_ns() - t0
            self.detail_ns_on_off[0 if on else 1] += dt
        self._detail_on = on
        self.detail_switches += 1

    def flush(self) -> None:
        """Deliver completed buffers (decoded in the callback) and take a clock anchor."""
        with self._switch_lock:
            if not self._active or self._detached:  # (a CUPTI call would attach it again)
                return
            try:
                self._cupti.activity_flush_all(0)
                self._anchor()
            except Exception as e:
                self._error(f"flush: {type(e).__name__}: {e}")

    def stop(self) -> None:
        """Force-flush every buffer, decode the buffers held (deferred decoding), close open NVTX
        ranges, disable CUPTI; idempotent."""
        if self._stopped or self._cupti is None:
            self._stopped = True
            return
        self._stopped = True
        if self._active and not self._detached:
            try:
                self._anchor()
                self._cupti.activity_flush_all(1)
            except Exception as e:
                self._error(f"final flush: {type(e).__name__}: {e}")
            self._read_dropped()
        if self._detached:  # already flushed, disabled and finalized by set_detail
            self._active, self._enabled = False, []
        self._disable()
        self.decode_pending()
        try:
            with self._lock:
                cols = self.decoder.close_open_ranges() if self.decoder else None
            if cols is not None and self.sink is not None:
                self.sink.append(cols)
        except Exception as e:
            self._error(f"closing open ranges: {type(e).__name__}: {e}")

    def decode_pending(self) -> None:
        """Decode every buffer held for deferred decoding, oldest first (stop() calls it; idempotent)."""
        if self.pending is None or not len(self.pending):
            return
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        with self._lock:
            for arr in self.pending.take():
                self._decode_buffer(arr, len(arr))
        self.stop_decode_ns += time.perf_counter_ns() - t0
        self.stop_decode_cpu_ns += time.thread_time_ns() - c0

    def info(self) -> dict[str, Any]:
        d = self.decoder
        decode_ns = d.decode_ns if d else 0
        decode_cpu_ns = d.decode_cpu_ns if d else 0
        errors = list(self.errors) + (list(self._raw.errors) if self._raw else [])
        return {
            "name": self.name,
            "available": self.available,
            "reason": self.reason,
            "kinds": list(self.kinds),
            "decode": self.decode_mode + (" (skipped: overhead study)" if self.skip_decode else ""),
            "decode_at": self.decode_at,
            "deferred": ({**self.pending.info(), "stop_decode_s": self.stop_decode_ns / 1e9,
                          "stop_decode_cpu_s": self.stop_decode_cpu_ns / 1e9}
                         if self.pending is not None else None),
            "callback_tids": list(self.callback_tids),
            "ranges": self.ranges,
            "undecoded_bytes": self.skipped_bytes,
            "api_filter": {"on": self.api_filter, "quiet_cbids": self.quiet_apis},
            "buffer_bytes": self.buffer_bytes,
            "detail_switches": self.detail_switches,
            "detail_teardown": self.teardown,
            "detail_teardown_note": self.teardown_note,
            "attach": "first-window" if self.attach_lazily else "start",
            "never_attached": self._pending_setup is not None,
            "detail_on_s": self.detail_ns_on_off[0] / 1e9,
            "detail_off_s": self.detail_ns_on_off[1] / 1e9,
            "thread_id_type": self.thread_id_type,
            "cupti_clock": self.clock_source,
            "nvtx_injection": os.environ.get("NVTX_INJECTION64_PATH", ""),
            "buffers": self.buffers,
            "records": self.records,
            "lost_records": self.lost_records,
            "lost_buffers": self.lost_buffers,
            "dropped_records": self.dropped_records if self.dropped_records is not None else 0,
            "decode_s": decode_ns / 1e9,
            "callback_s": self.callback_ns / 1e9,
            "decode_us_per_record": (decode_ns / 1e3 / self.records) if self.records else None,
            "decode_cpu_s": decode_cpu_ns / 1e9,
            "decode_cpu_us_per_record": (decode_cpu_ns / 1e3 / self.records) if self.records else None,
            "clock_anchors": self.clockmap.summary(),
            **(d.counts() if d else {}),
            "errors": errors,
        }

    # -- setup helpers --------------------------------------------------------------------------

    def _register(self, cupti: Any, values: dict[str, int], api_name: Callable[[str, int], str]) -> None:
        """Raw buffers through ctypes when the record layouts are known, else cupti-python's objects."""
        if self.decode_mode == "raw":
            try:
                layouts = {g: getattr(cupti, attr) for g, attr in LAYOUT_DTYPES.items()}
                self.decoder = RecordDecoder(values, api_name, self.clockmap, layouts)
                lib = find_libcupti()
                if not lib:
                    raise RuntimeError("libcupti not found in this process")
                self._raw = RawBuffers(lib, self.buffer_bytes, self._raw_completed)
                self._raw.register()
                return
            except Exception as e:
                self._error(f"raw decoding unavailable ({type(e).__name__}: {e}); using cupti-python objects")
                self._raw = None
        self.decode_mode = "objects"
        if self.pending is not None:
            self._error("deferred decoding needs raw buffers; cupti-python's objects are decoded inline")
            self.decode_at, self.pending = "inline", None
        self.decoder = RecordDecoder(values, api_name, self.clockmap)
        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)

    def _quiet(self, cupti: Any) -> None:
        """Stop recording the query calls of :data:`QUIET_APIS` (per-cbid activity switches)."""
        for enum_name, fn_name, runtime in (("runtime_api_trace_cbid", "activity_enable_runtime_api", True),
                                            ("driver_api_trace_cbid", "activity_enable_driver_api", False)):
            try:
                members = {k: int(v) for k, v in getattr(cupti, enum_name).__members__.items()}
                fn = getattr(cupti, fn_name)
                for cbid in quiet_cbids(members, runtime):
                    fn(cbid, 0)
                    self.quiet_apis += 1
            except Exception as e:
                self._error(f"API filter ({fn_name}): {type(e).__name__}: {e}; those calls stay recorded")

    def _route_ranges_through_nvtx(self) -> None:
        """Send the hooks' ranges to NVTX; they come back as MARKER records paired into RANGEs."""
        if "cupti" not in os.environ.get("NVTX_INJECTION64_PATH", ""):
            self._error("TELLER_CUPTI_RANGES=nvtx needs NVTX_INJECTION64_PATH=<libcupti>; ranges stay on the cpu recorder")
            self.ranges = "cpu"
            return
        if self.rt is None:
            self._error("TELLER_CUPTI_RANGES=nvtx needs the recording runtime; ranges stay on the cpu recorder")
            self.ranges = "cpu"
            return
        try:
            import torch.cuda.nvtx as nvtx

            push, pop = nvtx.range_push, nvtx.range_pop

            def nvtx_push(msg: str) -> None:
                push(msg)

            def nvtx_pop() -> None:
                pop()

            self.rt.set_range_backend(nvtx_push, nvtx_pop, name="nvtx")
        except Exception as e:
            self.ranges = "cpu"
            self._error(f"NVTX range backend: {type(e).__name__}: {e}; ranges stay on the cpu recorder")

    # -- CUPTI callbacks ------------------------------------------------------------------------

    def _buffer_requested(self) -> tuple[int, int]:
        return self.buffer_bytes, 0

    def _buffer_completed(self, activities: list) -> None:
        t0 = time.perf_counter_ns()
        self._note_thread()
        try:
            n = len(activities)
            with self._lock:
                self.buffers += 1
                self.records += n
                if not n or self.decoder is None:
                    return
                self._anchor()
                groups = self.decoder.decode(activities)
            for cols in groups:
                self.sink.append(cols)
        except Exception as e:  # never into CUPTI's thread / the engine
            try:
                self.lost_records += len(activities)
            except Exception:
                pass
            self._error(f"decode: {type(e).__name__}: {e}")
        self.callback_ns += time.perf_counter_ns() - t0
        self._mark(t0)

    def _mark(self, t0: int) -> None:
        """The callback as a range of its own when the runtime marks pauses (TELLER_MARK_PAUSES)."""
        pm = getattr(getattr(self.rt, "RUNTIME", None), "pause_marks", None)
        if pm is not None:
            pm.mark(pm.cupti_code, t0)

    def _raw_completed(self, buf: np.ndarray, valid: int) -> None:
        """A completed raw buffer: decoded now (inline) or copied aside (deferred)."""
        t0 = time.perf_counter_ns()
        self._note_thread()
        if self.skip_decode:
            self.buffers += 1
            self.skipped_bytes += valid
            return
        try:
            with self._lock:
                self.buffers += 1
                self._anchor()
                if self.pending is None:
                    self._decode_buffer(buf, valid)
                else:
                    for old in self.pending.add(buf, valid):
                        self._decode_buffer(old, len(old))
        except Exception as e:
            self.lost_buffers += 1
            self._error(f"buffer: {type(e).__name__}: {e}")
        self.callback_ns += time.perf_counter_ns() - t0
        self._mark(t0)

    def _decode_buffer(self, buf: np.ndarray, valid: int) -> None:
        """Decode one raw buffer into the sink (caller holds the lock); a bad buffer is counted lost."""
        try:
            before = sum(self.decoder.records_in.values())
            try:
                groups = self.decoder.decode_raw(buf, valid)
            finally:
                self.records += sum(self.decoder.records_in.values()) - before
            for cols in groups:
                self.sink.append(cols)
        except Exception as e:
            self.lost_buffers += 1
            self._error(f"decode: {type(e).__name__}: {e}")

    def _note_thread(self) -> None:
        if len(self.callback_tids) < 8:
            tid = threading.get_native_id()
            if tid not in self.callback_tids:
                self.callback_tids.append(tid)

    # -- helpers --------------------------------------------------------------------------------

    def _anchor(self) -> None:
        try:
            s, t, e = take_anchor(self._cupti.get_timestamp)
            self.clockmap.add(s, t, e)
        except Exception as e:
            self._error(f"clock anchor: {type(e).__name__}: {e}")

    def _guess_clock(self) -> str:
        """Which host clock CUPTI timestamps follow (for run.json; mapping uses anchors regardless)."""
        try:
            c = int(self._cupti.get_timestamp())
            for name, fn in (("realtime", time.time_ns), ("monotonic", time.monotonic_ns),
                             ("monotonic_raw", lambda: time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW))):
                if abs(fn() - c) < 50_000_000:
                    return name
            return "other"
        except Exception:
            return "unknown"

    def _read_dropped(self) -> None:
        if self._raw is not None:
            self.dropped_records = self._raw.dropped
            return
        try:
            v = ctypes.c_size_t(0)
            r = self._cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(v))
            self.dropped_records = int(r) if isinstance(r, int) and r else int(v.value)
        except Exception as e:
            self._error(f"activity_get_num_dropped_records: {type(e).__name__}: {e}")

    def _disable(self) -> None:
        self._active = False
        for kind in self._enabled:
            try:
                self._cupti.activity_disable(kind)
            except Exception as e:
                self._error(f"activity_disable: {type(e).__name__}: {e}")
        self._enabled = []

    def _error(self, msg: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(msg)
