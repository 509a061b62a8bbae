"""The shipped workload, alone and under ``teller record``, and the reconstruction of its recording."""

from __future__ import annotations

import json
import logging
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from teller.errors import TellerError
from teller.workload.serve import ServeConfig, make_requests, mean_length, parse_length

STATS_RE = re.compile(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                      r"Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, Prefix cache hit rate: 0\.0%")
TINY = ["--requests", "4", "--rate", "0", "--prompt-len", "uniform:4:12", "--output-len", "6", "--seed", "3"]  # = conftest.TINY_SERVE


def test_length_distributions():
    rng = random.Random(0)
    assert parse_length("7", "x")(rng) == 7
    assert all(3 <= parse_length("uniform:3:5", "x")(rng) <= 5 for _ in range(50))
    assert all(v in (2, 9) for v in (parse_length("choice:2,9", "x")(rng) for _ in range(20)))
    assert all(parse_length("normal:4:10", "x")(rng) >= 1 for _ in range(50))
    assert [mean_length(s, "x") for s in ("7", "uniform:3:6", "choice:2,9,10", "normal:4.5:10")] == [7.0, 4.5, 7.0, 4.5]
    for bad in ("0", "uniform:5:3", "poisson:3", "normal:a:b", "choice:"):
        with pytest.raises(TellerError, match="--x"):
            parse_length(bad, "x")


def test_poisson_arrivals_are_seeded():
    cfg = ServeConfig(requests=400, rate=50.0, seed=7, prompt_len="uniform:2:4", output_len="3")
    a, b = make_requests(cfg, 100), make_requests(cfg, 100)
    assert a == b and [r["id"] for r in a[:3]] == ["req_0", "req_1", "req_2"]
    gaps = [y["arrival_s"] - x["arrival_s"] for x, y in zip(a, a[1:], strict=False)]
    assert all(g >= 0 for g in gaps)
    assert 0.015 < sum(gaps) / len(gaps) < 0.025  # mean inter-arrival 1/rate = 20 ms
    assert make_requests(ServeConfig(requests=3, rate=0), 100)[-1]["arrival_s"] == 0.0
    # the extension continues the same arrival process: the planned requests do not change
    ext = make_requests(cfg, 100, extra=5)
    assert ext[:400] == a and [r["id"] for r in ext[400:]] == [f"req_{i}" for i in range(400, 405)]
    assert all(y["arrival_s"] >= x["arrival_s"] for x, y in zip(ext[399:], ext[400:], strict=False))


@pytest.mark.slow
def test_serve_in_process_logs_each_request(caplog):
    pytest.importorskip("transformers")
    from teller.workload.serve import serve

    caplog.set_level(logging.INFO, logger="teller.workload")
    res = serve(ServeConfig(requests=3, rate=200.0, prompt_len="5", output_len="4", seed=1, warmup=1,
                            stats_every_steps=2))
    s = res["summary"]
    assert s["ok"] and s["requests_finished"] == 3 and s["generated_tokens"] == 12
    assert s["requests_extended"] == 0  # no fault plan in this process: no request past --requests
    assert s["throughput_tok_s"] > 0 and s["steps"] > 0 and s["step_p50_s"] <= s["step_p99_s"]
    assert all(r["generated"] == 4 and r["latency_s"] > 0 for r in res["requests"])
    msgs = [r.getMessage() for r in caplog.records if r.name == "teller.workload"]
    for i in range(3):
        assert any(m.startswith(f"request req_{i} added") for m in msgs)
        assert any(m.startswith(f"request req_{i} finished generated=4") for m in msgs)
        assert f"Added request req_{i}: prompt_tokens=5 max_tokens=4" in msgs
        assert any(re.fullmatch(rf"Finished request req_{i}: prompt_tokens=5 output_tokens=4 e2e=[\d.]+s ttft=[\d.]+s", m)
                   for m in msgs)
    stats = [m for m in msgs if m.startswith("Engine 000: ")]
    assert stats and all(STATS_RE.fullmatch(m) for m in stats), stats[:2]
    assert res["config"]["device"] == "cpu" and res["config"]["model"]["layers"] == 2


@pytest.mark.slow
def test_serve_keeps_admitting_while_asked_and_within_its_bound(monkeypatch):
    """keep_serving() (hooked by a fault plan) extends the arrivals past --requests, never past
    max_extra_requests; every extra request is served in full. By itself it says no."""
    pytest.importorskip("transformers")
    from teller.workload import serve as serve_mod

    assert serve_mod.keep_serving() is False
    monkeypatch.setattr(serve_mod, "keep_serving", lambda: True)
    res = serve_mod.serve(ServeConfig(requests=2, rate=200.0, prompt_len="5", output_len="3", seed=1,
                                      max_extra_requests=2))
    s = res["summary"]
    assert s["ok"] and s["requests_extended"] == 2 and s["requests_finished"] == 4
    assert [r["id"] for r in res["requests"]] == ["req_0", "req_1", "req_2", "req_3"]
    assert [bool(r.get("extension")) for r in res["requests"]] == [False, False, True, True]
    assert all(r["generated"] == 3 for r in res["requests"])


def run_cmd(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, timeout=300)


@pytest.mark.slow
def test_recorded_workload_same_tokens_and_reconstructs(tmp_path: Path, plain_tiny_tokens):
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    rec = run_cmd([sys.executable, "-m", "teller.cli", "record", "-o", str(run), "--collector", "cpu", "--",
                   sys.executable, "-m", "teller.workload", "serve", *TINY, "--save-tokens",
                   "--out-json", str(tmp_path / "rec.json")], tmp_path)
    assert rec.returncode == 0, rec.stderr.decode()[-2000:]
    a = plain_tiny_tokens  # the same TINY workload run without recording (conftest)
    b = json.loads((tmp_path / "rec.json").read_text())["requests"]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # greedy output unchanged by recording
    assert all(len(r["tokens"]) == 6 for r in a)
    assert b"throughput" in rec.stdout  # passed through
    info = json.loads((run / "run.json").read_text())
    assert info["exit_code"] == 0 and info["engine"]["detected"] == ["transformers"]
    assert info["counts"]["hook_errors"] == 0 and info["counts"]["unbalanced_pops"] == 0
    mc = info["model_config"]
    assert mc["num_hidden_layers"] == 2 and mc["hidden_size"] == 128 and mc["class"] == "LlamaForCausalLM"
    logs = [json.loads(x)["text"] for x in (run / "logs" / "stderr.jsonl").read_text().splitlines()]
    assert sum("request req_" in t and " added " in t for t in logs) == 4

    from teller.rundir import RunDir

    names = RunDir(run).read_events().column("name").to_pylist()
    steps = [n for n in names if n.startswith("STEP")]
    assert steps and all(n.endswith("reqs=req_0,req_1,req_2,req_3") or "reqs=req_" in n for n in steps)
    for fe in ("FE LlamaDecoderLayer", "FE LlamaAttention", "FE LlamaMLP", "FE Embedding", "FE LMHead",
               "FE Sampling"):
        assert fe in names
    assert "BE aten::mm" in names

    reconstruct_mod = pytest.importorskip("teller.reconstruct")
    if not hasattr(reconstruct_mod, "reconstruct"):
        pytest.skip("teller.reconstruct.reconstruct not available yet")
    reconstruct_mod.reconstruct(run)
    import pyarrow.parquet as pq

    forest = pq.read_table(run / "forest.parquet").to_pylist()
    step_nodes = [n for n in forest if n["layer"] == "STEP"]
    assert len(step_nodes) == len(steps)
    children = {n["layer"] for n in forest if n["parent_id"] in {s["node_id"] for s in step_nodes}}
    assert {"FE", "BE"} <= children
    fe_ids = {n["node_id"] for n in forest if n["layer"] == "FE"}
    assert any(n["layer"] == "BE" and n["parent_id"] in fe_ids for n in forest)
    reqs = pq.read_table(run / "requests.parquet").column("request_id").to_pylist()
    assert set(reqs) == {"req_0", "req_1", "req_2", "req_3"}


def _step_fields(name: str) -> dict[str, int]:
    """The batch-context fields of a STEP message (after ``STEP id=.. reqs=..``)."""
    return {k: int(v) for k, v in (kv.split("=") for kv in name.split()[3:])}


@pytest.mark.slow
def test_recorded_serve_has_batch_context_idle_ranges_and_service_logs(tmp_path: Path):
    """Arrivals with gaps between them: STEP names carry the batch context, the engine thread
    records OTHER idle while it waits, and the service logs mine into templates and align."""
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    rec = run_cmd([sys.executable, "-m", "teller.cli", "record", "-o", str(run), "--collector", "cpu",
                   "--detail-every", "5", "--detail-window", "2", "--",
                   sys.executable, "-m", "teller.workload", "serve", "--requests", "6", "--rate", "6",
                   "--prompt-len", "uniform:4:12", "--output-len", "8", "--seed", "3", "--stats-every-steps", "4"],
                  tmp_path)
    assert rec.returncode == 0, rec.stderr.decode()[-2000:]
    info = json.loads((run / "run.json").read_text())
    assert info["counts"]["hook_errors"] == 0 and info["counts"]["unbalanced_pops"] == 0

    from teller.rundir import RunDir

    ev = RunDir(run).read_events()
    names = ev.column("name").to_pylist()
    steps = [n for n in names if n.startswith("STEP")]
    assert steps and all(re.fullmatch(r"STEP id=\d+ reqs=\S+ prefill=\d+ decode=\d+ waiting=\d+ kv_used=\d+ "
                                      r"kv_total=\d+ preempted=\d+( detail=0)?", n) for n in steps), steps[:3]
    # windows of two detailed steps every five (--detail-every 5 --detail-window 2), in step-id order
    by_id = sorted(steps, key=lambda n: int(n.split()[1][3:]))
    assert [n.endswith(" detail=0") for n in by_id] == [i % 5 >= 2 for i in range(len(by_id))]
    gate = info["processes"][0]["collector"]["detail"]
    assert gate["every"] == 5 and gate["window"] == 2 and gate["steps"] == len(steps)
    assert gate["detailed"] == sum(not n.endswith(" detail=0") for n in steps)
    fields = [_step_fields(n.removesuffix(" detail=0")) for n in steps]
    assert all(f["prefill"] + f["decode"] > 0 and f["kv_used"] <= f["kv_total"] and f["kv_total"] > 0
               for f in fields)
    assert fields[0]["prefill"] > 0 and fields[0]["decode"] == 0  # the first step prefills
    assert any(f["decode"] > 0 for f in fields) and any(f["kv_used"] > 0 for f in fields)
    # a decode-only step: one token per request in its batch
    assert all(f["decode"] == len(n.split()[2][5:].split(",")) for n, f in zip(steps, fields, strict=True)
               if f["prefill"] == 0)
    # idle waits between arrivals, on the engine thread (the STEPs' thread), never inside a STEP
    tids = ev.column("tid").to_pylist()
    step_tid = {t for n, t in zip(names, tids, strict=True) if n.startswith("STEP")}
    idle = [i for i, n in enumerate(names) if n == "OTHER idle"]
    assert idle and {tids[i] for i in idle} == step_tid
    starts, ends = ev.column("start_ns").to_pylist(), ev.column("end_ns").to_pylist()
    spans = [(starts[i], ends[i]) for i, n in enumerate(names) if n.startswith("STEP")]
    assert not any(a < starts[i] < b for i in idle for a, b in spans)

    from teller.logs import align_run
    from teller.reconstruct import reconstruct

    summary = reconstruct(run)
    align_run(run)  # on the reconstructed steps
    import pyarrow.parquet as pq

    # aten-level BE ranges in the detailed steps only; FE ranges in every step
    from teller.forest import Forest
    from teller.reconstruct.steps import without_detail
    from teller.rundir import LAYER_CODE

    fa = Forest.read(run)
    sampled = without_detail(pq.read_table(run / "steps.parquet").column("name").to_pylist())
    n_steps = len(sampled)
    be = np.bincount(fa.step_idx[(fa.layer == LAYER_CODE["BE"]) & (fa.step_idx >= 0)], minlength=n_steps)
    fe = np.bincount(fa.step_idx[(fa.layer == LAYER_CODE["FE"]) & (fa.step_idx >= 0)], minlength=n_steps)
    assert sampled.any() and (~sampled).any()
    assert (be[sampled] == 0).all() and (be[~sampled] > 0).all() and (fe > 0).all()
    assert summary["steps_without_detail"] == int(sampled.sum())
    # the in-run cost of detail (benchmarks/detail_sampling.py --pace): each window of two detailed
    # iterations set against the light ones around it
    import importlib.util

    spec = importlib.util.spec_from_file_location("detail_sampling", Path(__file__).resolve().parents[1] / "benchmarks" / "detail_sampling.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    pc_ = ds.pace(run)
    it = pq.read_table(run / "iterations.parquet")
    assert pc_["iterations"] == it.num_rows == n_steps and pc_["detailed"] == int((~sampled).sum())
    assert pc_["switch_iterations"] == 0  # the cpu collector has nothing to switch
    assert 1 <= pc_["windows_paired"] <= -(-n_steps // 5) and np.isfinite(pc_["detail_cost_median"])

    rows = pq.read_table(run / "log_alignment.parquet").to_pylist()
    by_tpl: dict[str, list[dict]] = {}
    for r in rows:
        by_tpl.setdefault(r["template"], []).append(r)
    stats = [t for t in by_tpl if "Engine" in t and "Avg prompt throughput" in t]
    assert len(stats) == 1, stats  # one template; the numbers are its parameters
    assert "Running: <NUM> reqs, Waiting: <NUM> reqs, GPU KV cache usage: <NUM>%" in stats[0]
    assert len(by_tpl[stats[0]]) >= 2 and all(r["step_id"] is not None and r["step_id"] >= 0
                                              for r in by_tpl[stats[0]])  # each on a step
    fin = [t for t in by_tpl if t.startswith("teller.workload: Finished request <REQ>")]
    assert fin == ["teller.workload: Finished request <REQ>: prompt_tokens=<NUM> output_tokens=<NUM> e2e=<NUM> "
                   "ttft=<NUM>"]
    assert {r["request_id"] for r in by_tpl[fin[0]]} == {f"req_{i}" for i in range(6)}
    assert any(t.startswith("teller.workload: Added request <REQ>") for t in by_tpl)


def test_engine_stats_lines_and_warnings(caplog):
    """The periodic statistics every N steps, an offload warning the KV-pressure label pattern
    reads, and one high-KV warning per interval."""
    from teller.inject.mechanisms import get
    from teller.workload.stats import EngineStats

    lg = logging.getLogger("teller.workload.test")
    caplog.set_level(logging.INFO, logger="teller.workload.test")
    st = EngineStats(lg, interval_s=3600.0, every_steps=2)
    st.step(12, 0, running=2, waiting=1, kv_used=2, kv_total=16)
    assert not caplog.records  # not due yet
    st.step(0, 2, running=2, waiting=1, kv_used=15, kv_total=16, offloaded=["req_3", "req_5"])
    st.step(0, 2, running=2, waiting=1, kv_used=16, kv_total=16)  # high again, same interval: no new warning
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records]
    off = [m for lvl, m in msgs if lvl == "WARNING" and m.startswith("Offloaded")]
    assert off == ["Offloaded 2 requests (KV cache full, 15/16 blocks in use): req_3,req_5; Running: 2 reqs, "
                   "Waiting: 1 reqs"]
    assert re.search(get("kv_cache_pressure").log_pattern, off[0])
    high = [m for lvl, m in msgs if lvl == "WARNING" and m.startswith("KV cache usage is high")]
    assert high == ["KV cache usage is high: 93.8% (15/16 blocks in use); new requests may wait or be offloaded"]
    stats = [m for lvl, m in msgs if lvl == "INFO"]
    assert len(stats) == 1 and STATS_RE.fullmatch(stats[0]) and "GPU KV cache usage: 93.8%" in stats[0]
    assert "Running: 2 reqs, Waiting: 1 reqs" in stats[0] and st.lines == 1


@pytest.mark.slow
def test_recorded_kv_pressure_counts_preemptions_and_warns(tmp_path: Path):
    """Too few KV blocks: the scheduler offloads requests; the STEP of that iteration says how
    many (preempted=), kv_used never exceeds kv_total, and the workload logs the offload."""
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    rec = run_cmd([sys.executable, "-m", "teller.cli", "record", "-o", str(run), "--collector", "cpu", "--",
                   sys.executable, "-m", "teller.workload", "serve", "--requests", "6", "--rate", "50",
                   "--prompt-len", "uniform:20:40", "--output-len", "30", "--seed", "3", "--num-blocks", "3"],
                  tmp_path)
    assert rec.returncode == 0, rec.stderr.decode()[-2000:]
    from teller.rundir import RunDir

    steps = [n for n in RunDir(run).read_events().column("name").to_pylist() if n.startswith("STEP")]
    fields = [_step_fields(n) for n in steps]
    assert all(f["kv_total"] == 3 and 0 <= f["kv_used"] <= 3 for f in fields)
    assert sum(f["preempted"] for f in fields) >= 1 and max(f["waiting"] for f in fields) >= 1
    logs = [json.loads(x)["text"] for x in (run / "logs" / "stderr.jsonl").read_text().splitlines()]
    off = [t for t in logs if "WARNING teller.workload: Offloaded " in t]
    assert off and all(re.search(r"Offloaded \d+ requests \(KV cache full, \d/3 blocks in use\): req_\d", t)
                       for t in off)
    assert any("KV cache usage is high: " in t for t in logs)


def _record_quiet(tmp_path: Path, mode: str, every: int, window: int, output_len: int) -> tuple[Path, dict]:
    """A CPU recording of the workload with ``TELLER_DETAIL_QUIET=mode``; its run folder and the
    detail gate's report (no hook error, no unbalanced range)."""
    import os

    run = tmp_path / "run"
    env = dict(os.environ, TELLER_DETAIL_QUIET=mode)
    rec = subprocess.run([sys.executable, "-m", "teller.cli", "record", "-o", str(run), "--collector", "cpu",
                          "--detail-every", str(every), "--detail-window", str(window), "--",
                          sys.executable, "-m", "teller.workload", "serve", "--requests", "8", "--rate", "0",
                          "--prompt-len", "uniform:4:12", "--output-len", str(output_len), "--seed", "3"],
                         cwd=tmp_path, capture_output=True, timeout=300, env=env)
    assert rec.returncode == 0, rec.stderr.decode()[-2000:]
    info = json.loads((run / "run.json").read_text())
    assert info["counts"]["hook_errors"] == 0 and info["counts"]["unbalanced_pops"] == 0
    return run, info["processes"][0]["collector"]["detail"]


@pytest.mark.slow
def test_alternate_quiet_blocks_sit_beside_light_ones(tmp_path: Path):
    """TELLER_DETAIL_QUIET=alternate: between the detail windows, every other block of W steps is
    quiet (STEP range only, ``quiet=1`` in its message), the others keep the light recording (FE
    ranges, no BE); benchmarks/detail_sampling.py --pace pairs the light blocks with the quiet ones."""
    pytest.importorskip("transformers")
    run, gate = _record_quiet(tmp_path, "alternate", 8, 2, 16)
    assert gate["quiet"] == "alternate" and gate["steps"] >= 16

    from teller.forest import Forest
    from teller.reconstruct import reconstruct
    from teller.reconstruct.steps import without_detail
    from teller.rundir import LAYER_CODE

    reconstruct(run)
    import pyarrow.parquet as pq

    st = pq.read_table(run / "steps.parquet", columns=["name", "start_ns"]).sort_by("start_ns")
    names = st.column("name").to_pylist()
    light_or_quiet = without_detail(names)
    quiet = np.asarray([" quiet=1" in n for n in names], bool)
    seq = np.arange(len(names))
    assert (light_or_quiet == (seq % 8 >= 2)).all()  # windows of 2 every 8
    assert (quiet == (light_or_quiet & ((seq // 2) % 2 == 1))).all()  # every other block of 2 between them
    order = np.argsort(pq.read_table(run / "steps.parquet", columns=["start_ns"]).column("start_ns").to_numpy(), kind="stable")
    fa = Forest.read(run)
    inside = fa.step_idx >= 0
    n_fe = np.bincount(fa.step_idx[(fa.layer == LAYER_CODE["FE"]) & inside], minlength=len(names))[order]
    n_be = np.bincount(fa.step_idx[(fa.layer == LAYER_CODE["BE"]) & inside], minlength=len(names))[order]
    assert (n_fe[quiet] == 0).all() and (n_be[quiet] == 0).all()
    light = light_or_quiet & ~quiet
    assert light.any() and (n_fe[light] > 0).all() and (n_be[light] == 0).all()
    assert (n_be[~light_or_quiet] > 0).all()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from detail_sampling import pace

    p = pace(run)
    assert p["quiet_iterations"] == int(quiet.sum()) and p["light_blocks_paired"] >= 1


@pytest.mark.slow
def test_quiet_steps_record_their_step_range_only(tmp_path: Path):
    """TELLER_DETAIL_QUIET=1 (a benchmark setting): steps outside the detail windows keep their
    STEP range and nothing recorded inside it, detailed steps everything, with no unbalanced range;
    the greedy output is the engine's own (tests above), and --pace pairs the two kinds."""
    pytest.importorskip("transformers")
    run, gate = _record_quiet(tmp_path, "1", 4, 2, 8)
    assert gate["quiet"] is True and gate["every"] == 4 and gate["window"] == 2

    from teller.forest import Forest
    from teller.reconstruct import reconstruct
    from teller.reconstruct.steps import without_detail
    from teller.rundir import LAYER_CODE

    reconstruct(run)
    import pyarrow.parquet as pq

    names = pq.read_table(run / "steps.parquet").column("name").to_pylist()
    assert len(names) == gate["steps"]  # every step keeps its STEP range
    quiet = without_detail(names)
    assert quiet.any() and (~quiet).any()
    fa = Forest.read(run)
    inside = fa.step_idx >= 0
    for layer in ("FE", "BE"):
        n = np.bincount(fa.step_idx[(fa.layer == LAYER_CODE[layer]) & inside], minlength=len(names))
        assert (n[quiet] == 0).all() and (n[~quiet] > 0).all(), layer
