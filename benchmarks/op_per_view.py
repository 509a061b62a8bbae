"""The operator head's threshold and the operator expert's weight chosen per view, measured: a
model's operator Macro₊ F1 (unit level, as its calibration scores it) over the grid of
thresholds × expert weights, on the val and test parts of its split, each view apart. The choice
per view is made on the val part with the calibration's own rules (the threshold nearest 0 within
the tolerance of the best at the model's weight, then the best weight at it) and the test figures
are read at that choice beside those at the model's one.

    python benchmarks/op_per_view.py MODEL DATASET -o RESULT.json [--split request]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def grid(model, ds, split: str, part: str, thresholds, weights) -> dict:
    from teller.rca.metrics import operator_metrics, operator_truth
    from teller.rca.train import operator_families, part_units

    idx, prep = part_units(model, ds, split, part)
    heads = model.operator_logits(prep)
    sel = ds.units.select(idx)
    truth = operator_truth(sel.operator_labels, sel.is_anomaly)
    views = np.asarray(sel.view)
    at = {v: np.flatnonzero(views == v) for v in sorted(set(views.tolist()))}
    out = {v: {"units": int(len(a)), "abnormal": int(np.asarray(sel.is_anomaly)[a].astype(bool).sum()), "rows": []}
           for v, a in at.items()}
    for th in thresholds:
        for w in weights:  # the families each unit names (as operator_row scores them), scored per view
            pred = operator_families(model, prep, heads, th, w)
            for v, a in at.items():
                mm = operator_metrics([truth[i] for i in a], [pred[i] for i in a])
                out[v]["rows"].append({"threshold": th, "weight": w, **{k: round(float(mm[k]), 6) for k in
                                       ("macro_plus_f1", "macro_plus_precision", "macro_plus_recall")}})
    return out


def choose(rows: list[dict], threshold0: float, weight0: float) -> dict:
    """The calibration's rules on one view's val rows: the threshold (at the model's weight), then
    the weight (at that threshold)."""
    from teller.rca.train import pick_threshold, pick_weight

    th = pick_threshold([r for r in rows if r["weight"] == weight0])["threshold"]
    w = pick_weight([r for r in rows if r["threshold"] == th], "macro_plus_f1")
    return {"threshold": th, "weight": w}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("dataset")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--split", default=None)
    a = ap.parse_args()
    from teller.rca import load
    from teller.rca.data import load_dataset
    from teller.rca.opexpert import OP_WEIGHTS
    from teller.rca.train import OP_THRESHOLDS

    t0 = time.time()
    m = load(a.model)
    split = a.split or m.meta["training"]["split"]
    ds = load_dataset(a.dataset, unit=m.cfg.unit)
    th0, w0 = m.op_threshold, m.op_weight
    res = {"model": a.model, "split": split, "model_threshold": th0, "model_weight": w0, "parts": {}}
    for part in ("val", "test"):
        res["parts"][part] = grid(m, ds, split, part, OP_THRESHOLDS, OP_WEIGHTS)
    res["per_view"] = {}
    for v, g in res["parts"]["val"].items():
        c = choose(g["rows"], th0, w0)
        test = {(r["threshold"], r["weight"]): r["macro_plus_f1"] for r in res["parts"]["test"].get(v, {}).get("rows", [])}
        val = {(r["threshold"], r["weight"]): r["macro_plus_f1"] for r in g["rows"]}
        res["per_view"][v] = {"chosen": c, "val_at_model": val[(th0, w0)], "val_at_chosen": val[(c["threshold"], c["weight"])],
                              "test_at_model": test.get((th0, w0)), "test_at_chosen": test.get((c["threshold"], c["weight"]))}
        print(f"{v}: model ({th0:+.1f}, {w0}) val {val[(th0, w0)]:.3f} test {test.get((th0, w0))}; "
              f"chosen ({c['threshold']:+.1f}, {c['weight']}) val {val[(c['threshold'], c['weight'])]:.3f} "
              f"test {test.get((c['threshold'], c['weight']))}", flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
