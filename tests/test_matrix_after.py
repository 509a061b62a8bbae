"""scripts/gpu/matrix_after.py on the CPU (tiny models of a slice of data/h200_v2): the experts of
models trained without them, fitted side by side as `teller rca experts` fits them, and the model
rows scored once per training seed with each model's config.json packed beside the answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rca_slice import DATA, need_rca

ROOT = Path(__file__).resolve().parents[1]


def test_experts_then_one_evaluation_per_seed(tmp_path):
    need_rca()
    pytest.importorskip("xgboost")
    if not (DATA / "iterations.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    from test_rca_floor import _small_with_iterations

    small = _small_with_iterations(tmp_path / "ds")
    work, out = tmp_path / "work", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    recipe = "mot:request:unit=iteration,op_unit=family,unit_stats=1,flag_expert=0,type_expert=0,op_expert=0"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "rca_matrix.py"), "--data", str(small), "--out",
                        str(tmp_path / "train"), "--work", str(work), "--device", "cpu", "--config", "tiny", "--workers", "1",
                        "--threads", "1", "--epochs", "1", "--batch-size", "16", "--deadline-s", "900",
                        "--job", f"a={recipe},seed=0", "--job", f"b={recipe},seed=1"],
                       capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    before = {n: json.loads((work / n / "config.json").read_text())["calibration"] for n in ("a", "b")}
    assert not any("flag_expert" in c for c in before.values())
    script = [sys.executable, str(ROOT / "scripts" / "gpu" / "matrix_after.py")]
    common = ["--work", str(work), "--data", str(small), "--out", str(out), "--device", "cpu", "--workers", "2", "--cores", "2"]
    r = subprocess.run([*script, "experts", *common], capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((out / "experts.json").read_text())
    assert res["experts"] == {"a": 0, "b": 0}
    for n in ("a", "b"):
        assert "experts " in (out / f"experts_{n}.log").read_text()
        cal = json.loads((work / n / "config.json").read_text())["calibration"]
        assert "episode_floor" in cal and "novelty" in cal
        if "flag_expert" in cal:  # fitted with the training's seed
            assert cal["flag_expert"]["seed"] == (0 if n == "a" else 1)
    r = subprocess.run([*script, "evaluate", *common, "--methods", "teller_mot_family", "--limit-steps", "40",
                        "--view", "vertical"],
                       capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((out / "evaluate.json").read_text())
    assert res["evaluate"] == {"seed0": 0, "seed1": 0} and res["seeds"] == {"0": ["a"], "1": ["b"]}
    with tarfile.open(out / "evaluate.tar") as tf:
        tf.extractall(tmp_path / "back", filter="data")
    back = tmp_path / "back"
    for seed, name in ((0, "a"), (1, "b")):
        got = json.loads((back / f"evaluate_s{seed}" / "results.json").read_text())
        assert str(work / f"_eval_models_s{seed}" / name) in json.dumps(got)  # the row read the model of its seed
        pred = pq.read_table(back / f"evaluate_s{seed}" / "predictions.parquet")
        assert set(pred.column("method").to_pylist()) == {"teller_mot_family"} and pred.num_rows > 0
        assert json.loads((back / "models" / name / "config.json").read_text()) == json.loads((work / name / "config.json").read_text())
    # an A/B of an expert setting on the same weights: copies of a model get their own experts and
    # are scored apart, the original untouched
    (work / "a" / "marker").write_text("x")
    r = subprocess.run([*script, "experts", *common, "--jobs", "a", "--suffix", "_w4", "--expert-args",
                        "--in-window-weight 4"], capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads((out / "experts_w4.json").read_text())["experts"] == {"a_w4": 0}
    assert (work / "a_w4" / "marker").is_file() and any((work / "a_w4").glob("model*.safetensors"))
    cal_a = json.loads((work / "a" / "config.json").read_text())["calibration"]
    cal_w4 = json.loads((work / "a_w4" / "config.json").read_text())["calibration"]
    assert cal_w4["flag_expert"]["in_window_weight"] == 4.0 and cal_a["flag_expert"]["in_window_weight"] == 1.0
    r = subprocess.run([*script, "evaluate", *common, "--jobs", "a_w4", "--tag", "_w4", "--methods", "teller_mot_family",
                        "--limit-steps", "40", "--view", "vertical"], capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads((out / "evaluate_w4.json").read_text())["seeds"] == {"0": ["a_w4"]}
    with tarfile.open(out / "evaluate_w4.tar") as tf:
        tf.extractall(tmp_path / "back_w4", filter="data")
    got = json.loads((tmp_path / "back_w4" / "evaluate_s0" / "results.json").read_text())
    assert str(work / "_eval_models_s0_w4" / "a_w4") in json.dumps(got)
