"""Reading and parsing log files, request ids, templates, and align_run / `teller logs` end to end."""

from __future__ import annotations

import calendar
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from teller.cli import main
from teller.logs import ALIGNMENT_SCHEMA, align_run
from teller.logs.formats import all_presets
from teller.logs.ids import RequestIndex, extract_ids
from teller.logs.readers import (
    FLAG_BACKWARDS,
    FLAG_BAD_RECORD,
    FLAG_NO_TIMESTAMP,
    FLAG_NON_UTF8,
    ParseContext,
    read_jsonl,
    read_plain,
)
from teller.logs.templates import mine_templates
from teller.rundir import RunDir, RunInfo

S = 1_000_000_000
MS = 1_000_000
T0 = calendar.timegm((2026, 11, 29, 8, 15, 0)) * S  # τ = 0 at 08:15:00 UTC
ESC = "\x1b"


def ctx(**kw):
    return ParseContext(all_presets(), ref_unix_ns=T0, utc_offset_s=0, **kw)


# ------------------------------------------------------------------------------------------
# readers


VLLM_LOG = (
    "INFO 11-29 08:15:01 [api_server.py:1000] vLLM API server version 0.11.0\n"
    f"{ESC}[1;36m(APIServer pid=4242){ESC}[0;0m INFO 11-29 08:15:02 [logger.py:43] Received request chatcmpl-abc123: prompt: 'hi'\n"
    "(EngineCore_DP0 pid=4300) ERROR 11-29 08:15:04 [core.py:710] EngineCore encountered a fatal error.\n"
    "Traceback (most recent call last):\n"
    '  File "core.py", line 701, in run_engine_core\n'
    "\n"
    "RuntimeError: CUDA error\n"
    "(EngineCore_DP0 pid=4300) INFO 11-29 08:15:03 [core.py:90] late line\n"
).encode() + b"(APIServer pid=4242) INFO 11-29 08:15:05 [launcher.py:12] bytes \xff\xfe here\n"


def test_plain_vllm_file_continuations_ansi_utf8_and_backwards(tmp_path):
    p = tmp_path / "vllm.log"
    p.write_bytes(VLLM_LOG)
    r = read_plain(p, ctx())
    t = r.table.to_pylist()
    assert r.format == "vllm"
    assert r.blank == 1 and len(t) == 8  # 9 lines, the blank one skipped and counted
    assert [x["file_line"] for x in t] == [1, 2, 3, 4, 5, 7, 8, 9]
    assert t[1]["pid"] == 4242 and t[1]["text"].startswith("(APIServer pid=4242) INFO")  # ANSI removed
    assert t[1]["wall_ns"] == T0 + 2 * S
    # traceback lines: time, level, logger and pid of the line they continue
    for row in t[3:6]:
        assert row["flags"] & FLAG_NO_TIMESTAMP
        assert (row["wall_ns"], row["level"], row["logger"], row["pid"]) == (T0 + 4 * S, "ERROR", "core.py", 4300)
    assert t[4]["message"] == '  File "core.py", line 701, in run_engine_core'
    # 08:15:03 after 08:15:04 on the same pid: kept, flagged
    assert t[6]["wall_ns"] == T0 + 3 * S and t[6]["flags"] & FLAG_BACKWARDS
    assert not t[7]["flags"] & FLAG_BACKWARDS  # pid 4242's times go forward
    assert t[7]["flags"] & FLAG_NON_UTF8 and "\ufffd" in t[7]["message"]
    assert sum(1 for x in t if x["flags"] & FLAG_NON_UTF8) == 1
    assert all(x["res_ns"] == S for x in t)


def test_plain_file_without_any_format(tmp_path):
    p = tmp_path / "out.txt"
    p.write_text("hello\nworld 2\n")
    r = read_plain(p, ctx())
    assert r.format == "none"
    assert r.table.column("wall_ns").to_pylist() == [-1, -1]
    assert all(f & FLAG_NO_TIMESTAMP for f in r.table.column("flags").to_pylist())


def test_jsonl_fast_path_and_fallback(tmp_path):
    good = tmp_path / "a.jsonl"
    rows = [
        {"ts_ns": T0 + 5 * MS, "node": 0, "pid": 7, "stream": "stderr",
         "text": "(EngineCore_DP0 pid=4300) INFO 11-29 08:15:00 [core.py:87] scheduled 3 reqs"},
        {"ts_ns": T0 + 6 * MS, "node": 0, "pid": 7, "stream": "stdout", "text": "progress 10%"},
    ]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    t = read_jsonl(good, ctx()).table.to_pylist()
    assert [x["wall_ns"] for x in t] == [T0 + 5 * MS, T0 + 6 * MS]
    assert t[0]["pid"] == 4300 and t[1]["pid"] == 7  # the vLLM prefix names the logging process
    assert t[0]["level"] == "INFO" and t[0]["message"] == "scheduled 3 reqs"
    assert t[1]["level"] == "" and t[1]["message"] == "progress 10%"
    assert all(x["flags"] == 0 for x in t) and all(x["res_ns"] == 1 for x in t)

    bad = tmp_path / "b.jsonl"
    bad.write_bytes(
        json.dumps({"ts_ns": T0 + 1, "node": "host-a", "pid": 1, "stream": "stdout", "text": "x"}).encode() + b"\n"
        + b"not json at all\n"
        + b'{"ts_ns": "soon", "pid": 1, "text": "y"}\n'
        + b'{"ts_ns": ' + str(T0 + 3).encode() + b', "pid": 1, "text": "caf\xe9"}\n'
    )
    r = read_jsonl(bad, ctx())
    t = r.table.to_pylist()
    assert len(t) == 4 and [x["file_line"] for x in t] == [1, 2, 3, 4]
    assert t[0]["node"] == -1 and t[0]["flags"] == 0
    assert t[1]["text"] == "not json at all" and t[1]["flags"] & FLAG_BAD_RECORD
    assert t[1]["wall_ns"] == T0 + 1 and t[1]["flags"] & FLAG_NO_TIMESTAMP  # inherited
    assert t[2]["flags"] & FLAG_BAD_RECORD
    assert t[3]["flags"] & FLAG_NON_UTF8 and t[3]["wall_ns"] == T0 + 3


# ------------------------------------------------------------------------------------------
# request ids


def test_extract_ids_in_order_without_repeats():
    lines = pa.array([
        "Added request chatcmpl-abc123-1a2b3c4d.",
        "Finished request cmpl-9f8e, request_id=cmpl-9f8e; also req_3 and req_3__child#1",
        "request id: r-7: nothing else",
        "no ids, just chatcmpl- and req_",
        None,
    ])
    got = extract_ids(lines).to_pylist()
    assert got == [["chatcmpl-abc123-1a2b3c4d"], ["cmpl-9f8e", "req_3", "req_3__child#1"], ["r-7"], [], []]


def test_request_index_normalizes_engine_suffixes():
    idx = RequestIndex(["chatcmpl-abc123", "cmpl-ff-0a1b2c3d", "cmpl-ff-99999999", "req_3"])
    code = idx.code
    assert idx.resolve("chatcmpl-abc123-1a2b3c4d") == [code["chatcmpl-abc123"]]  # internal → external
    assert sorted(idx.resolve("cmpl-ff")) == sorted([code["cmpl-ff-0a1b2c3d"], code["cmpl-ff-99999999"]])
    assert idx.resolve("req_3__child#2") == [code["req_3"]]
    assert idx.resolve("chatcmpl-zzz") == []
    pl, pr, pp = idx.pairs(np.array([0, 2, 2, 3]), pa.array(["chatcmpl-zzz", "req_3", "cmpl-ff"]))
    assert pl.tolist() == [0, 2, 2] and pp.tolist() == [1, 0, 0]
    assert pr.tolist() == [code["req_3"]] + sorted([code["cmpl-ff-0a1b2c3d"], code["cmpl-ff-99999999"]])


# ------------------------------------------------------------------------------------------
# templates


def test_drain3_groups_lines_that_differ_only_in_numbers():
    msgs = pa.array([
        "Avg prompt throughput: 12.5 tokens/s, Running: 3 reqs",
        "Avg prompt throughput: 0.0 tokens/s, Running: 17 reqs",
        "Added request chatcmpl-abc123.",
        "Added request chatcmpl-ff00ee-1a2b3c4d.",
        "Avg prompt throughput: 1e3 tokens/s, Running: 0 reqs",
        "KV cache usage 0x7f00 at 10.0.0.1:8000",
        "KV cache usage 0x7f99 at 10.0.0.2:8001",
        "EngineCore encountered a fatal error.",
    ])
    tid, tmpl = mine_templates(msgs)
    assert tid[0] == tid[1] == tid[4]
    assert tid[2] == tid[3]
    assert tid[5] == tid[6]
    assert len({tid[0], tid[2], tid[5], tid[7]}) == 4
    assert tmpl[0].as_py() == "Avg prompt throughput: <NUM> tokens/s, Running: <NUM> reqs"
    assert tmpl[2].as_py() == "Added request <REQ>."
    assert tmpl[5].as_py() == "KV cache usage <HEX> at <IP>"
    assert tmpl[7].as_py() == "EngineCore encountered a fatal error."


# ------------------------------------------------------------------------------------------
# align_run end to end


def make_run(tmp, t0=T0, steps=True):
    rd = RunDir(tmp / "run")
    clock = {"t0_unix_ns": t0, "utc_offset_s": 0} if t0 is not None else {}
    rd.write_info(RunInfo(source="test", clock=clock, start_wall=T0 / S))
    rd.logs_dir.mkdir(parents=True)
    if steps:
        # rank 0 (pid 4300) and rank 1 (pid 4301): overlapping steps
        rd.write_table(pa.table({
            "step_id": pa.array([10, 11, 12, 13], pa.int64()),
            "step_num": pa.array([0, 0, 1, 1], pa.int64()),
            "rank": pa.array([0, 1, 0, 1], pa.int32()),
            "pid": pa.array([4300, 4301, 4300, 4301], pa.int64()),
            "tid": pa.array([1, 1, 1, 1], pa.int64()),
            "start_ns": pa.array([100 * MS, 101 * MS, 3000 * MS, 3001 * MS], pa.int64()),
            "end_ns": pa.array([200 * MS, 203 * MS, 3100 * MS, 3090 * MS], pa.int64()),
            "name": ["STEP id=0", "STEP id=0", "STEP id=1", "STEP id=1"],
            "n_requests": pa.array([1, 1, 2, 2], pa.int64()),
        }), "steps")
        rd.write_table(pa.table({
            "request_id": ["chatcmpl-abc123", "chatcmpl-abc123", "chatcmpl-abc123", "chatcmpl-abc123", "req_9", "req_9"],
            "step_id": pa.array([10, 11, 12, 13, 12, 13], pa.int64()),
            "rank": pa.array([0, 1, 0, 1, 0, 1], pa.int32()),
            "step_num": pa.array([0, 0, 1, 1, 1, 1], pa.int64()),
        }), "requests")
    rec = [
        (150 * MS, 4300, "(EngineCore_DP0 pid=4300) INFO 11-29 08:15:00 [core.py:87] step took 12.5 ms"),
        (150 * MS, 4301, "worker 1 busy"),
        (205 * MS, 4301, "worker 1 done"),
        (500 * MS, 4300, "idle tick 3"),
        (3050 * MS, 4300, "(EngineCore_DP0 pid=4300) INFO 11-29 08:15:03 [engine.py:123] Added request chatcmpl-abc123-1a2b3c4d."),
        (9000 * MS, 4300, "Finished request req_9"),
    ]
    with open(rd.logs_dir / "engine.jsonl", "w") as f:
        for ts, pid, text in rec:
            f.write(json.dumps({"ts_ns": t0 + ts if t0 else T0 + ts, "node": 0, "pid": pid,
                                "stream": "stdout", "text": text}) + "\n")
    (rd.logs_dir / "api.log").write_text(
        "(APIServer pid=4242) INFO 11-29 08:15:00 [logger.py:43] Received request chatcmpl-abc123: prompt: 'hi'\n"
        "(APIServer pid=4242) INFO 11-29 08:15:07 [launcher.py:12] GET /health 200\n"
        "Traceback (most recent call last):\n"
    )
    return rd


def test_align_run_rules_and_output(tmp_path):
    rd = make_run(tmp_path)
    s = align_run(rd.path)
    t = pq.read_table(rd.artefact("log_alignment.parquet"))
    assert t.schema == ALIGNMENT_SCHEMA
    rows = t.to_pylist()
    by_text = {r["message"]: r for r in rows}
    assert [r["line_no"] for r in rows] == list(range(9))
    assert [r["file"] for r in rows] == ["logs/engine.jsonl"] * 6 + ["logs/api.log"] * 3

    def got(msg):
        r = by_text[msg]
        return r["rule"], r["step_id"], r["request_id"]

    assert got("step took 12.5 ms") == ("time_window", 10, None)  # own pid (rank 0)
    assert got("worker 1 busy") == ("time_window", 11, None)  # same time, other rank
    assert got("worker 1 done") == ("time_window", 11, None)  # 2 ms after step 11 ends: tolerance
    assert got("idle tick 3") == ("unaligned", -1, None)
    # internal id with vLLM's random suffix → external id, on its own rank
    assert got("Added request chatcmpl-abc123-1a2b3c4d.") == ("request_id", 12, "chatcmpl-abc123")
    assert by_text["Added request chatcmpl-abc123-1a2b3c4d."]["request_ids"] == ["chatcmpl-abc123-1a2b3c4d"]
    assert got("Finished request req_9") == ("request_id_nearest", 12, "req_9")
    # second-resolution plain log: 08:15:00 is 100 ms before step 10 (tolerance ≥ 1 s)
    assert got("Received request chatcmpl-abc123: prompt: 'hi'") == ("request_id", 10, "chatcmpl-abc123")
    assert got("GET /health 200") == ("unaligned", -1, None)
    tb = by_text["Traceback (most recent call last):"]
    assert tb["flags"] & FLAG_NO_TIMESTAMP and tb["ts_ns"] == 7 * S and tb["pid"] == 4242
    assert by_text["step took 12.5 ms"]["template"] == "step took <NUM> ms"
    assert by_text["step took 12.5 ms"]["step_num"] == 0
    assert s["lines"] == 9 == sum(s[k] for k in ("request_id", "request_id_nearest", "time_window", "unaligned"))
    assert (s["request_id"], s["request_id_nearest"], s["time_window"], s["unaligned"]) == (2, 1, 3, 3)
    assert s["formats"] == {"logs/engine.jsonl": "vllm", "logs/api.log": "vllm"}
    assert s["files"] == 2 and s["known_requests"] == 2 and s["steps"] == 4
    assert any("no year" in n for n in s["notes"])


def test_logs_an_hour_off_the_trace_are_said_to_disagree(tmp_path):
    """Logs whose clock runs an hour off the trace's align to no step by time; the summary says
    why in words instead of only counting them unaligned (the run's own logs fit: no such note)."""
    s = align_run(make_run(tmp_path).path)
    assert not any("disagree" in n for n in s["notes"])
    rd = make_run(tmp_path / "skewed")
    f = rd.logs_dir / "engine.jsonl"  # the engine's lines an hour late
    recs = [json.loads(x) for x in f.read_text().splitlines()]
    f.write_text("".join(json.dumps({**r, "ts_ns": r["ts_ns"] + 3600 * S}) + "\n" for r in recs))
    s = align_run(rd.path)
    assert s["time_window"] == 0
    note = next(n for n in s["notes"] if "disagree" in n)
    assert "8 of 9 timed log lines" in note and "after it" in note


def test_align_run_tolerance_option(tmp_path):
    rd = make_run(tmp_path)
    s = align_run(rd.path, tolerance_ms=0.5)
    rows = pq.read_table(rd.artefact("log_alignment.parquet")).to_pylist()
    done = next(r for r in rows if r["message"] == "worker 1 done")
    assert done["rule"] == "unaligned"  # 2 ms past the step with 0.5 ms tolerance
    assert s["time_window"] == 2


def test_align_run_without_clock_anchor_aligns_by_request_only(tmp_path):
    rd = make_run(tmp_path, t0=None)
    s = align_run(rd.path)
    rows = pq.read_table(rd.artefact("log_alignment.parquet")).to_pylist()
    assert all(r["ts_ns"] == -1 for r in rows)
    assert all(r["wall_ns"] > 0 for r in rows)
    assert s["time_window"] == 0 and s["request_id"] == 0
    assert s["request_id_nearest"] == 3 and s["unaligned"] == 6
    added = next(r for r in rows if r["message"].startswith("Added request"))
    assert added["step_id"] == 10  # earliest step of the request
    assert any("t0_unix_ns" in n for n in s["notes"])


def test_align_run_without_steps(tmp_path):
    rd = make_run(tmp_path, steps=False)
    s = align_run(rd.path)
    assert s["unaligned"] == s["lines"] == 9
    assert any("steps.parquet" in n for n in s["notes"])


def test_align_run_empty_and_missing(tmp_path):
    rd = RunDir(tmp_path / "empty")
    rd.write_info(RunInfo(source="test"))
    s = align_run(rd.path)
    assert s["lines"] == 0
    assert pq.read_table(rd.artefact("log_alignment.parquet")).num_rows == 0
    from teller.errors import TellerError

    with pytest.raises(TellerError, match="no such run directory"):
        align_run(tmp_path / "nope")


# ------------------------------------------------------------------------------------------
# CLI


def test_cli_logs_command(tmp_path, capsys):
    rd = make_run(tmp_path)
    extra = tmp_path / "custom.log"
    extra.write_text("t=1795940103.060 lvl=WARN msg=preempted req_9\nt=1795940200.000 lvl=INFO msg=bye\n")
    rc = main(["logs", str(rd.path), "--tolerance-ms", "2", "--regex",
               r"^t=(?P<ts>\S+) lvl=(?P<level>\w+) msg=(?P<msg>.*)$", "--time-format", "EPOCH",
               "--file", str(extra)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "logs: 11 lines from 3 files, 4 aligned to a step by the request they name, 3 by time, 4 unaligned" in err
    assert "log_alignment.parquet" in err and "lines=" not in err
    rows = pq.read_table(rd.artefact("log_alignment.parquet")).to_pylist()
    pre = next(r for r in rows if r["message"] == "preempted req_9")
    assert pre["level"] == "WARN" and pre["ts_ns"] == 3060 * MS
    # pid unknown: τ lies in steps 12 (rank 0) and 13 (rank 1); 13 is the shorter one
    assert (pre["rule"], pre["step_id"], pre["request_id"]) == ("request_id", 13, "req_9")
    api = [r for r in rows if r["file"] == "logs/api.log"]
    assert all(r["flags"] & FLAG_NO_TIMESTAMP for r in api)  # the forced format does not fit it
    assert next(r for r in rows if r["message"] == "step took 12.5 ms")["level"] == "INFO"  # JSONL: auto
    assert pre["file"] == str(extra)
    assert main(["logs", str(rd.path), "--format", "nope"]) == 2
    assert "unknown log format" in capsys.readouterr().err
    assert main(["logs", str(rd.path), "--file", str(tmp_path / "missing.log")]) == 2


def test_reconstruct_cli_path_calls_align_run(tmp_path, monkeypatch):
    """`teller reconstruct` aligns logs after reconstruction (reconstruction stubbed here)."""
    import sys
    import types

    rd = make_run(tmp_path)
    stub = types.ModuleType("teller.reconstruct")
    stub.reconstruct = lambda run, step_patterns=None: {"steps": 4}
    monkeypatch.setitem(sys.modules, "teller.reconstruct", stub)
    assert main(["reconstruct", str(rd.path)]) == 0
    assert rd.has_table("log_alignment")
    assert np.asarray(pq.read_table(rd.artefact("log_alignment.parquet")).column("step_id")).max() == 12


# ------------------------------------------------------------------------------------------
# property: the columnar id extraction and resolution equal plain Python over the same rules

_FRAGMENTS = ["chatcmpl-ab12", "chatcmpl-ab12-Zz09Yy87", "cmpl-ff", "req_7", "req_7__child#2",
              "request_id=x-1", "Request ID: chatcmpl-ab12.", " ", ", ", "word", "é", "-", "."]


def _ref_extract(s):
    import re

    from teller.logs.ids import DEFAULT_ID_PATTERNS, combined_pattern

    rx = re.compile(combined_pattern(DEFAULT_ID_PATTERNS), re.ASCII)
    out = []
    for m in rx.finditer(s):
        v = next(g for g in m.groups() if g).rstrip(".:")
        if v and v not in out:
            out.append(v)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_FRAGMENTS), max_size=6).map("".join), max_size=12))
def test_columnar_ids_equal_python_reference(texts):
    got = extract_ids(pa.array(texts, pa.string())).to_pylist()
    assert got == [_ref_extract(s) for s in texts]
    idx = RequestIndex(["chatcmpl-ab12", "req_7", "cmpl-ff-0a1b2c3d", "x-1"])
    from teller.logs.ids import extract_ids_flat

    off, vals = extract_ids_flat(pa.array(texts, pa.string()))
    pl, pr, pp = idx.pairs(off, vals)
    ref = sorted((i, c, k) for i, ids in enumerate(got) for k, rid in enumerate(ids) for c in idx.resolve(rid))
    assert sorted(zip(pl.tolist(), pr.tolist(), pp.tolist(), strict=True)) == ref


# ------------------------------------------------------------------------------------------
# property: readers never crash and never lose a line, whatever the bytes

_LINE_PARTS = [b"INFO 11-29 08:15:02 [core.py:1] ok", b"(EngineCore_DP0 pid=7) ", b"13-45 99:99:99 ",
               b"2026-11-29 08:15:02,123 - a - INFO - m", b'{"ts_ns": 5, "text": "x"}', b'{"ts_ns": "x"',
               b"\xff\xfe", b"\x1b[1;36m", b"\r", b"  ", b"\t", b"req_1", b"{", b"}", b"[]", b"null"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_LINE_PARTS), max_size=4).map(b"".join), max_size=10),
       st.booleans())
def test_readers_never_crash_and_keep_every_line(tmp_path_factory, lines, trailing_newline):
    d = tmp_path_factory.mktemp("r")
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    n_lines = len(data.split(b"\n")) - (1 if data.endswith(b"\n") else 0) if data else 0
    for name, reader in (("x.log", read_plain), ("x.jsonl", read_jsonl)):
        p = d / name
        p.write_bytes(data)
        r = reader(p, ctx())
        assert r.table.num_rows + r.blank == n_lines
        lines_no = r.table.column("file_line").to_pylist()
        assert lines_no == sorted(set(lines_no)) and all(1 <= x <= n_lines for x in lines_no)
