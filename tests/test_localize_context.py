"""The numeric stage's context: warm-up steps out of references, batch normalisation, STEP/OTHER
instances and their runtime-call mix, pageable copies, iterations.parquet, suspects lifted to
their FE module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_localize import N, forest_table

from teller.errors import TellerError
from teller.forest import COLD_STEPS, Forest, warmup_steps
from teller.localize import fit_localizer, localize
from teller.localize.features import (
    FEATURES,
    ITER_FEATURES,
    ITERATIONS_COLUMNS,
    admission_delay,
    instance_features,
    iteration_pace,
    pageable_rows,
    read_iterations,
    read_steps,
    run_features,
)
from teller.localize.gmm import GMMLocalizer
from teller.rundir import LAYER_CODE, RunDir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "h200_normal_a"
F = {name: i for i, name in enumerate(FEATURES)}


def test_the_warmup_rule_is_one_function():
    from teller.inject import labels

    assert labels.warmup_steps is warmup_steps and labels.COLD_STEPS == COLD_STEPS == 2
    t = pa.table({
        "name": ["STEP id=0 reqs=warmup_0,warmup_1", "STEP id=1 reqs=warmup_0", "STEP id=2 reqs=warmup_0,req_1",
                 "STEP id=3 reqs=req_1", "STEP id=9 reqs=warmup_3", "STEP id=0 reqs=req_0", "STEP id=1 reqs=req_0",
                 "STEP id=2 reqs=req_0"],
        "pid": [1, 1, 1, 1, 1, 2, 2, 2],
        "start_ns": [0, 10, 20, 30, 40, 5, 15, 25],
    })
    # warm-up requests only, or a process's first two steps; a mixed batch is not warm-up
    assert warmup_steps(t).tolist() == [True, True, False, False, True, True, True, False]
    with pytest.raises(TellerError, match="pid"):
        warmup_steps(t.drop_columns(["pid"]))


@pytest.fixture(scope="module")
def planted_ref(tmp_path_factory):
    from teller.reconstruct import reconstruct
    from teller.testing.planted import Plant, write_planted_run

    p = tmp_path_factory.mktemp("ref") / "ref"
    # the process's first two steps are cold: 8x slower multiplications
    write_planted_run(p, 30_000, [Plant("BE aten::mul", [0, 1], "host", 8.0)], seed=1)
    reconstruct(p)
    return p


def test_references_leave_warmup_steps_out(planted_ref):
    rf = run_features(planted_ref)
    assert rf.steps.warmup.tolist()[:3] == [True, True, False] and int(rf.steps.warmup.sum()) == 2
    out = fit_localizer([rf])
    kept = fit_localizer([rf], keep_warmup=True)
    assert out.extra_["reference_warmup_steps"] == 2 and not out.extra_["keep_warmup"]
    assert kept.extra_["reference_steps"] == out.extra_["reference_steps"] + 2
    assert kept.extra_["reference_warmup_steps"] == 0
    # the cold steps would have widened the family's radius
    f_out = list(out.families_).index("BE aten::mul")
    f_kept = list(kept.families_).index("BE aten::mul")
    assert out.radius_[f_out] < 0.5 * kept.radius_[f_kept]
    # so the cold steps of a run judged against the warm-up-free reference stand out
    loc = localize(out, rf.instances)
    assert {0, 1} <= set(loc.flagged)
    assert "BE aten::mul" in {c["family"] for c in loc.flagged[1].candidates}
    # kept in the reference, they widen the family: its cold instances are not suspects (the
    # STEP's per-feature test may still call step 1 slow: 2 cold steps in 30 are a tail it keeps out)
    kl = localize(kept, rf.instances).flagged
    assert 1 not in kl or "BE aten::mul" not in {c["family"] for c in kl[1].candidates}


def test_cli_keep_warmup(planted_ref, tmp_path):
    import typer
    from typer.testing import CliRunner

    from teller.localize.cli import register as register_localize
    from teller.report.cli import register

    app = typer.Typer()
    register(app)
    register_localize(app)
    r = CliRunner().invoke(app, ["localize", "fit", str(planted_ref), "-o", str(tmp_path / "a.npz")])
    assert r.exit_code == 0, r.output
    assert "2 warm-up steps left out" in " ".join(r.output.split())
    r = CliRunner().invoke(app, ["localize", "fit", str(planted_ref), "--keep-warmup", "-o", str(tmp_path / "b.npz")])
    assert r.exit_code == 0 and "warm-up" not in r.output
    assert GMMLocalizer.load(tmp_path / "b.npz").extra_["keep_warmup"] is True
    r = CliRunner().invoke(app, ["localize", "fit", str(planted_ref), "--max-steps", "5", "-o", str(tmp_path / "c.npz")])
    assert r.exit_code == 0, r.output
    x = GMMLocalizer.load(tmp_path / "c.npz").extra_
    assert x["reference_steps"] == 5 and x["reference_steps_sampled_from"] > 5
    r = CliRunner().invoke(app, ["diagnose", str(planted_ref), "-r", str(planted_ref), "--keep-warmup", "--no-model",
                                 "-o", str(tmp_path / "d"), "-q"])
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "d" / "diagnosis.json").read_text())
    assert d["reference"].endswith("(warm-up steps kept)") and d["localizer"]["keep_warmup"]
    assert [s["warmup"] for s in d["steps"][:3]] == [True, True, False]


def _batched(rng, batch, factor=1.0):
    """A family whose time grows as batch^0.8 (a decode op), with 5% noise."""
    X = np.zeros((len(batch), len(FEATURES)))
    X[:, F["dur_ns"]] = 10_000 * batch ** 0.8 * np.exp(rng.normal(0, 0.05, len(batch))) * factor
    X[:, F["self_ns"]] = X[:, F["dur_ns"]] / 2
    X[:, F["k_n"]] = 3
    return X


def test_batch_normalisation():
    rng = np.random.default_rng(0)
    b = rng.integers(1, 9, 400).astype(float)  # a small-batch reference: 1..8 requests
    X = _batched(rng, b)
    fam = np.array(["BE aten::mm"] * len(b))
    on = GMMLocalizer().fit(X, families=fam, batch=b)
    off = GMMLocalizer(batch_norm=False).fit(X, families=fam, batch=b)
    assert 0.6 < on.slope_[0, F["dur_ns"]] < 1.0 and on.slope_[0, F["k_n"]] == pytest.approx(0, abs=0.05)
    assert not off.slope_.any()
    big = np.full(20, 60.0)
    normal, slow = _batched(rng, big), _batched(rng, big, factor=4.0)
    # 60 requests at the reference's trend: normal once normalised, an outlier without
    assert (on.score_samples(normal, fam[:20], big) < 0.5).all()
    assert (off.score_samples(normal, fam[:20], big) > 0.5).all()
    # 4x the trend is an anomaly either way
    assert (on.score_samples(slow, fam[:20], big) > 0.5).all()
    # unknown batch: no normalisation
    np.testing.assert_allclose(on.score_samples(normal, fam[:20], np.full(20, np.nan)),
                               GMMLocalizer().fit(X, families=fam).score_samples(normal, fam[:20]), atol=1e-9)
    # the reference value named as evidence is the trend's value at the row's batch
    ref = on.reference_value(fam[:1], np.zeros(1, np.int64), big[:1])[0, F["dur_ns"]]
    assert ref == pytest.approx(10_000 * 60 ** 0.8, rel=0.2)


def test_batch_normalisation_survives_save_load(tmp_path):
    rng = np.random.default_rng(1)
    b = rng.integers(1, 9, 300).astype(float)
    fam = np.array(["BE aten::mm"] * len(b))
    est = GMMLocalizer().fit(_batched(rng, b), families=fam, batch=b)
    est.save(tmp_path / "l.npz")
    back = GMMLocalizer.load(tmp_path / "l.npz")
    assert back.get_params() == est.get_params()
    probe, pb = _batched(rng, np.full(5, 40.0)), np.full(5, 40.0)
    np.testing.assert_allclose(back.score_samples(probe, fam[:5], pb), est.score_samples(probe, fam[:5], pb))


def _mix_step():
    return N("STEP", "STEP id=0 reqs=a,b", 0, 10_000,
             N("OTHER", "update_batch", 100, 5000,
               N("RT", "cudaMemcpy", 200, 1200, N("MEM", "Memcpy HtoD", 300, 1100, stream=7, nbytes=64)),
               N("RT", "cudaStreamSynchronize", 1300, 2300, N("SYNC", "Stream Synchronize", 1300, 2300, kind="SYNC")),
               N("RT", "cudaMalloc", 2400, 2900),
               N("RT", "cudaDeviceSynchronize", 3000, 3100)),
             N("BE", "aten::copy_", 6000, 7000,
               N("RT", "cudaMemcpyAsync", 6100, 6200, N("MEM", "Memcpy HtoD", 6300, 6400, stream=7, nbytes=64))))


def test_step_and_other_instances_carry_the_runtime_call_mix(tmp_path):
    tab = forest_table([_mix_step()])
    fa = Forest.from_table(tab)
    inst = instance_features(fa, np.zeros(fa.n, np.int64), step_batch=np.array([2.0]))
    fam = list(inst.family_of())
    assert fam == ["STEP", "OTHER update_batch", "BE aten::copy_"]
    s, o, be = (inst.X[i] for i in range(3))
    assert (o[F["memcpy_sync_n"]], o[F["memcpy_sync_ns"]], o[F["memcpy_async_n"]]) == (1, 1000, 0)
    assert (o[F["stream_sync_n"]], o[F["stream_sync_ns"]]) == (1, 1000)
    assert (o[F["device_sync_n"]], o[F["device_sync_ns"]], o[F["alloc_n"]], o[F["alloc_ns"]]) == (1, 100, 1, 500)
    assert (s[F["memcpy_sync_n"]], s[F["memcpy_async_n"]], s[F["memcpy_async_ns"]]) == (1, 1, 100)
    assert np.isnan(be[F["memcpy_sync_n"]]) and be[F["dur_ns"]] == 1000
    assert inst.batch.tolist() == [2.0, 2.0, 2.0]
    # the memory kinds CUPTI records (src_kind/dst_kind in args) give the pageable copies
    args = [None] * fa.n
    mem_rows = np.flatnonzero(np.asarray(tab.column("kind").cast(pa.string()).to_pylist()) == "MEMCPY")
    args[mem_rows[0]] = json.dumps({"copy_kind": "HtoD", "src_kind": "Pageable", "dst_kind": "Device"})
    args[mem_rows[1]] = json.dumps({"copy_kind": "HtoD", "src_kind": "Pinned", "dst_kind": "Device"})
    run = tmp_path / "run"
    run.mkdir()
    pq.write_table(tab.append_column("args", pa.array(args, pa.string())), run / "forest.parquet")
    pg = pageable_rows(run, fa)
    assert pg.tolist() == [i == mem_rows[0] for i in range(fa.n)]
    inst = instance_features(fa, np.zeros(fa.n, np.int64), pageable=pg)
    assert (inst.X[0, F["pageable_n"]], inst.X[1, F["pageable_n"]]) == (1, 1)
    # no memory kinds recorded: unknown
    pq.write_table(tab, run / "forest.parquet")
    assert pageable_rows(run, fa) is None


# ------------------------------------------------------------------------------------------------
# iterations.parquet


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    from teller.reconstruct import reconstruct

    if not EXAMPLE.is_dir():
        pytest.skip("examples/h200_normal_a not present")
    p = tmp_path_factory.mktemp("it") / "run"
    shutil.copytree(EXAMPLE, p)
    reconstruct(p)
    return p


def _write_iterations(run: Path, gap_ns: np.ndarray, warmup: np.ndarray, rows: slice | None = None) -> pa.Table:
    """An iterations.parquet exactly as the contract lays it out, from the run's steps."""
    st = RunDir(run).read_table("steps")
    n = st.num_rows
    start = st.column("start_ns").to_numpy()
    end = st.column("end_ns").to_numpy()
    step = end - start
    sched = np.full(n, 2_000_000)
    cols = {
        "step_id": st.column("step_id").to_numpy(), "step_idx": np.arange(n), "pid": st.column("pid").to_numpy(),
        "tid": np.full(n, 7), "rank": st.column("rank").to_numpy(), "start_ns": start - sched - gap_ns,
        "end_ns": end, "dur_ns": step + sched + gap_ns, "step_ns": step, "schedule_ns": sched,
        "post_ns": np.zeros(n), "gap_ns": gap_ns, "host_busy_ns": step + sched, "gpu_busy_ns": step // 2,
        "n_requests": st.column("n_requests").to_numpy(), "prefill": np.full(n, 40), "decode": np.full(n, 8),
        "waiting": np.zeros(n), "kv_used": np.full(n, 30), "kv_total": np.full(n, -1), "preempted": np.full(n, -1),
        "warmup": warmup, "rule": ["engine ranges"] * n,
    }
    t = pa.table({k: pa.array(np.asarray(v) if k != "rule" else v, ITERATIONS_COLUMNS[k]) for k, v in cols.items()},
                 schema=pa.schema([pa.field(k, v) for k, v in ITERATIONS_COLUMNS.items()]))
    if rows is not None:
        t = t.slice(rows.start, rows.stop)
    pq.write_table(t, run / "iterations.parquet")
    return t


def test_iterations_are_read_when_present(example_run, tmp_path):
    rd = RunDir(example_run)
    # reconstruct wrote the run's own iterations: their features are on the STEP instances
    assert read_iterations(rd) is not None
    fa = Forest.read(example_run)
    st = read_steps(rd, fa)
    assert st.iterations is not None and st.warmup is not None
    rf = run_features(example_run)
    step_rows = np.flatnonzero(rf.instances.family_of() == "STEP")
    assert len(step_rows) == st.n and np.isfinite(rf.instances.X[step_rows][:, F["iter.dur"]]).all()
    # absent (a run reconstructed before iterations existed): step-only features
    old = tmp_path / "old"
    shutil.copytree(example_run, old)
    (old / "iterations.parquet").unlink()
    assert read_iterations(RunDir(old)) is None and read_steps(RunDir(old), fa).iterations is None

    ref = tmp_path / "ref"
    bad = tmp_path / "bad"
    shutil.copytree(example_run, ref)
    shutil.copytree(example_run, bad)
    n = st.n
    gaps = np.random.default_rng(0).integers(100_000, 150_000, n)
    rule_warm = warmup_steps(rd.read_table("steps"))
    _write_iterations(ref, gaps, rule_warm)
    slow = gaps.copy()
    slow[[20, 30]] = 50_000_000  # the engine thread held up before scheduling: 50 ms untraced
    warm = rule_warm.copy()
    warm[5] = True  # the table's warm-up column is what counts
    _write_iterations(bad, slow, warm)
    sb = read_steps(RunDir(bad), fa)
    assert sb.warmup[5] and not rule_warm[5]
    j = {f: i for i, f in enumerate(ITER_FEATURES)}
    assert sb.iterations[20, j["iter.gap"]] == 50_000_000 and sb.iterations[0, j["batch.prefill"]] == 40
    assert np.isnan(sb.iterations[:, j["batch.kv_frac"]]).all()  # kv_total not recorded (-1)
    assert np.isnan(sb.iterations[:, j["batch.preempted"]]).all()
    rb = run_features(bad)
    X = rb.instances.X[rb.instances.family_of() == "STEP"]
    assert X[20, F["iter.gap"]] == 50_000_000 and X[20, F["iter.schedule"]] == 2_000_000
    # fitted on the normal iterations, the held-up ones are flagged, at the STEP, by the gap
    est = fit_localizer([ref])
    loc = localize(est, rb.instances)
    assert {20, 30} <= set(loc.flagged)
    from teller.localize import evidence

    for s in (20, 30):
        res = loc.flagged[s]
        assert "STEP" in [c["family"] for c in res.candidates]
        k = [i for i in res.suspects.tolist() if rb.instances.family_of()[i] == "STEP"][0]
        ev = evidence(est, rb.instances, loc, np.array([k]))[0]
        assert ev[0]["feature"] in ("iter.gap", "iter.dur")
    # the batch context is context, not a score: n_requests/prefill/decode and the queue never count
    assert est.context_features == ("batch.n_requests", "batch.prefill", "batch.decode", "batch.waiting")


def test_admission_delay_counts_idle_iterations_after_arrival():
    """Four iterations of one process, 10 ns each; request A arrives at 5 and is first served by
    step 3 (start 30), B arrives at 12 and is served by step 2 (start 20), C's arrival is unknown."""
    start = np.array([0, 10, 20, 30])
    end = start + 10
    pid = np.full(4, 7)
    req_step, arrival = np.array([3, 2, 1]), np.array([5, 12, -1])
    d = admission_delay(start, end, pid, np.zeros(4, np.int64), req_step, arrival)
    # A: iterations [10, 20) and [20, 30) ran with nothing waiting after it arrived; B was taken
    # by the first iteration that started after it arrived; steps 0 and 1 admit no known arrival
    np.testing.assert_array_equal(d, [np.nan, np.nan, 0, 20])
    # a request counted as waiting in an iteration was queued there: only idle iterations count
    d = admission_delay(start, end, pid, np.array([0, 0, 2, 0]), req_step, arrival)
    np.testing.assert_array_equal(d, [np.nan, np.nan, 0, 10])
    # another process's iterations do not count; queue length not recorded: unknown
    d = admission_delay(start, end, np.array([7, 8, 7, 7]), np.zeros(4, np.int64), req_step, arrival)
    assert d[3] == 10
    assert np.isnan(admission_delay(start, end, pid, np.full(4, -1), req_step, arrival)).all()


def test_admission_delay_counts_the_engine_idle_after_arrival():
    """Iterations of one process (ms): [0, 10), [10, 20), idle, [81, 91), idle, [200, 210); the
    queue always empty. D arrives at 21 and is first served at 81 (the engine idle for 60 ms after
    it: a held request); E arrives at 199.9 and is served at 200 (a woken engine: no delay); F
    arrives at 5 and is served at 200: the iterations [10, 20) and [81, 91) and both idle stretches
    (61 + 109 ms) count. Without idle stretches (a dataset's sampled iterations) only iterations do."""
    ms = 1_000_000
    start = np.array([0, 10, 81, 200]) * ms
    end = start + 10 * ms
    req_step = np.array([2, 3, 3])
    arrival = np.array([21 * ms, 199_900_000, 5 * ms])
    d = admission_delay(start, end, np.full(4, 7), np.zeros(4, np.int64), req_step, arrival)
    np.testing.assert_array_equal(d, [np.nan, np.nan, 60 * ms, (10 + 10 + 61 + 109) * ms])
    e_only = admission_delay(start, end, np.full(4, 7), np.zeros(4, np.int64), req_step[1:2], arrival[1:2])
    assert e_only[3] == 0  # picked up within IDLE_PICKUP_NS
    d = admission_delay(start, end, np.full(4, 7), np.zeros(4, np.int64), req_step, arrival, idle_gaps=False)
    np.testing.assert_array_equal(d, [np.nan, np.nan, 0, 20 * ms])
    # an idle stretch before the process's first iteration (start-up) is not a delay: G arrives
    # 50 ms before the first iteration (times shifted by 100 ms) and is served by it
    g = admission_delay(start + 100 * ms, end + 100 * ms, np.full(4, 7), np.zeros(4, np.int64), np.array([0]),
                        np.array([50 * ms]))
    assert g[0] == 0


def _admission_dataset(d: Path, rows: list[tuple[str, int]]) -> Path:
    """A dataset folder of one run whose process ran four iterations of 10 ms at 0, 10, 20 and
    30 ms (step ids 0-3) with nothing waiting; A's first log line is at 5 ms, B's at 12 ms;
    ``rows``: the vertical request rows (request, step id)."""
    from teller.reconstruct.iterations import ITERATIONS_SCHEMA

    ms = 1_000_000
    n = 4
    cols = {f.name: [0] * n for f in ITERATIONS_SCHEMA}
    cols.update(step_id=list(range(n)), step_idx=list(range(n)), pid=[7] * n, start_ns=[i * 10 * ms for i in range(n)],
                end_ns=[(i + 1) * 10 * ms for i in range(n)], dur_ns=[10 * ms] * n, waiting=[0] * n, warmup=[False] * n,
                rule=["engine ranges"] * n)
    it = pa.Table.from_pydict(cols, schema=ITERATIONS_SCHEMA).append_column("run_id", pa.array(["r"] * n))
    d.mkdir()
    pq.write_table(it, d / "iterations.parquet")
    pq.write_table(pa.table({"run_id": ["r", "r"], "request_id": ["A", "B"], "ts_ns": [5 * ms, 12 * ms]}), d / "logs.parquet")
    pq.write_table(pa.table({"run_id": ["r"] * len(rows), "request_id": [q for q, _ in rows],
                             "step_id": pa.array([s for _, s in rows], pa.int64()), "view": ["vertical"] * len(rows)}),
                   d / "records.parquet")
    return d


def test_a_datasets_admission_delay_counts_only_iterations_whose_requests_it_kept(tmp_path):
    """A arrives at 5 ms and runs in steps 1-3; B arrives at 12 ms and is first served by step 3,
    step 2 having run with nothing waiting (10 ms of delay). A dataset that leaves out the rows of
    steps 1 and 2 but keeps their iterations (what `teller dataset nest` does to the rows of the
    mechanisms it drops) must not read A as held back through them (20 ms): its first kept step is
    not its first step. Such iterations do not count; B's delay then has no kept iteration to
    count either (the value is a lower bound, as for steps a dataset did not sample)."""
    from teller.localize.context import dataset_context

    runs = np.array(["r"])
    keys = np.arange(4, dtype=np.int64)  # run code 0
    j = ITER_FEATURES.index("iter.admit_delay")
    whole = _admission_dataset(tmp_path / "whole", [("A", 1), ("A", 2), ("A", 3), ("B", 3)])
    d = dataset_context(whole, runs, keys)["iter"][:, j]
    np.testing.assert_array_equal(d, [np.nan, 0, np.nan, 10_000_000])  # A taken at once; B held 10 ms
    part = _admission_dataset(tmp_path / "part", [("A", 3), ("B", 3)])
    d = dataset_context(part, runs, keys)["iter"][:, j]
    np.testing.assert_array_equal(d, [np.nan, np.nan, np.nan, 0])


def test_admission_delay_of_a_recorded_run(tmp_path):
    """A real CPU recording (examples/cpu_normal) with its service logs: the steps that admit a
    request whose arrival was logged carry the feature, 0 in this fault-free run; the others NaN."""
    from teller.cli import main

    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "cpu_normal", run)
    assert main(["reconstruct", str(run)]) == 0
    rf = run_features(run)
    v = rf.steps.iterations[:, ITER_FEATURES.index("iter.admit_delay")]
    rq = pq.read_table(run / "requests.parquet").to_pylist()
    steps = pq.read_table(run / "steps.parquet", columns=["step_id", "start_ns"]).to_pylist()
    start = {r["step_id"]: r["start_ns"] for r in steps}
    first: dict[str, int] = {}
    for r in rq:
        if r["request_id"] not in first or start[r["step_id"]] < start[first[r["request_id"]]]:
            first[r["request_id"]] = r["step_id"]
    logged = {r["request_id"] for r in pq.read_table(run / "log_alignment.parquet").to_pylist() if r["request_id"]}
    admitting = {first[q] for q in first if q in logged}
    ids = [r["step_id"] for r in steps]
    assert admitting and {ids[i] for i in np.flatnonzero(np.isfinite(v))} == admitting
    assert (v[np.isfinite(v)] == 0).all()
    j = F["iter.admit_delay"]
    X = rf.instances.X[rf.instances.family_of() == "STEP"]
    np.testing.assert_array_equal(np.isfinite(X[:, j]), np.isfinite(v))


def test_bad_iterations_tables_are_refused(example_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(example_run, run)
    rd = RunDir(run)
    fa = Forest.read(run)
    n = rd.read_table("steps").num_rows
    _write_iterations(run, np.zeros(n, np.int64), np.zeros(n, bool), rows=slice(0, n - 1))
    with pytest.raises(TellerError, match=r"iterations\.parquet.*rows.*re-run `teller reconstruct"):
        read_steps(rd, fa)
    t = _write_iterations(run, np.zeros(n, np.int64), np.zeros(n, bool))
    pq.write_table(t.drop_columns(["gap_ns"]), run / "iterations.parquet")
    with pytest.raises(TellerError, match=r"iterations\.parquet: lacks columns \['gap_ns'\]"):
        read_steps(rd, fa)


# ------------------------------------------------------------------------------------------------
# iteration pace: time per kernel launched, over a process's neighbouring iterations


def test_iteration_pace_is_a_per_process_median_of_time_per_kernel():
    dur = np.array([10.0, 10, 90, 10, 10, 40, 40, 40, 40, 40, 7, 7, 7])
    k_n = np.array([1.0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 1, 0, 1])
    pid = np.array([1] * 10 + [2] * 3)
    start = np.r_[np.arange(10)[::-1], np.arange(3)]  # one process listed out of time order
    v = iteration_pace(dur, k_n, pid, start)
    # in time order process 1 runs 40/2 five times, then 10/1 with one 90/1 hiccup: the median of
    # the step and two neighbours either side passes over the hiccup, and the first 10/1 step,
    # three of whose five iterations are 40/2 ones, takes their pace; process 2 keeps apart, and
    # its step without a kernel has no pace of its own
    assert v[:10].tolist() == [10, 10, 10, 10, 20, 20, 20, 20, 20, 20]
    assert v[10:].tolist() == [7, 7, 7]


def _paced_steps(n_kernels: list[int], durations: list[float], rank: int) -> tuple[list[dict], np.ndarray]:
    """Steps of one process: each STEP range spans its iteration (``durations``, ns) and launches
    ``n_kernels`` kernels of 10 µs from one op, one runtime call of 5 µs each. Returns the nodes
    and the iteration columns of the steps."""
    roots, t = [], 0
    for k, d in zip(n_kernels, durations, strict=True):
        t0, t1 = int(t), int(t + d)
        calls = [N("RT", "cudaLaunchKernel", t0 + 1000 + 20_000 * j, t0 + 6000 + 20_000 * j,
                   N("K", "gemm", t0 + 8000 + 20_000 * j, t0 + 18_000 + 20_000 * j, stream=7), rank=rank)
                 for j in range(k)]
        op = N("BE", "aten::mm", t0 + 500, t0 + 20_000 * k + 500, *calls, rank=rank)
        roots.append(N("STEP", f"STEP id={len(roots)} reqs=r", t0, t1, op, rank=rank))
        t += d + 100_000
    it = np.full((len(durations), len(ITER_FEATURES)), np.nan)
    it[:, ITER_FEATURES.index("iter.dur")] = durations
    return roots, it


def _paced_instances(processes: list[tuple[list[int], list[float]]]):
    nodes, its = [], []
    for rank, (k, d) in enumerate(processes):
        r, it = _paced_steps(k, d, rank)
        nodes += r
        its.append(it)
    fa = Forest.from_table(forest_table(nodes))
    step_node = np.flatnonzero(fa.layer == LAYER_CODE["STEP"])
    step_of_row = np.searchsorted(step_node, np.arange(fa.n), side="right") - 1
    return instance_features(fa, step_of_row, step_iter=np.concatenate(its))


def test_sustained_host_slowdown_is_flagged_by_the_iteration_pace():
    """A shallow model's iterations slowed 2.2 times for a stretch (other processes on the host's
    cores), kernels unchanged: the iteration time stays inside the reference's deeper model, so
    only the time per kernel launched, held over neighbouring iterations, shows it."""
    rng = np.random.default_rng(0)
    n = 150
    shallow, deep = 4, 8  # kernels per iteration (2 and 4 decoder layers)
    ref = _paced_instances([([shallow] * n, list(50e6 * rng.lognormal(0, 0.1, n))),
                            ([deep] * n, list(100e6 * rng.lognormal(0, 0.1, n)))])
    slow = 50e6 * rng.lognormal(0, 0.1, n)
    stretch = np.arange(60, 100)
    slow[stretch] *= 2.2  # about 110 ms: the reference's deep iterations take 80-125 ms
    test = _paced_instances([([shallow] * n, list(slow))])
    is_step = test.family_of() == "STEP"
    assert np.isfinite(test.X[is_step, F["iter.per_kernel"]]).all()

    def flagged(inst_ref, inst_test):
        est = GMMLocalizer().fit(inst_ref.X, families=inst_ref.family_of(), groups=inst_ref.step)
        return set(localize(est, inst_test).flagged)

    got = flagged(ref, test)
    assert len(got & set(stretch.tolist())) >= 0.9 * len(stretch)
    assert len(got - set(stretch.tolist())) <= 2
    # the same steps without the pace: the one-sided distance explains a slow shallow iteration by
    # the deep mode of the reference (fewer kernels is no excess), and the stretch goes unseen
    for inst in (ref, test):
        inst.X[:, F["iter.per_kernel"]] = np.nan
    assert len(flagged(ref, test) & set(stretch.tolist())) <= 0.2 * len(stretch)


def test_steps_recorded_without_detail_lack_only_the_detail_features(example_run, tmp_path):
    """``teller record --detail-every``: a step whose STEP message says ``detail=0`` has no BE
    ranges or GPU activity; its instances keep durations, COMM sizes and the iteration's times
    and batch, and leave every other feature NaN (left out of the distances), where a detailed
    step keeps them all."""
    from teller.localize.features import DETAIL_FEATURES
    from teller.reconstruct.steps import without_detail

    assert without_detail(["STEP id=1 reqs=a detail=0", "STEP id=2 reqs=a", "STEP id=3 reqs=a detail=01", ""]).tolist() \
        == [True, False, False, False]
    run = tmp_path / "sampled"
    shutil.copytree(example_run, run)
    st = pq.read_table(run / "steps.parquet")
    names = st.column("name").to_pylist()
    marked = [n + " detail=0" if i % 3 else n for i, n in enumerate(names)]
    pq.write_table(st.set_column(st.schema.get_field_index("name"), "name", pa.array(marked, pa.string())),
                   run / "steps.parquet")
    full, part = run_features(example_run), run_features(run)
    assert part.summary["steps_without_detail"] == sum(1 for i in range(len(names)) if i % 3)
    assert full.summary["steps_without_detail"] == 0
    inst = part.instances
    off = (inst.step >= 0) & (inst.step % 3 != 0)
    on = (inst.step >= 0) & (inst.step % 3 == 0)
    cols = [F[f] for f in DETAIL_FEATURES]
    assert off.any() and np.isnan(inst.X[np.ix_(off, cols)]).all()
    np.testing.assert_array_equal(inst.X[off][:, F["dur_ns"]], full.instances.X[off][:, F["dur_ns"]])
    step_on = on & (inst.family_of() == "STEP")
    assert step_on.any() and (inst.X[step_on][:, F["k_n"]] > 0).all()
    np.testing.assert_array_equal(inst.X[on][:, F["k_ns"]], full.instances.X[on][:, F["k_ns"]])
    step_off = off & (inst.family_of() == "STEP")
    assert np.isfinite(inst.X[step_off][:, F["iter.dur"]]).all()


def test_a_detail_switch_is_left_out_of_instances_and_iteration_times():
    """The recording runtime's ``OTHER detail_switch`` range (a collector switched between detail
    windows) is no instance; the ranges holding it lose their durations and the STEP of its
    iteration its iteration times, which the switch lengthened; other steps keep theirs."""
    def step(i, switch):
        t = i * 100_000
        sched = N("OTHER", "schedule", t, t + 30_000, *([N("OTHER", "detail_switch", t + 1000, t + 21_000)] if switch else []))
        return [sched, N("STEP", f"STEP id={i} reqs=a", t + 30_000, t + 60_000, N("FE", "model.mlp", t + 31_000, t + 50_000))]
    roots = [r for i in range(3) for r in step(i, i == 1)]
    fa = Forest.from_table(forest_table(roots))
    step_of_row = (fa.start // 100_000).astype(np.int64)
    it = np.full((3, len(ITER_FEATURES)), 50_000.0)
    inst = instance_features(fa, step_of_row, step_iter=it)
    fam = inst.family_of()
    assert "OTHER detail_switch" not in set(fam)
    sched = np.flatnonzero(fam == "OTHER schedule")
    assert np.isnan(inst.X[sched[1], F["dur_ns"]]) and inst.X[sched[0], F["dur_ns"]] == 30_000
    st = np.flatnonzero(fam == "STEP")
    assert np.isnan(inst.X[st[1], F["iter.dur"]]) and np.isnan(inst.X[st[1], F["iter.gap"]])
    assert inst.X[st[0], F["iter.dur"]] == 50_000 and inst.X[st[2], F["iter.gap"]] == 50_000
    assert inst.X[st[1], F["dur_ns"]] == 30_000  # the STEP range itself does not hold it
