"""Canonical events from elsewhere → a run directory (docs/design.md §2–3).

``src`` may be a run directory (what ``teller record`` writes; moved or copied by a user), a
folder of canonical ``*.parquet`` event files, or one such file. Every file is checked against
:data:`teller.rundir.EVENT_SCHEMA`: the columns of docs/design.md §3 must be there (``layer`` and
``flags`` are optional and filled in), extra columns are left out (and reported), types are cast
to the schema, and kinds outside :data:`teller.rundir.KINDS` are an error. ``run.json``,
``logs/`` and ``labels.json`` travel with a run directory. When ``src`` is ``out`` the run is
only validated, nothing is written.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.errors import InputError
from teller.ingest.common import prepare_out
from teller.rundir import (
    EVENT_COLUMNS,
    EVENT_SCHEMA,
    KINDS,
    RunDir,
    RunInfo,
    events_table,
    kind_counts,
)

#: Columns a canonical file must have (docs/design.md §3); the others have defaults.
REQUIRED_COLUMNS = tuple(c for c in EVENT_COLUMNS if c not in ("layer", "flags"))
#: Columns whose nulls mean damage rather than "not applicable".
_NO_NULLS = ("kind", "start_ns", "end_ns")
_FIX = (
    "write canonical events with teller.rundir.RunDir.write_events "
    "or re-run `teller record`/`teller ingest`"
)


def read_canonical_file(path: Path) -> tuple[pa.Table, dict[str, Any]]:
    """One canonical Parquet file as a table of :data:`EVENT_SCHEMA`, plus what was changed."""
    path = Path(path)
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        present = [c for c in EVENT_COLUMNS if c in names]
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise InputError(
                path,
                f"not a canonical events file: column {missing[0]!r} is missing"
                + (f" (and {', '.join(missing[1:])})" if missing[1:] else ""),
                _FIX,
            )
        table = pf.read(columns=present)
    except (pa.ArrowException, OSError) as e:
        raise InputError(path, f"unreadable Parquet ({e})", _FIX) from None
    n = table.num_rows
    report: dict[str, Any] = {
        "rows": n,
        "dropped_columns": [c for c in names if c not in EVENT_COLUMNS],
    }
    cols: dict[str, Any] = {}
    filled: dict[str, int] = {}
    for c in present:
        col = table.column(c).combine_chunks()
        if col.null_count:
            if c in _NO_NULLS:
                raise InputError(path, f"column {c!r} has {col.null_count} null values", _FIX)
            if c != "args":  # args may be null; other columns take their defaults
                filled[c] = col.null_count
                f = EVENT_SCHEMA.field(c)
                default = (
                    ""
                    if pa.types.is_dictionary(f.type) or pa.types.is_string(f.type)
                    else (0 if c == "flags" else -1)
                )
                col = _fill(col, default)
        cols[c] = col
    if filled:
        report["filled_nulls"] = filled
    _check_kinds(path, cols["kind"])
    if pa.types.is_integer(cols["kind"].type):  # codes into KINDS
        cols["kind"] = cols["kind"].to_numpy(zero_copy_only=False)
    try:
        out = events_table(cols, n)
    except (pa.ArrowException, ValueError, TypeError):
        for c, col in cols.items():  # name the column that does not cast
            try:
                events_table({c: col}, n)
            except (pa.ArrowException, ValueError, TypeError) as e:
                raise InputError(
                    path,
                    f"column {c!r} of type {col.type} does not convert to "
                    f"{EVENT_SCHEMA.field(c).type} ({e})",
                    _FIX,
                ) from None
        raise
    return out, report


def _fill(col: pa.Array, default: Any) -> pa.Array:
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return col.fill_null(
        pa.scalar(default).cast(col.type) if not pa.types.is_string(col.type) else default
    )


def _check_kinds(path: Path, col: pa.Array) -> None:
    values = col.dictionary if pa.types.is_dictionary(col.type) else None
    if values is not None:
        used = (
            np.unique(col.indices.to_numpy(zero_copy_only=False)) if len(col) else np.empty(0, int)
        )
        values = values.take(pa.array(used, pa.int64()))
    elif pa.types.is_integer(col.type):  # codes into KINDS
        arr = col.to_numpy(zero_copy_only=False)
        bad = (arr < 0) | (arr >= len(KINDS))
        if bad.any():
            raise InputError(
                path, f"kind code {int(arr[bad][0])} is not one of 0..{len(KINDS) - 1}", _FIX
            )
        return
    else:
        values = pc.unique(col.cast(pa.string()))
    unknown = sorted(set(values.to_pylist()) - set(KINDS))
    if unknown:
        raise InputError(
            path,
            f"unknown event kind {unknown[0]!r}"
            + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            + f"; expected one of {', '.join(KINDS)}",
            _FIX,
        )


def _event_files(src: Path) -> tuple[list[Path], Path | None]:
    """The event files under ``src`` and the run directory they belong to (None if none)."""
    if src.is_file():
        return [src], None
    if not src.is_dir():
        raise InputError(src, "no such file or folder", "check the path")
    rd = RunDir(src)
    if rd.exists():
        return rd.event_files(), src
    files = sorted(src.glob("*.parquet"))
    if not files:
        raise InputError(
            src,
            "folder holds no run.json, events/ or *.parquet",
            "point at a run directory or canonical Parquet files",
        )
    return files, None


def _check_labels(path: Path) -> None:
    if not path.is_file():
        return
    try:
        json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(
            path, f"not valid JSON ({e})", "restore labels.json from the injection run"
        ) from None


def _kind_counts(tables: list[pa.Table]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for t in tables:
        total.update(kind_counts(t))
    return dict(total)


def ingest_canonical(src: Path, out: Path, **options: Any) -> dict[str, Any]:
    """Validate canonical events at ``src`` and write them (with ``run.json``, ``logs/`` and
    ``labels.json``) to run directory ``out``; when ``src`` is ``out``, only validate."""
    src, out = Path(src), Path(out)
    files, run_src = _event_files(src)
    validate_only = run_src is not None and src.resolve() == out.resolve()
    tables, reports = [], {}
    for f in files:
        t, rep = read_canonical_file(f)
        tables.append(t)
        reports[str(f)] = rep
    summary: dict[str, Any] = {
        "format": "canonical",
        "files": len(files),
        "rows_in": sum(r["rows"] for r in reports.values()),
        "events": sum(t.num_rows for t in tables),
        "out": str(out),
        "validated_only": validate_only,
        "kinds": _kind_counts(tables),
        "dropped_columns": {
            f: r["dropped_columns"] for f, r in reports.items() if r["dropped_columns"]
        },
        "filled_nulls": {f: r["filled_nulls"] for f, r in reports.items() if r.get("filled_nulls")},
    }
    if run_src is not None:  # run.json and labels.json must parse, too
        RunDir(run_src).read_info()
        _check_labels(run_src / "labels.json")
    if validate_only:
        return summary

    in_place = run_src is None and src.resolve().parent == (out / "events").resolve()
    if not in_place:  # a file already in out/events is rewritten in place below
        prepare_out(out)
    rd = RunDir(out)
    for f, t in zip(files, tables, strict=True):
        rd.write_events(t, name=f.stem)
    logs = labels = 0
    if run_src is not None:
        srd = RunDir(run_src)
        info = srd.read_info()
        if (run_src / "logs").is_dir():
            shutil.copytree(run_src / "logs", rd.logs_dir, dirs_exist_ok=True)
            logs = len(srd.log_files())
        if (run_src / "labels.json").is_file():
            shutil.copy2(run_src / "labels.json", rd.artefact("labels.json"))
            labels = 1
    elif in_place:
        info = RunDir(out).read_info()
    else:
        info = RunInfo(source="canonical")
    info.counts = {**info.counts, "kinds": summary["kinds"]}
    info.collector = {**info.collector, "reader": "canonical"}
    info.extra.setdefault("ingested_from", str(src.resolve()))
    rd.write_info(info)
    summary.update(log_files=logs, labels=labels)
    return summary
