"""Damaged recorded runs through `reconstruct` and `stats`: right answers or one clear error.

The families of ``damage.RECORDED_DAMAGE`` applied to a copy of the bundled recording
(``examples/h200_faulty_op_delay``): runs without a host side, nulls in ``start_ns``, a copied
chunk, corrupt pages behind an intact footer, missing columns, a missing ``events/`` and one
thread's clock an hour off. Each case runs under a time bound (``bounded``): a hang fails.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import damage
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fuzz_readers import bounded, one_line_naming

from teller.cli import main
from teller.errors import TellerError
from teller.inspect.stats import collect_stats
from teller.logs import align_run
from teller.reconstruct import reconstruct
from teller.rundir import FLAG_CLOCK_REPAIRED


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict, dict]:
    run = damage.recorded_copy(tmp_path_factory.mktemp("ref") / "run")
    with bounded():
        s = reconstruct(run)
        logs = align_run(run)
    return run, s, logs


def _reconciles(s: dict) -> None:
    assert s["reconciled"], s
    assert s["events_in"] == s["nodes"] - s["gap_nodes"] + s["pops_consumed"] + s["repaired_pops_without_push"]


@pytest.mark.parametrize("family", sorted(damage.RECORDED_DAMAGE))
def test_damaged_recorded_runs(tmp_path, family, reference, capsys):
    ref_run, ref, _ = reference
    run = damage.recorded_copy(tmp_path / "run")
    planted = damage.RECORDED_DAMAGE[family](run, random.Random(family))
    try:
        with bounded(what=family):
            s = reconstruct(run)
    except TellerError as e:
        assert planted["expect"] in ("error", "error_or_same"), f"{family}: {e}"
        target = run / "events" / planted["file"] if planted.get("file") not in (None, "events") else run / "events"
        one_line_naming(e, target)
        assert planted["words"] in str(e)
        assert main(["reconstruct", str(run)]) == 2  # the command says the same in one line
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("teller: error:") and str(target) in err[0]
        return
    assert planted["expect"] not in ("error",), f"{family}: exit 0 on input that must be refused"
    _reconciles(s)
    with bounded(what=f"{family} stats"):
        st_ = collect_stats(run)
    assert st_["events"] == s["events_in"]
    if planted["expect"] in ("same", "error_or_same"):
        for k in ("events_in", "nodes", "steps", "max_depth", "binding_coverage", "requests"):
            assert s[k] == ref[k], (k, s[k], ref[k])
    elif planted["expect"] == "copies":
        assert s["dropped_copied_events"] == planted["planted"]
        assert s["events_in"] == ref["events_in"] and s["steps"] == ref["steps"]  # steps do not double
        assert any("(copy).parquet holds exactly the events of" in w for w in s["warnings"])  # the copy goes
        assert any("copied events files were left out" in line for line in st_["health"]["lines"])
    elif planted["expect"] == "no_host":
        assert s["gpu_bound"] == 0 and s["unbound"] == s["gpu_activity"] > 0
        assert s["events_in"] == planted.get("events", s["events_in"])
    elif planted["expect"] == "unbound_all":
        assert s["gpu_bound"] == 0 and s["steps"] == ref["steps"]
    elif planted["expect"] == "skew_repaired":
        c = s["clocks"]
        assert c["threads_repaired"] == 1 and c["after_repair_gpu_before_launch"] == 0
        assert c["threads_before_launch"][0]["thread"] == planted["thread"]
        assert abs(c["threads_before_launch"][0]["offset_ns"] + damage.HOUR_NS) < 50_000
        assert s["binding_coverage"] == ref["binding_coverage"] and s["steps"] == ref["steps"]
    else:
        raise AssertionError(f"unknown expectation {planted}")


def test_thread_an_hour_off_is_reported_and_repaired(tmp_path, reference, capsys):
    """The issue's case: before the repair, 9,565 of 9,719 kernels started before their launch
    and log alignment fell to 0 requests without a word."""
    ref_run, ref, ref_logs = reference
    run = damage.recorded_copy(tmp_path / "run")
    damage.r_thread_shift(run, random.Random(0))
    with bounded():
        assert main(["reconstruct", str(run)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "clock skew:" in err and "pid 471 thread 537" in err and "1 h ahead of the GPU's" in err
    s = json.loads((run / "reconstruct.json").read_text())
    c = s["clocks"]
    assert c["gpu_before_launch"] > 0.9 * c["launch_pairs"]
    assert [t["thread"] for t in c["threads_outside_run"]] == ["pid 471 thread 537"]
    assert c["after_repair_threads_outside_run"] == 0
    # after the repair: the binding, the steps and the log alignment of the unshifted run
    assert s["binding_coverage"] == ref["binding_coverage"]
    a, b = pq.read_table(ref_run / "steps.parquet"), pq.read_table(run / "steps.parquet")
    assert np.abs(np.asarray(a["start_ns"]) - np.asarray(b["start_ns"])).max() < 50_000
    la, lb = pq.read_table(ref_run / "log_alignment.parquet"), pq.read_table(run / "log_alignment.parquet")
    assert la.column("rule").to_pylist() == lb.column("rule").to_pylist()
    assert la.column("step_num").to_pylist() == lb.column("step_num").to_pylist()
    f = pq.read_table(run / "forest.parquet", columns=["tid", "flags"])
    repaired = (np.asarray(f["flags"]) & FLAG_CLOCK_REPAIRED) != 0
    assert repaired.any() and set(np.asarray(f["tid"])[repaired].tolist()) == {537}
    assert main(["stats", str(run)]) == 0
    assert "clock_repaired" in " ".join(capsys.readouterr().out.split())


def test_unshifted_runs_report_no_skew(reference):
    _, ref, _ = reference
    c = ref["clocks"]
    assert c["gpu_before_launch"] == 0 and c["threads_repaired"] == 0 and not c["threads_outside_run"]
    assert ref["flags"]["clock_repaired"] == 0 and ref["warnings"] == []


@settings(max_examples=6, deadline=None)
@given(shift_ms=st.sampled_from([-7_200_000, -30_000, -5, 20, 300, 90_000, 3_600_000]),
       tid=st.sampled_from([471, 537]))
def test_any_thread_shift_is_repaired_or_left_alone_correctly(shift_ms, tid):
    """A thread moved later by more than its launch latency is found and moved back (steps
    within 50 µs of the unshifted run); moved earlier, no kernel starts before its launch and
    nothing is touched."""
    with tempfile.TemporaryDirectory() as tmp:
        ref = damage.recorded_copy(Path(tmp) / "ref")
        run = damage.recorded_copy(Path(tmp) / "run")
        shift = shift_ms * 1_000_000

        def fn(t):
            m = pc.equal(t["tid"], tid)
            for c in ("start_ns", "end_ns"):
                t = t.set_column(t.schema.get_field_index(c), c, pc.if_else(m, pc.add(t[c], shift), t[c]))
            return t

        damage._rewrite(run, fn)
        with bounded():
            s0, s = reconstruct(ref), reconstruct(run)
        c = s["clocks"]
        if shift < 0:
            assert c["gpu_before_launch"] == 0 and c["threads_repaired"] == 0
            return
        assert c["threads_repaired"] == 1 and c["after_repair_gpu_before_launch"] == 0
        assert abs(c["threads_before_launch"][0]["offset_ns"] + shift) < 50_000
        a, b = pq.read_table(ref / "steps.parquet"), pq.read_table(run / "steps.parquet")
        assert s["steps"] == s0["steps"]
        assert np.abs(np.asarray(a["start_ns"]) - np.asarray(b["start_ns"])).max() < 50_000


def test_event_level_copies_across_files_are_not_merged(tmp_path):
    """Only whole-file copies are dropped: a file holding part of another's rows is kept (its
    rows are real events as far as anything can tell) and counted."""
    run = damage.recorded_copy(tmp_path / "run")
    f = max(damage._chunks(run), key=lambda c: c.stat().st_size)
    t = pq.read_table(f)
    pq.write_table(t.slice(0, 100), f.with_name("extra.parquet"))
    s = reconstruct(run)
    assert s["dropped_copied_events"] == 0 and s["events_in"] == sum(
        pq.ParquetFile(c).metadata.num_rows for c in damage._chunks(run))
    shutil.rmtree(run)


def test_foreign_traces_without_host_events_reconstruct(tmp_path):
    """A Kineto file of kernels only, one kernel, an Nsight export whose RUNTIME table is empty:
    GPU rows become unbound roots (was an IndexError in the preorder)."""
    from test_fuzz_readers import _write_export

    from teller.ingest import ingest

    kern = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": 1000 + 10 * i, "dur": 5,
             "args": {"device": 0, "stream": 7, "correlation": i}} for i in range(30)]
    cases = []
    for n in (30, 1):
        f = tmp_path / f"kernels{n}.json"
        f.write_text(json.dumps({"traceEvents": kern[:n]}))
        cases.append((f, n))
    f = tmp_path / "no_runtime.sqlite"
    _write_export(f, 8, {}, {"CUPTI_ACTIVITY_KIND_RUNTIME"}, None)
    cases.append((f, 8))
    for src, n in cases:
        run = tmp_path / f"run_{src.stem}"
        with bounded(what=src.name):
            ingest(src, run)
            s = reconstruct(run)
        _reconciles(s)
        assert s["events_in"] == s["gpu_activity"] == s["unbound"] == n and s["gpu_bound"] == 0
        assert s["steps"] >= 1 and s["iterations"]["count"] == s["steps"]
