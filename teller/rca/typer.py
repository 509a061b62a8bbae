"""The fault-type expert of a MoT that reads the unit statistics (docs/design.md §9, "Type expert").

The fault head names a type from the mean of the trace states plus an MLP of the unit's layer
mix; gradient-boosted trees on the same layer mix (the 90 numbers the MLP reads,
:meth:`teller.rca.data.ReferenceStats.unit_features`) tell the types of held-out runs apart
better (docs/results.md, "The type expert"). The expert is fitted on the training part's
abnormal units after the network; a flagged unit's type is then the argmax of
``(1 − w) · p_head + w · p_expert`` over the five types, with the weight ``w`` chosen on the
val part (:func:`teller.rca.train.fit_type_expert`). The abnormal probability stays the network's.

Saved as ``type_expert.ubj`` (XGBoost's own binary JSON; read without pickle) beside the
weights; ``config.json``'s ``calibration`` holds ``type_weight`` and the block it was chosen from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from teller.errors import InputError, TellerError
from teller.rca.data import FAULT_TYPES

#: the expert's file in a model directory
TYPE_EXPERT_FILE = "type_expert.ubj"
#: weights of the expert tried on the val part (0: the head alone, 1: the expert alone)
TYPE_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: the trees: rounds, depth, learning rate, row and column subsampling
TREES = dict(n_estimators=200, max_depth=4, learning_rate=0.1, subsample=0.8, colsample_bytree=0.8, tree_method="hist")

TYPES = FAULT_TYPES[1:]


def xgb_module():
    """XGBoost, which the experts need (a clear error where it is not installed)."""
    try:
        import xgboost
    except ImportError as e:
        raise TellerError("this model's experts (fault type, operators) need XGBoost: pip install 'teller[rca]'") from e
    return xgboost


def save_booster(booster: Any, path: Path, **attrs: str) -> Path:
    """Write an expert's trees to ``path`` (XGBoost's UBJSON) with TELLER's own attributes."""
    booster.set_attr(**attrs)
    booster.save_model(str(path))
    return path


def load_booster(path: Path, what: str, command: str, attr: str) -> tuple[Any, str]:
    """An expert's trees from ``path`` and its attribute ``attr`` (read without pickle), or an
    :class:`InputError` naming ``what`` and the ``command`` that writes it again."""
    xgb = xgb_module()
    if not path.is_file():
        raise InputError(path, f"missing, but config.json gives the {what} a weight",
                         f"copy the whole model directory, or run `{command}` again")
    b = xgb.Booster()
    try:
        b.load_model(str(path))
    except xgb.core.XGBoostError as e:
        raise InputError(path, f"not a {what} XGBoost reads ({e})", f"run `{command}` again") from e
    return b, b.attr(attr) or ""


class TypeExpert:
    """Gradient-boosted trees over a unit's statistics features, giving probabilities over the five
    fault types (a type absent from the training units gets 0)."""

    def __init__(self, booster: Any, classes: list[int]):
        self.booster, self.classes = booster, list(classes)

    @classmethod
    def fit(cls, X: np.ndarray, types: np.ndarray, seed: int = 0, threads: int = 2) -> "TypeExpert":
        """``types``: indices into the five types (0..4), one per row of ``X``."""
        xgb = xgb_module()
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
        xgb = xgb_module()
        X = np.asarray(X, np.float32)
        out = np.zeros((len(X), len(TYPES)), np.float64)
        if len(X):
            p = self.booster.predict(xgb.DMatrix(X))
            p = p.reshape(len(X), -1) if p.ndim > 1 or len(self.classes) > 2 else np.stack([1 - p, p], 1)
            out[:, self.classes] = p
        return out

    def save(self, directory: str | Path) -> Path:
        return save_booster(self.booster, Path(directory) / TYPE_EXPERT_FILE, teller_classes=",".join(map(str, self.classes)))

    @classmethod
    def load(cls, directory: str | Path) -> "TypeExpert":
        p = Path(directory) / TYPE_EXPERT_FILE
        b, raw = load_booster(p, "type expert", "teller rca typer MODEL DATASET", "teller_classes")
        try:
            classes = [int(c) for c in raw.split(",") if c != ""]
        except ValueError as e:
            raise InputError(p, f"its fault classes {raw!r} are not numbers ({e})", "run `teller rca typer MODEL DATASET` again") from e
        if len(classes) < 2 or not all(0 <= c < len(TYPES) for c in classes):
            raise InputError(p, f"its fault classes {classes} are not indices of the five types",
                             "run `teller rca typer MODEL DATASET` again")
        return cls(b, classes)


def type_shares(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of six class probabilities per row (normal first): the abnormal mass (rows × 1) and the five
    types' shares of it (uniform where the mass is 0)."""
    ab = np.clip(np.asarray(probs, np.float64)[:, 1:], 0.0, None)
    mass = ab.sum(1, keepdims=True)
    return mass, np.divide(ab, mass, out=np.full_like(ab, 1.0 / ab.shape[1]), where=mass > 0)


def fuse(probs: np.ndarray, expert: np.ndarray, weight: float) -> np.ndarray:
    """The six class probabilities (normal first) with the abnormal mass shared among the five
    types as ``(1 − weight) · head + weight · expert`` (each normalised over the types)."""
    probs = np.asarray(probs, np.float64)
    mass, head = type_shares(probs)
    ex = np.asarray(expert, np.float64)
    s = ex.sum(1, keepdims=True)
    ex = np.divide(ex, s, out=np.full_like(ex, 1.0 / ex.shape[1]), where=s > 0)
    out = probs.copy()
    out[:, 1:] = mass * ((1.0 - weight) * head + weight * ex)
    return out
