"""benchmarks/host_slowdown.py: a step's host slowdown against the reference, and the thresholds
chosen on one set of steps and read on another, checked on hand-computed cases."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("host_slowdown", ROOT / "benchmarks" / "host_slowdown.py")
hs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hs)


def test_step_stats_hand_case():
    # family 0 (FE): two instances, 60 + 40 µs against 25 + 25 → 2×; family 1 (BE): 400 against 100 → 4×;
    # family 2 (BE): 5 µs of reference time, under the 20 µs a family needs, left out of the family ratios;
    # an instance without a reference value is left out of everything
    x = np.array([60e3, 40e3, 400e3, 50e3, 99e3])
    ref = np.array([25e3, 25e3, 100e3, 5e3, np.nan])
    fam = np.array([0, 0, 1, 2, 3])
    layer = np.array(["FE", "FE", "BE", "BE", "BE"])
    # runtime (rt_ns, drv_ns, rt_n, drv_n): 30 µs in 3 calls against 10 µs in 2 → 10 µs a call against 5: 2×
    rt = np.array([[10e3, 0, 1, 0], [20e3, 0, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], float)
    rt_ref = np.array([[5e3, 0, 1, 0], [5e3, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], float)
    got = hs.step_stats(x, ref, fam, layer, rt, rt_ref)
    assert math.isclose(got["self_p90"], 2 + 0.9 * (4 - 2))  # the ratios 2 and 4, linear interpolation
    assert got["self_f3"] == 0.5  # one family of two over 3×
    assert math.isclose(got["self_tot"], 500e3 / 150e3)
    assert math.isclose(got["fe_self_tot"], 2.0)
    assert math.isclose(got["be_self_tot"], 450e3 / 105e3)  # the small family counts in the layer's total
    assert math.isclose(got["rt_call"], 2.0)


def test_step_stats_without_reference_is_nan():
    got = hs.step_stats(np.array([1e3]), np.array([np.nan]), np.array([0]), np.array(["BE"]),
                        np.zeros((1, 4)), np.zeros((1, 4)))
    assert all(math.isnan(v) for v in got.values()) and set(got) == set(hs.STATS)


def _rows(values, truths):
    return [{"abnormal": True, "truth": t, "self_tot": v, **dict.fromkeys(hs.STATS[:2], float("nan"))}
            for v, t in zip(values, truths, strict=True)]


def test_threshold_chosen_on_one_set_read_on_another():
    truths = ["memory", "memory", "memory", "scheduling", "scheduling"]
    vals = np.array([2.0, 3.0, 9.0, 8.0, 10.0])
    is_sched = np.array([t == "scheduling" for t in truths])
    b = hs.best_threshold(vals, is_sched)
    # above 3: 8, 9, 10 scheduling → 4 of 5 right (9 is memory); above 8: only 9 and 10 → 3 right
    assert b == {"correct": 4, "threshold": 3.0, "above": True}
    # scheduling below: the side is chosen too
    assert hs.best_threshold(np.array([5.0, 1.0]), np.array([False, True])) == {"correct": 2, "threshold": 5.0, "above": False}
    # no threshold beats keeping them all memory: none is chosen
    assert hs.best_threshold(np.array([1.0, 2.0]), np.array([False, False])) == {"correct": 2, "threshold": None, "above": None}
    # read elsewhere: a normal step and a runtime fault are not scored; NaN stays memory
    read = _rows([4.0, 2.0, float("nan"), 7.0], ["scheduling", "memory", "scheduling", "memory"])
    read += [{"abnormal": False, "truth": "", "self_tot": 50.0}, {"abnormal": True, "truth": "runtime", "self_tot": 50.0}]
    got = hs.apply(read, {"self_tot": b, "self_p90": {"correct": 0, "threshold": None, "above": None}})
    assert got == {"steps": 4, "scheduling": 2, "all_memory_correct": 2, "self_tot": 2, "self_p90": 2}
