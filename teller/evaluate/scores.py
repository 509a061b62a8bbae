"""Evaluation metrics of docs/design.md §11, in numpy (sacrebleu for BLEU).

- step level: accuracy, precision, recall, F1 of the abnormal flag (:func:`step_scores`);
- operator sets: precision, recall, F1, Jaccard per step, averaged, with f = j = 1 and p = r = 0
  when both sets are empty, and Macro₊ over the operator-positive steps only (:func:`operator_scores`);
- fault type: accuracy, macro-recall, macro-F1 and a confusion matrix (:func:`fault_type_scores`);
- low priors: abnormal steps downsampled to a fault prior (10%, 5%), repeated with fixed seeds:
  recall, F1, AUPRC, AUROC, mean and standard deviation (:func:`low_prior_scores`);
- explanations: corpus BLEU-1..4 (:func:`bleu_scores`).

Step and operator metrics are :func:`teller.evaluate.metrics.step_metrics` and
:func:`teller.evaluate.metrics.operator_metrics` (the definitions the numeric stage's results
use), re-exported here so every caller of the evaluation imports them from one place.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from teller.evaluate.metrics import operator_metrics, step_metrics

__all__ = ["step_scores", "operator_scores", "fault_type_scores", "auroc", "auprc", "low_prior_scores",
           "bleu_scores", "PRIORS", "REPEATS"]

#: the fault priors of the low-prior analysis, and its repeats
PRIORS = (0.10, 0.05)
REPEATS = 50


def step_scores(truth: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """Step accuracy/precision/recall/F1 (and tp/fp/fn): precision is 0 when nothing is flagged,
    recall 0 when nothing is abnormal."""
    return step_metrics(np.asarray(truth, bool), np.asarray(pred, bool))


def operator_scores(truth: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict[str, float]:
    """Operator-set P/R/F1/Jaccard per step averaged over all steps (both empty: f = j = 1,
    p = r = 0) and over the operator-positive steps (``macro_plus_*``)."""
    return operator_metrics([set(t) for t in truth], [set(p) for p in pred])


def fault_type_scores(truth: Sequence[str], pred: Sequence[str]) -> dict[str, Any]:
    """Fault-type accuracy, macro-recall and macro-F1 over the true classes, and the confusion
    matrix (rows: true, columns: predicted, over the union of true and predicted classes).

    A predicted class that never occurs in the truth counts against precision of nothing and
    recall of the true class: the macro averages run over the classes present in ``truth`` (a
    class no step has cannot be recalled)."""
    t = np.asarray([str(x) for x in truth], dtype=object).astype(str)
    p = np.asarray([str(x) for x in pred], dtype=object).astype(str)
    if len(t) != len(p):
        raise ValueError(f"fault types: {len(t)} true and {len(p)} predicted")
    classes = sorted(set(t.tolist()) | set(p.tolist()))
    if not len(t):
        return {"accuracy": 0.0, "macro_recall": 0.0, "macro_f1": 0.0, "steps": 0, "classes": [], "confusion": [],
                "per_class": {}}
    idx = {c: i for i, c in enumerate(classes)}
    ti = np.array([idx[x] for x in t.tolist()])
    pi = np.array([idx[x] for x in p.tolist()])
    k = len(classes)
    cm = np.bincount(ti * k + pi, minlength=k * k).reshape(k, k)
    tp = np.diag(cm).astype(float)
    n_true = cm.sum(1).astype(float)
    n_pred = cm.sum(0).astype(float)
    rec = np.divide(tp, n_true, out=np.zeros(k), where=n_true > 0)
    prec = np.divide(tp, n_pred, out=np.zeros(k), where=n_pred > 0)
    f1 = np.divide(2 * prec * rec, prec + rec, out=np.zeros(k), where=(prec + rec) > 0)
    present = n_true > 0
    return {"accuracy": float(tp.sum() / len(t)), "macro_recall": float(rec[present].mean()),
            "macro_f1": float(f1[present].mean()), "steps": int(len(t)), "classes": classes,
            "confusion": cm.tolist(),
            "per_class": {c: {"precision": float(prec[i]), "recall": float(rec[i]), "f1": float(f1[i]),
                              "support": int(n_true[i])} for i, c in enumerate(classes)}}


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (1-based) with ties sharing their mean rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    first = np.concatenate([[True], xs[1:] != xs[:-1]])
    grp = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    ends = np.concatenate([starts[1:], [len(x)]])
    mean_rank = (starts + ends + 1) / 2.0  # ranks starts+1 .. ends
    r = np.empty(len(x))
    r[order] = mean_rank[grp]
    return r


def auroc(truth: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve (Mann–Whitney, ties counted half); NaN with one class only."""
    t = np.asarray(truth, bool)
    s = np.asarray(score, float)
    n_pos, n_neg = int(t.sum()), int((~t).sum())
    if not n_pos or not n_neg:
        return float("nan")
    r = _ranks(s)
    return float((r[t].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auprc(truth: np.ndarray, score: np.ndarray) -> float:
    """Average precision (step-wise area under the precision-recall curve, as scikit-learn's
    ``average_precision_score``: tied scores form one threshold); NaN without positives."""
    t = np.asarray(truth, bool)
    s = np.asarray(score, float)
    n_pos = int(t.sum())
    if not n_pos:
        return float("nan")
    order = np.argsort(-s, kind="mergesort")
    ts, ss = t[order], s[order]
    last = np.concatenate([ss[1:] != ss[:-1], [True]])  # last row of each tied block
    tp = np.cumsum(ts)[last].astype(float)
    fp = np.cumsum(~ts)[last].astype(float)
    prec = tp / (tp + fp)
    rec = tp / n_pos
    return float(np.sum(np.diff(np.concatenate([[0.0], rec])) * prec))


def _sample_sizes(n_ab: int, n_norm: int, prior: float) -> tuple[int, int]:
    """Sizes of a sample at ``prior``: all normal steps and abnormal ones downsampled; when there
    are too few abnormal steps for that, all of them and the normal ones downsampled."""
    want_ab = int(round(prior / (1 - prior) * n_norm))
    if want_ab <= n_ab:
        return max(want_ab, 1 if n_ab else 0), n_norm
    return n_ab, int(round(n_ab * (1 - prior) / prior))


def low_prior_scores(truth: np.ndarray, pred: np.ndarray, score: np.ndarray, priors: Sequence[float] = PRIORS,
                     repeats: int = REPEATS, seed: int = 0) -> dict[str, Any]:
    """Recall, F1, AUPRC and AUROC on samples of the steps at each fault prior: every normal step
    and a random subset of the abnormal ones (or all abnormal ones and a subset of the normal ones
    when there are too few), ``repeats`` times with seeds ``seed .. seed + repeats - 1``; mean and
    standard deviation of each. The flag ``pred`` is the method's own (its threshold does not
    move with the prior), so recall stays put while precision and F1 fall."""
    t = np.asarray(truth, bool)
    p = np.asarray(pred, bool)
    s = np.asarray(score, float)
    s = np.where(np.isfinite(s), s, -np.inf if not np.isfinite(s).any() else np.nanmin(s[np.isfinite(s)]) - 1)
    ab, nm = np.flatnonzero(t), np.flatnonzero(~t)
    out: dict[str, Any] = {}
    for prior in priors:
        if not len(ab) or not len(nm):
            out[f"{prior:g}"] = {"note": f"needs abnormal and normal steps ({len(ab)} abnormal, {len(nm)} normal)"}
            continue
        k_ab, k_nm = _sample_sizes(len(ab), len(nm), prior)
        vals = np.zeros((repeats, 4))
        for r in range(repeats):  # 50 samples of a few thousand steps
            rng = np.random.default_rng(seed + r)
            idx = np.concatenate([rng.choice(ab, k_ab, replace=False), rng.choice(nm, k_nm, replace=False)])
            m = step_metrics(t[idx], p[idx])
            vals[r] = (m["recall"], m["f1"], auprc(t[idx], s[idx]), auroc(t[idx], s[idx]))
        out[f"{prior:g}"] = {"abnormal": k_ab, "normal": k_nm, "repeats": repeats,
                             **{f"{k}_mean": float(np.nanmean(vals[:, i])) for i, k in enumerate(("recall", "f1", "auprc", "auroc"))},
                             **{f"{k}_std": float(np.nanstd(vals[:, i])) for i, k in enumerate(("recall", "f1", "auprc", "auroc"))}}
    return out


def bleu_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU-1..4 (sacrebleu, its default 13a tokenizer, one reference per hypothesis),
    as fractions in [0, 1]."""
    from sacrebleu.metrics import BLEU

    if len(hypotheses) != len(references):
        raise ValueError(f"BLEU: {len(hypotheses)} hypotheses and {len(references)} references")
    hyps, refs = [str(h) for h in hypotheses], [[str(r) for r in references]]
    out = {}
    for n in (1, 2, 3, 4):
        out[f"bleu{n}"] = float(BLEU(max_ngram_order=n).corpus_score(hyps, refs).score / 100.0) if hyps else 0.0
    return out


# ------------------------------------------------------------------------------------------------
# explanations, checked by program

#: what each explanation check asks of a sentence (``explanation_checks``)
EXPLANATION_CHECKS = {
    "anomaly_correct": "it states a fault (starts '<type> fault') on a truly abnormal step",
    "type_correct": "the stated fault type is the step's labelled category",
    "locator_valid": "it names evidence operators, every one present in the step's own tree, and at least one among the step's labelled operators",
    "causal_consistent": "the mechanism it names in parentheses exists and belongs to the stated fault type, and it gives a 'Cause:'",
    "actionable": "it names a next step an operator can take (an imperative such as check, reduce, increase, pin or disable opening a clause)",
    "complete": "one complete sentence: names the step and rank, ends with a full stop, balanced parentheses, under 600 characters",
}

#: an imperative opening a sentence or clause (or after "next step" / "fix"), e.g. "; check the kernels"
_ACTION = re.compile(r"(?:^|[.;:]\s+|next step:?\s+|fix:?\s+)(?:check|reduce|increase|raise|lower|pin|disable|enable|move|"
                     r"restart|limit|avoid|upgrade|re-?run|set|use|add|remove|isolate)\b", re.I)


def _stated_type(text: str) -> str | None:
    from teller.inject import CATEGORY_TITLES

    head = text[:40].lower()  # a sentence may capitalise its first word
    for cat, title in CATEGORY_TITLES.items():
        if head.startswith(f"{title.lower()} fault"):
            return cat
    return None


def _evidence_names(text: str) -> list[str]:
    m = re.search(r":\s*evidence (.+?)(?: \(layer [^)]*\))?(?:;|\.(?:\s|$))", text)  # the list ends its clause or sentence
    if not m:
        return []
    return [x.strip() for x in m.group(1).split(",") if x.strip()]


def explanation_checks(texts: Sequence[str], truth_types: Sequence[str], truth_ops: Sequence[Sequence[str]],
                       tree_families: Sequence[set[str]]) -> dict[str, Any]:
    """The programmatic checks of :data:`EXPLANATION_CHECKS` on explanations of truly abnormal
    steps (one text per step; an empty text fails every check): the share of steps passing each,
    and the per-step booleans."""
    from teller.inject.mechanisms import registry

    cat_of = {k: m.category for k, m in registry().items()}
    n = len(texts)
    out = {k: np.zeros(n, bool) for k in EXPLANATION_CHECKS}
    for i, (t, ct, ops, fams) in enumerate(zip(texts, truth_types, truth_ops, tree_families, strict=True)):
        t = (t or "").strip()
        if not t:
            continue
        st = _stated_type(t)
        out["anomaly_correct"][i] = st is not None
        out["type_correct"][i] = st is not None and st == ct
        names = _evidence_names(t)
        out["locator_valid"][i] = bool(names) and all(x in fams for x in names) and bool(set(names) & set(ops))
        mech = re.match(r"[^(]* fault \(([a-z0-9_]+)\)", t)
        out["causal_consistent"][i] = (st is not None and mech is not None and cat_of.get(mech.group(1)) == st
                                       and "Cause:" in t)
        out["actionable"][i] = bool(_ACTION.search(t))
        out["complete"][i] = (t.endswith(".") and len(t) < 600 and t.count("(") == t.count(")")
                              and re.search(r"in step \d+ on rank \d+", t) is not None)
    return {"steps": n, "rates": {k: float(v.mean()) if n else 0.0 for k, v in out.items()},
            "per_step": {k: v.tolist() for k, v in out.items()}, "definitions": EXPLANATION_CHECKS}
