"""Metrics of RCA predictions on labelled units (docs/design.md §11).

The step and operator-set metrics are the project's one implementation in
``teller.evaluate.metrics``, imported here and nowhere else in this package.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from teller.evaluate.metrics import operator_metrics, step_metrics
from teller.rca.data import FAULT_TYPES

__all__ = ["step_metrics", "operator_metrics", "operator_truth", "macro_f1", "evaluate_predictions"]


def macro_f1(truth: Sequence[str], pred: Sequence[str], classes: Sequence[str]) -> dict[str, Any]:
    """Per-class and macro-averaged F1 over ``classes`` present in the truth or the predictions."""
    t = np.asarray(truth, dtype=object)
    p = np.asarray(pred, dtype=object)
    per = {}
    for c in classes:
        tp = int(((t == c) & (p == c)).sum())
        fp = int(((t != c) & (p == c)).sum())
        fn = int(((t == c) & (p != c)).sum())
        if tp + fp + fn:
            per[c] = 2 * tp / (2 * tp + fp + fn)
    return {"macro_f1": float(np.mean(list(per.values()))) if per else 0.0, "per_class_f1": per,
            "accuracy": float((t == p).mean()) if len(t) else 0.0, "n": int(len(t))}


def operator_truth(operator_labels: Sequence[Sequence[str]], is_anomaly: np.ndarray) -> list[set[str]]:
    """The labelled operator set of each unit, empty for a normal one (DESIGN.md §11's empty-set rule)."""
    return [set(o) if a else set() for o, a in zip(operator_labels, np.asarray(is_anomaly, bool), strict=True)]


def evaluate_predictions(pred: list[dict[str, Any]], is_anomaly: np.ndarray, fault: np.ndarray,
                         operator_labels: list[list[str]], explanations: list[str] | None = None) -> dict[str, Any]:
    """Step F1, fault-type macro-F1 and operator-set metrics of ``pred`` (from ``RCA.predict``).

    - ``step``: the abnormal flag against ``is_anomaly``;
    - ``fault_type``: on the truly abnormal units, the predicted type among the five
      (``fault_type_best``, so a missed step still counts its type) against the truth;
    - ``fault_type_6``: six classes (normal + five) on every unit, end to end;
    - ``operator``: evidence families of predicted-abnormal units against ``operator_labels``
      (empty for normal units): per-unit P/R/F1/Jaccard with f = j = 1 when both are empty, and
      Macro₊ on operator-positive units;
    - ``explanation`` (with ``explanations``, the units' reference sentences): corpus BLEU-1..4
      (:func:`teller.evaluate.scores.bleu_scores`) of the model's own explanation against the
      reference, on the truly abnormal units the model flagged and explained.
    """
    ab = np.asarray(is_anomaly, bool)
    names = np.asarray([FAULT_TYPES[int(f)] for f in fault], dtype=object)
    flag = np.asarray([p["abnormal"] for p in pred], bool)
    best = np.asarray([p["fault_type_best"] for p in pred], dtype=object)
    end = np.asarray([p["fault_type"] or "normal" for p in pred], dtype=object)
    truth_ops = operator_truth(operator_labels, ab)
    pred_ops = [set(p["evidence_operators"]) if p["abnormal"] else set() for p in pred]
    return {
        "units": int(len(pred)),
        "step": step_metrics(ab, flag),
        "fault_type": macro_f1(names[ab].tolist(), best[ab].tolist(), FAULT_TYPES[1:]),
        "fault_type_6": macro_f1(names.tolist(), end.tolist(), FAULT_TYPES),
        "operator": operator_metrics(truth_ops, pred_ops),
        "explained": int(sum(bool(p["explanation"]) for p in pred)),
        **({"explanation": _bleu(pred, ab, explanations)} if explanations is not None else {}),
    }


def _bleu(pred: list[dict[str, Any]], ab: np.ndarray, refs: list[str]) -> dict[str, Any]:
    from teller.evaluate.scores import bleu_scores

    keep = [i for i, p in enumerate(pred) if ab[i] and p["abnormal"] and p["explanation"] and refs[i]]
    return {"units": len(keep), **bleu_scores([pred[i]["explanation"] for i in keep], [refs[i] for i in keep])}
