"""The profiler BE backend: aten ops from torch.profiler's C++ callbacks, converted onto τ."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from teller.record import ranges, runtime  # noqa: E402
from teller.record.instrument import torch_profiler_ops as tpo  # noqa: E402


@pytest.fixture(autouse=True)
def clean():
    ranges.RECORDER.drain(final=True)
    runtime.set_be_backend(None)
    yield
    runtime.set_be_backend(None)
    ranges.RECORDER.drain(final=True)


class Sink:
    def __init__(self):
        self.batches: list[dict] = []

    def append(self, cols: dict) -> None:
        self.batches.append(cols)

    def rows(self) -> list[tuple[int, int, int, str]]:
        out = []
        for c in self.batches:
            out += list(zip(c["tid"].tolist(), c["start_ns"].tolist(), c["end_ns"].tolist(), c["name"].to_pylist(),
                            strict=True))
        return sorted(out, key=lambda r: (r[1], -r[2]))


def recorded() -> list[tuple[int, int, int, str]]:
    cols = ranges.RECORDER.drain()
    if cols is None:
        return []
    return sorted(zip(cols["tid"].tolist(), cols["start_ns"].tolist(), cols["end_ns"].tolist(),
                      cols["name"].to_pylist(), strict=True), key=lambda r: (r[1], -r[2]))


def steps_on_a_thread(n: int, between=None) -> int:
    """n steps of linear+softmax on a background thread (like an engine's batching thread)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        with torch.inference_mode():
            for i in range(n):
                runtime.push_step(f"STEP id={i} reqs=r{i}")
                runtime.push("FE Block")
                torch.softmax(lin(x), -1)
                runtime.pop()
                runtime.pop_step()
                if between is not None:
                    between()

    th = threading.Thread(target=body)
    th.start()
    th.join()
    return tid[0]


@pytest.mark.parametrize("depth", [1, 2])
def test_profiler_backend_records_nested_aten_ops_on_the_step_thread(tmp_path: Path, depth: int):
    sink = Sink()
    be = tpo.ProfilerBE(tmp_path, period_s=0, defer=False, fallback="dispatch", sink=sink, runtime=runtime)
    runtime.set_be_backend(be.enter, be.exit)
    old = runtime._default_be_depth
    runtime._default_be_depth = lambda: depth
    try:
        tid = steps_on_a_thread(3, between=lambda: torch.ones(3) * 2)  # ops between steps: not kept
    finally:
        runtime._default_be_depth = old
    be.stop()
    assert be.started and not be.failed and be.options["profile_all_threads"]
    be_rows = sink.rows()
    hooks = recorded()
    assert not [r for r in hooks if r[3].startswith("BE ")]  # the dispatch backend stayed off
    fe = [r for r in hooks if r[3] == "FE Block"]
    steps = [r for r in hooks if r[3].startswith("STEP")]
    assert len(fe) == 3 and len(steps) == 3
    assert {r[0] for r in be_rows} == {tid}
    top = [r for r in be_rows if not any(o[1] <= r[1] and r[2] <= o[2] and o != r for o in be_rows)]
    assert [r[3] for r in top] == ["BE aten::linear", "BE aten::softmax"] * 3
    # every op nests inside its step's FE range (both on τ, from different clocks)
    for r in be_rows:
        assert any(f[1] <= r[1] and r[2] <= f[2] for f in fe), r
    nested = [r[3] for r in be_rows if r not in top]
    if depth == 1:
        assert nested == []
    else:
        assert "BE aten::addmm" in nested and "BE aten::_softmax" in nested
    s = be.summary
    assert s["aten_rows"] == s["kept"] + s["outside_steps"] + s["too_deep"]
    assert s["kept"] == len(be_rows) and s["windows_matched"] == 3 and s["outside_steps"] >= 1
    assert s["bracket_len_diff_max_ns"] < 1_000_000
    assert not list((tmp_path / tpo.SEGMENT_DIR).glob("*.json"))  # converted segments are removed


def test_session_cycles_at_step_ends_and_segments_convert(tmp_path: Path):
    sink = Sink()
    be = tpo.ProfilerBE(tmp_path, period_s=1e-9, defer=True, sink=sink, runtime=runtime)  # cycle after every step
    runtime.set_be_backend(be.enter, be.exit)
    steps_on_a_thread(3)
    be.stop()
    assert be.cycles == 3 and len(be.segments) == 4 and sink.batches == []  # deferred: nothing yet
    out = tpo.convert_run(tmp_path)
    assert out["segments"] == 4 and out["failed"] == 0 and out["windows_matched"] == 3
    assert out["kept"] == 6 and out["aten_rows"] == out["kept"] + out["outside_steps"] + out["too_deep"]
    from teller.rundir import RunDir

    names = RunDir(tmp_path).read_events().column("name").to_pylist()
    assert sorted(names) == ["BE aten::linear"] * 3 + ["BE aten::softmax"] * 3
    assert not (tmp_path / tpo.SEGMENT_DIR).exists()


@pytest.mark.parametrize("fallback", ["dispatch", "none"])
def test_profiler_that_cannot_start_degrades(tmp_path: Path, monkeypatch, capsys, fallback: str):
    def broken():
        raise RuntimeError("this torch's profiler has no profile_all_threads option")

    monkeypatch.setattr(tpo, "experimental_config", broken)
    monkeypatch.setattr(runtime, "_logged", set())
    be = tpo.ProfilerBE(tmp_path, fallback=fallback, sink=Sink(), runtime=runtime)
    runtime.set_be_backend(be.enter, be.exit)
    steps_on_a_thread(2)
    be.stop()
    assert be.failed and not be.started and "profile_all_threads" in be.reason
    err = capsys.readouterr().err
    assert err.count("[teller] BE backend profiler unavailable") == 1
    be_names = [r[3] for r in recorded() if r[3].startswith("BE ")]
    if fallback == "dispatch":
        assert be_names.count("BE aten::linear") == 2 and "BE aten::softmax" in be_names
        assert "dispatch backend" in err
    else:
        assert be_names == [] and "no BE ranges" in err


def test_conversion_reconciles_counts_on_a_synthetic_trace(tmp_path: Path):
    """Ops outside windows, on other threads, too deep, non-aten rows: all counted, τ mapped."""
    base = 1_700_000_000_000_000_000
    ev = []

    def x(name: str, tid: int, ts_us: float, dur_us: float) -> None:
        ev.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": tid, "ts": ts_us, "dur": dur_us})

    x(f"{tpo.STEP_MARK}0", 11, 100.0, 50.0)
    x("aten::linear", 11, 110.0, 20.0)
    x("aten::addmm", 11, 112.0, 10.0)  # depth 1: too deep
    x("detach", 11, 131.0, 1.0)  # not aten
    x("aten::softmax", 11, 135.0, 5.0)
    x("aten::mm", 12, 120.0, 5.0)  # another thread, no window there
    x("aten::add", 11, 160.0, 5.0)  # after the window
    x(f"{tpo.STEP_MARK}1", 11, 200.0, 10.0)
    x("aten::cat", 11, 202.0, 3.0)
    x(f"{tpo.STEP_MARK}9", 11, 300.0, 10.0)  # a bracket with no window (cut by a cycle)
    trace = tmp_path / "7-0000.json"
    trace.write_text(json.dumps({"schemaVersion": 1, "baseTimeNanoseconds": base, "traceEvents": ev}))
    off = 5_000_000  # τ = profiler ns − base − offset
    win = [[0, 111, base + 100_000 - off, base + 100_000 - off, base + 150_000 - off, base + 150_000 - off, 1],
           [1, 111, base + 200_000 - off, base + 200_000 - off, base + 210_000 - off, base + 210_000 - off, 1]]
    (tmp_path / "7-0000.windows.json").write_text(json.dumps({"pid": 7, "windows": win}))
    cols, s = tpo.convert_segment(trace)
    assert s["aten_rows"] == 6 and s["other_rows"] == 1 and s["step_marks"] == 3
    assert s["windows_matched"] == 2
    assert (s["kept"], s["too_deep"], s["outside_steps"]) == (3, 1, 2)
    got = sorted(zip(cols["start_ns"].tolist(), cols["end_ns"].tolist(), cols["name"].to_pylist(),
                     cols["tid"].tolist(), strict=True))
    assert got == [(base + 110_000 - off, base + 130_000 - off, "BE aten::linear", 111),
                   (base + 135_000 - off, base + 140_000 - off, "BE aten::softmax", 111),
                   (base + 202_000 - off, base + 205_000 - off, "BE aten::cat", 111)]
    assert s["tids_remapped"] == 3 and cols["layer"].to_pylist() == ["BE"] * 3


def test_lopsided_brackets_keep_ops_inside_their_fe_range(tmp_path: Path):
    """The profiler's timestamp of a step bracket sits at one end of its τ bracket, not in the
    middle (recording: the bracket's enter work comes before the timestamp); the bracket's
    midpoint is then µs off, more than an op's distance to the FE range that encloses it. The
    narrowed brackets put each op back inside its FE range, within a few hundred ns of its true τ."""
    base = 1_700_000_000_000_000_000
    off = 5_000_000  # true clocks: τ = profiler ns − off (no drift)
    ev = []

    def x(name: str, ts_us: float, dur_us: float) -> None:
        ev.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": 11, "ts": ts_us, "dur": dur_us})

    def tau(ts_us: float) -> int:
        return base + int(round(ts_us * 1000)) - off

    x(f"{tpo.STEP_MARK}0", 100.0, 60.0)
    x("aten::linear", 101.5, 10.0)  # 1.5 µs after the bracket: early in its FE range
    x(f"{tpo.STEP_MARK}1", 300.0, 60.0)
    x("aten::linear", 348.0, 10.0)  # ends 0.8 µs before its FE range does
    trace = tmp_path / "7-0000.json"
    trace.write_text(json.dumps({"schemaVersion": 1, "baseTimeNanoseconds": base, "traceEvents": ev}))
    s0, e0, s1, e1 = tau(100.0), tau(160.0), tau(300.0), tau(360.0)
    # (a, b) around each bracket's enter, (c, d) around its exit: window 0 has its enter
    # timestamp at the end of a 6.2 µs bracket; window 1 has a lopsided enter and exit
    win = [[0, 111, s0 - 6_000, s0 + 200, e0 - 300, e0 + 300, 1],
           [1, 111, s1 - 5_000, s1 + 100, e1 - 100, e1 + 4_000, 1]]
    (tmp_path / "7-0000.windows.json").write_text(json.dumps({"pid": 7, "windows": win}))
    fe = [(tau(101.0), tau(112.5)), (tau(347.0), tau(358.8))]  # the FE ranges around the two ops (τ)
    cols, s = tpo.convert_segment(trace)
    got = sorted(zip(cols["start_ns"].tolist(), cols["end_ns"].tolist(), strict=True))
    assert len(got) == 2
    for (a, b), (fs, fe_end) in zip(got, fe, strict=True):
        assert fs <= a and b <= fe_end, (a - fs, fe_end - b)
    truth = [(tau(101.5), tau(111.5)), (tau(348.0), tau(358.0))]
    assert max(abs(g - t) for pair in zip(got, truth, strict=True) for g, t in zip(*pair, strict=True)) <= 300
    # what the narrowing did is in the summary
    assert s["anchor_err_raw_max_ns"] == 3_100 and s["anchor_err_max_ns"] <= 300
    assert s["anchors_narrowed"] == 4 and s["anchor_shift_max_ns"] >= 2_000
    assert s["anchor_drift_bound_ppm"] == 20 and s["anchor_sets_inconsistent"] == 0
    assert s["bracket_len_diff_max_ns"] <= 300


def test_host_ranges_put_ops_back_when_every_bracket_is_lopsided(tmp_path: Path):
    """Brackets that all have their timestamp at the same end narrow nothing (they agree): the
    mapping stays 2.9 µs early. The process's own FE/STEP ranges then put the window's ops back
    inside (one shift per window, within the error bound), counted."""
    base = 1_700_000_000_000_000_000
    ev = [{"ph": "X", "cat": "cpu_op", "name": n, "pid": 7, "tid": 11, "ts": ts, "dur": d}
          for n, ts, d in [(f"{tpo.STEP_MARK}0", 100.0, 60.0), ("aten::linear", 101.5, 10.0),
                           ("aten::addmm", 101.8, 9.0), ("aten::softmax", 140.0, 5.0)]]
    trace = tmp_path / "7-0000.json"
    trace.write_text(json.dumps({"schemaVersion": 1, "baseTimeNanoseconds": base, "traceEvents": ev}))

    def tau(ts_us: float) -> int:  # true clocks: τ = profiler ns − 5 ms
        return base + int(round(ts_us * 1000)) - 5_000_000

    s0, e0 = tau(100.0), tau(160.0)
    win = [[0, 111, s0 - 6_000, s0 + 200, e0 - 6_000, e0 + 200, 2]]
    (tmp_path / "7-0000.windows.json").write_text(json.dumps({"pid": 7, "windows": win}))
    step = (tau(93.0), tau(167.0))  # the STEP range opens before the bracket's first τ reading
    fe = [(tau(101.0), tau(112.5)), (tau(139.5), tau(146.0))]  # FE ranges around linear, softmax
    host = {"tid": np.array([111, 111, 111]), "start_ns": np.array([step[0], fe[0][0], fe[1][0]]),
            "end_ns": np.array([step[1], fe[0][1], fe[1][1]])}
    plain, s_plain = tpo.convert_segment(trace)
    assert s_plain["anchor_err_max_ns"] == 3_100 and "host_ranges" not in s_plain
    assert plain["start_ns"].min() < fe[0][0]  # anchors alone: linear starts before its FE range
    cols, s = tpo.convert_segment(trace, host=host)
    assert s["host_ranges"] == 3 and s["straddles"] == 3 and s["straddles_unrepaired"] == 0  # all three ops
    assert s["windows_shifted"] == 1 and 0 < s["nesting_shift_max_ns"] <= s["anchor_err_max_ns"]
    got = dict(zip(cols["name"].to_pylist(), zip(cols["start_ns"].tolist(), cols["end_ns"].tolist(), strict=True),
                   strict=True))
    for name, (fs, fe_end) in (("BE aten::linear", fe[0]), ("BE aten::addmm", fe[0]), ("BE aten::softmax", fe[1])):
        a, b = got[name]
        assert fs <= a and b <= fe_end, name
    # one shift for the window: durations and the ops' own nesting are kept
    d = got["BE aten::linear"][0] - plain["start_ns"][plain["name"].to_pylist().index("BE aten::linear")]
    for i, name in enumerate(plain["name"].to_pylist()):
        assert got[name] == (plain["start_ns"][i] + d, plain["end_ns"][i] + d)


def test_host_nesting_repair_bounds():
    r = tpo.repair_host_nesting
    tid = np.array([1, 1, 1])
    # three ops of one window; host range [100, 200]: op 0 sticks out 3 before it, op 1 is
    # inside, op 2 lies after it, 5 clear of its end
    s, e = np.array([97, 150, 205]), np.array([120, 160, 230])
    hs, he = np.array([100]), np.array([200])
    ns, ne, c = r(tid, s, e, np.zeros(3), np.array([1]), hs, he, tol_ns=10)
    assert ns.tolist() == [100, 153, 208] and (ne - ns).tolist() == (e - s).tolist()
    assert (c["straddles"], c["straddles_unrepaired"], c["windows_shifted"], c["nesting_shift_max_ns"]) == (1, 0, 1, 3)
    # a straddle deeper than the error bound is no clock error: left alone, counted
    ns, ne, c = r(tid, s, e, np.zeros(3), np.array([1]), hs, he, tol_ns=2)
    assert ns.tolist() == s.tolist() and c["straddles_unrepaired"] == 1 and c["windows_shifted"] == 0
    # no shift fits: op 2 may move right by 2 at most (another host range starts at 232)
    ns, ne, c = r(tid, s, e, np.zeros(3), np.array([1, 1]), np.array([100, 232]), np.array([200, 300]), tol_ns=10)
    assert ns.tolist() == s.tolist() and c["straddles_unrepaired"] == 1
    # in windows of their own, op 0 moves alone
    ns, ne, c = r(tid, s, e, np.array([0, 1, 1]), np.array([1, 1]), np.array([100, 232]), np.array([200, 300]),
                  tol_ns=10)
    assert ns.tolist() == [100, 150, 205] and c["windows_shifted"] == 1
    # the nearer side wins: 3 past the end of a range, the op moves out of it, to the right
    ns, ne, c = r(np.array([1]), np.array([197]), np.array([230]), np.zeros(1), np.array([1]), hs, he, tol_ns=10)
    assert ns.tolist() == [200]
    # an op with a whole host range inside it (a Python op running a module) is left alone; so
    # are ops on threads without host ranges
    ns, ne, c = r(np.array([1, 2]), np.array([90, 97]), np.array([210, 120]), np.zeros(2), np.array([1]), hs, he,
                  tol_ns=10)
    assert ns.tolist() == [90, 97] and c["straddles"] == 0


@st.composite
def true_clock_brackets(draw):
    """Anchors of a source clock whose offset to τ drifts by at most 10 ppm, each with a τ
    bracket that contains its true τ at a random place (zero width allowed)."""
    n = draw(st.integers(2, 30))
    gaps = draw(st.lists(st.integers(200_000, 50_000_000), min_size=n, max_size=n))  # 1 ns rounding: ≤ 5 ppm
    src = 1_700_000_000_000_000_000 + np.cumsum(np.array(gaps, np.int64))
    drift = draw(st.floats(-10e-6, 10e-6))
    off0 = draw(st.integers(-10**12, 10**12))
    true = src + off0 + np.rint((src - src[0]) * drift).astype(np.int64)
    below = np.array(draw(st.lists(st.integers(0, 20_000), min_size=n, max_size=n)), np.int64)
    above = np.array(draw(st.lists(st.integers(0, 20_000), min_size=n, max_size=n)), np.int64)
    return src, true, true - below, true + above


@settings(max_examples=200, deadline=None)
@given(true_clock_brackets())
def test_narrowed_brackets_still_hold_the_true_time(case):
    from teller.record import clock

    src, true, lo, hi = case
    order = np.random.default_rng(len(src)).permutation(len(src))  # input order does not matter
    src, true, lo, hi = src[order], true[order], lo[order], hi[order]
    nlo, nhi, ppm = clock.tighten_brackets(src, lo, hi)
    assert ppm == 20  # the true drift (≤ 10 ppm) is within the smallest bound
    assert np.all(lo <= nlo) and np.all(nhi <= hi)  # inside the given brackets
    assert np.all(nlo <= true) and np.all(true <= nhi)  # and still around the true time
    # the tightest bracket bounds every other one, up to the drift allowed between them (+ rounding)
    i = int(np.argmin(hi - lo))
    allowed = (hi[i] - lo[i]) + 2 * np.ceil(20e-6 * np.abs(src - src[i])).astype(np.int64) + 2
    assert np.all(nhi - nlo <= np.minimum(hi - lo, allowed))


def test_brackets_no_drift_bound_reconciles_stay_as_they_are():
    from teller.record import clock

    src = np.array([0, 1_000_000], np.int64)  # 1 ms apart, offsets 1001 ns apart: above 1000 ppm
    lo = np.array([0, 1_001_001], np.int64)
    hi = np.array([0, 1_001_001], np.int64)
    nlo, nhi, ppm = clock.tighten_brackets(src, lo, hi)
    assert ppm is None and nlo.tolist() == lo.tolist() and nhi.tolist() == hi.tolist()
    lo[1] -= 2  # offsets 999..1001 ns apart: 1000 ppm reconciles them, and bounds the second
    nlo, nhi, ppm = clock.tighten_brackets(src, lo, hi)
    assert ppm == 1000 and nlo.tolist() == [0, 1_000_999] and nhi.tolist() == [0, 1_001_000]


@st.composite
def nested_intervals(draw):
    """Random forests of properly nested intervals on a few threads, with their true depths.

    Time moves on by at least 1 ns between events, so no two intervals tie ambiguously (an
    instant op at its sibling's start would look like its child); ties are tested separately.
    """
    out = []
    for tid in range(draw(st.integers(1, 3))):
        t = 0
        stack: list[tuple[int, int]] = []  # (start, depth)
        for op in draw(st.lists(st.sampled_from(["open", "close", "leaf"]), max_size=40)):
            t += draw(st.integers(1, 3))
            if op == "open":
                stack.append((t, len(stack)))
            elif op == "close" and stack:
                s, d = stack.pop()
                out.append((tid, s, t, d))
            elif op == "leaf":
                e = t + draw(st.integers(0, 2))
                out.append((tid, t, e, len(stack)))
                t = e
        while stack:
            t += 1
            s, d = stack.pop()
            out.append((tid, s, t, d))
    return out


@settings(max_examples=200, deadline=None)
@given(nested_intervals())
def test_nesting_depth_counts_enclosing_intervals(iv):
    if not iv:
        assert len(tpo.nesting_depth([], [], [])) == 0
        return
    tid, s, e, d = (np.array(c, np.int64) for c in zip(*iv, strict=True))
    got = tpo.nesting_depth(tid, s, e)
    # the generator's depth is the number of ranges open around the interval when it began
    assert got.tolist() == d.tolist()


def test_nesting_depth_ties():
    # same start: the longer one is the parent; a sibling may start where the previous ended;
    # an instant op at its parent's end is still inside it
    got = tpo.nesting_depth([1, 1, 1, 1, 2], [0, 0, 5, 9, 0], [10, 5, 9, 10, 3])
    assert got.tolist() == [0, 1, 1, 1, 0]
    assert tpo.nesting_depth([1, 1], [4, 4], [4, 4]).tolist() in ([0, 1], [1, 0])


def test_cupti_collector_gets_cupti_back_after_a_profiler_start():
    calls = []

    class Kind:
        EXTERNAL_CORRELATION = 39

    class Cupti:
        ActivityKind = Kind

        def activity_enable(self, k):
            calls.append(("enable", k))

        def activity_disable(self, k):
            calls.append(("disable", k))

    class Raw:
        def register(self):
            calls.append(("register",))

    class Coll:
        name, _active, api_filter, quiet_apis = "cupti", True, True, 12
        _cupti, _raw, _enabled = Cupti(), Raw(), [5, 4, 10]

        def _quiet(self, cupti):
            calls.append(("quiet",))
            self.quiet_apis += 12

    c = Coll()
    tpo.reassert_cupti_collector(c)
    assert calls == [("register",), ("enable", 5), ("enable", 4), ("enable", 10), ("quiet",), ("disable", 39)]
    assert c.quiet_apis == 12


def test_runtime_picks_the_backend(tmp_path: Path):
    env = {"TELLER_RUN_DIR": str(tmp_path / "run"), "TELLER_COLLECTOR": "cpu", "TELLER_FLUSH_S": "3600"}
    rt = runtime.Runtime({**env, "TELLER_BE_BACKEND": "profiler"})
    try:
        rt.ensure_started()
        rt._setup_be_backend()
        assert rt.be is not None and runtime._be_functions()[0] == rt.be.enter
        assert rt.proc_info("running")["collector"]["be_backend"] == "profiler"
        runtime.set_be_backend(None)
        k = runtime.Runtime({**env, "TELLER_BE_BACKEND": "profiler"})
        k.collector_name = "kineto"  # Kineto holds the profiler: the dispatch backend records BE
        k._setup_be_backend()
        assert k.be is None and "kineto" in k.be_note
        d = runtime.Runtime({**env, "TELLER_BE_BACKEND": "dispatch"})
        d._setup_be_backend()
        assert d.be is None and d.proc_info("running")["collector"]["be_backend"] == "dispatch"
    finally:
        rt._stopped = True
        rt._stop_evt.set()


def test_launcher_rejects_an_unknown_backend(tmp_path: Path):
    from teller.errors import TellerError
    from teller.record.launcher import record

    with pytest.raises(TellerError, match="--be-backend"):
        record(tmp_path / "run", [sys.executable, "-c", "pass"], collector="cpu", be_backend="nvtx")


TINY = ["--requests", "4", "--rate", "0", "--prompt-len", "uniform:4:12", "--output-len", "6", "--seed", "3"]  # = conftest.TINY_SERVE


@pytest.mark.slow
def test_recorded_workload_with_the_profiler_backend(tmp_path: Path, plain_tiny_tokens):
    """The CPU workload: same greedy tokens, BE ranges under FE ranges on the batching thread."""
    pytest.importorskip("transformers")
    serve = [sys.executable, "-m", "teller.workload", "serve", *TINY, "--save-tokens"]
    run = tmp_path / "run"
    code = ("import sys; from teller.record.launcher import record; "
            "sys.exit(record(sys.argv[1], sys.argv[2:], collector='cpu', be_backend='profiler')['exit_code'])")
    rec = subprocess.run([sys.executable, "-c", code, str(run), *serve, "--out-json", str(tmp_path / "rec.json")],
                         cwd=tmp_path, capture_output=True, timeout=300)
    assert rec.returncode == 0, rec.stderr.decode()[-2000:]
    a = plain_tiny_tokens  # the same TINY workload run without recording (conftest)
    b = json.loads((tmp_path / "rec.json").read_text())["requests"]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    info = json.loads((run / "run.json").read_text())
    conv = info["be_conversion"]
    assert conv["failed"] == 0 and conv["kept"] > 0 and conv["windows_matched"] == conv["windows"]
    assert conv["aten_rows"] == conv["kept"] + conv["outside_steps"] + conv["too_deep"]
    # the launcher's conversion had the process's FE/STEP ranges to check nesting against
    assert conv["host_ranges"] > 0 and conv["straddles_unrepaired"] == 0
    proc = info["processes"][0]
    assert proc["collector"]["be_backend"] == "profiler" and proc["be"]["started"]
    assert not (run / tpo.SEGMENT_DIR).exists()

    from teller.rundir import RunDir

    ev = RunDir(run).read_events().to_pylist()
    be = [e for e in ev if e["layer"] == "BE"]
    steps = [e for e in ev if e["name"].startswith("STEP")]
    fe = [e for e in ev if e["layer"] == "FE"]
    assert len(be) == conv["kept"] and steps
    step_tids = {e["tid"] for e in steps}
    assert {e["tid"] for e in be} == step_tids and len(step_tids) == 1
    assert threading.get_native_id() not in step_tids  # not the main thread: the batching thread
    assert {"BE aten::linear", "BE aten::embedding"} <= {e["name"] for e in be}
    for e in be:  # each op lies in one of the steps, and linear ops inside an FE module range
        assert any(s["start_ns"] <= e["start_ns"] and e["end_ns"] <= s["end_ns"] for s in steps)
    lin = [e for e in be if e["name"] == "BE aten::linear"]
    inside_fe = sum(any(f["start_ns"] <= e["start_ns"] and e["end_ns"] <= f["end_ns"] for f in fe) for e in lin)
    assert inside_fe == len(lin)

    reconstruct_mod = pytest.importorskip("teller.reconstruct")
    if not hasattr(reconstruct_mod, "reconstruct"):
        pytest.skip("teller.reconstruct.reconstruct not available yet")
    reconstruct_mod.reconstruct(run)
    import pyarrow.parquet as pq

    forest = pq.read_table(run / "forest.parquet").to_pylist()
    fe_ids = {n["node_id"] for n in forest if n["layer"] == "FE"}
    be_nodes = [n for n in forest if n["layer"] == "BE"]
    assert len(be_nodes) == len(be) and sum(n["parent_id"] in fe_ids for n in be_nodes) >= len(lin)

