"""Episodes over a dataset's kept steps: step numbers or the order of the kept steps.

    python benchmarks/episode_axis.py --fold TEST_OUT,VAL_OUT [--fold ...] [--apply OUT[,VAL_OUT] ...] -o RESULT.json

An episode (:mod:`teller.localize.episodes`) is a run of flagged steps of one lane whose step
numbers lie at most 2 apart. `teller diagnose` reads every step of a run, so there neighbours are
one step apart; a dataset keeps a sample of each run's steps (every step of some runs, one in
two or fewer of others), so the evaluation's rows see a lasting fault as flagged steps 3, 4 or 30
step numbers apart, and its episodes break where the run's would not. The other reading counts
the distance in kept steps: a lane's kept steps in order, at most one unflagged kept step inside
an episode, whatever steps the dataset left out between them.

Both readings are scored from what ``benchmarks/gap_anatomy.py`` keeps per step
(``steps.parquet``: every kept step of the test runs, the model's answers on the test steps, the
stage's flags): the model read over time (:func:`teller.localize.episodes.over_time` on the test
steps) and the stage's lasting departures (episodes of the stage's flags over every kept step,
warm-up out) are drawn again on each axis, and the row's flags follow as
``teller_sustained_family`` sets them (the stage episode length and the floor of ``--setting``:
``E,F`` absolute, ``E,qQ`` the Q quantile of the model's probability over the val output's normal
steps). With ``--check`` the script first checks that the step-number axis gives the row's
episode lengths and over-time flags back (they do not depend on the setting). Per fold and view: step F1 and F1 at a 10% prior (50 draws); the axis
with the higher mean of the two over the folds' blocks is chosen (ties: step numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from episode_settings import normal_quantiles, scores  # noqa: E402

from teller.localize.episodes import episode_lengths, over_time  # noqa: E402

COLUMNS = ("view", "run", "lane", "step", "test", "warmup", "abnormal", "model_p", "model_flag", "sustained_flag",
           "stage_flag", "episode", "own_reference", "flag")
AXES = ("step", "kept")


def read_all(out: str | Path) -> dict[str, np.ndarray]:
    """Every kept step of the test runs of a gap-anatomy output (``test`` marks the scored ones)."""
    t = pq.read_table(Path(out) / "steps.parquet", columns=list(COLUMNS))
    c = {k: t.column(k).to_numpy(zero_copy_only=False) for k in COLUMNS}
    for k in ("view", "run"):
        c[k] = c[k].astype(str)
    return c


def kept_order(key: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Per step: its place among its lane's kept steps (0, 1, 2, ... in step order; ``key``: the
    lane's code, :func:`lane_codes`)."""
    order = np.lexsort((step, key))
    pos = np.empty(len(step), np.int64)
    first = np.r_[True, key[order][1:] != key[order][:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    pos[order] = np.arange(len(order)) - start
    return pos


def lane_codes(run: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """Per step: a code of its run and lane."""
    return np.unique(np.char.add(np.char.add(run.astype(str), "\x1f"), lane.astype(str)), return_inverse=True)[1]


def row_on_axis(c: dict[str, np.ndarray], axis: str, episode: int, floor: float, check: bool = False) -> np.ndarray:
    """The row's flags on the test steps of one view's steps ``c``, its episodes drawn on ``axis``."""
    lane = lane_codes(c["run"], c["lane"])
    at = c["step"].astype(np.int64) if axis == "step" else kept_order(lane, c["step"].astype(np.int64))
    test = c["test"].astype(bool)
    p = np.nan_to_num(c["model_p"].astype(float), nan=0.0)
    sust = over_time(lane[test], at[test], c["model_flag"][test].astype(bool), p[test])["flag"]
    _, length = episode_lengths(lane, at, c["stage_flag"].astype(bool) & ~c["warmup"].astype(bool))
    if check:
        bad_len = int((length != c["episode"]).sum())
        bad_sust = int((sust != c["sustained_flag"][test].astype(bool)).sum())
        if bad_len or bad_sust:
            raise SystemExit(f"the step-number axis differs from the row's on {bad_len} episode lengths and {bad_sust} "
                             "over-time flags: steps.parquet is not of the row as this script reads it")
    stage = c["stage_flag"][test].astype(bool)
    keep = stage & ~sust & (length[test] >= episode) & c["own_reference"][test].astype(bool) & (p[test] >= floor)
    return sust | keep


def parse_setting(s: str) -> tuple[int, str]:
    e, f = s.split(",")
    return int(e), f


def floor_of(f: str, val_q: dict[float, float] | None) -> float | None:
    if f.startswith("q"):
        return None if not val_q else float(val_q[float(f[1:])])
    return float(f)


def block(c: dict[str, np.ndarray], setting: tuple[int, str], val_q: dict[float, float] | None, seed: int,
          check: bool) -> dict[str, Any]:
    e, f = setting
    floor = floor_of(f, val_q)
    if floor is None:
        return {}
    test = c["test"].astype(bool)
    t = {"abnormal": c["abnormal"][test], "model_p": c["model_p"][test]}
    out: dict[str, Any] = {"floor": floor}
    for axis in AXES:
        flag = row_on_axis(c, axis, e, floor, check=check and axis == "step")
        out[axis] = scores(t, flag, seed)
    return out


def by_view(c: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    return {v: {k: x[c["view"] == v] for k, x in c.items()} for v in dict.fromkeys(c["view"].tolist())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fold", action="append", required=True, metavar="TEST_OUT,VAL_OUT")
    ap.add_argument("--apply", action="append", default=[], metavar="OUT[,VAL_OUT]")
    ap.add_argument("--setting", default="5,0.01", help="the stage episode length and floor the rows are scored with")
    ap.add_argument("--check", action="store_true", help="check the step-number axis against the row's own episode "
                    "lengths and over-time flags")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    setting = parse_setting(a.setting)
    blocks: dict[str, Any] = {}
    for k, pair in enumerate(a.fold):
        test, *val = pair.split(",")
        qs = normal_quantiles(val[0]) if val else {}
        for view, c in by_view(read_all(test)).items():
            got = block(c, setting, qs.get(view), a.seed, a.check)
            if got:
                blocks[f"fold{k}/{view}"] = got
    mean = {axis: float(np.mean([b[axis]["step_f1"] + b[axis]["prior_0.1_f1"] for b in blocks.values()])) for axis in AXES}
    pick = "kept" if round(mean["kept"], 3) > round(mean["step"], 3) else "step"
    res: dict[str, Any] = {"command": "python benchmarks/episode_axis.py " + " ".join(
        [f"--fold {f}" for f in a.fold] + [f"--apply {x}" for x in a.apply] + [f"--setting {a.setting}"]
        + (["--check"] if a.check else []) + [f"-o {a.out}"]),
        "setting": a.setting, "seed": a.seed, "selection": blocks, "selection_mean": mean, "chosen": pick, "applied": {}}
    print(f"chosen axis {pick}: mean step F1 + prior, step numbers {mean['step']:.4f}, kept steps {mean['kept']:.4f}")
    for name, b in blocks.items():
        print(f"  {name}: " + "   ".join(f"{ax} {b[ax]['step_f1']:.4f} ; {b[ax]['prior_0.1_f1']:.4f}" for ax in AXES))
    for spec in a.apply:
        out, *val = spec.split(",")
        qs = normal_quantiles(val[0]) if val else {}
        for view, c in by_view(read_all(out)).items():
            got = block(c, setting, qs.get(view), a.seed, a.check)
            if got:
                res["applied"][f"{out}/{view}"] = got
                print(f"  {out}/{view}: " + "   ".join(f"{ax} {got[ax]['step_f1']:.4f} ; {got[ax]['prior_0.1_f1']:.4f}"
                                                       for ax in AXES))
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
