"""Do the per-layer statistics of a step tell its fault type, and do they carry over to another model
shape? A Random Forest on the statistical baselines' per-layer columns (``teller.baselines.features``:
``n_L``, ``self_L``, ``dur_L`` per layer tag), once as sums and once as the means and shares the
root-cause model reads (``teller.rca.data.unit_statistics``), on the run and workload splits.

    python benchmarks/layer_mix_rf.py runs/h200_v2_all -o benchmarks/results/layer_mix_rf.json

Per split and column set: step F1 (trained on every train step, binary) and fault-type macro-F1
(trained and scored on the abnormal steps only), vertical view, 300 trees, seed 0.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from sklearn.ensemble import RandomForestClassifier
from sklearn.metrics import f1_score

from teller.baselines.features import read_dataset_features
from teller.baselines.steps import load_steps, split_masks
from teller.rca.data import UNIT_STAT_LAYERS


def column_sets(std: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    S = np.maximum(std, 0).astype(np.float64)

    def c(n: str) -> np.ndarray:
        return S[:, names.index(n)]

    lays = [lay for lay in UNIT_STAT_LAYERS if f"n_{lay}" in names]
    sums = np.log1p(np.stack([c(f"{k}_{lay}") for k in ("n", "self", "dur") for lay in lays], 1))
    n_all = sum(c(f"n_{lay}") for lay in lays)
    s_all = sum(c(f"self_{lay}") for lay in lays)
    mix = []
    for lay in lays:
        n = np.maximum(c(f"n_{lay}"), 1.0)
        mix += [np.log1p(c(f"self_{lay}") / n / 1e3), np.log1p(c(f"dur_{lay}") / n / 1e3),
                c(f"n_{lay}") / np.maximum(n_all, 1.0), c(f"self_{lay}") / np.maximum(s_all, 1.0)]
    return {"sums": sums, "means_and_shares": np.stack(mix, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--splits", default="run,workload")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.perf_counter()
    st = load_steps(a.dataset, view="vertical")
    f = read_dataset_features(a.dataset, st)
    sets = column_sets(f.std, list(f.std_names))
    out: dict = {"dataset": a.dataset, "view": "vertical", "seed": a.seed, "trees": 300, "results": []}
    for split in a.splits.split(","):
        tr, te, _ = split_masks(st, split)
        ab = st.is_anomaly.astype(bool)
        for name, X in sets.items():
            m = RandomForestClassifier(300, random_state=a.seed, n_jobs=2).fit(X[tr], ab[tr])
            step_f1 = f1_score(ab[te], m.predict(X[te]))
            m2 = RandomForestClassifier(300, random_state=a.seed, n_jobs=2).fit(X[tr & ab], st.fault_type[tr & ab])
            fault_f1 = f1_score(st.fault_type[te & ab], m2.predict(X[te & ab]), average="macro")
            row = {"split": split, "columns": name, "n_columns": int(X.shape[1]), "step_f1": round(float(step_f1), 4),
                   "fault_type_macro_f1": round(float(fault_f1), 4)}
            out["results"].append(row)
            print(f"{split:9s} {name:17s} {X.shape[1]:3d} columns: step F1 {step_f1:.3f}, fault-type macro-F1 {fault_f1:.3f}", flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
