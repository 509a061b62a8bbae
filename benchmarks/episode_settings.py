"""The settings of the stage's lasting departures (the row `teller diagnose` reports,
``teller_sustained_family``), chosen on a nested mechanism hold-out and then read on the splits.

    python benchmarks/episode_settings.py --fold TEST_OUT,VAL_OUT [--fold ...] [--apply OUT ...] -o RESULT.json

A lasting departure is a step the numeric stage flags, the model (read over time) does not, in an
episode of at least ``E`` stage flags of its rank, against a reference of the step's deployment,
which the model gives at least ``f``. The row flags the model's over-time flags and its lasting
departures, so its flags under any ``(E, f)`` follow from what ``benchmarks/gap_anatomy.py``
keeps per step (``steps.parquet``: the over-time flag, the stage's flag and episode length, the
reference, the model's probability); the script checks that the setting the outputs were written
with (``--row``, :data:`CURRENT`: 5 and 0.01, the setting until this script's choice was
adopted) gives the row's own flags back. The rows now use the choice, ``(4, q0.85)``
(:data:`teller.localize.episodes.STAGE_EPISODE` and the floor each model keeps,
:func:`teller.rca.episode_floor`; ``(5, 0.01)`` where the model keeps none); outputs written
since carry it, and the model's own floor
is measured on the val units (warm-up from the iterations alone), not on this script's val
output, so such outputs are read with ``--no-check``.

``--fold``: the gap-anatomy outputs of one fold of ``teller dataset nest`` (its test part: the
mechanisms it holds out; its val part: kinds trained on and ordinary normal steps), pooled per
view. Every ``(E, f)`` of :data:`EPISODES` × :data:`FLOORS` gets step F1 and F1 at a 10% prior
(the evaluation's 50 draws) per fold and view; the chosen one has the highest mean over those
blocks of the two; ties at three decimals keep the current setting when it is among them, else the
higher mean step F1. ``--apply``: gap-anatomy outputs of the splits' test parts, scored with every
setting (the chosen and the current one side by side in the summary). Writes RESULT.json.

A floor relative to the model (``E,qQ``, :data:`QUANTILES`): the ``Q`` quantile of the model's
probability over the normal steps (warm-up out) of its split's val part in the same view, read
from the val gap-anatomy output (a fold's second; ``--apply TEST_OUT,VAL_OUT``). A probability
threshold does not carry from one model to another (the nested fold 0 model gives its val normal
steps a median of 0.00000, the shipped one 0.00082); a quantile of the model's own normal steps
does. An ``--apply`` output without a val output is scored with the absolute floors only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from teller.evaluate.scores import low_prior_scores, step_scores

EPISODES = (1, 2, 3, 4, 5, 8)
FLOORS = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1)
QUANTILES = (0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
#: the setting of the rows whose gap-anatomy outputs the selection was made on (``--row``)
CURRENT = (5, 0.01)
COLUMNS = ("view", "test", "abnormal", "flag", "sustained_flag", "stage_flag", "episode", "own_reference", "model_p")


def normal_quantiles(val_out: str | Path) -> dict[str, dict[float, float]]:
    """Per view: the :data:`QUANTILES` of the model's probability over the scored part's normal
    steps, warm-up out, of a gap-anatomy output (``--part val``)."""
    t = pq.read_table(Path(val_out) / "steps.parquet", columns=["view", "test", "abnormal", "warmup", "model_p"])
    c = {k: t.column(k).to_numpy(zero_copy_only=False) for k in t.column_names}
    view = c["view"].astype(str)
    ok = c["test"].astype(bool) & ~c["abnormal"].astype(bool) & ~c["warmup"].astype(bool)
    p = np.nan_to_num(c["model_p"].astype(float), nan=0.0)
    return {v: {q: float(np.quantile(p[ok & (view == v)], q)) for q in QUANTILES}
            for v in dict.fromkeys(view.tolist()) if (ok & (view == v)).any()}


def read_steps(out: str | Path) -> dict[str, np.ndarray]:
    """The scored steps (``test`` true: the part the run scored) of a gap-anatomy output."""
    t = pq.read_table(Path(out) / "steps.parquet", columns=list(COLUMNS))
    cols = {c: t.column(c).to_numpy(zero_copy_only=False) for c in COLUMNS}
    keep = cols["test"].astype(bool)
    return {c: (v[keep].astype(str) if c == "view" else v[keep]) for c, v in cols.items()}


def row_flags(t: dict[str, np.ndarray], episode: int, floor: float) -> np.ndarray:
    """The row's flags with lasting departures of ``episode`` or more stage flags the model gives
    at least ``floor``."""
    p = np.nan_to_num(t["model_p"].astype(float), nan=0.0)
    keep = (t["stage_flag"].astype(bool) & ~t["sustained_flag"].astype(bool) & (t["episode"] >= episode)
            & t["own_reference"].astype(bool) & (p >= floor))
    return t["sustained_flag"].astype(bool) | keep


def scores(t: dict[str, np.ndarray], flag: np.ndarray, seed: int = 0) -> dict[str, float]:
    truth = t["abnormal"].astype(bool)
    s = step_scores(truth, flag)
    lp = low_prior_scores(truth, flag, np.nan_to_num(t["model_p"].astype(float), nan=0.0), seed=seed)
    return {"step_f1": float(s["f1"]), "prior_0.1_f1": float(lp["0.1"]["f1_mean"]), "tp": int(s["tp"]), "fp": int(s["fp"]),
            "fn": int(s["fn"])}


def _pool(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {c: np.concatenate([p[c] for p in parts]) for c in COLUMNS}


def _by_view(t: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    return {v: {c: x[t["view"] == v] for c, x in t.items()} for v in dict.fromkeys(t["view"].tolist())}


def grid(t: dict[str, np.ndarray], seed: int = 0, quantiles: dict[float, float] | None = None,
         row: tuple[int, float] | None = CURRENT) -> dict[str, dict[str, float]]:
    """Scores of every setting on the steps ``t`` (with ``quantiles``, :func:`normal_quantiles` of
    the view, the relative floors too); raises if setting ``row`` (None: no check) does not give
    the row's own flags back."""
    mism = int((row_flags(t, *row) != t["flag"].astype(bool)).sum()) if row is not None else 0
    if mism:
        raise SystemExit(f"the setting {row} differs from the row's flags on {mism} steps: "
                         "steps.parquet is not of the row as this script reads it (--row E,F)")
    out = {f"{e},{f:g}": scores(t, row_flags(t, e, f), seed) for e in EPISODES for f in FLOORS}
    for q, f in (quantiles or {}).items():
        for e in EPISODES:
            out[f"{e},q{q:g}"] = {**scores(t, row_flags(t, e, f), seed), "floor": f}
    return out


def choose(blocks: dict[str, dict[str, dict[str, float]]]) -> tuple[str, dict[str, dict[str, float]]]:
    """The chosen setting (module docstring) and every setting's means over ``blocks``."""
    keys = list(next(iter(blocks.values())))
    mean = {k: {m: float(np.mean([b[k][m] for b in blocks.values()])) for m in ("step_f1", "prior_0.1_f1")} for k in keys}
    for k in keys:
        mean[k]["sum"] = mean[k]["step_f1"] + mean[k]["prior_0.1_f1"]
    best = max(round(v["sum"], 3) for v in mean.values())
    tied = [k for k in keys if round(mean[k]["sum"], 3) == best]
    cur = f"{CURRENT[0]},{CURRENT[1]:g}"
    pick = cur if cur in tied else max(tied, key=lambda k: (mean[k]["step_f1"], -keys.index(k)))
    return pick, mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fold", action="append", required=True, metavar="TEST_OUT,VAL_OUT")
    ap.add_argument("--apply", action="append", default=[], metavar="OUT[,VAL_OUT]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row", default=f"{CURRENT[0]},{CURRENT[1]:g}", metavar="E,F",
                    help="the setting the outputs' row flagged with, checked against its flags")
    ap.add_argument("--no-check", action="store_true", help="do not check the row's flags")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    e, f = a.row.split(",")
    row = None if a.no_check else (int(e), float(f))
    blocks: dict[str, dict[str, dict[str, float]]] = {}
    for k, pair in enumerate(a.fold):
        parts = pair.split(",")
        pooled = _pool([read_steps(p) for p in parts])
        qs = normal_quantiles(parts[1]) if len(parts) > 1 else {}
        for view, t in _by_view(pooled).items():
            blocks[f"fold{k}/{view}"] = grid(t, a.seed, qs.get(view), row)
    pick, mean = choose(blocks)
    cur = f"{CURRENT[0]},{CURRENT[1]:g}"
    res: dict[str, Any] = {"command": "python benchmarks/episode_settings.py " + " ".join(
        [f"--fold {f}" for f in a.fold] + [f"--apply {x}" for x in a.apply] + [f"-o {a.out}"]),
        "episodes": list(EPISODES), "floors": list(FLOORS), "quantiles": list(QUANTILES), "current": cur, "chosen": pick,
        "seed": a.seed,
        "folds": a.fold, "selection": blocks, "selection_mean": mean, "applied": {}}
    for spec in a.apply:
        out, *val = spec.split(",")
        qs = normal_quantiles(val[0]) if val else {}
        for view, t in _by_view(read_steps(out)).items():
            res["applied"][f"{out}/{view}"] = grid(t, a.seed, qs.get(view), row)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"chosen {pick} (current {cur}): selection mean step F1 + prior {mean[pick]['sum']:.4f} against {mean[cur]['sum']:.4f}")
    for name, g in res["applied"].items():
        got = f"{g[pick]['step_f1']:.4f} ; {g[pick]['prior_0.1_f1']:.4f}" if pick in g else "n/a (no val output)"
        print(f"  {name}: chosen {got}   current {g[cur]['step_f1']:.4f} ; {g[cur]['prior_0.1_f1']:.4f}")


if __name__ == "__main__":
    main()
