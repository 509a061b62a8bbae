"""How far a fault's rank skew sets its steps apart from normal ones, in the horizontal view
(docs/results.md, "Every block trained for 12 epochs", the workload horizontal Macro₊):

    python benchmarks/rank_skew.py runs/h200_v2_all --split workload --mechanism straggler_rank --json SKEW.json

The rank skew of a horizontal step is the spread of a per-rank statistic over its ranks (max −
min, the baselines' ``spread_<feature>``, :mod:`teller.baselines.features`) over its mean per rank:
for a straggler rank, the other ranks wait in ``all_reduce`` for it, so the host COMM time
(``comm_ns``, default) differs between ranks whatever the model's shape. Per part of the split
(train, val, test): the quantiles of the skew of the mechanism's abnormal steps, of the normal
steps and of the other abnormal steps; the skew of each of the mechanism's test steps; for each
cut, how many normal steps of each part lie above it and in which runs (test); and for each run of
the mechanism, its steps above each cut inside its fault windows (labelled abnormal or not) and
outside them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

PARTS = {"train": 0, "val": 1, "test": 2}
QUANTILES = (10, 50, 90, 99)
CUTS = (0.3, 0.4, 0.5)


def rank_skew(std: np.ndarray, names: list[str], ranks: np.ndarray, feature: str = "comm_ns") -> np.ndarray:
    """Per step, ``spread_<feature> / (feature / ranks)`` from the baselines' standard features
    (raw values, as :class:`teller.baselines.features.StepFeatures` keeps them: the models apply
    ``log1p``)."""
    col = {n: i for i, n in enumerate(names)}
    if feature not in col or f"spread_{feature}" not in col:
        raise ValueError(f"no feature {feature!r} with its spread over ranks; features: "
                         f"{', '.join(n for n in names if f'spread_{n}' in col)}")
    total = np.asarray(std[:, col[feature]], np.float64)
    spread = np.asarray(std[:, col[f"spread_{feature}"]], np.float64)
    return spread / np.maximum(total / np.maximum(ranks, 1), 1.0)


def summary(skew: np.ndarray, part: np.ndarray, is_anomaly: np.ndarray, mechanism: np.ndarray, run: np.ndarray,
            step: np.ndarray, target: str, in_window: np.ndarray | None = None) -> dict[str, Any]:
    """The distributions, the target mechanism's test steps, the normal steps above each cut and,
    with ``in_window``, each run of the mechanism's steps inside and outside its fault windows
    above each cut (every part)."""
    out: dict[str, Any] = {"parts": {}, "test_steps": [], "cuts": {}}
    if in_window is not None:
        out["runs"] = {}
        for r in sorted(set(run[is_anomaly & (mechanism == target)].tolist())):
            m = run == r
            out["runs"][r] = {"steps": int(m.sum()), "abnormal": int((m & is_anomaly).sum()),
                              "in_window": int((m & in_window).sum()), "out_of_window": int((m & ~in_window).sum()),
                              **{f"above_{c}": {"abnormal": int((m & is_anomaly & (skew > c)).sum()),
                                                "in_window_normal": int((m & in_window & ~is_anomaly & (skew > c)).sum()),
                                                "out_of_window": int((m & ~in_window & (skew > c)).sum()),
                                                "out_of_window_steps": sorted(step[m & ~in_window & (skew > c)].tolist())}
                                 for c in CUTS}}
    hit = is_anomaly & (mechanism == target)
    for name, code in PARTS.items():
        m = part == code
        groups = {target: m & hit, "normal": m & ~is_anomaly, "other abnormal": m & is_anomaly & ~hit}
        out["parts"][name] = {g: ({"steps": int(s.sum()), **{f"p{q}": float(np.percentile(skew[s], q)) for q in QUANTILES}}
                                  if s.any() else {"steps": 0}) for g, s in groups.items()}
    t = (part == PARTS["test"]) & hit
    out["test_steps"] = [{"run": str(run[i]), "step": int(step[i]), "skew": float(skew[i])} for i in np.flatnonzero(t)]
    for c in CUTS:
        row: dict[str, Any] = {}
        for name, code in PARTS.items():
            n = (part == code) & ~is_anomaly
            row[f"{name}_normal_above"] = int((n & (skew > c)).sum())
            row[f"{name}_normal"] = int(n.sum())
        row["test_target_above"] = int((t & (skew > c)).sum())
        row["test_normal_above_by_run"] = dict(Counter(run[(part == PARTS["test"]) & ~is_anomaly & (skew > c)].tolist())
                                               .most_common())
        out["cuts"][str(c)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--split", required=True, help="request, run, mechanism or workload")
    ap.add_argument("--mechanism", default="straggler_rank")
    ap.add_argument("--feature", default="comm_ns", help="a per-rank standard feature with a spread (default comm_ns)")
    ap.add_argument("--json", help="the summary as JSON (default: stdout)")
    a = ap.parse_args(argv)
    from teller.baselines.features import read_dataset_features
    from teller.baselines.steps import load_steps
    from teller.errors import TellerError

    try:
        st = load_steps(a.dataset, view="horizontal")
        col = f"split_{a.split}"
        if col not in st.split:
            raise ValueError(f"{a.dataset}: no split {a.split!r}; splits: {', '.join(s[6:] for s in st.split)}")
        f = read_dataset_features(a.dataset, st)
        skew = rank_skew(f.std, f.std_names, np.diff(st.unit_ptr), a.feature)
    except (OSError, ValueError, TellerError) as e:
        print(e, file=sys.stderr)
        return 2
    mech = np.asarray(st.mechanism).astype(str)
    if not (mech == a.mechanism).any():
        print(f"{a.dataset}: no horizontal step of mechanism {a.mechanism!r}; mechanisms: "
              f"{', '.join(sorted(set(mech.tolist()) - {''}))}", file=sys.stderr)
        return 2
    got = {"dataset": str(a.dataset), "split": a.split, "mechanism": a.mechanism, "feature": a.feature,
           **summary(skew, st.split[col], np.asarray(st.is_anomaly, bool), mech, st.runs[st.run_code].astype(str),
                     np.asarray(st.step_num), a.mechanism, np.asarray(st.in_window, bool))}
    text = json.dumps(got, indent=1) + "\n"
    if a.json:
        Path(a.json).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
