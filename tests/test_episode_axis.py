"""benchmarks/episode_axis.py draws the row's episodes again over a dataset's kept steps: checked
on hand-built steps of two lanes with gaps in their step numbers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("episode_axis", ROOT / "benchmarks" / "episode_axis.py")
ea = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ea)


def _lane(run: str, steps: list[int], stage: list[int], model: list[int]) -> dict[str, np.ndarray]:
    n = len(steps)
    s = np.asarray(steps)
    return {"view": np.array(["vertical"] * n), "run": np.array([run] * n), "lane": np.zeros(n, np.int64), "step": s,
            "test": np.ones(n, bool), "warmup": np.zeros(n, bool), "abnormal": np.isin(s, stage),
            "model_p": np.where(np.isin(s, model), 0.9, 0.02), "model_flag": np.isin(s, model),
            "stage_flag": np.isin(s, stage), "own_reference": np.ones(n, bool)}


def _steps() -> dict[str, np.ndarray]:
    """Run a keeps every third step (0, 3, ..., 27), the stage flags 6-18 (five kept steps); run b
    keeps every step 0-11, the stage flags 2-6 (five)."""
    a = _lane("a", list(range(0, 30, 3)), [6, 9, 12, 15, 18], [])
    b = _lane("b", list(range(12)), [2, 3, 4, 5, 6], [])
    c = {k: np.concatenate([a[k], b[k]]) for k in a}
    return c


def test_kept_order_counts_a_lanes_kept_steps():
    c = _steps()
    pos = ea.kept_order(ea.lane_codes(c["run"], c["lane"]), c["step"])
    assert pos[:10].tolist() == list(range(10)) and pos[10:].tolist() == list(range(12))
    # shuffled rows: the same places
    perm = np.random.default_rng(0).permutation(len(pos))
    assert ea.kept_order(ea.lane_codes(c["run"][perm], c["lane"][perm]), c["step"][perm]).tolist() == pos[perm].tolist()


@pytest.mark.parametrize("axis, a_kept", [("step", False), ("kept", True)])
def test_a_sampled_runs_departure_lasts_only_over_kept_steps(axis, a_kept):
    """Step numbers 3 apart break run a's episode (five single flags); over kept steps it is one
    episode of five. Run b's five neighbours are one episode either way."""
    c = _steps()
    flag = ea.row_on_axis(c, axis, episode=5, floor=0.01)
    stage = c["stage_flag"]
    assert flag[10:].tolist() == stage[10:].tolist()
    assert flag[:10].tolist() == (stage[:10] & a_kept).tolist()
    # the check compares the row's own episode lengths: those of the step-number axis pass
    c["episode"] = np.where(stage, np.r_[np.ones(10, np.int64), np.full(12, 5)], 0)
    c["sustained_flag"] = np.zeros(len(stage), bool)
    ea.row_on_axis(c, "step", 5, 0.01, check=True)
    c["episode"] = np.where(stage, 5, 0)
    with pytest.raises(SystemExit, match="episode lengths"):
        ea.row_on_axis(c, "step", 5, 0.01, check=True)
