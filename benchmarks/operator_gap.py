"""Where a row's operator Macro₊ F1 is lost against another method's, fault mechanism by mechanism
(docs/results.md, "Every block trained for 12 epochs", the workload horizontal Macro₊):

    teller evaluate runs/h200_v2_all --split workload --seed 0 --view horizontal \\
        --methods svm,teller_mot_family,teller_mot_family_sustained,teller_numeric_deploy,teller_sustained_family \\
        --reuse PREDICTIONS.parquet --models MODELS -o OUT
    python benchmarks/operator_gap.py runs/h200_v2_all OUT/predictions.parquet --split workload --view horizontal \\
        --row teller_sustained_family --against svm --json GAP.json

Macro₊ F1 is the mean, over the steps whose true operator set is not empty, of each step's
operator-set F1 (docs/design.md §11; a step the method does not flag names no operator and scores
0). Its loss on a step is 1 − that F1, so the sum of the losses over a mechanism's steps is how
many steps' worth of Macro₊ the method leaves there. Per mechanism: the steps, each method's
loss, and the steps the row loses most on (unflagged, or the operators it named against the
labels). The per-method means are checked against :func:`teller.evaluate.scores.operator_scores`
(the evaluation's own Macro₊), so the table adds up to the figures of `results.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow.parquet as pq

from teller.evaluate.metrics import operator_prf
from teller.evaluate.scores import operator_scores


def step_f1(truth: set[str], pred: set[str]) -> float:
    """Operator-set F1 of one step (:func:`teller.evaluate.metrics.operator_prf`; an
    operator-positive step that names nothing: 0)."""
    return operator_prf(set(truth), set(pred))[2]


def mechanism_losses(truth: Sequence[set[str]], mechanism: Sequence[str],
                     preds: dict[str, Sequence[set[str]]]) -> dict[str, Any]:
    """Per method of ``preds`` (operator sets aligned with ``truth``), its Macro₊ F1 over the
    operator-positive steps and, per mechanism, the steps and the summed loss (1 − F1);
    ``step_f1``: per method, each operator-positive step's F1 (step index → F1)."""
    pos = [i for i, t in enumerate(truth) if t]
    mechs: dict[str, dict[str, Any]] = {}
    for i in pos:
        mechs.setdefault(str(mechanism[i]), {"steps": 0, "loss": {name: 0.0 for name in preds}})["steps"] += 1
    out: dict[str, Any] = {"steps": len(pos), "methods": {}, "mechanisms": mechs, "step_f1": {}}
    for name, pred in preds.items():
        f = np.array([step_f1(truth[i], pred[i]) for i in pos])
        out["methods"][name] = {"macro_plus_f1": float(f.mean()) if len(f) else 0.0}
        out["step_f1"][name] = dict(zip(pos, f.tolist(), strict=True))
        for i, v in zip(pos, f.tolist(), strict=True):
            mechs[str(mechanism[i])]["loss"][name] += 1.0 - v
    return out


def read(dataset: str | Path, predictions: str | Path, split: str, view: str, methods: list[str]) -> dict[str, Any]:
    """The methods' operator sets from an evaluation's ``predictions.parquet`` joined to the
    dataset's labels (run and step number) of ``view``, on ``split``'s test steps there."""
    from teller.baselines.steps import load_steps

    st = load_steps(dataset, view=view)
    labels = {(str(st.runs[st.run_code[i]]), int(st.step_num[i])): (set(st.labels[i]), str(st.mechanism[i]))
              for i in range(st.n)}
    cols = ["view", "split", "method", "run_id", "step", "flag", "score", "operators"]
    rows = pq.read_table(predictions, columns=cols).to_pylist()
    by: dict[str, dict[tuple[str, int], dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        if r["view"] == view and r["split"] == split and r["method"] in methods:
            by[r["method"]][(r["run_id"], int(r["step"]))] = r
    missing = [m for m in methods if m not in by]
    if missing:
        raise ValueError(f"{predictions}: no {split}/{view} answers of {', '.join(missing)}; methods there: "
                         f"{', '.join(sorted({r['method'] for r in rows}))}")
    keys = sorted(by[methods[0]])
    for m in methods[1:]:
        if sorted(by[m]) != keys:
            raise ValueError(f"{predictions}: {m} and {methods[0]} answer different steps")
    unknown = [k for k in keys if k not in labels]
    if unknown:
        raise ValueError(f"{predictions}: {len(unknown)} steps not in {dataset}'s {view} steps (first {unknown[0]}); "
                         "give the dataset the evaluation read")
    truth = [labels[k][0] for k in keys]
    mech = [labels[k][1] for k in keys]
    preds = {m: [set(by[m][k]["operators"] or []) if by[m][k]["flag"] else set() for k in keys] for m in methods}
    got = mechanism_losses(truth, mech, preds)
    for m in methods:  # the evaluation's own Macro₊ on the same answers
        ref = operator_scores([sorted(t) for t in truth], [sorted(by[m][k]["operators"] or []) for k in keys])
        got["methods"][m]["evaluation_macro_plus_f1"] = ref["macro_plus_f1"]
    row = methods[0]
    worst = [{"run": keys[i][0], "step": keys[i][1], "mechanism": mech[i], "f1": f, "flag": bool(by[row][keys[i]]["flag"]),
              "score": float(by[row][keys[i]]["score"]), "truth": sorted(truth[i]), "named": sorted(preds[row][i])}
             for i, f in got.pop("step_f1")[row].items() if f < 1.0]
    got["row_losses"] = sorted(worst, key=lambda w: (w["f1"], w["run"], w["step"]))
    return got


def markdown(got: dict[str, Any], row: str, against: str) -> str:
    lines = [f"Operator-positive steps: {got['steps']}; Macro₊ F1 {row} {got['methods'][row]['macro_plus_f1']:.4f}, "
             f"{against} {got['methods'][against]['macro_plus_f1']:.4f}", "",
             f"| mechanism | steps | {row}: loss | {against}: loss | difference |", "|---|---:|---:|---:|---:|"]
    mech = sorted(got["mechanisms"].items(), key=lambda kv: kv[1]["loss"][against] - kv[1]["loss"][row])
    for name, m in mech:
        a, b = m["loss"][row], m["loss"][against]
        lines.append(f"| {name} | {m['steps']} | {a:.2f} | {b:.2f} | {a - b:+.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("predictions", help="predictions.parquet of `teller evaluate` with both methods")
    ap.add_argument("--split", required=True)
    ap.add_argument("--view", default="vertical")
    ap.add_argument("--row", default="teller_sustained_family")
    ap.add_argument("--against", required=True, help="the method to read the row against (e.g. svm)")
    ap.add_argument("-o", "--out", help="markdown file (default: stdout)")
    ap.add_argument("--json", help="the losses and the row's lossy steps as JSON")
    a = ap.parse_args(argv)
    try:
        got = read(a.dataset, a.predictions, a.split, a.view, [a.row, a.against])
    except (OSError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    md = markdown(got, a.row, a.against)
    if a.out:
        Path(a.out).write_text(md + "\n")
    else:
        print(md)
    if a.json:
        Path(a.json).write_text(json.dumps({"split": a.split, "view": a.view, "row": a.row, "against": a.against, **got},
                                           indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
