"""benchmarks/rank_skew.py: a horizontal step's rank skew (spread over ranks / mean per rank) by
hand, the summary's groups and cuts, and the whole script on data/h200_v2's straggler steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import rank_skew as rs  # noqa: E402  (a script of benchmarks/)

DS = ROOT / "data" / "h200_v2"


def test_rank_skew_by_hand():
    names = ["wall_ns", "comm_ns", "spread_comm_ns"]
    # two ranks: 300 and 100 ns of COMM (sum 400, spread 200, mean 200): skew 1; equal ranks: 0
    std = np.array([[0, 400, 200], [0, 400, 0], [0, 0, 0]], float)
    assert rs.rank_skew(std, names, np.array([2, 2, 2])).tolist() == [1.0, 0.0, 0.0]  # no COMM: 0, not NaN
    with pytest.raises(ValueError, match="no feature 'wall_ns' with its spread"):
        rs.rank_skew(std, names, np.array([2, 2, 2]), "wall_ns")


def test_summary_groups_and_cuts():
    skew = np.array([0.9, 0.45, 0.2, 0.6, 0.1, 0.5])
    part = np.array([0, 2, 2, 2, 2, 0])
    ab = np.array([True, True, False, False, True, False])
    mech = np.array(["s", "s", "", "", "x", ""])
    run = np.array(["a", "a", "a", "b", "b", "c"])
    got = rs.summary(skew, part, ab, mech, run, np.arange(6), "s")
    assert got["parts"]["train"]["s"]["steps"] == 1 and got["parts"]["train"]["normal"]["steps"] == 1
    assert got["parts"]["test"]["other abnormal"] == {"steps": 1, **{f"p{q}": 0.1 for q in rs.QUANTILES}}
    assert got["parts"]["val"]["normal"] == {"steps": 0}
    assert got["test_steps"] == [{"run": "a", "step": 1, "skew": 0.45}]
    assert got["cuts"]["0.4"]["test_normal_above"] == 1 and got["cuts"]["0.4"]["test_normal_above_by_run"] == {"b": 1}
    assert got["cuts"]["0.5"]["test_target_above"] == 0 and got["cuts"]["0.4"]["test_target_above"] == 1
    assert got["cuts"]["0.4"]["train_normal_above"] == 1 and got["cuts"]["0.5"]["train_normal_above"] == 0
    assert "runs" not in got
    win = np.array([True, True, True, False, False, False])
    runs = rs.summary(skew, part, ab, mech, run, np.arange(6), "s", win)["runs"]
    assert list(runs) == ["a"]  # the runs with the mechanism's abnormal steps
    assert runs["a"]["steps"] == 3 and runs["a"]["in_window"] == 3 and runs["a"]["out_of_window"] == 0
    assert runs["a"]["above_0.4"] == {"abnormal": 2, "in_window_normal": 0, "out_of_window": 0, "out_of_window_steps": []}


def test_the_straggler_steps_of_a_real_dataset(tmp_path, capsys):
    if not (DS / "records.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    out = tmp_path / "s.json"
    assert rs.main([str(DS), "--split", "request", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    tr = got["parts"]["train"]
    assert tr["straggler_rank"]["steps"] > 0 and tr["normal"]["steps"] > 100
    # the other ranks wait for the straggler: its steps' skew is well above the normal steps'
    assert tr["straggler_rank"]["p50"] > 2 * tr["normal"]["p50"]
    # the straggler's runs: every labelled step counted once, inside its windows
    assert got["runs"] and all(r["abnormal"] <= r["in_window"] for r in got["runs"].values())
    assert rs.main([str(DS), "--split", "request", "--mechanism", "no_such"]) == 2
    assert "no horizontal step of mechanism 'no_such'" in capsys.readouterr().err
    assert rs.main([str(DS), "--split", "nope"]) == 2
    assert "no split 'nope'" in capsys.readouterr().err
