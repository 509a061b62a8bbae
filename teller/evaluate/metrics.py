"""The evaluation metrics of docs/design.md §11: how well a diagnosis finds the abnormal steps and the
operators behind them.

- step level (:func:`step_metrics`): accuracy, precision, recall and F1 of the abnormal flag;
- operator level (:func:`operator_metrics`): per step, precision/recall/F1/Jaccard of the
  predicted operator set against the true one, averaged over steps, with f = j = 1 and
  p = r = 0 when both sets are empty; and the same averaged over the operator-positive steps
  only (those whose true set is non-empty: Macro₊).

The truth comes from ``step_labels.parquet`` (``teller inject``) or from the windows of
``labels.json`` (planted runs, :mod:`teller.testing.planted`, or injected ones):
:func:`truth_from_step_labels`, :func:`truth_for_steps`; :func:`evaluate` scores a
``diagnosis.json`` against either.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from teller.rundir import RunDir


def truth_for_steps(steps: list[dict[str, Any]], labels: dict[str, Any] | None) -> tuple[np.ndarray, list[set[str]]]:
    """Per diagnosis step: abnormal (overlaps a label window of its rank) and the true operators.

    Windows are ``{start_ns, end_ns, operators}`` (:func:`plant`) or, as ``teller inject`` writes
    them, ``{start_tau_ns, end_tau_ns, targets_hit}``."""
    wins = (labels or {}).get("windows", [])
    ab = np.zeros(len(steps), bool)
    ops: list[set[str]] = [set() for _ in steps]
    if not wins:
        return ab, ops
    ws = np.array([w.get("start_ns", w.get("start_tau_ns", 0)) for w in wins], np.int64)
    we = np.array([w.get("end_ns", w.get("end_tau_ns", 0)) for w in wins], np.int64)
    wr = np.array([w.get("rank", -1) if w.get("rank") is not None else -1 for w in wins], np.int64)
    for i, s in enumerate(steps):  # steps: thousands at most
        hit = (ws < s["end_ns"]) & (we > s["start_ns"]) & ((wr < 0) | (wr == s.get("rank", 0)))
        if hit.any():
            ab[i] = True
            for j in np.flatnonzero(hit).tolist():
                ops[i].update(wins[j].get("operators", wins[j].get("targets_hit", [])))
    return ab, ops


def truth_from_step_labels(steps: list[dict[str, Any]], table: Any) -> tuple[np.ndarray, list[set[str]]]:
    """Per diagnosis step: ``is_anomaly`` and ``operator_labels`` from ``step_labels.parquet``
    (``teller inject``), matched on the STEP node id; steps it does not list are normal."""
    ids = table.column("step_id").to_pylist()
    lab = dict(zip(ids, table.column("is_anomaly").to_pylist(), strict=True))
    opl = dict(zip(ids, table.column("operator_labels").to_pylist(), strict=True))
    ab = np.array([bool(lab.get(s["node_id"], False)) for s in steps], bool)
    ops = [set(opl.get(s["node_id"]) or []) if a else set() for s, a in zip(steps, ab, strict=True)]
    return ab, ops


def step_metrics(truth: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """Step-level accuracy, precision, recall and F1 of the abnormal flag."""
    truth, pred = np.asarray(truth, bool), np.asarray(pred, bool)
    tp = int((truth & pred).sum())
    fp = int((~truth & pred).sum())
    fn = int((truth & ~pred).sum())
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    acc = float((truth == pred).mean()) if len(truth) else 0.0
    return {"accuracy": acc, "precision": p, "recall": r, "f1": f, "tp": tp, "fp": fp, "fn": fn,
            "steps": int(len(truth)), "abnormal": int(truth.sum())}


def operator_prf(t: set[str], p: set[str]) -> tuple[float, float, float, float]:
    """One step's operator-set precision, recall, F1 and Jaccard (true set ``t``, named ``p``;
    both empty: p = r = 0, f = j = 1), what :func:`operator_metrics` averages."""
    if not t and not p:
        return 0.0, 0.0, 1.0, 1.0
    inter = len(t & p)
    prec = inter / len(p) if p else 0.0
    rec = inter / len(t) if t else 0.0
    f = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    j = inter / len(t | p)
    return prec, rec, f, j


def operator_metrics(truth: list[set[str]], pred: list[set[str]]) -> dict[str, float]:
    """Operator-set P/R/F1/Jaccard averaged per step (f = j = 1, p = r = 0 when both sets are
    empty) and the same averaged over operator-positive steps only (Macro₊)."""
    vals = np.array([operator_prf(set(t), set(p)) for t, p in zip(truth, pred, strict=True)]).reshape(-1, 4)
    pos = np.array([bool(t) for t in truth], bool)
    out: dict[str, float] = {"steps": int(len(truth)), "operator_positive_steps": int(pos.sum())}
    for i, k in enumerate(("precision", "recall", "f1", "jaccard")):
        out[k] = float(vals[:, i].mean()) if len(vals) else 0.0
        out[f"macro_plus_{k}"] = float(vals[pos, i].mean()) if pos.any() else 0.0
    return out


def evaluate(diagnosis: dict[str, Any], labels: dict[str, Any] | None = None,
             step_labels: Any = None) -> dict[str, Any]:
    """Step and operator metrics of a diagnosis against ``step_labels`` (a ``step_labels.parquet``
    table) or, without one, the windows of ``labels``. Predicted operators of a flagged step are
    its candidate families."""
    steps = diagnosis["steps"]
    if step_labels is not None:
        ab, ops = truth_from_step_labels(steps, step_labels)
    else:
        ab, ops = truth_for_steps(steps, labels)
    pred = np.array([bool(s["flag"]) for s in steps], bool)
    pops = [{c["family"] for c in s.get("candidates", [])} if s["flag"] else set() for s in steps]
    return {"step": step_metrics(ab, pred), "operator": operator_metrics(ops, pops),
            "truth": ab.tolist(), "pred": pred.tolist(), "true_ops": [sorted(o) for o in ops],
            "pred_ops": [sorted(o) for o in pops]}


def evaluate_run(run: str | os.PathLike, diagnosis: dict[str, Any]) -> dict[str, Any]:
    """:func:`evaluate` with the labels found in ``run`` (step_labels.parquet, else labels.json)."""
    rd = RunDir(run)
    table = None
    if rd.has_table("step_labels"):
        table = rd.read_table("step_labels")
    return evaluate(diagnosis, rd.read_labels(), table)


def save_json(obj: Any, path: str | os.PathLike) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)
