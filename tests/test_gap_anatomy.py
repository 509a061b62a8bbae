"""benchmarks/gap_anatomy.py sorts the errors of the row `teller diagnose` reports by the part
that made them and where they lie, and scores two rules on its lasting departures; checked on a
hand-built block of one lane whose every count is worked out below."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gap_anatomy", ROOT / "benchmarks" / "gap_anatomy.py")
ga = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ga)


def _block() -> dict[str, np.ndarray]:
    """One run, one lane, steps 0..39. Labelled abnormal: 20..29 (a window 18..31, so 18, 19,
    30, 31 are in-window steps without effect). The stage flags 17..31 (one episode of 15) and
    step 5 alone; the model flags 22..27; the over-time reading adds 21 and 28; the row keeps the
    stage's episode where the model does not flag: 17..20 and 29..31. Step 38: a model flag far
    from the window. Test steps: every step."""
    n = 40
    s = np.arange(n)
    ab = (s >= 20) & (s <= 29)
    win = (s >= 18) & (s <= 31)
    stage = ((s >= 17) & (s <= 31)) | (s == 5)
    model = ((s >= 22) & (s <= 27)) | (s == 38)
    sus = model | (s == 21) | (s == 28)
    flag = sus | ((s >= 17) & (s <= 31))
    ep = np.where((s >= 17) & (s <= 31), 15, np.where(s == 5, 1, 0))
    nov = np.where(np.isin(s, [19, 20, 30]), 2.0, 0.5)
    wall = np.full(n, 10.0)
    wall[(s >= 19) & (s <= 29)] = 30.0  # 19..29 slower than every step outside the episode; 17, 18, 30, 31 not
    wall[3] = 11.0  # the lane's out-of-episode p99 lies just under 11
    return {"view": np.full(n, "vertical", dtype=object), "split": np.full(n, "run", dtype=object),
            "run": np.full(n, "r", dtype=object), "step": s, "lane": np.zeros(n, np.int64), "test": np.ones(n, bool),
            "warmup": np.zeros(n, bool), "abnormal": ab, "in_window": win, "true_type": np.where(ab, "kernel", "").astype(object),
            "model_p": np.where(sus, 0.9, 0.05), "model_flag": model, "sustained_flag": sus,
            "model_type": np.full(n, "memory", dtype=object), "stage_flag": stage, "stage_type": np.full(n, "kernel", dtype=object),
            "episode": ep, "own_reference": np.ones(n, bool), "novelty": nov, "flag": flag, "score": np.where(flag, 0.9, 0.05),
            "fault_type": np.where(flag & ~sus, "kernel", "memory").astype(object),
            "effect.wall_ns": wall, "effect.gpu_busy_ns": np.ones(n), "effect.comm_ns": np.zeros(n),
            "effect.iteration_ns": np.full(n, np.nan), "effect.stage_families_ns": np.full(n, np.nan)}


def test_errors_by_part_and_place():
    a = ga.anatomy(_block(), seed=0)
    assert a["composition"] == {"test_steps": 40, "abnormal": 10, "normal_in_window_no_effect": 4, "normal_outside_windows": 26}
    fp = a["errors"]["false_positives"]
    # row FPs: 17 (outside, 3 from 20), 18, 19, 30, 31 (in window), 38 (model, far)
    assert fp["total"] == 6
    assert fp["by_model"] == {"in_window_no_effect": 0, "outside_windows_within_3_steps_of_a_fault": 0, "outside_windows_elsewhere": 1}
    assert fp["by_over_time_reading"] == {"in_window_no_effect": 0, "outside_windows_within_3_steps_of_a_fault": 0,
                                          "outside_windows_elsewhere": 0}
    assert fp["by_lasting_departure"] == {"in_window_no_effect": 4, "outside_windows_within_3_steps_of_a_fault": 1,
                                          "outside_windows_elsewhere": 0}
    assert a["errors"]["false_negatives"] == {"total": 0, "stage_flagged": 0, "stage_flagged_in_5plus_episode": 0}
    assert a["errors"]["lasting_departures_kept"] == {"abnormal": 2, "normal": 5}  # 20, 29 / 17, 18, 19, 30, 31


def test_rules_on_the_lasting_departures():
    r = ga.anatomy(_block(), seed=0)["rules"]
    assert (r["as_is"]["tp"], r["as_is"]["fp"], r["as_is"]["fn"]) == (10, 6, 0)
    # novel: kept steps with novelty > 1 stay (19, 20, 30); 17, 18, 29, 31 go back to the model's answer
    assert (r["novel"]["tp"], r["novel"]["fp"], r["novel"]["fn"]) == (9, 3, 1)
    assert (r["novel"]["dropped_abnormal"], r["novel"]["dropped_normal"]) == (1, 3)
    # effect: kept steps above the lane's p99 outside the episode (19, 20, 29) stay; 17, 18, 30, 31 go
    assert (r["effect"]["tp"], r["effect"]["fp"], r["effect"]["fn"]) == (10, 2, 0)
    assert (r["effect"]["dropped_abnormal"], r["effect"]["dropped_normal"]) == (0, 4)
    assert r["as_is"]["step_f1"] == pytest.approx(2 * 10 / (2 * 10 + 6))
    # a dropped abnormal step takes the model's type again (memory: wrong), a kept one the stage's (kernel: right)
    assert r["as_is"]["fault_type_macro_f1"] < 1.0 and r["novel"]["fault_type_macro_f1"] < r["as_is"]["fault_type_macro_f1"] + 1e-9


def test_the_stage_families_time_counts_as_an_effect():
    b = _block()
    b["effect.stage_families_ns"][17] = 1.5  # step 17: the families the stage names above their own p99
    r = ga.anatomy(b, seed=0)["rules"]["effect"]
    assert (r["tp"], r["fp"], r["dropped_normal"]) == (10, 3, 3)


def test_near_a_fault_is_per_lane():
    b = _block()
    b["lane"] = np.where(b["step"] < 10, 1, 0)  # steps 0..9 on another lane: no abnormal step there
    near = ga._near_abnormal(b)
    assert near[17] and near[32] and not near[33] and not near[16] and not near[9]


def test_anatomy_again_from_the_kept_steps(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    b = _block()
    b["stage_families"] = np.full(len(b["step"]), "FE LlamaMLP", dtype=object)
    pq.write_table(pa.table({k: (v.astype(str) if v.dtype == object else v) for k, v in b.items()}), tmp_path / "steps.parquet")
    (tmp_path / "results.json").write_text(json.dumps({"seed": 0, "command": "the evaluation"}))
    got = ga.from_steps(tmp_path)
    assert got["command"] == "the evaluation" and got["seed"] == 0
    assert got["views"]["vertical"] == json.loads(json.dumps(ga.anatomy(b, seed=0)))
    assert json.loads((tmp_path / "anatomy.json").read_text()) == got


def test_horizontal_answers_with_the_ranks_verdicts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # run r, steps 1..3 on two ranks; step 4 has one rank step only in the vertical view (uncovered)
    rows = []
    for s, truth, hflag, vflags in ((1, True, True, (False, False)), (2, True, False, (False, True)), (3, False, False, (True, False))):
        rows.append(("horizontal", s, truth, 0.9 if hflag else 0.1, hflag))
        rows += [("vertical", s, False, 0.8 if f else 0.2, f) for f in vflags]
    rows += [("horizontal", 4, True, 0.1, False), ("vertical", 4, True, 0.9, True)]
    pq.write_table(pa.table({"view": [r[0] for r in rows], "method": [ga.ROW] * len(rows), "run_id": ["r"] * len(rows),
                             "step": [r[1] for r in rows], "is_anomaly": [r[2] for r in rows], "score": [r[3] for r in rows],
                             "flag": [r[4] for r in rows]}), tmp_path / "predictions.parquet")
    vsteps = [(s, k) for s in (1, 2, 3) for k in (0, 1)] + [(4, 0), (4, 1)]  # step 4: two rank steps, one of them not a test step
    pq.write_table(pa.table({"view": ["vertical"] * len(vsteps), "run": ["r"] * len(vsteps), "step": [s for s, _ in vsteps]}),
                   tmp_path / "steps.parquet")
    got = ga.horizontal_from_ranks(tmp_path, seed=0)
    assert (got["covered"], got["uncovered"]) == (3, 1)
    assert (got["as_is"]["tp"], got["as_is"]["fp"], got["as_is"]["fn"]) == (1, 0, 1)
    assert (got["or_ranks"]["tp"], got["or_ranks"]["fp"], got["or_ranks"]["fn"]) == (2, 1, 0)


def test_the_novelty_gate_and_its_cut(tmp_path):
    """The gate the row applies (``lasting_novelty``: a lasting departure stays above
    LASTING_NOVELTY) among the anatomy's rules, and benchmarks/lasting_novelty.py's sweep of its
    cut over gap_anatomy OUT folders: steps 17 and 31 (normal, kept) made near the training steps."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from teller.rca import LASTING_NOVELTY

    b = _block()
    b["novelty"] = b["novelty"].copy()
    b["novelty"][[17, 31]] = LASTING_NOVELTY * 0.8
    r = ga.anatomy(b, seed=0)["rules"]
    assert (r["lasting_novelty"]["tp"], r["lasting_novelty"]["fp"], r["lasting_novelty"]["fn"]) == (10, 4, 0)
    assert (r["lasting_novelty"]["dropped_abnormal"], r["lasting_novelty"]["dropped_normal"]) == (0, 2)
    # the unmodified block: every kept step lies above the cut, the gate drops nothing
    assert ga.anatomy(_block(), seed=0)["rules"]["lasting_novelty"]["fp"] == 6

    spec = importlib.util.spec_from_file_location("lasting_novelty", ROOT / "benchmarks" / "lasting_novelty.py")
    ln = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ln)
    out = tmp_path / "a"
    out.mkdir()
    b["stage_families"] = np.full(len(b["step"]), "FE LlamaMLP", dtype=object)
    pq.write_table(pa.table({k: (v.astype(str) if v.dtype == object else v) for k, v in b.items()}), out / "steps.parquet")
    (out / "results.json").write_text(json.dumps({"seed": 0}))
    res = ln.sweep([str(out)], "vertical", (0.0, LASTING_NOVELTY, 1.0))
    got = [(x["blocks"][str(out)]["tp"], x["blocks"][str(out)]["fp"], x["blocks"][str(out)]["fn"]) for x in res["rows"]]
    assert got == [(10, 6, 0), (10, 4, 0), (9, 3, 1)]  # as is; 17 and 31 dropped; novel above 1 (17, 18, 29, 31 dropped)
    best = max(res["rows"], key=lambda x: (round(x["objective"], 3), -x["cut"]))
    assert res["chosen"] == best["cut"] == LASTING_NOVELTY
    assert res["rows"][0]["objective"] == pytest.approx(r["as_is"]["step_f1"] + r["as_is"]["prior_0.1_f1"])
