"""Every CPU-runnable mechanism recorded briefly (campaigns/cpu_mechanisms.toml): its window is
recorded, its effect shows in the trace inside the window, and the labels follow it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from teller.dataset.codec import read_subtrees
from teller.inject.effects import window_effects
from teller.inject.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "campaigns" / "cpu_mechanisms.toml"
pytestmark = pytest.mark.slow  # one recorded campaign of four runs


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    from teller.inject.campaign import run_campaign

    out = tmp_path_factory.mktemp("mech")
    s = run_campaign(load_spec(SPEC), out)
    assert s["crashed"] == 0 and s["finished"] == s["runs"] == 4, s
    return out


@pytest.fixture(scope="module")
def serve(campaign):
    return {r["mechanism"]: r for r in window_effects(campaign / "serve-mixed-r0")}


@pytest.fixture(scope="module")
def tp(campaign):
    return {r["mechanism"]: r for r in window_effects(campaign / "tp-comm-r0")}


def _labels(run: Path) -> list[dict]:
    return pq.read_table(run / "step_labels.parquet").to_pylist()


def _by_mech(run: Path, mech: str) -> tuple[list[dict], list[dict]]:
    rows = _labels(run)
    return [r for r in rows if r["mechanism"] == mech], [r for r in rows if not r["in_window"]]


def test_windows_recorded_and_closed(campaign):
    for run in ("serve-mixed-r0", "tp-comm-r0"):
        lab = json.loads((campaign / run / "labels.json").read_text())
        opened = [w for w in lab["windows"] if w["start_tau_ns"] is not None]
        assert lab["unapplied"] == [], lab["unapplied"]  # every window reached, and for its whole length
        assert {w["mechanism"] for w in opened} == {p["mechanism"] for p in lab["plan"]}
        for w in opened:
            assert w["state"] in ("closed", "closed-at-exit") and w["start_tau_ns"] < w["end_tau_ns"], w
            assert not w["errors"], w


def test_labels_abnormal_only_inside_windows(campaign):
    for run in ("serve-mixed-r0", "tp-comm-r0", "normal-r0", "kv-pressure-r0"):
        rows = _labels(campaign / run)
        assert not any(r["is_anomaly"] and not r["in_window"] for r in rows), run
        assert all(bool(r["operator_labels"]) == r["is_anomaly"] for r in rows), run


@pytest.mark.parametrize("mech", ["hidden_host_sync", "scheduler_stall", "allocator_churn"])
def test_step_latency_grows_in_window(serve, campaign, mech):
    e = serve[mech]
    assert e["in_n"] >= 5
    assert e["in_p50_ms"] > 1.5 * e["out_p50_ms"], e
    inw, _ = _by_mech(campaign / "serve-mixed-r0", mech)
    assert sum(r["is_anomaly"] for r in inw) >= 1


def test_hidden_sync_locator_names_targeted_operator(serve, campaign):
    e = serve["hidden_host_sync"]
    assert e["targets_hit"] == ["FE LlamaAttention"] and e["injections"] > 0
    assert e["target_in_p50_ms"] > 2 * e["target_out_p50_ms"]
    inw, _ = _by_mech(campaign / "serve-mixed-r0", "hidden_host_sync")
    ab = [r for r in inw if r["is_anomaly"]]
    assert ab and all(r["operator_labels"] == ["FE LlamaAttention"] and r["fault_type"] == "runtime" for r in ab)


def test_allocator_churn_shows_in_fill(serve):
    e = serve["allocator_churn"]
    assert e["target_families"] and "BE aten::fill_" in e["target_families"]
    assert e["target_in_p50_ms"] > e["target_out_p50_ms"] + 1.0
    assert e["affected_layers"][0].startswith("BE aten::fill_")


def test_scheduler_stall_adds_its_sleep(serve):
    e = serve["scheduler_stall"]
    assert e["injections"] >= 5 and e["in_p50_ms"] - e["out_p50_ms"] > 0.8 * e["magnitude"]


def test_host_contention_spawned_pinned_hogs(campaign):
    lab = json.loads((campaign / "serve-mixed-r0" / "labels.json").read_text())
    (w,) = [w for w in lab["windows"] if w["mechanism"] == "host_cpu_contention"]
    assert w["extra"]["procs"] >= 1 and w["extra"]["pids"]
    # the hogs need ~0.1-0.2 s to start, longer than this step-anchored window on a fast run:
    # its effect is measured by benchmarks/fault_effects.py with a time window (docs/faults.md)
    e = {r["mechanism"]: r for r in window_effects(campaign / "serve-mixed-r0")}["host_cpu_contention"]
    assert e["in_n"] >= 5


def test_delayed_admission_delays_first_steps(campaign):
    run = campaign / "serve-mixed-r0"
    lab = json.loads((run / "labels.json").read_text())
    (w,) = [w for w in lab["windows"] if w["mechanism"] == "delayed_admission"]
    delayed = set(w["extra"].get("requests", []))
    assert delayed and w["injections"] == len(delayed)
    req = pq.read_table(run / "requests.parquet")
    steps = {r["step_id"]: r for r in pq.read_table(run / "steps.parquet").select(["step_id", "start_ns"]).to_pylist()}
    first: dict[str, int] = {}
    for r in req.to_pylist():
        s = steps[r["step_id"]]["start_ns"]
        first[r["request_id"]] = min(first.get(r["request_id"], s), s)
    delay_ns = int(w["magnitude"] * 1e6)
    # a delayed request was added after the window opened and admitted `magnitude` ms later
    assert all(first[q] >= w["start_tau_ns"] + delay_ns for q in delayed if q in first)
    ab = [r for r in _labels(run) if r["mechanism"] == "delayed_admission" and r["is_anomaly"]]
    assert ab and all(r["operator_labels"] == ["OTHER schedule"] for r in ab)


def test_delayed_admission_shows_as_admission_delay(campaign):
    """The numeric stage's ``iter.admit_delay`` (arrival log line → first step, iterations that ran
    with an empty queue meanwhile) is positive on the labelled delayed-admission steps, on no step
    outside that window, and zero on the steps outside every window that admit a request."""
    from teller.localize.features import ITER_FEATURES, run_features

    run = campaign / "serve-mixed-r0"
    v = run_features(run).steps.iterations[:, ITER_FEATURES.index("iter.admit_delay")]
    lab = _labels(run)  # one row per steps.parquet row, same order
    da = [i for i, r in enumerate(lab) if r["mechanism"] == "delayed_admission" and r["is_anomaly"]]
    assert da and (v[da] > 0).all(), v[da]
    outside = np.array([not r["in_window"] for r in lab]) & np.isfinite(v)
    assert outside.any() and (v[outside] == 0).all(), [(lab[i]["step_num"], v[i]) for i in np.flatnonzero(outside & (v != 0))]
    # the only steps with a delay are those of the delayed-admission window
    in_da = np.array([r["mechanism"] == "delayed_admission" for r in lab])
    assert in_da[np.nan_to_num(v) > 0].all(), [(lab[i]["step_num"], lab[i]["mechanism"], v[i]) for i in np.flatnonzero(np.nan_to_num(v) > 0)]


def test_kv_pressure_caps_the_batch(campaign):
    """Fewer KV blocks cap how many requests share a step; step latency barely moves on the CPU
    (docs/faults.md), so only the batch cap is asserted."""
    lab = json.loads((campaign / "kv-pressure-r0" / "labels.json").read_text())
    assert "--num-blocks" in lab["command"] and lab["command"][lab["command"].index("--num-blocks") + 1] == "2"

    def max_batch(run: str) -> int:
        sid = pq.read_table(campaign / run / "requests.parquet").column("step_id").to_numpy()
        return int(np.unique(sid, return_counts=True)[1].max())

    assert max_batch("kv-pressure-r0") <= 2 < max_batch("normal-r0")


def test_straggler_makes_the_peer_wait(tp, campaign):
    e = tp["straggler_rank"]
    assert e["injections"] > 0
    # rank 1 sleeps before each all_reduce: rank 0 waits inside its COMM ranges
    assert e["comm_in_p50_ms_rank0"] > 1.5 * e["comm_out_p50_ms_rank0"]
    assert e["comm_in_p50_ms_rank0"] > 1.5 * e["comm_in_p50_ms_rank1"]
    inw, _ = _by_mech(campaign / "tp-comm-r0", "straggler_rank")
    ab = [r for r in inw if r["is_anomaly"]]
    # labels: a step is abnormal only above the fault-free p99 of COMM time (both ranks' steps)
    assert all(r["operator_labels"] == ["COMM all_reduce"] and r["fault_type"] == "communication" for r in ab)


def test_throttled_collective_slows_both_ranks(tp, campaign):
    e = tp["throttled_collective"]
    assert e["injections"] > 0
    for rk in (0, 1):
        assert e[f"comm_in_p50_ms_rank{rk}"] > 2 * e[f"comm_out_p50_ms_rank{rk}"]
    inw, _ = _by_mech(campaign / "tp-comm-r0", "throttled_collective")
    assert {r["rank"] for r in inw if r["is_anomaly"]} == {0, 1}


def test_horizontal_records_carry_cross_rank_edges(campaign, tmp_path):
    from teller.dataset.build import build_dataset

    sheet = build_dataset([campaign / "tp-comm-r0", campaign / "normal-r0"], tmp_path / "ds")
    assert sheet["by_view"].get("horizontal", 0) > 0
    rec = pq.read_table(tmp_path / "ds" / "records.parquet")
    hz = rec.filter(pc.equal(rec.column("view"), "horizontal")).to_pylist()
    edges = pq.read_table(tmp_path / "ds" / "comm_edges.parquet").to_pylist()
    sub = read_subtrees(tmp_path / "ds").select(["run_id", "node_id", "layer", "rank", "step_id"])
    nodes = {(r["run_id"], r["node_id"]): r for r in sub.to_pylist()}
    with_edges = [h for h in hz if h["comm_edge_rows"]]
    assert len(with_edges) >= 0.9 * len(hz)
    for h in with_edges[:20]:
        assert sorted(h["ranks"]) == [0, 1]
        for i in h["comm_edge_rows"]:
            e = edges[i]
            assert e["run_id"] == h["run_id"]
            a, b = nodes[(h["run_id"], e["src_node_id"])], nodes[(h["run_id"], e["dst_node_id"])]
            # the collective on one rank and the peer rank's COMM node, both in the record's steps
            assert str(a["layer"]) == str(b["layer"]) == "COMM" and a["rank"] != b["rank"]
            assert {a["step_id"], b["step_id"]} <= set(h["step_ids"])
