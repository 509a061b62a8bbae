"""Canonical Parquet / run-directory reader: round trip, validation, carried files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from teller.cli import main
from teller.errors import InputError
from teller.ingest import ingest
from teller.ingest.canonical import REQUIRED_COLUMNS, ingest_canonical
from teller.rundir import (
    EVENT_COLUMNS,
    EVENT_SCHEMA,
    FLAG_REPAIRED,
    KINDS,
    RunDir,
    RunInfo,
    events_table,
)

NSYS = Path(__file__).parent / "data" / "external" / "nsys"


def sample_events(n: int = 50, pid: int = 10) -> pa.Table:
    rng = np.random.default_rng(pid)
    start = np.sort(rng.integers(0, 10_000, n))
    kinds = np.array(["RUNTIME", "KERNEL", "RANGE", "MARKER", "MEMCPY"])[np.arange(n) % 5]
    return events_table(
        {
            "kind": kinds.tolist(),
            "name": [f"op{i % 7}" for i in range(n)],
            "layer": ["" if i % 3 else "BE" for i in range(n)],
            "pid": np.full(n, pid),
            "tid": np.where(kinds == "KERNEL", -1, pid + 1),
            "device": np.where(kinds == "KERNEL", 0, -1),
            "start_ns": start,
            "end_ns": start + rng.integers(0, 100, n),
            "corr_id": np.arange(n),
            "bytes": np.where(kinds == "MEMCPY", 4096, -1),
            "flags": np.where(np.arange(n) == 3, FLAG_REPAIRED, 0),
            "args": [None if i % 2 else json.dumps({"i": i}) for i in range(n)],
        }
    )


def make_run(path: Path) -> RunDir:
    rd = RunDir(path)
    rd.write_events(sample_events(pid=10), name="proc_10")
    rd.write_events(sample_events(pid=11), name="proc_11")
    rd.write_info(
        RunInfo(source="record", command=["python", "serve.py"], clock={"t0_unix_ns": 123})
    )
    rd.logs_dir.mkdir(parents=True, exist_ok=True)
    (rd.logs_dir / "10.jsonl").write_text(
        json.dumps({"ts_ns": 1, "node": 0, "pid": 10, "stream": "stderr", "text": "hi"}) + "\n"
    )
    rd.write_labels({"windows": [{"start_ns": 0, "end_ns": 10, "category": "cuda"}]})
    return rd


def as_rows(t: pa.Table) -> list[dict]:
    return t.to_pylist()


def test_round_trip_of_a_moved_run(tmp_path):
    src = make_run(tmp_path / "a")
    summary = ingest_canonical(src.path, tmp_path / "b")
    out = RunDir(tmp_path / "b")
    assert as_rows(out.read_events()) == as_rows(src.read_events())
    assert out.read_events().schema.equals(EVENT_SCHEMA)
    assert [f.name for f in out.event_files()] == ["proc_10.parquet", "proc_11.parquet"]
    assert summary["events"] == summary["rows_in"] == 100 and summary["files"] == 2
    assert summary["kinds"] == {
        "RUNTIME": 20,
        "KERNEL": 20,
        "RANGE": 20,
        "MARKER": 20,
        "MEMCPY": 20,
    }
    info = out.read_info()
    assert (
        info.source == "record"
        and info.command == ["python", "serve.py"]
        and info.clock == {"t0_unix_ns": 123}
    )
    assert info.counts["kinds"] == summary["kinds"]
    assert (out.logs_dir / "10.jsonl").read_text() == (src.logs_dir / "10.jsonl").read_text()
    assert out.read_labels() == src.read_labels()
    assert summary["log_files"] == 1 and summary["labels"] == 1


def test_dispatcher_and_cli_route_run_directories_and_parquet_here(tmp_path):
    src = make_run(tmp_path / "a")
    s = ingest(src.path, tmp_path / "b")
    assert s["format"] == "canonical"
    s = ingest(src.event_files()[0], tmp_path / "c")
    assert s["format"] == "canonical" and s["events"] == 50
    assert as_rows(RunDir(tmp_path / "c").read_events()) == as_rows(sample_events(pid=10))
    assert RunDir(tmp_path / "c").read_info().source == "canonical"
    assert main(["ingest", str(src.path), "-o", str(tmp_path / "d")]) == 0


def test_folder_of_parquet_files(tmp_path):
    src = tmp_path / "parquet"
    src.mkdir()
    for pid in (1, 2, 3):
        pq.write_table(sample_events(pid=pid), src / f"rank{pid}.parquet")
    s = ingest_canonical(src, tmp_path / "run")
    assert s["files"] == 3 and s["events"] == 150
    assert sorted(set(RunDir(tmp_path / "run").read_events().column("pid").to_pylist())) == [
        1,
        2,
        3,
    ]


def test_same_source_and_output_only_validates(tmp_path):
    src = make_run(tmp_path / "a")
    before = {p: p.stat().st_mtime_ns for p in src.path.rglob("*")}
    s = ingest_canonical(src.path, src.path)
    assert s["validated_only"] and s["events"] == 100
    assert {p: p.stat().st_mtime_ns for p in src.path.rglob("*")} == before


def test_nsys_run_round_trips(tmp_path):
    f = sorted(NSYS.glob("*.sqlite"))[0]
    ingest(f, tmp_path / "a")
    ingest(tmp_path / "a", tmp_path / "b")
    a, b = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    assert as_rows(a.read_events()) == as_rows(b.read_events())
    assert a.read_info().clock == b.read_info().clock


@pytest.mark.parametrize("column", REQUIRED_COLUMNS)
def test_missing_column_is_an_input_error_naming_file_and_column(tmp_path, column):
    p = tmp_path / "ev.parquet"
    pq.write_table(sample_events().drop_columns([column]), p)
    with pytest.raises(InputError) as e:
        ingest_canonical(p, tmp_path / "run")
    assert str(p) in str(e.value) and repr(column) in str(e.value)
    assert not (tmp_path / "run").exists()


def test_optional_columns_get_defaults(tmp_path):
    p = tmp_path / "ev.parquet"
    pq.write_table(sample_events().drop_columns(["layer", "flags"]), p)
    ingest_canonical(p, tmp_path / "run")
    t = RunDir(tmp_path / "run").read_events()
    assert set(t.column("layer").to_pylist()) == {""} and set(t.column("flags").to_pylist()) == {0}


def test_extra_columns_are_dropped_and_reported(tmp_path):
    p = tmp_path / "ev.parquet"
    t = sample_events()
    pq.write_table(
        t.append_column("user_note", pa.array(["x"] * t.num_rows)).append_column(
            "score", pa.array(np.ones(t.num_rows))
        ),
        p,
    )
    s = ingest_canonical(p, tmp_path / "run")
    assert s["dropped_columns"] == {str(p): ["user_note", "score"]}
    out = RunDir(tmp_path / "run").read_events()
    assert out.column_names == list(EVENT_COLUMNS)
    assert as_rows(out) == as_rows(t)


def test_types_are_cast_to_the_schema(tmp_path):
    t = sample_events()
    loose = pa.table(
        {
            c: (
                t.column(c).cast(pa.string())
                if pa.types.is_dictionary(t.schema.field(c).type)
                else t.column(c).cast(pa.int32())
                if c in ("start_ns", "end_ns", "pid", "corr_id")
                else t.column(c)
            )
            for c in EVENT_COLUMNS
        }
    )
    p = tmp_path / "loose.parquet"
    pq.write_table(loose, p)
    ingest_canonical(p, tmp_path / "run")
    out = RunDir(tmp_path / "run").read_events()
    assert out.schema.equals(EVENT_SCHEMA)
    assert as_rows(out) == as_rows(t)


def test_nulls_are_filled_or_refused(tmp_path):
    t = sample_events(n=5)
    p = tmp_path / "n.parquet"
    pid = pa.array([None, 1, 2, 3, 4], pa.int64())
    pq.write_table(t.set_column(t.schema.get_field_index("pid"), "pid", pid), p)
    s = ingest_canonical(p, tmp_path / "run")
    assert s["filled_nulls"] == {str(p): {"pid": 1}}
    assert RunDir(tmp_path / "run").read_events().column("pid").to_pylist() == [-1, 1, 2, 3, 4]
    start = pa.array([None, 1, 2, 3, 4], pa.int64())
    pq.write_table(t.set_column(t.schema.get_field_index("start_ns"), "start_ns", start), p)
    with pytest.raises(InputError, match="'start_ns' has 1 null"):
        ingest_canonical(p, tmp_path / "run2")


def test_unknown_kind_is_an_input_error(tmp_path):
    t = sample_events(n=5)
    kinds = pa.array(["RUNTIME", "KERNEL", "WARP_STALL", "RANGE", "KERNEL"]).dictionary_encode()
    p = tmp_path / "k.parquet"
    pq.write_table(t.set_column(0, "kind", kinds), p)
    with pytest.raises(InputError) as e:
        ingest_canonical(p, tmp_path / "run")
    assert str(p) in str(e.value) and "'WARP_STALL'" in str(e.value)


def test_uncastable_column_is_named(tmp_path):
    t = sample_events(n=3)
    p = tmp_path / "bad.parquet"
    pq.write_table(
        t.set_column(t.schema.get_field_index("bytes"), "bytes", pa.array(["a", "b", "c"])), p
    )
    with pytest.raises(InputError, match="column 'bytes'"):
        ingest_canonical(p, tmp_path / "run")


def test_not_parquet(tmp_path, capsys):
    p = tmp_path / "events.parquet"
    p.write_bytes(b"PAR1 but not really")
    with pytest.raises(InputError, match="unreadable Parquet"):
        ingest_canonical(p, tmp_path / "run")
    capsys.readouterr()
    assert main(["ingest", str(p), "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(p) in err


def test_folder_without_events(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no run.json, events/ or"):
        ingest_canonical(tmp_path / "empty", tmp_path / "run")


def test_a_file_inside_the_output_is_rewritten_in_place(tmp_path):
    src = make_run(tmp_path / "a")
    ingest_canonical(src.path, tmp_path / "b")
    f = RunDir(tmp_path / "b").event_files()[0]
    s = ingest_canonical(f, tmp_path / "b")
    assert s["events"] == 50
    assert as_rows(RunDir(tmp_path / "b").read_events()) == as_rows(src.read_events())
    assert RunDir(tmp_path / "b").read_info().command == ["python", "serve.py"]


def test_kind_codes_and_bad_labels(tmp_path):
    t = sample_events(n=10)
    codes = pa.array(np.array([KINDS.index(k) for k in t.column("kind").to_pylist()], np.int8))
    p = tmp_path / "codes.parquet"
    pq.write_table(t.set_column(0, "kind", codes), p)
    ingest_canonical(p, tmp_path / "run")
    assert as_rows(RunDir(tmp_path / "run").read_events()) == as_rows(t)
    pq.write_table(t.set_column(0, "kind", pa.array(np.full(10, 42, np.int8))), p)
    with pytest.raises(InputError, match="kind code 42"):
        ingest_canonical(p, tmp_path / "run2")
    src = make_run(tmp_path / "a")
    (src.path / "labels.json").write_text("{not json")
    with pytest.raises(InputError, match="labels.json: not valid JSON"):
        ingest_canonical(src.path, tmp_path / "b")
