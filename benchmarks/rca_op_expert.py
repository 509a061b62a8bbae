"""Operator-expert variants side by side on one trained model (docs/results.md, "The operator
expert"): for each variant (which slot features, how many trees of which depth) the expert is fitted
on the split's abnormal training units and the model's families are scored at each mixing weight,
on the val part (where `teller rca opexpert` chooses) and on the test part; operator Macro₊ F1 over
all units and over the vertical ones.

    python benchmarks/rca_op_expert.py runs/h200_v2_all --model MODEL [--split run] -o OUT.json

The model keeps its abnormal cut, operator threshold and type expert; only the operator expert
varies. Variants: ``shipped`` (:data:`teller.rca.opexpert.TREES` on every feature), ``shallow``
(200 rounds of depth 4, the type expert's trees), ``no_unit`` (without the unit's layer mix) and
``no_family_row`` (without the family's row in the reference).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--model", required=True)
    ap.add_argument("--split", default=None, help="default: the model's own")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-units", type=int, default=None, help="a random sample of units (smoke runs)")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()

    import xgboost as xgb

    from teller.evaluate.metrics import operator_metrics
    from teller.rca import load
    from teller.rca.api import FamilyScores
    from teller.rca.data import load_dataset
    from teller.rca.metrics import operator_truth
    from teller.rca.opexpert import LAYERS, OP_WEIGHTS, TREES, OperatorExpert, slot_features
    from teller.rca.train import prepare_units

    t0 = time.perf_counter()
    m = load(a.model)
    split = a.split or m.meta.get("training", {}).get("split", "request")
    ds = load_dataset(a.dataset, unit=m.cfg.unit, max_units=a.max_units, seed=a.seed)
    u = ds.units
    tr = u.part(split, "train")
    tr = tr[u.is_anomaly[tr].astype(bool)]
    prep, _ = prepare_units(ds, tr, m.cfg, m.text_tok, m.trace_tok, m.ref)
    X = slot_features(prep, m.ref)
    y = np.asarray(prep.slot_target, np.int64)
    F = prep.slot_feat.shape[1]
    row_col = F + (F // 2) * 2 + len(LAYERS) + 1  # the family's row in the reference
    unit_from = row_col + 2
    every = np.arange(X.shape[1])
    variants = {"shipped": (every, TREES),
                "shallow": (every, {**TREES, "n_estimators": 200, "max_depth": 4}),
                "no_unit": (every[:unit_from], TREES),
                "no_family_row": (np.delete(every, row_col), TREES)}
    experts = {}
    for name, (cols, trees) in variants.items():
        clf = xgb.XGBClassifier(**trees, random_state=a.seed, n_jobs=2)
        clf.fit(X[:, cols], y)
        experts[name] = OperatorExpert(clf.get_booster(), len(cols))
    del prep, X
    t = m.op_threshold
    out = {"dataset": a.dataset, "model": a.model, "split": split, "seed": a.seed, "op_threshold": t,
           "train_units": int(len(tr)), "train_slots": int(len(y)), "labelled_slots": int(y.sum()),
           "variants": {k: {"features": int(len(c)), "trees": tr_} for k, (c, tr_) in variants.items()}, "parts": {}}
    for part in ("val", "test"):
        idx = u.part(split, part)
        prep, _ = prepare_units(ds, idx, m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
        heads = m.operator_logits(prep)
        Xp = slot_features(prep, m.ref)
        sel = u.select(idx)
        truth = operator_truth(sel.operator_labels, sel.is_anomaly)
        vert = np.asarray(sel.view) == "vertical"
        res = {}
        for name, (cols, _) in variants.items():
            pex = experts[name].proba(Xp[:, cols])
            scores = [FamilyScores(sc.tokens, sc.families, pex[prep.slots.slots(i)]) for i, (_, sc) in enumerate(heads)]
            rows = []
            for w in OP_WEIGHTS:
                pred = [set(m.evidence_families(prep, i, ft, scores[i], t, op_weight=w)) if ft else set()
                        for i, (ft, _) in enumerate(heads)]
                al = operator_metrics(truth, pred)
                ve = operator_metrics([x for x, v in zip(truth, vert, strict=True) if v], [p for p, v in zip(pred, vert, strict=True) if v])
                rows.append({"weight": w, "macro_plus_f1": round(al["macro_plus_f1"], 4), "vertical_macro_plus_f1": round(ve["macro_plus_f1"], 4)})
            res[name] = rows
            print(part, name, [(r["weight"], r["macro_plus_f1"], r["vertical_macro_plus_f1"]) for r in rows], flush=True)
        out["parts"][part] = {"units": int(len(idx)), "variants": res}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"{out['seconds']} s, peak RSS {out['peak_rss_mib']} MiB → {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
