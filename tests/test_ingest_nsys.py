"""Nsight Systems SQLite reader: real exports, synthetic schemas, damaged input, CLI."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sqlite3
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teller.cli import main
from teller.errors import InputError, TellerError
from teller.ingest import ingest
from teller.ingest.nsys import ingest_nsys, read_nsys
from teller.rundir import (
    EVENT_SCHEMA,
    FLAG_DUPLICATE,
    FLAG_REPAIRED,
    FLAG_TRUNCATED,
    RunDir,
    RunInfo,
    np_col,
)

DATA = Path(__file__).parent / "data" / "external" / "nsys"
FILES = sorted(DATA.glob("*.sqlite"))
IDS = [f.stem for f in FILES]


def sql(path: Path, q: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute(q).fetchall()
    finally:
        con.close()


def tables_of(path: Path) -> set[str]:
    return {r[0] for r in sql(path, "SELECT name FROM sqlite_master WHERE type='table'")}


def kind_list(t: pa.Table) -> list[str]:
    return t.column("kind").cast(pa.string()).to_pylist()


def test_sample_files_present():
    assert len(FILES) >= 2


# --------------------------------------------------------------------------------------------
# real exports


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_real_export_counts_reconcile_with_source_tables(path, tmp_path):
    summary = ingest_nsys(path, tmp_path / "run")
    have = tables_of(path)

    def count(table, where=""):
        return sql(path, f"SELECT count(*) FROM {table} {where}")[0][0] if table in have else 0

    expected = {
        "RUNTIME": count("CUPTI_ACTIVITY_KIND_RUNTIME", "WHERE eventClass = 0"),
        "DRIVER": count("CUPTI_ACTIVITY_KIND_RUNTIME", "WHERE eventClass = 1"),
        "KERNEL": count("CUPTI_ACTIVITY_KIND_KERNEL"),
        "MEMCPY": count("CUPTI_ACTIVITY_KIND_MEMCPY"),
        "MEMSET": count("CUPTI_ACTIVITY_KIND_MEMSET"),
        "SYNC": count("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"),
        "RANGE": count("NVTX_EVENTS", "WHERE eventType IN (59, 60)"),
        "MARKER": count("NVTX_EVENTS", "WHERE eventType = 34"),
    }
    expected = {k: v for k, v in expected.items() if v}
    assert summary["kinds"] == expected
    assert count("CUPTI_ACTIVITY_KIND_RUNTIME") == expected.get("RUNTIME", 0) + expected.get(
        "DRIVER", 0
    )

    # what was written agrees with the summary, and rows in = events out + skipped
    events = RunDir(tmp_path / "run").read_events()
    assert events.num_rows == summary["events"] == sum(expected.values())
    assert sum(summary["tables"].values()) == summary["events"] + summary["skipped"]
    from collections import Counter

    assert dict(Counter(kind_list(events))) == expected
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["collector"]["reader"] == "nsys" and info["source"] == str(path)
    assert info["counts"]["kinds"] == expected
    assert info["counts"]["tables"] == summary["tables"]
    assert events.schema.equals(EVENT_SCHEMA)


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_real_export_kernels_bind_to_host_calls(path):
    t = read_nsys(path)
    kinds = np.array(kind_list(t))
    pid, corr = np_col(t, "pid"), np_col(t, "corr_id")
    host = np.isin(kinds, ["RUNTIME", "DRIVER"])
    host_keys = set(zip(pid[host].tolist(), corr[host].tolist(), strict=True))
    for k in ("KERNEL", "MEMCPY", "MEMSET", "SYNC"):
        sel = kinds == k
        if not sel.any():
            continue
        keys = list(zip(pid[sel].tolist(), corr[sel].tolist(), strict=True))
        coverage = sum(key in host_keys for key in keys) / len(keys)
        assert coverage >= 0.99, (k, coverage)
    # GPU rows have no thread, host rows have no device
    assert (np_col(t, "tid")[~host & np.isin(kinds, ["KERNEL", "MEMCPY", "MEMSET"])] == -1).all()
    assert (np_col(t, "device")[host] == -1).all()


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_real_export_names_times_and_ids(path, tmp_path):
    t = read_nsys(path)
    kinds = np.array(kind_list(t))
    names = np.array(t.column("name").cast(pa.string()).to_pylist(), dtype=object)
    host = np.isin(kinds, ["RUNTIME", "DRIVER"])

    # API names: the StringIds value with the CUPTI version suffix removed, in source order
    raw = [
        r[0]
        for r in sql(
            path,
            "SELECT s.value FROM CUPTI_ACTIVITY_KIND_RUNTIME r "
            "JOIN StringIds s ON s.id = r.nameId ORDER BY r.rowid",
        )
    ]
    assert list(names[host]) == [re.sub(r"_v\d+$", "", s) for s in raw]
    assert not any(re.search(r"_v\d{4,}$", s) for s in names[host])
    assert any(s != re.sub(r"_v\d+$", "", s) for s in raw)  # the files do carry suffixes

    # kernel names: the demangled string
    dem = [
        r[0]
        for r in sql(
            path,
            "SELECT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
            "JOIN StringIds s ON s.id = k.demangledName ORDER BY k.rowid",
        )
    ]
    assert list(names[kinds == "KERNEL"]) == dem
    for a in t.column("args").to_pylist():
        assert a is None or isinstance(json.loads(a), dict)

    # τ starts at 0; the wall clock of τ = 0 is the session start plus the earliest event
    start, end = np_col(t, "start_ns"), np_col(t, "end_ns")
    assert start.min() == 0 and (end >= start).all()
    t_min = min(
        sql(path, f"SELECT min(start) FROM {tb}")[0][0]
        for tb in tables_of(path)
        if tb.startswith("CUPTI_ACTIVITY_KIND_") and tb != "CUPTI_ACTIVITY_KIND_OVERHEAD"
    )
    utc = sql(path, "SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME")[0][0]
    summary = ingest_nsys(path, tmp_path / "run")
    assert summary["t0_unix_ns"] == utc + t_min
    clock = json.loads((tmp_path / "run" / "run.json").read_text())["clock"]
    assert clock["t0_unix_ns"] == utc + t_min

    # pid decoded from the global ids is the OS pid nsys lists in PROCESSES
    procs = {r[0] for r in sql(path, "SELECT pid FROM PROCESSES")}
    assert set(np_col(t, "pid").tolist()) <= procs
    # bytes of copies agree with the source
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables_of(path):
        assert (
            np_col(t, "bytes")[kinds == "MEMCPY"].sum()
            == sql(path, "SELECT sum(bytes) FROM CUPTI_ACTIVITY_KIND_MEMCPY")[0][0]
        )


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_real_export_is_not_modified(path, tmp_path):
    copy = tmp_path / path.name
    shutil.copy2(path, copy)
    before = hashlib.sha256(copy.read_bytes()).hexdigest()
    ingest_nsys(copy, tmp_path / "run")
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, "run"]
    )  # no journal left


def test_folder_of_exports_gives_one_rank_per_file_on_one_clock(tmp_path):
    src = tmp_path / "reports"
    src.mkdir()
    for f in FILES:
        shutil.copy2(f, src / f.name)
    summary = ingest_nsys(src, tmp_path / "run")
    rd = RunDir(tmp_path / "run")
    events = rd.read_events()
    assert summary["files"] == len(FILES) == len(rd.event_files())
    assert sorted(set(np_col(events, "rank").tolist())) == list(range(len(FILES)))
    assert np_col(events, "start_ns").min() == 0
    singles = [ingest_nsys(f, tmp_path / f.stem) for f in FILES]
    assert summary["t0_unix_ns"] == min(s["t0_unix_ns"] for s in singles)
    assert summary["events"] == sum(s["events"] for s in singles)
    # each file keeps its own offset to the common τ = 0 (wall clock)
    for rank, s in enumerate(singles):
        mine = np_col(events, "start_ns")[np_col(events, "rank") == rank]
        assert mine.min() == s["t0_unix_ns"] - summary["t0_unix_ns"]


# --------------------------------------------------------------------------------------------
# synthetic exports: schemas and cases the sample files lack

GTID = (1 << 48) | (4242 << 24) | 77  # pid 4242, tid 77
GPID = (1 << 48) | (4242 << 24)


def ddl(*columns: str) -> str:
    """Column list for CREATE TABLE: a bare name is an INTEGER column."""
    return ", ".join(c if " " in c else f"{c} INTEGER" for c in columns)


def make_db(path: Path, tables: dict[str, tuple[str, list[tuple]]]) -> Path:
    """Write a SQLite file with ``{table: ("col type, ...", rows)}``."""
    con = sqlite3.connect(path)
    for name, (cols, rows) in tables.items():
        con.execute(f"CREATE TABLE {name} ({cols})")
        if rows:
            con.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(rows[0]))})", rows)
    con.commit()
    con.close()
    return path


STRINGS = (
    "id INTEGER PRIMARY KEY, value TEXT NOT NULL",
    [
        (1, "text from id"),
        (2, "cudaLaunchKernel_v7000"),
        (3, "cuLaunchKernel"),
        (4, "void gemm<float>(float*, int)"),
        (5, "gemm"),
        (6, "cudaGraphLaunch_v10000"),
        (7, "cudaStreamSynchronize_v3020"),
    ],
)
NVTX_COLS = ddl(
    "start INTEGER NOT NULL",
    "end",
    "eventType INTEGER NOT NULL",
    "rangeId",
    "category",
    "color",
    "text TEXT",
    "globalTid",
    "endGlobalTid",
    "textId",
    "domainId",
)


def test_synthetic_nvtx_events(tmp_path):
    gt2 = GTID + 1
    db = make_db(
        tmp_path / "nvtx.sqlite",
        {
            "StringIds": STRINGS,
            "NVTX_EVENTS": (
                NVTX_COLS,
                [
                    (1000, 2000, 59, None, None, None, "step 1", GTID, None, None, 0),
                    (1100, 1500, 59, None, None, None, None, GTID, None, 1, 0),
                    (1200, 3000, 60, 9, None, None, "async", GTID, gt2, None, 0),
                    (1300, None, 34, None, None, None, "tick", GTID, None, None, 0),
                    (1400, None, 59, None, None, None, "never closed", GTID, None, None, 0),
                    (0, None, 75, None, None, None, "engine", GTID, None, None, 5),
                    (1600, 1700, 59, None, None, None, "in domain", GTID, None, None, 5),
                    (1800, 1750, 59, None, None, None, "backwards", GTID, None, None, 0),
                ],
            ),
        },
    )
    t = read_nsys(db)
    rows = {r["name"]: r for r in t.to_pylist()}
    assert len(rows) == 7  # the domain declaration is metadata, not an event
    assert [rows[n]["kind"] for n in ("step 1", "text from id", "async", "tick")] == [
        "RANGE",
        "RANGE",
        "RANGE",
        "MARKER",
    ]
    assert (rows["step 1"]["start_ns"], rows["step 1"]["end_ns"]) == (0, 1000)
    assert rows["tick"]["start_ns"] == rows["tick"]["end_ns"] == 300
    assert rows["async"]["range_id"] == 9
    assert json.loads(rows["async"]["args"]) == {"nvtx": "start/end", "end tid": 78}
    assert json.loads(rows["in domain"]["args"])["domain"] == "engine"
    # open range: closed at the last time in the file, flagged truncated
    assert rows["never closed"]["end_ns"] == 3000 - 1000
    assert rows["never closed"]["flags"] == FLAG_TRUNCATED
    # end before start: repaired to zero duration
    assert rows["backwards"]["end_ns"] == rows["backwards"]["start_ns"] == 800
    assert rows["backwards"]["flags"] == FLAG_REPAIRED
    assert {r["pid"] for r in rows.values()} == {4242} and {r["tid"] for r in rows.values()} == {77}
    assert sum(r["flags"] for r in rows.values()) == FLAG_TRUNCATED + FLAG_REPAIRED

    summary = ingest_nsys(db, tmp_path / "run")
    assert summary["tables"] == {"NVTX_EVENTS": 8}
    assert summary["skipped_rows"] == {"NVTX_EVENTS.eventType=75": 1}
    assert summary["events"] + summary["skipped"] == 8
    assert summary["flags"] == {"repaired": 1, "truncated": 1}


def test_synthetic_runtime_without_event_class_and_duplicates(tmp_path):
    db = make_db(
        tmp_path / "rt.sqlite",
        {
            "StringIds": STRINGS,
            "CUPTI_ACTIVITY_KIND_RUNTIME": (
                ddl("start", "end", "globalTid", "correlationId", "nameId", "returnValue"),
                [
                    (100, 150, GTID, 10, 2, 0),
                    (160, 170, GTID, 11, 3, 0),
                    (180, 190, GTID, 10, 7, 0),  # duplicate correlation id: flagged
                    (200, 195, GTID, 12, 6, 700),  # end < start, and an error code
                    (210, 220, GTID, 13, 99, 0),  # name id not in StringIds
                ],
            ),
        },
    )
    rows = read_nsys(db).to_pylist()
    assert [r["kind"] for r in rows] == ["RUNTIME", "DRIVER", "RUNTIME", "RUNTIME", "RUNTIME"]
    assert [r["name"] for r in rows] == [
        "cudaLaunchKernel",
        "cuLaunchKernel",
        "cudaStreamSynchronize",
        "cudaGraphLaunch",
        "",
    ]
    assert [r["flags"] for r in rows] == [0, 0, FLAG_DUPLICATE, FLAG_REPAIRED, FLAG_REPAIRED]
    assert rows[3]["end_ns"] == rows[3]["start_ns"] == 100
    assert json.loads(rows[3]["args"]) == {"return value": 700}
    assert rows[0]["args"] is None


KERNEL_COLS = ddl(
    "start INTEGER NOT NULL",
    "end INTEGER NOT NULL",
    "deviceId",
    "contextId",
    "streamId",
    "correlationId",
    "globalPid",
    "demangledName",
    "shortName",
    "gridX",
    "gridY",
    "gridZ",
    "blockX",
    "blockY",
    "blockZ",
    "registersPerThread",
    "staticSharedMemory",
    "dynamicSharedMemory",
    "graphNodeId",
    "graphId",
)


def test_synthetic_kernels_graphs_and_gpu_tables(tmp_path):
    db = make_db(
        tmp_path / "k.sqlite",
        {
            "StringIds": STRINGS,
            "CUPTI_ACTIVITY_KIND_RUNTIME": (
                ddl(
                    "start",
                    "end",
                    "eventClass",
                    "globalTid",
                    "correlationId",
                    "nameId",
                    "returnValue",
                ),
                [(100, 120, 0, GTID, 1, 2, 0), (130, 140, 0, GTID, 2, 6, 0)],
            ),
            "CUPTI_ACTIVITY_KIND_KERNEL": (
                KERNEL_COLS,
                [
                    (125, 135, 0, 1, 7, 1, GPID, 4, 5, 8, 2, 1, 128, 1, 1, 32, 1024, 512, None, 0),
                    # one graph launch, two kernels with one correlation id: not duplicates
                    (145, 150, 0, 1, 7, 2, GPID, 4, 5, 8, 2, 1, 128, 1, 1, 32, 1024, 512, 11, 42),
                    (151, 155, 0, 1, 7, 2, GPID, 4, 5, 8, 2, 1, 128, 1, 1, 32, 1024, 512, 12, 42),
                    # a plain launch seen twice: the later one is a duplicate
                    (160, 165, 0, 1, 7, 1, GPID, 4, 5, 8, 2, 1, 128, 1, 1, 32, 1024, 512, None, 0),
                    # dangling demangled name: falls back to the short name, flagged
                    (170, 175, 1, 1, 9, 3, GPID, 99, 5, 1, 1, 1, 1, 1, 1, 8, 0, 0, None, None),
                ],
            ),
            "CUPTI_ACTIVITY_KIND_MEMCPY": (
                ddl(
                    "start",
                    "end",
                    "deviceId",
                    "contextId",
                    "streamId",
                    "correlationId",
                    "globalPid",
                    "bytes",
                    "copyKind",
                    "srcKind",
                    "dstKind",
                ),
                [(200, 210, 0, 1, 7, 5, GPID, 4096, 1, 1, 2)],
            ),
            "CUPTI_ACTIVITY_KIND_MEMSET": (
                ddl(
                    "start",
                    "end",
                    "deviceId",
                    "contextId",
                    "streamId",
                    "correlationId",
                    "globalPid",
                    "value",
                    "bytes",
                    "memKind",
                ),
                [(220, 230, 0, 1, 7, 6, GPID, 0, 64, 2)],
            ),
            "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION": (
                ddl(
                    "start",
                    "end",
                    "deviceId",
                    "contextId",
                    "streamId",
                    "correlationId",
                    "globalPid",
                    "syncType",
                    "eventId",
                ),
                [(240, 250, 0, 1, 4294967295, 7, GPID, 3, 4294967295)],
            ),
        },
    )
    t = read_nsys(db)
    k = [r for r in t.to_pylist() if r["kind"] == "KERNEL"]
    assert [r["graph_id"] for r in k] == [-1, 42, 42, -1, -1]
    assert [r["flags"] for r in k] == [0, 0, 0, FLAG_DUPLICATE, FLAG_REPAIRED]
    assert [r["name"] for r in k] == ["void gemm<float>(float*, int)"] * 4 + ["gemm"]
    assert {(r["pid"], r["tid"], r["stream"]) for r in k} == {(4242, -1, 7), (4242, -1, 9)}
    a = json.loads(k[0]["args"])
    assert a["short name"] == "gemm" and a["grid"] == [8, 2, 1] and a["block"] == [128, 1, 1]
    assert a["registers per thread"] == 32 and a["shared memory"] == 1536
    assert json.loads(k[1]["args"])["graph node id"] == 11
    rest = {r["kind"]: r for r in t.to_pylist() if r["kind"] not in ("KERNEL", "RUNTIME")}
    assert (
        rest["MEMCPY"]["name"] == "Memcpy HtoD (Pinned -> Device)"
        and rest["MEMCPY"]["bytes"] == 4096
    )
    assert json.loads(rest["MEMCPY"]["args"])["copy kind"] == "HtoD"
    assert rest["MEMSET"]["name"] == "Memset (Device)" and rest["MEMSET"]["bytes"] == 64
    assert rest["SYNC"]["name"] == "Stream Sync" and rest["SYNC"]["stream"] == -1
    assert json.loads(rest["SYNC"]["args"]) == {"sync type": "Stream Sync", "context": 1}


def test_synthetic_old_schema_text_names_and_no_strings(tmp_path):
    """Older exports: names stored as TEXT, no StringIds, no session start time."""
    db = make_db(
        tmp_path / "old.sqlite",
        {
            "CUPTI_ACTIVITY_KIND_KERNEL": (
                ddl(
                    "start",
                    "end",
                    "deviceId",
                    "streamId",
                    "correlationId",
                    "globalPid",
                    "demangledName TEXT",
                    "shortName TEXT",
                ),
                [(5000, 6000, 0, 7, 1, GPID, 'k<"q">\\', "k")],
            ),
            "CUPTI_ACTIVITY_KIND_RUNTIME": (
                ddl("start", "end", "globalTid", "correlationId", "nameId"),
                [(4000, 4500, GTID, 1, 3)],
            ),
        },
    )
    summary = ingest_nsys(db, tmp_path / "run")
    t = RunDir(tmp_path / "run").read_events()
    rows = t.to_pylist()
    assert summary["t0_unix_ns"] is None
    assert [r["name"] for r in rows] == ["", 'k<"q">\\']
    assert rows[0]["flags"] == FLAG_REPAIRED  # runtime name id unresolved without StringIds
    assert rows[1]["flags"] == 0 and json.loads(rows[1]["args"])["short name"] == "k"
    assert [r["start_ns"] for r in rows] == [0, 1000]


def test_empty_event_tables_give_an_empty_run(tmp_path):
    db = make_db(tmp_path / "e.sqlite", {"NVTX_EVENTS": (NVTX_COLS, [])})
    summary = ingest_nsys(db, tmp_path / "run")
    assert summary["events"] == 0 and summary["tables"] == {"NVTX_EVENTS": 0}
    assert RunDir(tmp_path / "run").read_events().num_rows == 0


# --------------------------------------------------------------------------------------------
# damaged input


def test_database_without_known_tables(tmp_path):
    db = make_db(tmp_path / "other.sqlite", {"users": ("id INTEGER, name TEXT", [(1, "a")])})
    with pytest.raises(
        InputError, match="no CUPTI/NVTX tables; was this exported from an nsys report"
    ):
        read_nsys(db)


@pytest.mark.parametrize(
    "content,what", [(b"", "empty file"), (bytes(range(256)) * 40, "not a SQLite database")]
)
def test_not_a_database(tmp_path, content, what):
    p = tmp_path / "report.sqlite"
    p.write_bytes(content)
    with pytest.raises(InputError) as e:
        read_nsys(p)
    assert (
        str(p) in str(e.value)
        and what in str(e.value)
        and "nsys export --type sqlite" in str(e.value)
    )


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_nsys(tmp_path / "nope.sqlite")


SAMPLE = FILES[-1]
SAMPLE_BYTES = SAMPLE.read_bytes()


def _synthetic_bytes() -> bytes:
    """A small export with every table this reader knows, for damage tests."""
    with tempfile.TemporaryDirectory() as d:
        p = make_db(
            Path(d) / "all.sqlite",
            {
                "StringIds": STRINGS,
                "NVTX_EVENTS": (
                    NVTX_COLS,
                    [
                        (10 * i, 10 * i + 5, 59, None, None, None, f"r{i}", GTID, None, None, 0)
                        for i in range(200)
                    ],
                ),
                "CUPTI_ACTIVITY_KIND_RUNTIME": (
                    ddl(
                        "start",
                        "end",
                        "eventClass",
                        "globalTid",
                        "correlationId",
                        "nameId",
                        "returnValue",
                    ),
                    [(10 * i, 10 * i + 3, i % 2, GTID, i, 2 + i % 2, 0) for i in range(200)],
                ),
                "CUPTI_ACTIVITY_KIND_KERNEL": (
                    KERNEL_COLS,
                    [
                        (
                            10 * i + 4,
                            10 * i + 9,
                            0,
                            1,
                            7,
                            i,
                            GPID,
                            4,
                            5,
                            1,
                            1,
                            1,
                            32,
                            1,
                            1,
                            8,
                            0,
                            0,
                            None,
                            0,
                        )
                        for i in range(200)
                    ],
                ),
            },
        )
        return p.read_bytes()


DAMAGE_SOURCES = {"real": SAMPLE_BYTES, "synthetic": _synthetic_bytes()}


def _read_or_input_error(p: Path) -> None:
    try:
        t = read_nsys(p)
    except InputError as e:
        assert str(p) in str(e)
        return
    assert t.schema.equals(EVENT_SCHEMA)
    assert (np_col(t, "end_ns") >= np_col(t, "start_ns")).all()


@pytest.mark.parametrize("source", sorted(DAMAGE_SOURCES))
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frac=st.floats(min_value=0.0, max_value=1.0))
def test_truncated_export_gives_a_result_or_an_input_error(tmp_path, source, frac):
    data = DAMAGE_SOURCES[source]
    p = tmp_path / "cut.sqlite"
    p.write_bytes(data[: int(frac * len(data))])
    _read_or_input_error(p)


@pytest.mark.parametrize("source", sorted(DAMAGE_SOURCES))
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frac=st.floats(min_value=0.0, max_value=1.0), junk=st.binary(min_size=1, max_size=64))
def test_corrupted_export_gives_a_result_or_an_input_error(tmp_path, source, frac, junk):
    data = bytearray(DAMAGE_SOURCES[source])
    pos = int(frac * (len(data) - len(junk)))
    data[pos : pos + len(junk)] = junk
    p = tmp_path / "bad.sqlite"
    p.write_bytes(bytes(data))
    _read_or_input_error(p)


def test_truncated_half_is_an_input_error(tmp_path):
    p = tmp_path / "half.sqlite"
    p.write_bytes(SAMPLE_BYTES[: len(SAMPLE_BYTES) // 2])
    with pytest.raises(InputError, match="nsys export --type sqlite"):
        read_nsys(p)


# --------------------------------------------------------------------------------------------
# dispatcher and CLI


def test_dispatcher_detects_sqlite(tmp_path):
    s = ingest(FILES[0], tmp_path / "run")
    assert s["format"] == "nsys" and s["events"] > 0


def test_cli_ingest(tmp_path, capsys):
    assert main(["ingest", str(FILES[0]), "-o", str(tmp_path / "run")]) == 0
    assert RunDir(tmp_path / "run").read_events().num_rows > 0
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(SAMPLE_BYTES[:5000])
    capsys.readouterr()
    assert main(["ingest", str(bad), "-o", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("teller: error: ") and str(bad) in err


def test_reingest_replaces_and_recorded_runs_are_refused(tmp_path):
    out = tmp_path / "run"
    ingest_nsys(FILES[0], out)
    s = ingest_nsys(FILES[1], out)
    rd = RunDir(out)
    assert [f.name for f in rd.event_files()] == [f"nsys_{FILES[1].stem}.parquet"]
    assert rd.read_events().num_rows == s["events"]
    recorded = RunDir(tmp_path / "recorded")
    recorded.write_events(rd.read_events(), name="proc_1")
    recorded.write_info(RunInfo(source="record"))
    with pytest.raises(TellerError, match="not written by `teller ingest`"):
        ingest_nsys(FILES[0], recorded.path)
    assert [f.name for f in recorded.event_files()] == ["proc_1.parquet"]
