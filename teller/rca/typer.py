"""The fault-type expert of a MoT that reads the unit statistics (docs/design.md §9, "Type expert").

The fault head names a type from the mean of the trace states plus an MLP of the unit's layer
mix; gradient-boosted trees on the same layer mix (the 90 numbers the MLP reads,
:meth:`teller.rca.data.ReferenceStats.unit_features`) tell the types of held-out runs apart
better (docs/results.md, "The type expert"). The expert is fitted on the training part's
abnormal units after the network; a flagged unit's type is then the argmax of
``(1 − w) · p_head + w · p_expert`` over the five types, with the weight ``w`` chosen on the
val part (:func:`fit_type_expert`). The abnormal probability stays the network's.

Saved as ``type_expert.ubj`` (XGBoost's own binary JSON; read without pickle) beside the
weights; ``config.json``'s ``calibration`` holds ``type_weight`` and the block it was chosen from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from teller.errors import InputError, TellerError
from teller.rca.data import FAULT_TYPES

if TYPE_CHECKING:
    from teller.rca.api import RCA
    from teller.rca.data import Dataset

#: the expert's file in a model directory
TYPE_EXPERT_FILE = "type_expert.ubj"
#: weights of the expert tried on the val part (0: the head alone, 1: the expert alone)
TYPE_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: the trees: rounds, depth, learning rate, row and column subsampling
TREES = dict(n_estimators=200, max_depth=4, learning_rate=0.1, subsample=0.8, colsample_bytree=0.8, tree_method="hist")

TYPES = FAULT_TYPES[1:]


def _xgb():
    try:
        import xgboost
    except ImportError as e:
        raise TellerError("this model's fault types need its type expert, which needs XGBoost: "
                          "pip install 'teller[rca]'") from e
    return xgboost


class TypeExpert:
    """Gradient-boosted trees over a unit's statistics features, giving probabilities over the five
    fault types (a type absent from the training units gets 0)."""

    def __init__(self, booster: Any, classes: list[int]):
        self.booster, self.classes = booster, list(classes)

    @classmethod
    def fit(cls, X: np.ndarray, types: np.ndarray, seed: int = 0, threads: int = 2) -> "TypeExpert":
        """``types``: indices into the five types (0..4), one per row of ``X``."""
        xgb = _xgb()
        types = np.asarray(types, np.int64)
        classes = sorted(set(types.tolist()))
        if len(classes) < 2:
            raise TellerError(f"the type expert needs abnormal units of two fault types or more (got {len(classes)})")
        remap = {c: i for i, c in enumerate(classes)}
        clf = xgb.XGBClassifier(**TREES, random_state=seed, n_jobs=threads)
        clf.fit(np.asarray(X, np.float32), np.array([remap[c] for c in types.tolist()]))
        return cls(clf.get_booster(), classes)

    def proba(self, X: np.ndarray) -> np.ndarray:
        """(n, 5) probabilities over :data:`TYPES`."""
        xgb = _xgb()
        X = np.asarray(X, np.float32)
        out = np.zeros((len(X), len(TYPES)), np.float64)
        if len(X):
            p = self.booster.predict(xgb.DMatrix(X))
            p = p.reshape(len(X), -1) if p.ndim > 1 or len(self.classes) > 2 else np.stack([1 - p, p], 1)
            out[:, self.classes] = p
        return out

    def save(self, directory: str | Path) -> Path:
        p = Path(directory) / TYPE_EXPERT_FILE
        self.booster.set_attr(teller_classes=",".join(map(str, self.classes)))
        self.booster.save_model(str(p))
        return p

    @classmethod
    def load(cls, directory: str | Path) -> "TypeExpert":
        xgb = _xgb()
        p = Path(directory) / TYPE_EXPERT_FILE
        if not p.is_file():
            raise InputError(p, "missing, but config.json gives the type expert a weight",
                             "copy the whole model directory, or run `teller rca typer MODEL DATASET` again")
        b = xgb.Booster()
        try:
            b.load_model(str(p))
            classes = [int(c) for c in (b.attr("teller_classes") or "").split(",") if c != ""]
        except (xgb.core.XGBoostError, ValueError) as e:
            raise InputError(p, f"not a type expert XGBoost reads ({e})", "run `teller rca typer MODEL DATASET` again") from e
        if len(classes) < 2 or not all(0 <= c < len(TYPES) for c in classes):
            raise InputError(p, f"its fault classes {classes} are not indices of the five types",
                             "run `teller rca typer MODEL DATASET` again")
        return cls(b, classes)


def fuse(probs: np.ndarray, expert: np.ndarray, weight: float) -> np.ndarray:
    """The six class probabilities (normal first) with the abnormal mass shared among the five
    types as ``(1 − weight) · head + weight · expert`` (each normalised over the types)."""
    probs = np.asarray(probs, np.float64)
    ab = probs[:, 1:]
    mass = ab.sum(1, keepdims=True)
    head = np.divide(ab, mass, out=np.full_like(ab, 1.0 / ab.shape[1]), where=mass > 0)
    ex = np.asarray(expert, np.float64)
    s = ex.sum(1, keepdims=True)
    ex = np.divide(ex, s, out=np.full_like(ex, 1.0 / ex.shape[1]), where=s > 0)
    out = probs.copy()
    out[:, 1:] = mass * ((1.0 - weight) * head + weight * ex)
    return out


def _macro_f1(truth: np.ndarray, pred: np.ndarray) -> float:
    labels = sorted(set(truth.tolist()))
    f = []
    for c in labels:
        tp = float(((pred == c) & (truth == c)).sum())
        d = float((pred == c).sum() + (truth == c).sum())
        f.append(2 * tp / d if d else 0.0)
    return float(np.mean(f)) if f else 0.0


def fit_type_expert(model: "RCA", ds: "Dataset", split: str, seed: int = 0, batch_size: int = 64,
                    out: str | Path | None = None) -> dict[str, Any]:
    """Fit the expert on ``split``'s training part (its abnormal units), choose its weight on the
    val part (the best fault-type macro-F1 of :data:`TYPE_WEIGHTS` over the abnormal val units,
    ties to the weight nearest 0.5, then the lower), attach both to ``model`` and, with ``out``,
    save the expert there. Returns the ``type_expert`` block of the calibration (with
    ``type_weight``)."""
    from teller.rca.train import prepare_units

    if not model.cfg.reads_unit_stats:
        raise TellerError("the type expert reads the unit statistics: only a MoT trained with --unit-stats has them")
    u = ds.units

    def features(part: str) -> tuple[np.ndarray, np.ndarray, Any]:
        idx = u.part(split, part)
        idx = idx[u.is_anomaly[idx].astype(bool)]
        if not len(idx):
            return np.zeros((0, 0)), np.zeros(0, np.int64), None
        prep, _ = prepare_units(ds, idx, model.cfg, model.text_tok, model.trace_tok, model.ref, labels=False)
        return prep.unit_feat, np.asarray(u.fault[idx], np.int64) - 1, prep

    Xtr, ytr, _ = features("train")
    expert = TypeExpert.fit(Xtr, ytr, seed=seed)
    Xva, yva, prep = features("val")
    rows = []
    if prep is not None:
        head = np.concatenate([model.fault_probs(prep, np.arange(a, min(a + batch_size, len(prep))))
                               for a in range(0, len(prep), batch_size)])
        ex = expert.proba(Xva)
        for w in TYPE_WEIGHTS:
            pred = fuse(head, ex, w)[:, 1:].argmax(1)
            rows.append({"weight": w, "macro_f1": round(_macro_f1(yva, pred), 6)})
    if rows:
        top = max(r["macro_f1"] for r in rows)
        weight = min((r["weight"] for r in rows if r["macro_f1"] == top), key=lambda w: (abs(w - 0.5), w))
    else:
        weight = 0.5
    model.type_expert, model.meta.setdefault("calibration", {})["type_weight"] = expert, weight
    block = {"split": split, "train_units": int(len(ytr)), "val_units": int(len(yva)), "classes": expert.classes,
             "trees": TREES, "seed": seed, "grid": rows, "chosen": weight}
    model.meta["calibration"]["type_expert"] = block
    if out is not None:
        expert.save(out)
    return {"type_weight": weight, "type_expert": block}
