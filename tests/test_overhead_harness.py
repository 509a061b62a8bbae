"""The long overhead harness's bookkeeping (benchmarks/overhead.py): intervals, pairing, rotation,
calibration, resuming from a cut JSONL. The runs themselves need the workload (a CPU smoke run is
in benchmarks/README.md); nothing here times anything."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"
_spec = importlib.util.spec_from_file_location("overhead_bench", _PATH)
ov = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ov)


def test_t_interval_by_hand():
    d = ov.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    # mean 3, sd sqrt(2.5) = 1.58114, t(0.975, 4) = 2.776: half = 2.776 * 1.58114 / sqrt(5) = 1.96293
    assert d["n"] == 5 and d["mean"] == pytest.approx(3.0) and d["sd"] == pytest.approx(math.sqrt(2.5))
    assert d["half"] == pytest.approx(1.96293, abs=1e-4)
    assert (d["lo"], d["hi"]) == (pytest.approx(1.03707, abs=1e-4), pytest.approx(4.96293, abs=1e-4))
    assert ov.t_interval([7.0]) == {"n": 1, "mean": 7.0} and ov.t_interval([]) == {"n": 0}
    assert ov.t975(4) == 2.776 and ov.t975(50) == pytest.approx(2.0105)
    assert 1.96 < ov.t975(1000) < ov.t975(120) == 1.980
    with pytest.raises(ValueError):
        ov.t975(0)


def _row(config, rnd, tok, p50, **kw):
    return {"config": config, "round": rnd, "exit_code": 0, "throughput_tok_s": tok, "step_p50_s": p50,
            "step_p99_s": 2 * p50, "serving_s": 61.0, "process_wall_s": 80.0, "process_cpu_s": 90.0, **kw}


def test_paired_loss_by_round_by_hand():
    rows = [_row("none", 0, 100, 0.100), _row("cupti", 0, 97, 0.110),
            _row("none", 1, 200, 0.200), _row("cupti", 1, 190, 0.200),
            _row("none", 2, 50, 0.050), _row("cupti", 2, 49, 0.050),
            _row("cupti", 3, 10, 1.0),  # its none run failed: unpaired, left out of the loss
            {"config": "none", "round": 3, "exit_code": 1},
            _row("none", 0, 1.0, 9.0, warmup=True)]  # a warm-up is never counted
    s = ov.summarize_long(rows, ["none", "cupti"])
    loss = s["cupti"]["tok_s_loss_pct"]
    # losses 3, 5, 2 %: mean 3.333, sd 1.5275, t(0.975, 2) = 4.303, half = 4.303 * 1.5275 / sqrt(3) = 3.7949
    assert loss["n"] == 3 and loss["mean"] == pytest.approx(10 / 3)
    assert loss["half"] == pytest.approx(3.7949, abs=1e-3)
    growth = s["cupti"]["step_p50_growth_pct"]  # 10, 0, 0 %
    assert growth["n"] == 3 and growth["mean"] == pytest.approx(10 / 3)
    assert s["none"]["runs"] == 3 and s["cupti"]["runs"] == 4 and s["none"]["failed_runs"] == 1
    assert s["none"]["tok_s"]["mean"] == pytest.approx(350 / 3)
    md = ov.table_long(s)
    assert "| cupti | 4 |" in md and "3.3 [-0.5, 7.1] (±3.8, 3 rounds)" in md
    short = ov.summarize_long(rows, ["none", "cupti"], min_serving_s=70.0)
    assert short["cupti"]["runs"] == 0


def test_rotation_puts_every_configuration_first_once():
    cfg = ["none", "hooks", "cupti", "cupti_deferred", "cupti_lean"]
    orders = [ov.rotation(cfg, r) for r in range(5)]
    assert [o[0] for o in orders] == cfg and all(sorted(o) == sorted(cfg) for o in orders)
    assert ov.rotation(cfg, 7) == orders[2]


def test_spread_pools_the_runs_of_each_configuration():
    runs = [{"config": c, "round": i, "throughput_tok_s": v, "serving_s": 70.0, "exit_code": 0}
            for c, vals in (("none", [100.0, 110.0, 90.0]), ("cupti", [95.0, 105.0]), ("hooks", [99.0]))
            for i, v in enumerate(vals)]
    sp = ov.spread(runs, ["none", "cupti", "hooks"])
    # CV of none 10%, of cupti 7.07%; pooled over 2 + 1 degrees of freedom; hooks (one run) adds none
    cv = ((2 * 0.1 ** 2 + 1 * (7.0710678 / 100) ** 2) / 3) ** 0.5 * 100
    assert sp["degrees_of_freedom"] == 3 and sp["pooled_cv_pct"] == pytest.approx(cv, rel=1e-6)
    assert sp["paired_sd_points"] == pytest.approx(2 ** 0.5 * cv)
    n = sp["rounds_needed"]
    assert ov.t975(n - 1) * sp["paired_sd_points"] / n ** 0.5 <= 2.0 < ov.t975(n - 2) * sp["paired_sd_points"] / (n - 1) ** 0.5
    assert "needs ~%d rounds" % n in ov.spread_line(sp)
    assert ov.spread(runs[-1:], ["hooks"]) == {"configs_with_two_runs": 0}
    assert "no configuration has two runs" in ov.spread_line({"configs_with_two_runs": 0})


def test_a_round_the_deadline_cuts_runs_its_baseline_first():
    cfg = ["none", "cupti", "cupti_lazy", "cupti_nodetail_lazy"]
    # round 1 rotated: none comes last; with time for every run the rotation stays
    assert ov.round_todo(cfg, 1, set(), left_s=1000.0, run_s=120.0) == ov.rotation(cfg, 1)
    assert ov.rotation(cfg, 1)[0] != "none"
    cut = ov.round_todo(cfg, 1, set(), left_s=300.0, run_s=120.0)  # room for 2 of 4
    assert cut[0] == "none" and sorted(cut) == sorted(cfg)
    assert cut[1:] == [c for c in ov.rotation(cfg, 1) if c != "none"]
    # baseline already run: nothing to move; a finished round is empty
    assert ov.round_todo(cfg, 1, {"none"}, left_s=10.0, run_s=120.0) == [c for c in ov.rotation(cfg, 1) if c != "none"]
    assert ov.round_todo(cfg, 1, set(cfg), left_s=10.0, run_s=120.0) == []


def test_calibration_from_a_line_and_from_one_run():
    runs = [{"throughput_tok_s": 1000 / 12, "serving_s": 12.0, "generated_tokens": 1000},
            {"throughput_tok_s": 2000 / 22, "serving_s": 22.0, "generated_tokens": 2000}]
    fixed, per_token = ov.serving_model(runs)
    assert fixed == pytest.approx(2.0) and per_token == pytest.approx(0.01)
    assert ov.calibrate_requests(runs, 66.0, 32.0) == 200  # (66 - 2) / 0.01 = 6,400 tokens / 32
    assert ov.calibrate_requests(runs, 66.0, 32.0, max_requests=150) == 150
    one = [{"throughput_tok_s": 80.0, "serving_s": 12.5, "generated_tokens": 1000, "steady_tok_s": 100.0}]
    assert ov.serving_model(one) == (pytest.approx(2.5), pytest.approx(0.01))
    assert ov.calibrate_requests([], 66.0, 32.0) is None
    reqs = [{"finish_s": float(i), "generated": 10} for i in range(11)]
    assert ov.steady_throughput(reqs) == pytest.approx(10.0)  # 10 tokens a second between 20% and 80%


def test_jsonl_resume_keeps_whole_lines_and_the_estimate_follows_runs(tmp_path):
    p = tmp_path / "runs.jsonl"
    ov._append(p, _row("none", 0, 100, 0.1))
    ov._append(p, _row("hooks", 0, 90, 0.1, process_wall_s=100.0))
    with open(p, "a") as f:
        f.write('{"config": "cupti", "rou')  # cut by a kill
    rows = ov.load_jsonl(p)
    assert [r["config"] for r in rows] == ["none", "hooks"]
    assert ov.estimate_run_s(rows, 999.0) == pytest.approx(1.15 * 100 + 10)
    assert ov.estimate_run_s([], 999.0) == 999.0
    json.dumps(ov.summarize_long(rows, ["none", "hooks"]))


def test_workload_args_and_slots():
    w = ov._set_arg(["--rate", "0"], "--requests", "300")
    assert ov._set_arg(w, "--requests", "400") == ["--rate", "0", "--requests", "400"]
    assert ov._get_arg(w, "--rate") == "0" and ov._get_arg(w, "--seed") is None
    assert ov._expand("0-2,5") == [0, 1, 2, 5] and ov._compress([5, 0, 1, 2]) == "0-2,5"
    from teller.workload.serve import mean_length  # the mean output length the calibration uses

    assert mean_length("uniform:32:128", "output-len") == 80 and mean_length("32", "output-len") == 32
    slots = ov.make_slots([0, 1, 2], pin=False)
    assert [s["gpu"] for s in slots] == [0, 1, 2] and all(s["cpus"] is None for s in slots)
    pinned = ov.make_slots([None, None], pin=True)
    cpus = [set(s["cpus"]) for s in pinned]
    assert all(cpus) and not cpus[0] & cpus[1]
    # serial runs pinned to a bound of whole cores (this machine has 2 cpus: one physical group at least)
    one = ov.make_slots([None], pin=True, cores=1)
    groups = ov._physical_groups(sorted(__import__("os").sched_getaffinity(0)))
    assert one[0]["cpus"] == sorted(groups[0])  # the first whole core only, not every cpu allowed


def test_gpu_query_falls_back_to_the_basic_fields(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/bash\ncase \"$*\" in\n  *power.draw*) echo bad field >&2; exit 2;;\n"
                   "  *) echo '0, 1980, 3201, 35'; echo '1, 345, 3201, 30';;\nesac\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    q = ov.gpu_query()
    assert [g["index"] for g in q] == [0, 1] and q[1]["sm_mhz"] == 345.0 and q[0]["power_w"] is None
    assert ov._gpu_of(q, 1)["temp_c"] == 30.0 and ov._gpu_of(None, 0) is None


def test_summarize_pairs_each_files_rounds_within_that_file(tmp_path, capsys):
    """Two calls with separate states both count from round 0: a run pairs with its own file's
    `none` run (losses 10% and 20%), not with the other file's."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    w = ["--requests", "10"]
    a.write_text("\n".join(json.dumps(_row(c, 0, t, 0.1, workload=w, started_unix=k)) for k, (c, t) in
                           enumerate((("none", 100.0), ("cupti", 90.0)))) + "\n")
    b.write_text("\n".join(json.dumps(_row(c, 0, t, 0.1, workload=w, started_unix=10 + k)) for k, (c, t) in
                           enumerate((("none", 200.0), ("cupti", 160.0)))) + "\n")
    out = tmp_path / "s.json"
    ov.summarize_main(["--summarize", str(a), str(b), "--configs", "none,cupti", "--json", str(out)])
    s = json.loads(out.read_text())["summary"]
    loss = s["cupti"]["tok_s_loss_pct"]
    assert loss["n"] == 2 and loss["mean"] == pytest.approx(15.0)  # (10 + 20) / 2; pairing by round alone: (55 + 20) / 2
    assert s["none"]["runs"] == 2 and "| cupti | 2 |" in capsys.readouterr().out
