"""Damaged, hostile and skewed input through the readers: counts that balance or one clear error.

Every case either reads with counts that reconcile (Kineto: events_in = events_out + skipped;
Nsight: rows in = events + skipped; logs: one row per non-blank line) and with what was planted
showing up in those counts, or raises a one-line :class:`TellerError` naming the file and the
record. Each case runs under a time bound (an alarm in-process, a timeout for the child
process of the large salvage case): a hang fails the test instead of stalling the suite.

Two sources of damage: hypothesis strategies over small documents built here (Kineto JSON, an
Nsight SQLite export, recorder JSONL lines), and fixed damaged copies of the real traces in
``tests/data/external`` built at run time by :mod:`damage`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import damage
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teller.cli import main
from teller.errors import InputError, TellerError
from teller.ingest import ingest
from teller.ingest.kineto import ingest_kineto, parse_kineto_file
from teller.ingest.nsys import ingest_nsys
from teller.logs import build_alignment
from teller.logs.formats import all_presets
from teller.logs.readers import FLAG_BAD_RECORD, FLAG_NON_UTF8, ParseContext, read_jsonl
from teller.rundir import FLAG_REPAIRED, RunDir, RunInfo

BOUND_S = 60  # per case; the intact inputs here read in well under a second


@contextlib.contextmanager
def bounded(seconds: float = BOUND_S, what: str = "case"):
    """Fail (instead of hanging) when the body runs longer than ``seconds``."""

    def _fire(*_):
        raise TimeoutError(f"{what} still running after {seconds} s (hang)")

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def one_line_naming(err: BaseException, path: Path) -> None:
    msg = str(err)
    assert isinstance(err, TellerError), f"{type(err).__name__}: {msg}"
    assert "\n" not in msg and str(path) in msg, msg


def kineto_balance(s: dict) -> None:
    assert s["events_in"] == s["events_out"] + s["skipped"]
    assert sum(s["skipped_by_reason"].values()) == s["skipped"]
    assert sum(s["out_by_kind"].values()) == s["events_out"]


# --------------------------------------------------------------------------------------------
# Kineto: hypothesis over documents and bytes

_ODD_VALUES = st.one_of(
    st.sampled_from(
        [None, True, "abc", "", [1], {"a": 1}, 1e300, -1e300, 1e25, 10**30, -(10**40),
         float("nan"), float("inf"), float("-inf"), "\ud800", "x\udfffy", 2**63, -(2**63) - 1]
    ),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
_CATS = ["cpu_op", "cuda_runtime", "kernel", "gpu_memcpy", "user_annotation", "python_function", None]


@st.composite
def kineto_event(draw, i: int) -> dict:
    cat = draw(st.sampled_from(_CATS))
    e = {"ph": draw(st.sampled_from(["X", "X", "X", "i", "B", "E", "M", "s", "f", "C", "b"])),
         "cat": cat, "name": f"ev{i}", "pid": 100, "tid": draw(st.sampled_from([100, 101])),
         "ts": 1000 + 10 * i, "dur": draw(st.sampled_from([1, 5, 0.5])),
         "args": {"correlation": i, "External id": i}}
    if cat in ("kernel", "gpu_memcpy"):
        e.update(pid=0, tid=7)
        e["args"].update(device=0, stream=7)
    for key in draw(st.lists(st.sampled_from(["ts", "dur", "pid", "tid", "name", "cat", "args", "ph"]),
                             max_size=2)):
        e[key] = draw(_ODD_VALUES)
    return e


@st.composite
def kineto_doc(draw) -> tuple[dict, int]:
    n = draw(st.integers(1, 25))
    evs = [draw(kineto_event(i)) for i in range(n)]
    dups = draw(st.lists(st.integers(0, n - 1), max_size=3, unique=True))
    evs += [json.loads(json.dumps(evs[k])) for k in dups]
    top = {"schemaVersion": 1, "traceEvents": evs}
    if draw(st.booleans()):
        top["baseTimeNanoseconds"] = draw(st.sampled_from([1_700_000_000_000_000_000, 10**30, -5, 2**62]))
    return top, len(dups)


def _damage_bytes(draw, data: bytes) -> bytes:
    op = draw(st.sampled_from(["none", "cut", "flip", "insert", "deep"]))
    if op == "cut" and len(data) > 1:
        return data[: draw(st.integers(1, len(data) - 1))]
    if op == "flip" and data:
        b = bytearray(data)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(b)
    if op == "insert" and data:
        i = draw(st.integers(0, len(data)))
        return data[:i] + draw(st.sampled_from([b"\x00garbage{{{", b"},{", b'"', b"]", b"\xff\xfe"])) + data[i:]
    if op == "deep":
        i = data.find(b'"args"')
        if i > 0:
            return data[:i] + b'"args": {"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}, " + data[i:]
    return data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=kineto_doc(), data=st.data(), gz=st.booleans(), exact=st.booleans())
def test_kineto_documents_read_with_balanced_counts_or_one_clear_error(doc, data, gz, exact):
    top, _ = doc
    text = json.dumps(top)  # NaN/Infinity and "\ud800" escapes pass through as JSON text
    if exact:  # ns-precision timestamps (Unix µs with three decimals): the exact-decimal path
        text = text.replace('"ts": 1', '"ts": 1700000000000001.125 , "x": 1', 1)
    raw = _damage_bytes(data.draw, text.encode())
    if gz:
        raw = _damage_bytes(data.draw, gzip.compress(raw))
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / ("t.json.gz" if gz else "t.json")
        f.write_bytes(raw)
        try:
            with bounded(what=f.name):
                s = ingest_kineto(f, Path(tmp) / "run")
        except TellerError as e:
            one_line_naming(e, f)
            return
        kineto_balance(s)
        t = RunDir(Path(tmp) / "run").read_events()
        assert t.num_rows == s["events_out"]
        if t.num_rows:
            start, end = np.asarray(t["start_ns"]), np.asarray(t["end_ns"])
            assert (end >= start).all() and (np.abs(start) < 2**62).all()


def _host_doc(n: int = 40) -> dict:
    evs = [{"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 7}", "pid": 1, "tid": 1 + i % 2,
            "ts": 1000 + 10 * i, "dur": 4, "args": {"External id": i}} for i in range(n)]
    evs.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1,
                "ts": 990, "dur": 10 * n + 20})
    return {"schemaVersion": 1, "baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceEvents": evs}


@settings(max_examples=40, deadline=None)
@given(copies=st.lists(st.integers(0, 39), min_size=1, max_size=12), near=st.booleans())
def test_exact_duplicates_are_dropped_and_counted(copies, near):
    doc = _host_doc()
    evs = doc["traceEvents"]
    planted = [json.loads(json.dumps(evs[k])) for k in copies]
    if near:  # same everything but args: a different event, kept
        evs.append({**evs[0], "args": {"External id": 999}})
    evs.extend(planted)
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "dups.json"
        f.write_text(json.dumps(doc))
        with bounded():
            s = ingest_kineto(f, Path(tmp) / "run")
    kineto_balance(s)
    assert s["skipped_by_reason"]["exact_duplicate"] == len(copies)
    assert s["events_out"] == 41 + near
    assert any("exact duplicate" in w for w in s["warnings"])


@settings(max_examples=40, deadline=None)
@given(bad=st.lists(st.integers(0, 39), min_size=1, max_size=6, unique=True),
       dur=st.sampled_from([1e12, 3.5e13, 8.9e15, 10**14, 1e25]), exact=st.booleans())
def test_absurd_durations_become_zero_flagged_and_counted(bad, dur, exact):
    doc = _host_doc()
    for k in bad:
        doc["traceEvents"][k]["dur"] = dur
    text = json.dumps(doc)
    if exact:
        text = text.replace('"baseTimeNanoseconds": 1700000000000000000, ', "")
        text = re.sub(r'"ts": (\d+)', lambda m: f'"ts": {1_700_000_000_000_000 + int(m.group(1))}.125', text)
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "absurd.json"
        f.write_text(text)
        with bounded():
            pf = parse_kineto_file(f)
    d = pf.table.to_pydict()
    assert pf.stats.repaired["absurd_duration"] == len(bad)
    names = {f"aten::op{k % 7}" for k in bad}
    zero = [i for i, n in enumerate(d["name"]) if d["end_ns"][i] == d["start_ns"][i] and n in names]
    assert len(zero) >= len(bad)
    assert sum(1 for x in d["flags"] if x & FLAG_REPAIRED) == len(bad)
    assert (np.asarray(d["end_ns"]) - np.asarray(d["start_ns"])).max() <= 500_000  # the step, in ns


def test_legitimately_long_events_are_not_absurd(tmp_path):
    # one range covering a 2-hour trace, and a 30-minute event ending just after the last start
    evs = [{"ph": "X", "cat": "user_annotation", "name": "whole", "pid": 1, "tid": 1, "ts": 0, "dur": 7.2e9},
           {"ph": "X", "cat": "cpu_op", "name": "last", "pid": 1, "tid": 1, "ts": 7.1e9, "dur": 1.8e9},
           {"ph": "X", "cat": "cpu_op", "name": "first", "pid": 1, "tid": 1, "ts": 5, "dur": 1}]
    f = tmp_path / "long.json"
    f.write_text(json.dumps({"baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceEvents": evs}))
    pf = parse_kineto_file(f)
    assert not pf.stats.repaired and not (np.asarray(pf.table["flags"]) & FLAG_REPAIRED).any()


def _read_ns_rows(f: Path, rows: list[str]):
    """``rows`` (event JSON texts) as an ns-display trace at ``f``, parsed on the exact-decimal path:
    the parsed file and its table as a dict."""
    f.write_text('{"displayTimeUnit": "ns", "traceEvents": [' + ",".join(rows) + "]}")
    with bounded():
        pf = parse_kineto_file(f)
    assert pf.meta["exact_decimal_ts"]
    return pf, pf.table.to_pydict()


def test_huge_and_nonfinite_times_in_exact_files_are_skipped_not_overflowed(tmp_path):
    rows = [
        '{"ph": "X", "cat": "cpu_op", "name": "ok", "pid": 1, "tid": 1, "ts": 1700000000000001.125, "dur": 2.5}',
        '{"ph": "X", "cat": "cpu_op", "name": "big_dur", "pid": 1, "tid": 1, "ts": 1700000000000002.125, "dur": 1e25}',
        '{"ph": "X", "cat": "cpu_op", "name": "big_ts", "pid": 1, "tid": 1, "ts": 1e300, "dur": 1}',
        '{"ph": "X", "cat": "cpu_op", "name": "inf_ts", "pid": 1, "tid": 1, "ts": Infinity, "dur": 1}',
        '{"ph": "X", "cat": "cpu_op", "name": "int_ts", "pid": 1, "tid": 1, "ts": 100000000000000000000000000, "dur": 1}',
        '{"ph": "X", "cat": "cpu_op", "name": "str_ts", "pid": 1, "tid": 1, "ts": "1e999999999", "dur": 1}',
        '{"ph": "X", "cat": "cpu_op", "name": "long_ts", "pid": 1, "tid": 1, "ts": 1' + "0" * 5000 + '.5, "dur": 1}',
    ]
    pf, d = _read_ns_rows(tmp_path / "ns.json", rows)
    assert sorted(d["name"]) == ["big_dur", "ok"]
    assert pf.stats.skipped["bad_timestamp"] == 5
    assert pf.stats.repaired["absurd_duration"] == 1  # dur 1e25 µs: no duration can be that long
    ok = d["name"].index("ok")
    assert d["end_ns"][ok] - d["start_ns"][ok] == 2500


def test_exponents_past_the_decimal_range_in_exact_files_are_skipped_not_raised(tmp_path):
    # a damaged digit can make an exponent no Decimal holds: the number reads as json.loads reads it
    # (inf, 0.0), so the event is counted as a bad timestamp and the document still reads
    rows = [
        '{"ph": "X", "cat": "cpu_op", "name": "ok", "pid": 1, "tid": 1, "ts": 1700000000000001.125, "dur": 2.5}',
        '{"ph": "X", "cat": "cpu_op", "name": "huge_ts", "pid": 1, "tid": 1, "ts": 1e99999999999999999999, "dur": 1}',
        '{"ph": "X", "cat": "cpu_op", "name": "tiny_ts", "pid": 1, "tid": 1, "ts": -4e-99999999999999999999, "dur": 1}',
        '{"ph": "X", "cat": "cpu_op", "name": "late", "pid": 1, "tid": 1, "ts": 1700000000000003.250, "dur": 1}',
    ]
    pf, d = _read_ns_rows(tmp_path / "exp.json", rows)
    assert sorted(d["name"]) == ["late", "ok", "tiny_ts"]
    assert pf.stats.skipped["bad_timestamp"] == 1
    assert d["start_ns"][d["name"].index("late")] - d["start_ns"][d["name"].index("ok")] == 2125


def test_lone_surrogates_are_replaced_flagged_and_counted(tmp_path):
    evs = [{"ph": "X", "cat": "cpu_op", "name": "bad\ud800name", "pid": 1, "tid": 1, "ts": 1, "dur": 1},
           {"ph": "X", "cat": "x\udfff", "name": "n", "pid": 1, "tid": 1, "ts": 2, "dur": 1},
           {"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 3, "dur": 1,
            "args": {"k\ud800": "v\udbff"}},
           {"ph": "X", "cat": "cpu_op", "name": "fine", "pid": 1, "tid": 1, "ts": 4, "dur": 1}]
    f = tmp_path / "surr.json"
    f.write_text(json.dumps({"traceEvents": evs}))
    s = ingest_kineto(f, tmp_path / "run")
    kineto_balance(s)
    assert s["events_out"] == 4 and s["repaired_by_reason"]["invalid_unicode"] == 3
    d = RunDir(tmp_path / "run").read_events().to_pydict()
    assert "bad\ufffdname" in d["name"]
    flagged = {n for n, fl in zip(d["name"], d["flags"], strict=True) if fl & FLAG_REPAIRED}
    assert flagged == {"bad\ufffdname", "n", "a"}


# --------------------------------------------------------------------------------------------
# Kineto: salvage stays linear, gzip damage is named


def _garbled_text(n: int) -> tuple[str, int]:
    """A pretty-printed trace of ``n`` events in which every other event from the 10th on
    cannot be parsed (a quote replaced); returns the text and the number of readable events."""
    lines, ok = [], 0
    for i in range(n):
        e = json.dumps({"ph": "X", "cat": "cpu_op", "name": f"ev{i}", "pid": 1, "tid": 1,
                        "ts": 1000 + i, "dur": 1, "args": {"Input Dims": [[i, 2]], "n": [{"a": i}], "unit": "µs"}},
                       ensure_ascii=False)  # non-ASCII text: byte offsets differ from indices
        if i >= 10 and i % 2:
            e = e.replace('"name"', '#name"', 1)
        else:
            ok += 1
        lines.append(" " + e)
    return '{\n "traceEvents": [\n' + ",\n".join(lines) + "\n ]\n}\n", ok


def test_garbled_events_are_skipped_one_by_one_exactly(tmp_path):
    text, ok = _garbled_text(400)
    f = tmp_path / "garbled.json"
    f.write_text(text)
    with bounded():
        pf = parse_kineto_file(f, chunk_bytes=4096)
    assert pf.table.num_rows == ok
    notes = [d for d in pf.damage if d.startswith("skipped")]
    assert len(notes) == 20 and any("unreadable stretches in all" in d for d in pf.damage)


SALVAGE_CHILD = """
import sys, json
sys.path.insert(0, {tests!r})
from test_fuzz_readers import _garbled_text
from teller.ingest.kineto import parse_kineto_file
from pathlib import Path
text, ok = _garbled_text({n})
p = Path({path!r}); p.write_text(text)
pf = parse_kineto_file(p)
print(json.dumps([pf.table.num_rows, ok]))
"""


def test_salvage_of_a_large_garbled_file_finishes(tmp_path):
    """~12 MB with 50,000 unreadable events: quadratic salvage took minutes here; the bound is
    generous (a hang guard, not a speed test: see benchmarks/fuzz_readers.py --salvage-timing)."""
    code = SALVAGE_CHILD.format(tests=str(Path(__file__).parent), n=100_000, path=str(tmp_path / "g.json"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows, ok = json.loads(r.stdout.strip().splitlines()[-1])
    assert rows == ok


def _first_failing_byte(data: bytes) -> int:
    for i in range(10, len(data) - 8):
        b = bytearray(data)
        b[i] ^= 0xFF
        try:
            zlib.decompressobj(wbits=31).decompress(bytes(b))
        except zlib.error:
            return i
    raise AssertionError("no corrupting byte")


def test_corrupt_small_gzip_says_what_happened_not_whitespace(tmp_path):
    data = gzip.compress(b'{"traceEvents": [' + b'{"ph": "X", "ts": 1, "dur": 1},' * 3 + b"]}")
    i = _first_failing_byte(data)
    b = bytearray(data)
    b[i] ^= 0xFF
    f = tmp_path / "small.json.gz"
    f.write_bytes(bytes(b))
    with pytest.raises(InputError) as ei:
        parse_kineto_file(f)
    msg = str(ei.value)
    assert "whitespace" not in msg and "corrupt gzip data at compressed byte" in msg
    assert str(f) in msg and "\n" not in msg


def test_cut_gzip_names_the_byte_and_what_was_recovered(tmp_path):
    text = _garbled_text(300)[0].replace("#name", '"name')
    data = gzip.compress(text.encode())
    f = tmp_path / "cut.json.gz"
    f.write_bytes(data[: len(data) // 2])
    pf = parse_kineto_file(f)
    gz = [d for d in pf.damage if "gzip" in d]
    assert gz and f"compressed byte {len(data) // 2}" in gz[0] and "bytes of text recovered" in gz[0]


def test_ingest_prints_the_damage_at_the_end(tmp_path, capsys):
    text = _garbled_text(200)[0].replace("#name", '"name')
    cut = text.index('"ev150"')
    f = tmp_path / "cut.json"
    f.write_text(text[:cut])
    assert main(["ingest", str(f), "-o", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "file cut or corrupt at byte" in err
    assert "the 150 complete events read are kept" in err
    info = RunDir(tmp_path / "run").read_info()
    assert any("file cut or corrupt at byte" in w for w in info.extra["warnings"])


# --------------------------------------------------------------------------------------------
# Nsight Systems SQLite: hypothesis over a small export


_SQL_ODD = st.one_of(
    st.sampled_from(["garbage", b"\x00\x01", "12abc", "", 1.5, 1e300, 2**63 - 1, -(2**63), None, "7"]),
    st.integers(-(2**63), 2**63 - 1),
)


def _write_export(path: Path, n: int, odd: dict, drop: set[str], epoch) -> None:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "cudaLaunchKernel_v7000"), (2, "kern")])
    rt = ["start", "end", "eventClass", "globalTid", "correlationId", "nameId", "returnValue"]
    kn = ["start", "end", "deviceId", "contextId", "streamId", "correlationId", "globalPid", "demangledName",
          "shortName", "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ"]
    gt = (1 << 24) * 5 + 5
    for table, cols, row in (
        ("CUPTI_ACTIVITY_KIND_RUNTIME", rt, lambda i: [100 * i, 100 * i + 10, 0, gt, i + 1, 1, 0]),
        ("CUPTI_ACTIVITY_KIND_KERNEL", kn,
         lambda i: [100 * i + 20, 100 * i + 60, 0, 1, 7, i + 1, gt, 2, 2, 1, 1, 1, 32, 1, 1]),
    ):
        if table in drop:
            continue
        keep = [c for c in cols if f"{table}.{c}" not in drop]
        con.execute(f'CREATE TABLE "{table}" ({", ".join(f"{c} INTEGER" for c in keep)})')
        for i in range(n):
            vals = dict(zip(cols, row(i), strict=True))
            for (t, c, r), v in odd.items():
                if t == table and r == i:
                    vals[c] = v
            con.execute(f'INSERT INTO "{table}" VALUES ({", ".join("?" * len(keep))})', [vals[c] for c in keep])
    if epoch is not None:
        con.execute("CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER)")
        con.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?)", (epoch,))
    con.commit()
    con.close()


def _stored_text_times(path: Path) -> int:
    """Rows whose start or end SQLite stores as text or a blob (INTEGER affinity turns "7"
    into 7, so what was written is not what is stored)."""
    con = sqlite3.connect(path)
    n = 0
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE name LIKE 'CUPTI%'"):
        cols = {r[1] for r in con.execute(f'PRAGMA table_info("{t}")')}
        conds = [f"typeof({c}) IN ('text', 'blob')" for c in ("start", "end") if c in cols]
        if conds:
            n += con.execute(f'SELECT count(*) FROM "{t}" WHERE {" OR ".join(conds)}').fetchone()[0]
    con.close()
    return n


@st.composite
def nsys_case(draw):
    n = draw(st.integers(1, 12))
    tables = ["CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL"]
    cols = ["start", "end", "globalTid", "correlationId", "nameId", "deviceId", "streamId", "globalPid",
            "demangledName"]
    odd = draw(st.dictionaries(st.tuples(st.sampled_from(tables), st.sampled_from(cols), st.integers(0, n - 1)),
                               _SQL_ODD, max_size=5))
    drop = set(draw(st.lists(st.sampled_from(
        tables + [f"{t}.{c}" for t in tables for c in ("start", "end", "globalTid", "correlationId")]), max_size=2)))
    epoch = draw(st.sampled_from([1_736_033_315_993_265_791, 2**63 - 1, 1e30, -5, "soon", None]))
    return n, odd, drop, epoch


@settings(max_examples=120, deadline=None)
@given(case=nsys_case())
def test_nsys_exports_read_with_balanced_counts_or_one_clear_error(case):
    n, odd, drop, epoch = case
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "r.sqlite"
        _write_export(f, n, odd, drop, epoch)
        try:
            with bounded(what=f.name):
                s = ingest_nsys(f, Path(tmp) / "run")
        except TellerError as e:
            one_line_naming(e, f)
            return
        assert sum(s["tables"].values()) == s["events"] + s["skipped"]
        rejected = sum(v for k, v in s["skipped_rows"].items() if "not an integer" in k)
        assert rejected == _stored_text_times(f)
        t0 = s["t0_unix_ns"]
        assert t0 is None or 0 <= t0 < 4_102_444_800 * 10**9
        if isinstance(epoch, int) and not 0 < epoch < 4_102_444_800 * 10**9:
            assert t0 is None and any("utcEpochNs" in w for w in s["warnings"])
        RunDir(Path(tmp) / "run").read_events()


def test_nsys_event_time_far_from_the_session_start_leaves_no_wall_clock(tmp_path):
    """A REAL start of 1e300 reads as the largest integer: the session start plus it lies beyond
    2100, so the run gets no wall clock (with a warning) rather than a t0 in the year 2317."""
    f = tmp_path / "r.sqlite"
    _write_export(f, 1, {("CUPTI_ACTIVITY_KIND_RUNTIME", "start", 0): 1e300,
                         ("CUPTI_ACTIVITY_KIND_KERNEL", "start", 0): "garbage"}, set(), 1_736_033_315_993_265_791)
    s = ingest_nsys(f, tmp_path / "run")
    assert s["t0_unix_ns"] is None
    assert any("not a wall-clock time" in w and "r.sqlite" in w for w in s["warnings"])
    _write_export(tmp_path / "ok.sqlite", 1, {}, set(), 1_736_033_315_993_265_791)
    assert ingest_nsys(tmp_path / "ok.sqlite", tmp_path / "run2")["t0_unix_ns"] >= 1_736_033_315_993_265_791


# --------------------------------------------------------------------------------------------
# recorder JSONL log lines


_GOOD_LINE = st.builds(
    lambda i: json.dumps({"ts_ns": 1_700_000_000_000_000_000 + i, "node": 0, "pid": 3,
                          "stream": "stderr", "text": f"INFO x {i}"}).encode(),
    st.integers(0, 10**9),
)
_BAD_LINE = st.one_of(
    st.sampled_from(damage._BAD_LOG_LINES + damage._ODD_LOG_LINES),
    st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b.strip()),
    st.builds(lambda v: json.dumps({"ts_ns": v, "text": "t"}, default=str).encode(),
              st.one_of(st.floats(), st.integers(), st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2))),
)


@settings(max_examples=120, deadline=None)
@given(lines=st.lists(st.one_of(_GOOD_LINE, _BAD_LINE, st.just(b"")), min_size=1, max_size=30))
def test_jsonl_logs_keep_every_line_and_count_the_bad_ones(lines):
    body = b"\n".join(lines) + b"\n"
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        (run / "logs").mkdir(parents=True)
        RunDir(run).write_info(RunInfo(clock={"t0_unix_ns": 1_700_000_000_000_000_000}))
        f = run / "logs" / "l.jsonl"
        f.write_bytes(body)
        with bounded(what=f.name):
            r = read_jsonl(f, ParseContext(all_presets(), ref_unix_ns=0, utc_offset_s=0), "l.jsonl")
            table, summary = build_alignment(run)
    nonblank = sum(1 for ln in body.split(b"\n")[:-1] if ln.strip())
    assert r.table.num_rows == nonblank == summary["lines"]
    line_no = r.table.column("file_line").to_pylist()
    assert line_no == sorted(set(line_no))
    flags = np.asarray(r.table.column("flags"))
    n_bad = int(((flags & FLAG_BAD_RECORD) > 0).sum())
    assert summary["bad_records"] == n_bad
    good = {i + 1 for i, ln in enumerate(body.split(b"\n")[:-1]) if ln in set(_good_lines(lines))}
    bad_rows = {n for n, fl in zip(line_no, flags, strict=True) if fl & FLAG_BAD_RECORD}
    assert not (bad_rows & good)
    if n_bad:
        note = [x for x in summary["notes"] if "unusable records" in x]
        assert note and "l.jsonl" in note[0] and str(min(bad_rows)) in note[0]


def _good_lines(lines: list[bytes]) -> list[bytes]:
    """The lines drawn from ``_GOOD_LINE`` (well-formed recorder records)."""
    return [ln for ln in lines if ln.startswith(b'{"ts_ns": 1700') and b'"text": "INFO x ' in ln]


def test_each_bad_log_line_is_kept_as_text_and_named(tmp_path):
    body = b"\n".join([b'{"ts_ns": 5, "pid": 1, "text": "ok"}'] + damage._BAD_LOG_LINES
                      + damage._ODD_LOG_LINES) + b"\n"
    f = tmp_path / "bad.jsonl"
    f.write_bytes(body)
    with bounded():
        r = read_jsonl(f, ParseContext(all_presets(), ref_unix_ns=0, utc_offset_s=0))
    flags = r.table.column("flags").to_pylist()
    n_bad = len(damage._BAD_LOG_LINES)
    assert len(flags) == 1 + n_bad + len(damage._ODD_LOG_LINES)
    assert flags[0] & FLAG_BAD_RECORD == 0
    assert all(x & FLAG_BAD_RECORD for x in flags[1 : 1 + n_bad])
    # usable records with odd text (bytes that are not UTF-8, a lone surrogate): kept, repaired
    assert not any(x & FLAG_BAD_RECORD for x in flags[1 + n_bad :])
    assert all(x & FLAG_NON_UTF8 for x in flags[1 + n_bad :])
    assert r.notes and str(f) in r.notes[0] and "line" in r.notes[0]
    assert "lone \ufffd surrogate" in r.table.column("text").to_pylist()


def test_log_lines_in_a_run_without_steps(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    RunDir(run).write_info(RunInfo(clock={"t0_unix_ns": 1_700_000_000_000_000_000}))
    RunDir(run).write_table(pa.table({c: pa.array([], pa.int64()) for c in
                                      ("step_id", "step_num", "rank", "pid", "start_ns", "end_ns")}), "steps")
    body, k = damage.log_lines(random.Random(3), 1_700_000_000_000_000_000)
    (run / "logs" / "l.jsonl").write_bytes(body)
    with bounded():
        table, summary = build_alignment(run)
    assert summary["lines"] == 20 + k + len(damage._ODD_LOG_LINES) and summary["bad_records"] == k
    assert set(table.column("rule").to_pylist()) == {"unaligned"}


@pytest.mark.parametrize("t0", [10**30, 1e300, float("inf"), float("nan"), "soon", -5])
def test_garbage_wall_clock_in_run_json_does_not_break_log_alignment(tmp_path, t0):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    RunDir(run).write_info(RunInfo(clock={"t0_unix_ns": t0, "utc_offset_s": 1e300}, start_wall=1e300))
    (run / "logs" / "l.jsonl").write_bytes(b'{"ts_ns": 1700000000000000000, "pid": 1, "text": "x"}\n')
    with bounded():
        table, summary = build_alignment(run)
    assert summary["lines"] == 1 and table.column("ts_ns").to_pylist() == [-1]
    assert any("t0_unix_ns" in n for n in summary["notes"])


# --------------------------------------------------------------------------------------------
# run directory files


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    ingest(damage.EXTERNAL / "kineto" / "hta_triton_example.json.gz", run)
    return run


@pytest.mark.parametrize("body", ["[]", '"x"', "3", "null", '{"schema_version": 1, "clo'])
def test_run_json_that_is_not_an_object_is_one_clear_error(tmp_path, body):
    run = _run(tmp_path)
    (run / "run.json").write_text(body)
    with pytest.raises(TellerError) as ei:
        RunDir(run).read_info()
    one_line_naming(ei.value, run / "run.json")


def test_events_file_without_args_reads_with_null_args(tmp_path):
    run = _run(tmp_path)
    ev = RunDir(run).event_files()[0]
    t = pq.read_table(ev)
    pq.write_table(t.drop_columns(["args", "layer", "flags"]), ev)
    got = RunDir(run).read_events()
    assert got.num_rows == t.num_rows and got.column("args").null_count == t.num_rows
    assert RunDir(run).read_events(columns=["args", "kind"]).num_rows == t.num_rows


@pytest.mark.parametrize("column", ["start_ns", "end_ns", "kind"])
def test_nulls_in_required_event_columns_are_refused_wherever_read(tmp_path, column):
    run = _run(tmp_path)
    ev = RunDir(run).event_files()[0]
    t = pq.read_table(ev)
    col = t.column(column).combine_chunks()
    mask = np.zeros(len(col), bool)
    mask[[1, 3]] = True
    bad = pc_if_null(col, mask)
    pq.write_table(t.set_column(t.schema.get_field_index(column), column, bad), ev)
    for columns in (None, ["kind"], ["name"], [column]):
        with pytest.raises(TellerError) as ei:
            RunDir(run).read_events(columns=columns)
        one_line_naming(ei.value, ev)
        assert "2 null values (first at row 1)" in str(ei.value)


def pc_if_null(col: pa.Array, mask: np.ndarray) -> pa.Array:
    import pyarrow.compute as pc

    return pc.if_else(pa.array(mask), pa.scalar(None, col.type), col)


def test_events_file_missing_a_required_column_is_one_clear_error(tmp_path):
    run = _run(tmp_path)
    ev = RunDir(run).event_files()[0]
    pq.write_table(pq.read_table(ev).drop_columns(["tid"]), ev)
    with pytest.raises(TellerError) as ei:
        RunDir(run).read_events(columns=["kind"])
    one_line_naming(ei.value, ev)
    assert "tid" in str(ei.value)


# --------------------------------------------------------------------------------------------
# fixed damaged copies of the real traces


_BIG = {"h200_transformers_cb_llama4l.json.gz", "hta_nccl_data_rank0.json.gz", "hta_ns_resolution_rank0.json.gz"}
_BIG_FAMILIES = {"truncate_gz", "flip_gz", "surrogate", "duplicates", "deep"}
KINETO_CASES = [(f, fam) for f in damage.KINETO_FILES for fam in damage.KINETO_DAMAGE
                if f.name not in _BIG or fam in _BIG_FAMILIES]


@pytest.mark.parametrize("src, family", KINETO_CASES,
                         ids=[f"{f.name.split('.')[0]}-{fam}" for f, fam in KINETO_CASES])
def test_damaged_real_kineto_traces(tmp_path, src, family):
    rng = random.Random(f"{src.name}/{family}")
    p, planted = damage.KINETO_DAMAGE[family](src, tmp_path / "v", rng)
    try:
        with bounded(what=p.name):
            s = ingest(p, tmp_path / "run")
    except TellerError as e:
        one_line_naming(e, p)
        assert family in ("truncate", "truncate_gz", "flip_gz", "flip_json", "deep"), str(e)
        return
    kineto_balance(s)
    assert RunDir(tmp_path / "run").read_events().num_rows == s["events_out"]
    if planted.get("expect") == "duplicates":
        assert s["skipped_by_reason"].get("exact_duplicate", 0) == planted["planted"]
    if planted.get("expect") == "repaired":
        assert s["repaired_by_reason"].get("absurd_duration", 0) == planted["planted"]
    if family in ("truncate", "truncate_gz", "flip_gz") and s["repaired"]:
        assert any("kept" in w for w in s["warnings"])


NSYS_CASES = [(f, fam, i) for f in damage.NSYS_FILES for fam in damage.NSYS_DAMAGE for i in range(2)]


@pytest.mark.parametrize("src, family, i", NSYS_CASES,
                         ids=[f"{f.stem}-{fam}-{i}" for f, fam, i in NSYS_CASES])
def test_damaged_real_nsys_exports(tmp_path, src, family, i):
    p, planted = damage.NSYS_DAMAGE[family](src, tmp_path / "v", random.Random(f"{src.name}/{family}/{i}"))
    try:
        with bounded(what=p.name):
            s = ingest(p, tmp_path / "run")
    except TellerError as e:
        one_line_naming(e, p)
        assert family in ("byte_damage", "huge", "drop_table", "drop_column"), str(e)
        return
    assert sum(s["tables"].values()) == s["events"] + s["skipped"]
    if planted.get("expect") == "rejected_rows":
        assert sum(v for k, v in s["skipped_rows"].items() if "not an integer" in k) == planted["planted"]
    if planted.get("expect") == "no_epoch":
        t0 = s["t0_unix_ns"]
        assert t0 is None or 946_684_800 * 10**9 <= t0 < 4_102_444_800 * 10**9
    RunDir(tmp_path / "run").read_events()


def _same_reading(f: Path, **options) -> None:
    """The typed (msgspec) path and the stdlib path read ``f`` to the same rows, counts and
    notes (args compared as JSON values: the typed path keeps their numbers as written)."""
    got = {}
    for fast in (True, False):
        try:
            got[fast] = parse_kineto_file(f, fast=fast, **options)
        except TellerError as e:
            got[fast] = str(e)
    a, b = got[True], got[False]
    assert type(a) is type(b), (a, b)
    if isinstance(a, str):
        assert a == b
        return
    # values, not dictionary layouts (which entries a dictionary holds follows the chunking)
    assert a.table.drop_columns(["args"]).to_pydict() == b.table.drop_columns(["args"]).to_pydict()
    assert [json.loads(x) for x in a.table["args"].to_pylist()] == [
        json.loads(x) for x in b.table["args"].to_pylist()
    ]
    for k in ("in_by_category", "skipped", "repaired"):
        assert getattr(a.stats, k) == getattr(b.stats, k), k
    assert (a.damage, a.warnings, a.meta, a.clock) == (b.damage, b.warnings, b.meta, b.clock)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=kineto_doc(), data=st.data(), exact=st.booleans(), chunk=st.sampled_from([64, 400, 1 << 22]))
def test_typed_path_reads_hostile_documents_as_the_stdlib_path(doc, data, exact, chunk):
    top, _ = doc
    text = json.dumps(top)
    if exact:
        text = text.replace('"ts": 1', '"ts": 1700000000000001.125 , "x": 1', 1)
    raw = _damage_bytes(data.draw, text.encode())
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "t.json"
        f.write_bytes(raw)
        with bounded(what=f.name):
            _same_reading(f, chunk_bytes=chunk)


@pytest.mark.parametrize("path", sorted((Path(__file__).parent / "data" / "external" / "kineto").iterdir()), ids=lambda p: p.name)
def test_typed_path_reads_every_real_trace_as_the_stdlib_path(path):
    _same_reading(path)
    _same_reading(path, chunk_bytes=1 << 16)


@pytest.mark.parametrize("where", [b'"args": {"name": "ma\xffin"}', b'"ts": "1\xff0"', b'"args": {"a": "\xfe"}'])
def test_typed_path_falls_back_on_invalid_utf8_inside_raw_values(tmp_path, where):
    """msgspec keeps ts/dur/args as raw text without checking its UTF-8; the stdlib path must
    then read the chunk, with the same outcome."""
    evs = [b'{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}}']
    evs += [b'{"ph": "X", "cat": "cpu_op", "name": "op%d", "pid": 1, "tid": 1, "ts": %d, "dur": 2}' % (i, 10 * i) for i in range(5)]
    evs[2] = evs[2].replace(b'"ts": 10', where) if where.startswith(b'"ts"') else evs[2][:-1] + b", " + where + b"}"
    evs[0] = evs[0].replace(b'"args": {"name": "main"}', where) if b"name" in where else evs[0]
    f = tmp_path / "t.json"
    f.write_bytes(b'{"traceEvents": [' + b", ".join(evs) + b"]}")
    _same_reading(f)


@pytest.mark.parametrize("close", [b"]", b"]\n  ", b"]\t"])
@pytest.mark.parametrize("chunk", [256, 1 << 22])
def test_typed_path_with_a_trailer_of_objects_after_the_array(tmp_path, close, chunk):
    """Keys after ``traceEvents`` holding lists of objects (``}, {`` past the array's end)."""
    evs = [
        b'{"ph": "X", "cat": "cpu_op", "name": "op%d", "pid": 1, "tid": 1, "ts": %d.125, "dur": 2}'
        % (i, 1_700_000_000_000_000 + 10 * i)
        for i in range(60)
    ]
    trailer = b', "deviceProperties": [{"id": 0}, {"id": 1}], "baseTimeNanoseconds": 5}'
    f = tmp_path / "t.json"
    f.write_bytes(b'{"traceEvents": [' + b", ".join(evs) + close + trailer)
    _same_reading(f, chunk_bytes=chunk)
    pf = parse_kineto_file(f, chunk_bytes=chunk)
    assert pf.table.num_rows == 60 and not pf.damage
    assert pf.meta["devices"] == [None, None] and pf.clock["baseTimeNanoseconds"] == 5


def test_a_float_pid_reads_alike_whatever_rows_share_its_chunk(tmp_path):
    """A float pid (0.0) is not an int whichever values are read beside it: read alone with ints it
    used to become pid 0 silently, read in a chunk with a label ("abc") it was kept in args, so
    its exact copy was dropped in one path and kept in the other (a case the fuzzing above found)."""
    from teller.ingest.kineto import _int_array

    assert _int_array([1, 0.0])[1].tolist() == [False, True]
    assert _int_array([1, "abc", 0.0])[1].tolist() == [False, True, True]
    assert _int_array([1, 0.5])[0].tolist() == [1, -1]  # not truncated to 0
    assert _int_array([1, None])[1] is None

    def ev(i, pid=100, ts=None):
        return {"ph": "X", "cat": "cpu_op", "name": f"ev{i}", "pid": pid, "tid": 100,
                "ts": 1000 + 10 * i if ts is None else ts, "dur": 1, "args": {"correlation": i, "External id": i}}

    evs = [ev(i) for i in range(20)]
    evs[14]["pid"] = 0.0
    evs[15].update(pid="abc", ts=None)
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"schemaVersion": 1, "traceEvents": evs + [ev(0), dict(evs[15]), dict(evs[14])]}))
    for chunk in (64, 400, 1 << 22):
        _same_reading(f, chunk_bytes=chunk)
    got = parse_kineto_file(f, fast=False, chunk_bytes=400)
    assert got.stats.skipped["exact_duplicate"] == 2 and got.table["name"].to_pylist().count("ev14") == 1
