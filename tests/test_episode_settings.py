"""benchmarks/episode_settings.py recomputes the row's flags under other lasting-departure
settings from what gap_anatomy.py keeps, and chooses one by its stated rule; checked on
hand-built steps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("episode_settings", ROOT / "benchmarks" / "episode_settings.py")
es = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(es)


def _steps() -> dict[str, np.ndarray]:
    """12 scored steps: the model (over time) flags 0-1; the stage flags 2-9: 2-3 in an episode of
    2 (model p 0.5), 4-9 in an episode of 6 (p 0.005 on 4-5, 0.05 on 6-9); 9 against a reference
    of another deployment. Abnormal: 0, 2, 3, 6, 7, 8, 9, 11."""
    n = 12
    s = np.arange(n)
    stage = (s >= 2) & (s <= 9)
    episode = np.where((s >= 2) & (s <= 3), 2, np.where(stage, 6, 0))
    p = np.where(s < 2, 0.9, np.where(s < 4, 0.5, np.where(s < 6, 0.005, 0.05)))
    t = {"view": np.array(["vertical"] * n), "test": np.ones(n, bool), "abnormal": np.isin(s, [0, 2, 3, 6, 7, 8, 9, 11]),
         "sustained_flag": s < 2, "stage_flag": stage, "episode": episode, "own_reference": s != 9, "model_p": p}
    t["flag"] = es.row_flags(t, *es.CURRENT)
    return t


def test_row_flags_keep_lasting_departures_of_e_or_more_that_the_model_gives_f():
    t = _steps()
    assert np.flatnonzero(es.row_flags(t, 5, 0.01)).tolist() == [0, 1, 6, 7, 8]  # 4-5 under the floor, 9 another deployment
    assert np.flatnonzero(es.row_flags(t, 5, 0.0)).tolist() == [0, 1, 4, 5, 6, 7, 8]
    assert np.flatnonzero(es.row_flags(t, 2, 0.01)).tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert np.flatnonzero(es.row_flags(t, 8, 0.0)).tolist() == [0, 1]
    assert np.flatnonzero(es.row_flags(t, 1, 0.1)).tolist() == [0, 1, 2, 3]


def test_grid_refuses_steps_whose_row_it_does_not_reproduce_and_scores_every_setting():
    t = _steps()
    g = es.grid(t)
    assert len(g) == len(es.EPISODES) * len(es.FLOORS)
    # (2, 0.01): flags 0,1,2,3,6,7,8 -> tp 6 (0,2,3,6,7,8), fp 1 (1), fn 2 (9, 11)
    assert (g["2,0.01"]["tp"], g["2,0.01"]["fp"], g["2,0.01"]["fn"]) == (6, 1, 2)
    assert g["2,0.01"]["step_f1"] == pytest.approx(2 * 6 / (2 * 6 + 1 + 2))
    bad = dict(t, flag=~t["flag"])
    with pytest.raises(SystemExit, match="differs from the row"):
        es.grid(bad)


def test_choose_takes_the_best_mean_and_keeps_the_current_setting_on_a_tie():
    cur = f"{es.CURRENT[0]},{es.CURRENT[1]:g}"
    blocks = {"a": {cur: {"step_f1": 0.8, "prior_0.1_f1": 0.7}, "2,0": {"step_f1": 0.9, "prior_0.1_f1": 0.7}},
              "b": {cur: {"step_f1": 0.8, "prior_0.1_f1": 0.7}, "2,0": {"step_f1": 0.8, "prior_0.1_f1": 0.65}}}
    pick, mean = es.choose(blocks)
    assert pick == "2,0" and mean["2,0"]["sum"] == pytest.approx(1.525)  # 0.85 + 0.675 against 0.8 + 0.7
    blocks["a"][cur]["step_f1"] = 0.9  # current: 0.85 + 0.7 = 1.55 against 1.525
    assert es.choose(blocks)[0] == cur
    blocks["b"]["2,0"]["prior_0.1_f1"] = 0.7  # 0.85 + 0.7 on both: a tie keeps the current setting
    assert es.choose(blocks)[0] == cur
    blocks["a"]["2,0"]["step_f1"] = 0.9001  # still equal at three decimals
    assert es.choose(blocks)[0] == cur


def test_read_steps_keeps_the_scored_steps(tmp_path):
    t = _steps()
    t["test"][5] = False
    pq.write_table(pa.table({k: v for k, v in t.items()}), tmp_path / "steps.parquet")
    got = es.read_steps(tmp_path)
    assert len(got["abnormal"]) == 11 and got["view"].dtype.kind == "U"


def test_relative_floors_are_quantiles_of_the_models_own_normal_val_steps(tmp_path):
    """A val output with 5 normal steps (model p 0, 0.001, 0.002, 0.004, 0.1), a warm-up step and
    an abnormal one (both left out), and an unscored step: the floors are their quantiles; the grid
    then scores the relative settings too, with the floor each one used."""
    n = 8
    val = {"view": np.array(["vertical"] * n), "test": np.array([1, 1, 1, 1, 1, 1, 1, 0], bool),
           "abnormal": np.array([0, 0, 0, 0, 0, 0, 1, 0], bool), "warmup": np.array([0, 0, 0, 0, 0, 1, 0, 0], bool),
           "model_p": np.array([0, 0.001, 0.002, 0.004, 0.1, 0.9, 0.9, 0.9])}
    pq.write_table(pa.table(val), tmp_path / "steps.parquet")
    q = es.normal_quantiles(tmp_path)["vertical"]
    assert q[0.5] == pytest.approx(0.002) and q[0.75] == pytest.approx(0.004)
    assert q[0.9] == pytest.approx(0.004 + 0.6 * (0.1 - 0.004))  # linear between the 4th and 5th of five
    t = _steps()
    g = es.grid(t, quantiles={0.5: 0.002, 0.99: 0.06})
    assert len(g) == len(es.EPISODES) * (len(es.FLOORS) + 2)
    # a floor of 0.002 keeps 4-5 (p 0.005) as the absolute floor 0.001 does; 0.06 drops 4-9 as 0.1 does
    assert {k: v for k, v in g["5,q0.5"].items() if k != "floor"} == g["5,0.001"] and g["5,q0.5"]["floor"] == 0.002
    assert {k: v for k, v in g["5,q0.99"].items() if k != "floor"} == g["5,0.1"]
