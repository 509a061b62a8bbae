"""Kineto / PyTorch-profiler reader: real traces, synthetic edge cases, damaged input, CLI."""

from __future__ import annotations

import gzip
import json
import tempfile
from collections import Counter
from decimal import Decimal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teller.cli import main
from teller.errors import InputError, TellerError
from teller.ingest import ingest
from teller.ingest.kineto import ingest_kineto, load_layer_rules, parse_kineto_file, read_kineto
from teller.rundir import FLAG_DUPLICATE, FLAG_REPAIRED, FLAG_UNBOUND, RunDir

DATA = Path(__file__).parent / "data" / "external" / "kineto"
FILES = sorted(DATA.glob("*.json*"))
IDS = [f.name.split(".")[0] for f in FILES]
GPU_KINDS = {"KERNEL", "MEMCPY", "MEMSET", "SYNC"}


def load_doc(path: Path, **kw) -> dict:
    raw = gzip.open(path).read() if path.name.endswith(".gz") else path.read_bytes()
    return json.loads(raw, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, RunDir]]:
    """Every external file ingested once through the public dispatcher."""
    out = {}
    for f in FILES:
        d = tmp_path_factory.mktemp(f.name.split(".")[0])
        out[f.name] = (ingest(f, d), RunDir(d))
    return out


def events(runs, name: str) -> dict[str, list]:
    return runs[name][1].read_events().to_pydict()


# --------------------------------------------------------------------------------------------
# real traces


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_every_external_file_ingests_with_reconciled_counts(runs, path):
    summary, rd = runs[path.name]
    t = rd.read_events()
    info = rd.read_info()
    assert summary["events_in"] == summary["events_out"] + summary["skipped"]
    assert sum(summary["in_by_category"].values()) == summary["events_in"]
    assert sum(summary["out_by_kind"].values()) == summary["events_out"] == t.num_rows > 0
    assert sum(summary["skipped_by_reason"].values()) == summary["skipped"]
    assert info.counts["events_out"] == t.num_rows
    # metadata and flows are the only things skipped in these (undamaged) files
    assert set(summary["skipped_by_reason"]) <= {"metadata", "flow"}
    n_meta = sum(1 for e in load_doc(path)["traceEvents"] if e.get("ph") == "M")
    assert summary["skipped_by_reason"].get("metadata", 0) == n_meta
    assert summary["repaired"] == 0 and not summary["warnings"]

    assert (
        t.schema.field("start_ns").type == pa.int64()
        and t.schema.field("end_ns").type == pa.int64()
    )
    start, end = np.asarray(t["start_ns"]), np.asarray(t["end_ns"])
    assert start.min() == 0 and (end >= start).all()
    assert (np.diff(start) >= 0).all()  # sorted by time
    d = t.to_pydict()
    for kind, tid, dev, stream, pid in zip(
        d["kind"], d["tid"], d["device"], d["stream"], d["pid"], strict=True
    ):
        if kind in GPU_KINDS:
            assert (
                tid == -1 and dev >= 0 and stream >= 0 and pid > 100
            )  # pid = a host process, not the device
    assert info.clock["t0_unix_ns"] is None or info.clock["t0_unix_ns"] > 10**18
    assert info.ranks and info.ranks[0]["pid"] > 0
    assert info.collector["reader"] == "kineto"


def test_h200_transformers_counts_match_the_trace(runs):
    s, _ = runs["h200_transformers_cb_llama4l.json.gz"]
    assert s["out_by_kind"]["RUNTIME"] == 3555
    assert s["out_by_kind"]["DRIVER"] == 408
    assert s["out_by_kind"]["KERNEL"] == 3067
    assert s["out_by_kind"]["MEMCPY"] == 311 and s["out_by_kind"]["MEMSET"] == 48
    assert s["in_by_category"]["cpu_op"] == 120
    d = events(runs, "h200_transformers_cb_llama4l.json.gz")
    # every kernel binds by correlation id to a runtime or driver call of the same process
    host = {
        (p, c)
        for k, p, c in zip(d["kind"], d["pid"], d["corr_id"], strict=True)
        if k in ("RUNTIME", "DRIVER")
    }
    kern = [
        (p, c) for k, p, c in zip(d["kind"], d["pid"], d["corr_id"], strict=True) if k == "KERNEL"
    ]
    assert all(x in host for x in kern)
    # binding is reconstruction's: ingest flags none, reconstruct binds every one of them
    assert not any(f & FLAG_UNBOUND for f in d["flags"]) and "unbound" not in s["flagged"]
    from teller.reconstruct import reconstruct

    r = reconstruct(runs["h200_transformers_cb_llama4l.json.gz"][1].path)
    assert r["gpu_activity"] == 3067 + 311 + 48 and r["gpu_bound"] == r["gpu_activity"] and r["unbound"] == 0


def test_nccl_kernels_are_comm_with_collective_args_and_bytes(runs):
    d = events(runs, "hta_nccl_data_rank0.json.gz")
    comm_k = [
        i
        for i, (k, n) in enumerate(zip(d["kind"], d["name"], strict=True))
        if k == "KERNEL" and n.startswith("ncclKernel")
    ]
    assert len(comm_k) == 21
    with_args = 0
    for i in comm_k:
        assert d["layer"][i] == "COMM"
        a = json.loads(d["args"][i])
        assert a["cat"] == "kernel"
        if "Collective name" in a:
            with_args += 1
            assert a["Process Group Name"] == "0" and a["Group size"] == 2
            assert (
                d["bytes"][i]
                == max(a["In msg nelems"], a["Out msg nelems"])
                * {"Float": 4, "Long": 8}[a["dtype"]]
            )
    assert with_args == 21
    layers = Counter(
        (k, tag, n)
        for k, tag, n in zip(d["kind"], d["layer"], d["name"], strict=True)
        if tag == "COMM" and k == "RANGE"
    )
    assert layers[("RANGE", "COMM", "record_param_comms")] == 27
    assert layers[("RANGE", "COMM", "c10d::allreduce_")] == 15
    assert layers[("RANGE", "COMM", "nccl:all_reduce")] == 15
    assert (
        Counter(tag for k, tag in zip(d["kind"], d["layer"], strict=True) if k == "RANGE")["STEP"]
        >= 1
    )
    # aten ops are BE, runtime calls keep an empty tag (reconstruction decides from the kind)
    assert all(
        tag == "BE" for n, tag in zip(d["name"], d["layer"], strict=True) if n.startswith("aten::")
    )
    assert all(tag == "" for k, tag in zip(d["kind"], d["layer"], strict=True) if k == "RUNTIME")


def test_amd_hip_calls_are_runtime_rows_bound_to_kernels(runs):
    d = events(runs, "hta_amd_mi250.json.gz")
    rt = {
        c: (p, n)
        for k, c, p, n in zip(d["kind"], d["corr_id"], d["pid"], d["name"], strict=True)
        if k == "RUNTIME"
    }
    assert rt and all(n.startswith("hip") for _, n in rt.values())
    gpu = [
        (c, p, dev)
        for k, c, p, dev in zip(d["kind"], d["corr_id"], d["pid"], d["device"], strict=True)
        if k in ("KERNEL", "MEMCPY")
    ]
    assert len(gpu) == 16
    for c, p, dev in gpu:
        assert c in rt and rt[c][0] == p == 597913 and dev == 2


def test_2022_format_kernels_runtime_and_external_id(runs):
    s, rd = runs["hta_inference_rank1_2022format.json.gz"]
    assert s["out_by_kind"]["KERNEL"] == 4 and s["out_by_kind"]["RUNTIME"] == 8
    d = events(runs, "hta_inference_rank1_2022format.json.gz")
    for k, a in zip(d["kind"], d["args"], strict=True):
        if k in ("KERNEL", "RUNTIME"):
            a = json.loads(a)
            assert "External id" in a and "external id" not in a
    assert set(d["rank"]) == {1}  # from distributedInfo
    assert rd.read_info().clock["per_file"][0]["source"] == "ts_unix_us"


def test_cpu_only_trace_has_no_gpu_rows(runs):
    d = events(runs, "hta_cpu_only.json.gz")
    assert set(d["device"]) == {-1} and not GPU_KINDS & set(d["kind"])
    tags = Counter((n, tag) for n, tag in zip(d["name"], d["layer"], strict=True))
    assert tags[("gloo:all_reduce", "COMM")] == 10
    assert tags[("ProfilerStep#551", "STEP")] == 1
    assert set(d["rank"]) == {34}


def test_ns_resolution_keeps_nanoseconds(runs):
    """ts 1712195495406752.797 µs: float64 would round to 0.25 µs; the reader keeps every ns."""
    path = DATA / "hta_ns_resolution_rank0.json.gz"
    doc = load_doc(path, parse_float=Decimal)
    assert doc["displayTimeUnit"] == "ns" and "baseTimeNanoseconds" not in doc
    timed = [e for e in doc["traceEvents"] if e.get("ph") in ("X", "i")]
    t0 = min(int(e["ts"] * 1000) for e in timed)
    want = Counter(int(e["ts"] * 1000) - t0 for e in timed if e.get("cat") == "cpu_op")
    d = events(runs, path.name)
    got = Counter(
        s for s, a in zip(d["start_ns"], d["args"], strict=True) if json.loads(a)["cat"] == "cpu_op"
    )
    assert got == want
    assert any(s % 1000 not in (0, 250, 500, 750) for s in got)
    assert runs[path.name][1].read_info().clock["t0_unix_ns"] == t0 == 1712195495406752797


def test_current_format_uses_base_time(runs):
    path = DATA / "h200_torch211_matmul.json.gz"
    doc = load_doc(path)
    first = min(e["ts"] for e in doc["traceEvents"] if e.get("ph") in ("X", "i"))
    t0 = runs[path.name][1].read_info().clock["t0_unix_ns"]
    assert abs(t0 - (round(first * 1000) + doc["baseTimeNanoseconds"])) <= 1
    d = events(runs, path.name)
    assert Counter(d["kind"])["MARKER"] == 2  # the profiler's instant events


def test_runtime_names_lose_version_suffix_only_for_api_calls(tmp_path):
    f = write_trace(
        tmp_path / "t.json",
        [
            x("cuda_runtime", "cudaLaunchKernel_v7000", 10, 5, corr=1),
            x("kernel", "my_kernel_v2", 20, 3, pid=0, tid=7, corr=1, device=0, stream=7),
            x("cuda_driver", "cuLaunchKernel_v2", 30, 1, corr=2),
        ],
    )
    d = read_kineto(f).to_pydict()
    assert sorted(d["name"]) == ["cuLaunchKernel", "cudaLaunchKernel", "my_kernel_v2"]


def test_chunked_parse_equals_whole_parse():
    path = DATA / "hta_alexnet.json.gz"
    a = read_kineto(path)
    b = read_kineto(path, chunk_bytes=512)
    assert a.replace_schema_metadata(None).equals(b.replace_schema_metadata(None))


def test_split_inside_nested_values_is_not_damage(tmp_path):
    """`},{` inside args (a list of dicts) is a false boundary; the reader must merge and go on."""
    evs = [
        x("cpu_op", f"op{i}", i * 10, 5, args={"shapes": [{"a": i}, {"b": i}, {"c": "},{"}]})
        for i in range(60)
    ]
    f = write_trace(tmp_path / "nested.json", evs)
    pf = parse_kineto_file(f, chunk_bytes=40)
    assert pf.table.num_rows == 60 and not pf.damage
    assert json.loads(pf.table["args"][0].as_py())["shapes"][2] == {"c": "},{"}


# --------------------------------------------------------------------------------------------
# synthetic traces


def x(cat, name, ts, dur, pid=100, tid=100, corr=None, device=None, stream=None, args=None, ph="X"):
    a = dict(args or {})
    if corr is not None:
        a["correlation"] = corr
    if device is not None:
        a["device"], a["stream"] = device, stream
    e = {"ph": ph, "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts}
    if dur is not None:
        e["dur"] = dur
    if a:
        e["args"] = a
    return e


def write_trace(path: Path, evs: list, **top) -> Path:
    doc = {"schemaVersion": 1, **top, "traceEvents": evs}
    text = json.dumps(doc, indent=1)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_repairs_flags_and_skips_are_counted(tmp_path):
    evs = [
        x("cpu_op", "aten::mm", 50, 10),
        x("cpu_op", "aten::neg", 40, -3),  # negative duration
        x("cpu_op", "aten::nodur", 45, None),  # missing duration
        x("cuda_runtime", "cudaLaunchKernel", 60, 2, corr=7),
        x("cuda_runtime", "cudaLaunchKernel", 62, 2, corr=7),  # duplicate correlation id
        x("kernel", "k_bound", 70, 5, pid=0, tid=7, corr=7, device=0, stream=7),
        x("kernel", "k_orphan", 80, 5, pid=0, tid=7, corr=99, device=0, stream=7),
        x("gpu_user_annotation", "region", 70, 20, pid=0, tid=7),
        {"ph": "i", "name": "mark", "pid": 100, "tid": 100, "ts": 30, "s": "t"},
        {"ph": "B", "name": "push", "pid": 100, "tid": 101, "ts": 10},
        {"ph": "E", "pid": 100, "tid": 101, "ts": 90},
        {"ph": "X", "cat": "cpu_op", "name": "no_ts", "pid": 100, "tid": 100, "dur": 1},
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 100, "args": {"name": "main"}},
        {"ph": "s", "cat": "ac2g", "id": 7, "pid": 100, "tid": 100, "ts": 60},
        {"ph": "f", "cat": "ac2g", "id": 99, "pid": 100, "tid": 100, "ts": 80, "bp": "e"},
        {"ph": "C", "name": "mem", "pid": 100, "ts": 5, "args": {"v": 1}},
        {"ph": "b", "cat": "async", "name": "a", "id": 1, "pid": 100, "ts": 5},
        42,
        x("Trace", "PyTorch Profiler (0)", 0, 100, pid="Spans", tid="PyTorch Profiler"),
    ]
    f = write_trace(
        tmp_path / "t.json", evs, baseTimeNanoseconds=1_700_000_000_000_000_000, schemaVersion=99
    )
    s = ingest_kineto(f, tmp_path / "run")
    assert s["events_in"] == len(evs) == s["events_out"] + s["skipped"]
    assert s["skipped_by_reason"] == {
        "bad_timestamp": 1,
        "counter": 1,
        "flow": 2,
        "malformed": 1,
        "metadata": 1,
        "phase_b": 1,
    }
    assert s["repaired_by_reason"] == {
        "duplicate_corr_id": 1,
        "missing_duration": 1,
        "negative_duration": 1,
    }
    assert any("schemaVersion 99" in w for w in s["warnings"])
    d = RunDir(tmp_path / "run").read_events().to_pydict()
    row = {n: i for i, n in enumerate(d["name"]) if n}
    assert (
        d["end_ns"][row["aten::neg"]] == d["start_ns"][row["aten::neg"]]
        and d["flags"][row["aten::neg"]] & FLAG_REPAIRED
    )
    assert d["flags"][row["aten::nodur"]] & FLAG_REPAIRED
    launches = [i for i, n in enumerate(d["name"]) if n == "cudaLaunchKernel"]
    assert [bool(d["flags"][i] & FLAG_DUPLICATE) for i in launches] == [
        False,
        True,
    ]  # the later one
    # GPU rows take the file's process; which call launched them is reconstruction's to decide
    assert d["pid"][row["k_orphan"]] == d["pid"][row["k_bound"]] == d["pid"][row["region"]] == 100
    assert not any(f & FLAG_UNBOUND for f in d["flags"]) and "unbound" not in s["flagged"]
    from teller.reconstruct import reconstruct

    r = reconstruct(tmp_path / "run")
    f = RunDir(tmp_path / "run").read_table("forest").to_pydict()
    node = {n: i for i, n in enumerate(f["name"])}
    assert f["flags"][node["k_orphan"]] & FLAG_UNBOUND and f["parent_id"][node["k_orphan"]] == -1
    assert not f["flags"][node["k_bound"]] & FLAG_UNBOUND
    assert f["name"][f["parent_id"][node["k_bound"]]] == "cudaLaunchKernel"
    assert (r["gpu_activity"], r["gpu_bound"], r["unbound"]) == (2, 1, 1)
    assert (
        d["device"][row["region"]] == 0
        and d["stream"][row["region"]] == 7
        and d["tid"][row["region"]] == -1
    )
    assert d["kind"][row["mark"]] == "MARKER" and d["kind"][row["push"]] == "NVTX_PUSH"
    assert Counter(d["kind"])["NVTX_POP"] == 1
    prof = row["PyTorch Profiler (0)"]
    assert d["pid"][prof] == -1 and json.loads(d["args"][prof])["pid"] == "Spans"
    assert d["start_ns"] == sorted(d["start_ns"]) and d["start_ns"][0] == 0
    info = RunDir(tmp_path / "run").read_info()
    assert info.clock["t0_unix_ns"] == 1_700_000_000_000_000_000
    assert info.extra["kineto"][0]["threads"] == [{"pid": 100, "tid": 100, "name": "main"}]


def test_folder_of_ranks_shares_one_time_base(tmp_path):
    src = tmp_path / "traces"
    src.mkdir()
    base = 1_700_000_000_000_000_000
    # rank from distributedInfo (file b) and from the file name (file a); clocks 1 ms apart
    write_trace(
        src / "worker_rank3.json", [x("cpu_op", "aten::a", 100.0, 5.0)], baseTimeNanoseconds=base
    )
    write_trace(
        src / "b.json.gz",
        [x("cpu_op", "aten::b", 100.5, 5.0, pid=200, tid=200)],
        baseTimeNanoseconds=base + 1_000_000,
        distributedInfo={"rank": 1},
    )
    s = ingest(src, tmp_path / "run")
    assert s["files"] == 2 and s["ranks"] == 2
    d = RunDir(tmp_path / "run").read_events().to_pydict()
    by_name = {n: (r, st) for n, r, st in zip(d["name"], d["rank"], d["start_ns"], strict=True)}
    assert by_name["aten::a"] == (3, 0)
    assert by_name["aten::b"] == (1, 1_000_500)
    info = RunDir(tmp_path / "run").read_info()
    assert info.clock["t0_unix_ns"] == base + 100_000
    assert sorted((r["rank"], r["pid"]) for r in info.ranks) == [(1, 200), (3, 100)]


def test_reingest_replaces_events_but_recorded_run_is_protected(tmp_path):
    f = write_trace(tmp_path / "t.json", [x("cpu_op", "aten::a", 1, 1)])
    ingest(f, tmp_path / "run")
    ingest(f, tmp_path / "run")
    assert RunDir(tmp_path / "run").read_events().num_rows == 1
    rec = RunDir(tmp_path / "rec")
    rec.write_events(read_kineto(f), name="recorded")
    with pytest.raises(TellerError, match="not written by `teller ingest`"):
        ingest(f, tmp_path / "rec")


def test_layer_rules_are_validated(tmp_path):
    bad = tmp_path / "rules.toml"
    bad.write_text('[[rule]]\ncategory = "cpu_op"\nname = "x"\nlayer = "NOPE"\n')
    with pytest.raises(TellerError, match="rule 1"):
        load_layer_rules(bad)
    good = tmp_path / "good.toml"
    good.write_text('[[rule]]\ncategory = "^cpu_op$"\nname = "^my::"\nlayer = "FE"\n')
    f = write_trace(
        tmp_path / "t.json", [x("cpu_op", "my::op", 1, 1), x("cpu_op", "aten::mm", 2, 1)]
    )
    d = read_kineto(f, layer_rules=good).to_pydict()
    assert dict(zip(d["name"], d["layer"], strict=True)) == {"my::op": "FE", "aten::mm": ""}


# --------------------------------------------------------------------------------------------
# damaged input


def kineto_text(n: int = 30) -> tuple[str, list[int]]:
    """A Kineto-like document and the offset just past each event's closing brace."""
    evs = [
        x(
            "cpu_op",
            f"ev{i}",
            1000 + i,
            1.5,
            args={"Input Dims": [[i, 2]], "nested": [{"a": i}, {"b": "},{"}]},
        )
        for i in range(n)
    ]
    head = '{\n  "schemaVersion": 1,\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n'
    parts, ends, pos = [], [], len(head)
    for i, e in enumerate(evs):
        s = "  " + json.dumps(e) + (",\n" if i < n - 1 else "\n")
        parts.append(s)
        ends.append(pos + 2 + len(json.dumps(e)))
        pos += len(s)
    return head + "".join(parts) + '  ],\n  "traceName": "t.json"\n}\n', ends


TEXT, ENDS = kineto_text()
FULL_NAMES = [f"ev{i}" for i in range(len(ENDS))]


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(0, len(TEXT)), chunk=st.sampled_from([48, 300, 1 << 20]))
def test_truncated_json_salvages_exactly_the_complete_prefix(cut, chunk):
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "cut.json"
        f.write_text(TEXT[:cut])
        expect = sum(1 for e in ENDS if e <= cut)
        try:
            pf = parse_kineto_file(f, chunk_bytes=chunk)
        except InputError as e:
            assert expect == 0 and str(f) in str(e)
            return
        names = sorted(pf.table["name"].to_pylist(), key=lambda s: int(s[2:]))
        assert names == FULL_NAMES[:expect]
        flags = np.asarray(pf.table["flags"])
        if cut < len(TEXT.rstrip()):
            assert pf.damage and (flags & FLAG_REPAIRED).all()
            assert pf.stats.repaired["salvaged_from_damaged_file"] == expect
        else:
            assert not pf.damage and not (flags & FLAG_REPAIRED).any()


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(1, len(gzip.compress(TEXT.encode())) - 1))
def test_truncated_gzip_salvages_a_prefix(cut):
    data = gzip.compress(TEXT.encode())[:cut]
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "cut.json.gz"
        f.write_bytes(data)
        try:
            pf = parse_kineto_file(f)
        except InputError as e:
            assert "cut.json.gz" in str(e)
            return
        names = sorted(pf.table["name"].to_pylist(), key=lambda s: int(s[2:]))
        assert names == FULL_NAMES[: len(names)]
        assert any("gzip" in d for d in pf.damage)


@settings(max_examples=150, deadline=None)
@given(
    data=st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(str.encode),
        st.builds(
            lambda a, b: a + b,
            st.sampled_from([b"{", b"[", b'{"traceEvents": [', b"\x1f\x8b"]),
            st.binary(max_size=100),
        ),
    )
)
def test_garbage_never_crashes_with_anything_but_input_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "junk.json"
        f.write_bytes(data)
        try:
            s = ingest_kineto(f, Path(tmp) / "run")
        except InputError as e:
            assert "junk.json" in str(e)
            return
        assert s["events_in"] == s["events_out"] + s["skipped"]


def test_corrupt_middle_is_skipped_and_reading_resumes(tmp_path):
    i = TEXT.index('"name": "ev10"')
    f = tmp_path / "mid.json"
    f.write_text(TEXT[:i] + "\x00garbage{{{" + TEXT[i + 5 :])
    pf = parse_kineto_file(f, chunk_bytes=200)
    names = set(pf.table["name"].to_pylist())
    assert "ev10" not in names and {"ev0", "ev9", "ev11", "ev29"} <= names
    assert any("skipped" in d for d in pf.damage)


def test_corrupt_gzip_keeps_what_decompresses(tmp_path):
    data = bytearray(gzip.compress(TEXT.encode() * 1))
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    f = tmp_path / "bad.json.gz"
    f.write_bytes(bytes(data))
    try:
        pf = parse_kineto_file(f)
    except InputError:
        return  # the damage hit before the first event: acceptable, and named
    assert pf.table.num_rows < len(FULL_NAMES) and pf.damage


@pytest.mark.parametrize(
    "content, what",
    [
        (b"", "empty file"),
        (b"   \n", "only whitespace"),
        (b"hello world", "not JSON"),
        (b'{"foo": 1}', "without a 'traceEvents' array"),
        (b'{"schemaVersion": 1, "deviceProperties": [{"id": 0, "na', "before any traceEvents"),
        (b'{"traceEvents": []}', "traceEvents is empty"),
        (b'{"traceEvents": [{"ph": "X", "na', "no complete trace event"),
    ],
)
def test_unreadable_files_raise_input_error_naming_the_file(tmp_path, content, what):
    f = tmp_path / "bad.json"
    f.write_bytes(content)
    with pytest.raises(InputError, match=what) as ei:
        ingest(f, tmp_path / "run")
    assert str(f) in str(ei.value)


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_ingest_ok_and_bad_file(tmp_path, capsys):
    assert (
        main(["ingest", str(DATA / "hta_triton_example.json.gz"), "-o", str(tmp_path / "run")]) == 0
    )
    assert RunDir(tmp_path / "run").read_events().num_rows == 10
    bad = tmp_path / "broken.json"
    bad.write_text("{ not json")
    capsys.readouterr()
    assert main(["ingest", str(bad), "-o", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and err.startswith("teller: error:")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.integers(-(2**63), 2**63 - 1),
            st.integers(-(2**70), 2**70),
            st.sampled_from(["Spans", "PyTorch Profiler", "stream 7", "", "-3x", "12"]),
            st.text(max_size=6),
        ),
        max_size=40,
    ),
    st.sampled_from([-1, 0, -(2**62)]),
)
def test_int_column_of_ints_and_labels_reads_value_by_value(vals, fill):
    """The int columns (pid, tid, args fields) read a list of ints with a few string labels in
    C loops; the result is the value-by-value reading: each int as is (beyond int64: its
    fallback), each label its first integer or ``fill``, the labels marked."""
    from teller.ingest.kineto import _int_array, _to_int

    got, odd = _int_array(vals, fill)
    want = [
        v if type(v) is int and -(2**63) <= v < 2**63 else _to_int(v) if v is not None else None
        for v in vals
    ]
    assert got.tolist() == [fill if w is None else w for w in want]
    want_odd = [v is not None and type(v) is not int for v in vals]
    if odd is None:
        assert not any(want_odd) and all(v is None or -(2**63) <= v < 2**63 for v in vals)
    else:
        assert odd.tolist() == want_odd
