"""The run directory and the canonical event table (docs/design.md §2–3).

Every reader produces, and every later stage consumes, a run directory::

    RUN/run.json          metadata: schema version, command, ranks, clock anchors, counts
    RUN/events/*.parquet  canonical events, one file per process (or per source file)
    RUN/logs/*.jsonl      captured log lines {ts_ns, node, pid, stream, text}
    RUN/labels.json       ground truth, only for fault-injection runs

Events are one Arrow table with dictionary-encoded strings and int64 nanoseconds on the run's
time base τ (ns since run start). Log lines keep their wall-clock ``ts_ns`` (Unix epoch ns);
``run.json["clock"]["t0_unix_ns"]`` is the wall-clock instant of τ = 0, so τ = ts_ns − t0_unix_ns.

The table has one optional column, ``layer`` (docs/design.md §3): a tag a reader already knows
from its layer rules (e.g. Kineto ``cpu_op`` aten:: → BE). Empty means "let reconstruction decide"
(from the NVTX message prefix or from the event kind).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from teller import __version__
from teller.errors import TellerError

SCHEMA_VERSION = 1

#: Event kinds, in the order of their dictionary codes.
KINDS = (
    "NVTX_PUSH",
    "NVTX_POP",
    "RANGE",
    "MARKER",
    "RUNTIME",
    "DRIVER",
    "KERNEL",
    "MEMCPY",
    "MEMSET",
    "SYNC",
)
KIND_CODE = {k: i for i, k in enumerate(KINDS)}

#: GPU work: the kinds that run on a device and bind to the host call that launched them.
GPU_KINDS = ("KERNEL", "MEMCPY", "MEMSET")
#: :data:`GPU_KINDS` as a lookup array indexed by kind code.
IS_GPU_KIND = np.array([k in GPU_KINDS for k in KINDS], dtype=bool)

#: Version suffix of CUDA API entry points (``cudaLaunchKernel_v7000`` → ``cudaLaunchKernel``).
API_VERSION_SUFFIX = r"_v\d+$"
_API_VERSION_RE = re.compile(API_VERSION_SUFFIX)

#: Layer tags (docs/design.md §4), in the order of their codes in the forest. ``GAP`` (code 10)
#: marks untraced time inside an engine iteration: rows reconstruction adds, never read from events.
LAYERS = ("STEP", "FE", "BE", "COMM", "RT", "DRV", "K", "MEM", "SYNC", "OTHER", "GAP")
LAYER_CODE = {k: i for i, k in enumerate(LAYERS)}

#: Bits of the ``flags`` column of events and forest rows.
FLAG_REPAIRED = 1  # input was damaged and fixed (pop without push, negative duration, ...)
FLAG_TRUNCATED = 2  # range still open at thread end / file end: end set to the last seen time
FLAG_UNBOUND = 4  # GPU activity whose correlation id matches no host call
FLAG_DUPLICATE = 8  # a second record with an id already seen (kept, not merged)
FLAG_CLOCK_REPAIRED = 16  # its thread's clock was off and its times were moved (reconstruction)
FLAG_NAMES = {
    FLAG_REPAIRED: "repaired",
    FLAG_TRUNCATED: "truncated",
    FLAG_UNBOUND: "unbound",
    FLAG_DUPLICATE: "duplicate",
    FLAG_CLOCK_REPAIRED: "clock_repaired",
}

_DICT_STR = pa.dictionary(pa.int32(), pa.string())

#: The canonical event schema. Columns missing from a source are filled with -1 / "".
EVENT_SCHEMA = pa.schema(
    [
        ("kind", pa.dictionary(pa.int8(), pa.string())),
        ("name", _DICT_STR),
        ("layer", pa.dictionary(pa.int8(), pa.string())),
        ("node", pa.int32()),
        ("rank", pa.int32()),
        ("pid", pa.int64()),
        ("tid", pa.int64()),
        ("device", pa.int32()),
        ("stream", pa.int64()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("range_id", pa.int64()),
        ("corr_id", pa.int64()),
        ("graph_id", pa.int64()),
        ("bytes", pa.int64()),
        ("flags", pa.int32()),
        ("args", pa.string()),
    ]
)
EVENT_COLUMNS = tuple(EVENT_SCHEMA.names)
_INT_DEFAULT = -1


def events_table(columns: dict[str, Any], n: int | None = None) -> pa.Table:
    """Build a canonical event table from a dict of column arrays (numpy, lists or Arrow).

    Missing integer columns become -1 (``flags`` 0), missing strings "" and missing ``args``
    null. ``kind`` may be given as strings or as codes into :data:`KINDS`.
    """
    if n is None:
        n = len(next(iter(columns.values()))) if columns else 0
    unknown = set(columns) - set(EVENT_COLUMNS)
    if unknown:
        raise ValueError(f"unknown event columns: {sorted(unknown)}")
    arrays = []
    for f in EVENT_SCHEMA:
        v = columns.get(f.name)
        if v is None:
            if f.name == "args":
                arrays.append(pa.nulls(n, pa.string()))
            elif pa.types.is_dictionary(f.type):
                arrays.append(pa.DictionaryArray.from_arrays(np.zeros(n, np.int8), pa.array([""])).cast(f.type))
            else:
                fill = 0 if f.name == "flags" else _INT_DEFAULT
                arrays.append(pa.array(np.full(n, fill, dtype=f.type.to_pandas_dtype())))
            continue
        if f.name == "kind" and not isinstance(v, (pa.Array, pa.ChunkedArray)):
            arr = np.asarray(v)
            if arr.dtype.kind in "iu":
                v = pa.DictionaryArray.from_arrays(arr.astype(np.int8), pa.array(KINDS))
        arrays.append(_as_type(v, f.type, f.name))
    given = columns.get("kind") is not None
    kinds = arrays[0].dictionary.to_pylist() if given and isinstance(arrays[0], pa.DictionaryArray) else []
    unknown_kinds = set(kinds) - set(KINDS)
    if unknown_kinds:
        raise ValueError(f"unknown event kinds {sorted(unknown_kinds)}; expected one of {', '.join(KINDS)}")
    return pa.Table.from_arrays(arrays, schema=EVENT_SCHEMA)


def _as_type(v: Any, typ: pa.DataType, name: str) -> pa.Array:
    if isinstance(v, pa.ChunkedArray):
        v = v.combine_chunks()
    if isinstance(v, pa.Array):
        if v.type == typ:
            return v
        if pa.types.is_dictionary(typ):
            if pa.types.is_dictionary(v.type):
                try:
                    return v.cast(typ)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    pass  # indices too wide for the target (e.g. a repetitive dictionary): re-encode
            return v.cast(pa.string()).dictionary_encode().cast(typ)
        return v.cast(typ)
    if pa.types.is_dictionary(typ):
        return pa.array(v, pa.string()).dictionary_encode().cast(typ)
    if pa.types.is_string(typ):
        return pa.array(v, pa.string())
    arr = np.asarray(v)
    if arr.dtype.kind == "f":
        arr = np.where(np.isfinite(arr), arr, _INT_DEFAULT)
    return pa.array(arr.astype(typ.to_pandas_dtype()), typ)


def empty_events() -> pa.Table:
    return EVENT_SCHEMA.empty_table()


def concat_events(tables: Iterable[pa.Table]) -> pa.Table:
    """Concatenate canonical tables, unifying their dictionaries."""
    tables = [t for t in tables if t is not None]
    if not tables:
        return empty_events()
    t = pa.concat_tables([t.select(EVENT_COLUMNS).cast(EVENT_SCHEMA) for t in tables])
    return t.unify_dictionaries().combine_chunks()


def np_col(table: pa.Table, name: str) -> np.ndarray:
    """A numeric column as a numpy array (zero-copy where Arrow allows)."""
    col = table.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col.to_numpy(zero_copy_only=False)


def str_array(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A string column as a numpy array of ``str`` (nulls as ``""``; any type cast to string)."""
    return np.asarray(col.cast(pa.string()).fill_null("").to_numpy(zero_copy_only=False), dtype=object).astype(str)


def dict_codes(table: pa.Table, name: str) -> tuple[np.ndarray, list[str]]:
    """Codes (int32) and dictionary of a string column, whatever its chunking and per-chunk
    dictionaries; nulls get the code of an appended ``""``."""
    col = table.column(name)
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks > 1 and pa.types.is_dictionary(col.type):
            col = pa.table({name: col}).unify_dictionaries().column(0)
        col = col.combine_chunks()
    if not pa.types.is_dictionary(col.type):
        col = col.cast(pa.string()).dictionary_encode()
    idx = col.indices
    dictionary = [x if x is not None else "" for x in col.dictionary.cast(pa.string()).to_pylist()]
    if idx.null_count:
        idx = idx.fill_null(len(dictionary))
        dictionary.append("")
    return idx.to_numpy(zero_copy_only=False).astype(np.int32), dictionary


def kind_codes(table: pa.Table) -> np.ndarray:
    """``kind`` as codes into :data:`KINDS`, whatever the column's own dictionary order."""
    codes, dictionary = dict_codes(table, "kind")
    try:
        remap = np.array([KIND_CODE[k] for k in dictionary] or [0], dtype=np.int8)
    except KeyError as e:
        raise TellerError(f"unknown event kind {e.args[0]!r}; expected one of {', '.join(KINDS)}") from None
    return remap[codes] if len(codes) else codes.astype(np.int8)


def strip_api_version(names: Any) -> Any:
    """API names without their version suffix (:data:`API_VERSION_SUFFIX`): one string, or every
    string of an Arrow array (done by Arrow)."""
    if isinstance(names, str):
        return _API_VERSION_RE.sub("", names)
    import pyarrow.compute as pc  # not at module level: the recorder imports this module at start-up

    return pc.replace_substring_regex(names, API_VERSION_SUFFIX, "")


def kind_counts(table: pa.Table) -> dict[str, int]:
    """Events per kind, kinds with none left out."""
    codes = kind_codes(table)
    counts = np.bincount(codes, minlength=len(KINDS)) if len(codes) else np.zeros(len(KINDS), int)
    return {k: int(c) for k, c in zip(KINDS, counts, strict=True) if c}


def flag_counts(flags: np.ndarray) -> dict[str, int]:
    """Rows per flag bit (:data:`FLAG_NAMES`), bits never set left out."""
    flags = np.asarray(flags)
    return {name: int(((flags & bit) != 0).sum()) for bit, name in FLAG_NAMES.items() if ((flags & bit) != 0).any()}

# --------------------------------------------------------------------------------------------
# run.json


@dataclass
class RunInfo:
    """The contents of ``run.json``. Unknown keys are kept in ``extra``."""

    source: str = ""
    command: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    model_config: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    clock: dict[str, Any] = field(default_factory=dict)
    collector: dict[str, Any] = field(default_factory=dict)
    dropped_records: dict[str, int] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)
    start_wall: float | None = None
    end_wall: float | None = None
    exit_code: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunInfo":
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        info = cls(**{k: v for k, v in d.items() if k in known})
        info.extra = {k: v for k, v in d.items() if k not in known}
        return info


class RunDir:
    """A run directory on disk. Creating one does not touch the disk until something is written."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # paths
    @property
    def events_dir(self) -> Path:
        return self.path / "events"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    def artefact(self, name: str) -> Path:
        return self.path / name

    def exists(self) -> bool:
        return (self.path / "run.json").is_file() or self.events_dir.is_dir()

    def require(self) -> "RunDir":
        if not self.path.is_dir():
            raise TellerError(f"{self.path}: no such run directory; make one with `teller ingest SRC -o {self.path}` or `teller record -o {self.path} -- CMD`")
        if not self.exists():
            raise TellerError(f"{self.path}: not a run directory (no run.json or events/); make one with `teller ingest` or `teller record`")
        return self

    # run.json
    def read_info(self) -> RunInfo:
        p = self.path / "run.json"
        if not p.is_file():
            return RunInfo()
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TellerError(f"{p}: not valid JSON ({e}); restore it or re-run `teller ingest`") from e
        if not isinstance(d, dict):
            what = "an array" if isinstance(d, list) else f"a JSON {type(d).__name__}"
            raise TellerError(f"{p}: holds {what}, not the run's metadata object; restore it or re-run `teller ingest`/`teller record`")
        v = d.get("schema_version", SCHEMA_VERSION)
        if not isinstance(v, int) or v > SCHEMA_VERSION:
            raise TellerError(f"{p}: schema_version {v!r} is newer than this teller understands ({SCHEMA_VERSION}); upgrade teller")
        return RunInfo.from_json(d)

    def write_info(self, info: RunInfo) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / "run.json.tmp"
        tmp.write_text(json.dumps(info.to_json(), indent=2, default=str))
        tmp.replace(self.path / "run.json")

    # events
    def write_events(self, table: pa.Table, name: str = "events") -> Path:
        """Write one events file, ``events/<name>.parquet`` (atomically)."""
        self.events_dir.mkdir(parents=True, exist_ok=True)
        table = table.select(EVENT_COLUMNS).cast(EVENT_SCHEMA)
        out = self.events_dir / f"{name}.parquet"
        tmp = out.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(out)
        return out

    def event_files(self, skip_copies: bool = False) -> list[Path]:
        """The events files, sorted by name; ``skip_copies``: without the exact copies of an
        earlier file (:meth:`copied_event_files`), as every reader of the events sees them."""
        files = sorted(self.events_dir.glob("*.parquet")) if self.events_dir.is_dir() else []
        if skip_copies and len(files) > 1:
            copies = self.copied_event_files()
            files = [f for f in files if f not in copies]
        return files

    def copied_event_files(self) -> dict[Path, Path]:
        """Events files that hold exactly the rows of another file, each mapped to the one kept
        (the shorter name, then the first by name): a chunk copied inside ``events/`` (``471-00003 (copy).parquet``) would
        otherwise count its events twice and double its steps (docs/design.md §17).

        Candidates share row count and the file-wide range of ``start_ns``/``end_ns`` from the
        row-group statistics (metadata only; a copy rewritten with other row groups has the same
        range); only those are read and compared. Cached per listing of the folder."""
        files = sorted(self.events_dir.glob("*.parquet")) if self.events_dir.is_dir() else []
        stamp = tuple((f.name, st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()])
        if getattr(self, "_copies", (None,))[0] == stamp:
            return self._copies[1]
        groups: dict[tuple, list[Path]] = {}
        for f in files:
            try:
                md = pq.ParquetFile(f).metadata
                names = [md.schema.column(i).name for i in range(md.num_columns)]
                key: tuple = (md.num_rows,)
                for c in ("start_ns", "end_ns"):
                    if c not in names:
                        continue
                    j = names.index(c)
                    stats = [md.row_group(g).column(j).statistics for g in range(md.num_row_groups)]
                    if stats and all(st is not None and st.has_min_max for st in stats):
                        key += (min(st.min for st in stats), max(st.max for st in stats))
                    else:
                        key += (None,)
            except (pa.ArrowInvalid, OSError):
                continue  # unreadable: the readers name it
            if md.num_rows:
                groups.setdefault(key, []).append(f)
        copies: dict[Path, Path] = {}
        for same in groups.values():
            kept: list[tuple[Path, pa.Table]] = []
            for f in sorted(same, key=lambda p: (len(p.name), p.name)):  # "x.parquet" before "x (copy).parquet"
                try:
                    t = pq.read_table(f)
                except (pa.ArrowInvalid, OSError):
                    continue
                orig = next((k for k, kt in kept if kt.schema.equals(t.schema) and kt.equals(t)), None)
                if orig is None:
                    kept.append((f, t))
                else:
                    copies[f] = orig
        self._copies = (stamp, copies)
        return copies

    def read_events(self, columns: list[str] | None = None) -> pa.Table:
        """All events of the run as one table (dictionaries unified).

        Every file is checked, whichever columns are asked for: the columns of
        :data:`REQUIRED_EVENT_COLUMNS` must exist (``layer``, ``flags`` and ``args`` are filled
        with their defaults when absent) and ``kind``, ``start_ns``, ``end_ns`` must hold no
        nulls (the same rule canonical ingest applies); otherwise a :class:`TellerError` names
        the file and the fix.
        """
        want = list(columns) if columns is not None else list(EVENT_COLUMNS)
        tables = []
        for f in self.event_files(skip_copies=True):
            try:
                pf = pq.ParquetFile(f)
                names = set(pf.schema_arrow.names)
                _check_event_file(f, pf, names)
                t = pf.read(columns=[c for c in want if c in names])
            except (pa.ArrowInvalid, OSError) as e:
                raise TellerError(unreadable_parquet(f, e)) from e
            for c in want:
                if c not in names:  # an optional column: its default
                    t = t.append_column(EVENT_SCHEMA.field(c), events_table({}, t.num_rows).column(c))
            tables.append(t.select(want))
        if columns is not None:
            if not tables:
                return EVENT_SCHEMA.empty_table().select(columns)
            t = pa.concat_tables([x.cast(pa.schema([EVENT_SCHEMA.field(c) for c in columns])) for x in tables])
            return t.unify_dictionaries().combine_chunks()
        return concat_events(tables)

    # generic tables (forest, steps, iterations, requests, comm_edges, log_alignment, ...)
    def write_table(self, table: pa.Table, name: str) -> Path:
        out = self.path / f"{name}.parquet"
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(out)
        return out

    def read_table(self, name: str, hint: str = "", columns: list[str] | None = None) -> pa.Table:
        """A table of the run; with ``columns``, only those of them the file has."""
        p = self.path / f"{name}.parquet"
        if not p.is_file():
            raise TellerError(f"{p}: missing; {hint or f'run `teller reconstruct {self.path}` first'}")
        if columns is not None:
            have = set(pq.read_schema(p).names)
            columns = [c for c in columns if c in have]
        return pq.read_table(p, columns=columns)

    def has_table(self, name: str) -> bool:
        return (self.path / f"{name}.parquet").is_file()

    # logs
    def log_files(self) -> list[Path]:
        return sorted(self.logs_dir.glob("*.jsonl")) if self.logs_dir.is_dir() else []

    def write_labels(self, labels: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "labels.json").write_text(json.dumps(labels, indent=2))

    def read_labels(self) -> dict[str, Any] | None:
        p = self.path / "labels.json"
        return json.loads(p.read_text()) if p.is_file() else None


def recording_state(rd: "RunDir") -> dict[str, Any]:
    """Whether the run is complete, and if not what was lost, from ``run.json`` and
    ``proc/*.json`` (docs/design.md §17, killed recordings). Keys: ``status`` (``complete``,
    ``killed``, ``interrupted``: the launcher died before finishing run.json, ``recording``: its
    launcher is still alive), ``partial`` (bool), ``lost`` (counts) and ``words`` (lines for the
    console). Runs that were not recorded here (ingested traces) are ``complete``, or ``damaged``
    (partial) when the reader salvaged the events before a cut or a corruption of the file."""
    info = rd.read_info()
    status = info.extra.get("status")
    out: dict[str, Any] = {"status": "complete", "partial": False, "lost": {}, "words": []}
    if info.source != "teller record" or status is None:
        salvaged = ((info.counts or {}).get("repaired_by_reason") or {}).get("salvaged_from_damaged_file")
        if isinstance(salvaged, int) and salvaged > 0:
            out.update(status="damaged", partial=True)
            out["words"].append(f"the input trace is cut or corrupt: the {salvaged:,} complete events before the damage "
                                "were kept, what the file held after it is lost (re-export the trace for a whole run)")
        return out
    procs = []
    for f in sorted((rd.path / "proc").glob("*.json")) if (rd.path / "proc").is_dir() else []:
        try:
            p = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(p, dict):
            procs.append(p)
    unfinished = [p for p in procs if p.get("status") != "exited"]
    pending = sum(int(c.get("pending_ranges", 0) or 0) + int(c.get("open_ranges", 0) or 0)
                  for p in unfinished for c in (p.get("collectors") or {}).values() if isinstance(c, dict))
    dropped = sum(int(v) for v in (info.dropped_records or {}).values() if isinstance(v, (int, float)))
    words = out["words"]
    launcher = info.extra.get("launcher") or {}
    if status == "running":
        alive = False
        lpid = launcher.get("pid")
        if isinstance(lpid, int) and lpid > 0 and launcher.get("host") == _hostname():
            try:
                os.kill(lpid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        if alive:
            out["status"] = "recording"
            words.append(f"the recording is still running (launcher pid {lpid}); what is read now is partial")
        else:
            out["status"] = "interrupted"
            last = max((int(p.get("update_wall_ns") or 0) for p in procs), default=0)
            when = f", last flush {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(last / 1e9))} UTC" if last else ""
            words.append(f"the recording was interrupted: its launcher{f' (pid {lpid})' if lpid else ''} ended without "
                         f"finishing run.json (killed?), so the exit code, the process reports and log lines after it "
                         f"are missing{when}")
        out["partial"] = True
    elif info.extra.get("killed_by") or (isinstance(info.exit_code, int) and info.exit_code >= 128):
        out["status"] = "killed"
        out["partial"] = True
        by = info.extra.get("killed_by") or f"signal {info.exit_code - 128}"
        words.append(f"the recorded command was killed ({by}, exit code {info.exit_code}): the run is partial")
    if unfinished:
        out["partial"] = True
        out["lost"]["processes_unfinished"] = len(unfinished)
        out["lost"]["pending_ranges"] = pending
        pids = ", ".join(str(p.get("pid")) for p in unfinished[:5])
        words.append(f"{len(unfinished)} recorded process(es) (pid {pids}) ended without their last flush: events "
                     f"since it are lost" + (f", {pending:,} ranges still open or unwritten at that flush" if pending else ""))
    if dropped:
        out["lost"]["dropped_records"] = dropped
        words.append(f"{dropped:,} records were dropped while recording ({', '.join(f'{k} {v:,}' for k, v in info.dropped_records.items() if v)})")
    return out


def _hostname() -> str:
    import socket

    return socket.gethostname()


#: Event columns a file must have; the others (``layer``, ``flags``, ``args``) have defaults.
OPTIONAL_EVENT_COLUMNS = ("layer", "flags", "args")
REQUIRED_EVENT_COLUMNS = tuple(c for c in EVENT_COLUMNS if c not in OPTIONAL_EVENT_COLUMNS)
#: Columns whose nulls mean damage rather than "not applicable".
NO_NULL_EVENT_COLUMNS = ("kind", "start_ns", "end_ns")
_EVENTS_FIX = "write it with teller.rundir.RunDir.write_events, or delete it and re-run the recording/ingest that wrote it"


def _check_event_file(path: Path, pf: pq.ParquetFile, names: set[str]) -> None:
    """Refuse an events file without the required columns or with nulls where none may be.

    Null counts come from the row-group statistics (no data read); a row group without them
    has its column read and counted.
    """
    missing = [c for c in REQUIRED_EVENT_COLUMNS if c not in names]
    if missing:
        raise TellerError(f"{path}: not a canonical events file (missing columns {missing}); {_EVENTS_FIX}")
    md = pf.metadata
    for c in NO_NULL_EVENT_COLUMNS:
        leaf = pf.schema.names.index(c) if c in pf.schema.names else -1
        nulls, row = 0, None
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(leaf).statistics if leaf >= 0 else None
            k = st.null_count if st is not None and st.has_null_count else None
            if k is None:
                k = pf.read_row_group(g, columns=[c]).column(0).null_count
            if k and row is None:
                col = pf.read_row_group(g, columns=[c]).column(0).combine_chunks()
                row = sum(md.row_group(x).num_rows for x in range(g)) + int(
                    np.flatnonzero(~np.asarray(col.is_valid().to_numpy(zero_copy_only=False), bool))[0])
            nulls += k
        if nulls:
            raise TellerError(f"{path}: column {c!r} has {nulls} null values (first at row {row}); {_EVENTS_FIX}")


def unreadable_parquet(path: Path, err: BaseException) -> str:
    """One line naming an events file Parquet cannot decode (a corrupt page behind an intact
    footer, a cut file) and the fix (docs/design.md §17)."""
    why = " ".join(str(err).split()) or type(err).__name__
    return (f"{path}: unreadable Parquet ({why[:300]}); the file is damaged: move it out of "
            f"{path.parent} to use the rest of the run, or re-run the recording/ingest that wrote it")


def now_unix_ns() -> int:
    return time.time_ns()
