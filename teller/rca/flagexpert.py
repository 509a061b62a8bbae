"""The abnormal-step expert of a MoT that reads the unit statistics (docs/design.md §9, "Flag expert").

The fault head's normal class says whether a unit is abnormal, from the trace states plus an MLP
of the unit's layer mix. Gradient-boosted trees on the same layer mix (the numbers the MLP reads,
:meth:`teller.rca.data.ReferenceStats.unit_features`), fitted on every unit of the training part,
rank held-out steps differently from the network: on the val part of the union's request split
the mix of the two had fewer false positives at the same recall than either alone
(docs/results.md, "The flag expert"). A unit's abnormal probability is then

    p = (1 − w) · p_head + w · p_expert

and its five types keep the head's shares of that mass (the type expert's where one is fitted).
The weight ``w`` and the abnormal cut are chosen together on the val part, as the cut alone was:
the best step F1 expected at the deployment's fault prior
(:func:`teller.rca.train.fit_flag_expert`). With ``w = 0`` this is the head.

Saved as ``flag_expert.ubj`` (XGBoost's own binary JSON; read without pickle) beside the weights;
``config.json``'s ``calibration`` holds ``flag_weight`` and the block it was chosen from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from teller.errors import InputError, TellerError
from teller.rca.typer import load_booster, save_booster, xgb_module

#: the expert's file in a model directory
FLAG_EXPERT_FILE = "flag_expert.ubj"
#: the views whose units the expert reads: on the horizontal view (every rank of a step as one
#: unit) the trees on the context lowered step F1 where the head alone did not (docs/results.md,
#: "The flag expert on the shape-free context"); those units keep the head's probability
FLAG_VIEWS = ("vertical",)
#: weights of the expert tried on the val part (0: the head alone, 1: the expert alone)
FLAG_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: the trees: rounds, depth, learning rate, row and column subsampling (the type expert's)
TREES = dict(n_estimators=200, max_depth=4, learning_rate=0.1, subsample=0.8, colsample_bytree=0.8, tree_method="hist")


#: what an expert reads: the layer mix against the training reference (``prep.unit_feat``), or
#: the shape-free context (``prep.unit_ctx``, :mod:`teller.rca.context`)
READS = ("stats", "context")


class FlagExpert:
    """Gradient-boosted trees over a unit's statistics features (``reads="stats"``) or its
    shape-free context (``reads="context"``), giving its abnormal probability."""

    def __init__(self, booster: Any, reads: str = "stats"):
        if reads not in READS:
            raise TellerError(f"a flag expert reads {' or '.join(READS)}, not {reads!r}")
        self.booster, self.reads = booster, reads

    @classmethod
    def fit(cls, X: np.ndarray, abnormal: np.ndarray, seed: int = 0, threads: int = 2, reads: str = "stats",
            weight: np.ndarray | None = None) -> "FlagExpert":
        """``abnormal``: one boolean per row of ``X`` (both kinds needed); ``weight``: each row's
        weight in the trees' loss (None: 1)."""
        xgb = xgb_module()
        y = np.asarray(abnormal, bool)
        if len(y) != len(X):
            raise TellerError(f"the flag expert got {len(X)} feature rows for {len(y)} labels")
        if y.all() or not y.any():
            raise TellerError(f"the flag expert needs normal and abnormal units (got {int(y.sum())} abnormal of {len(y)})")
        clf = xgb.XGBClassifier(**TREES, random_state=seed, n_jobs=threads)
        if weight is not None and len(weight) != len(y):
            raise TellerError(f"the flag expert got {len(weight)} weights for {len(y)} labels")
        clf.fit(np.asarray(X, np.float32), y.astype(np.int64), sample_weight=None if weight is None else np.asarray(weight, np.float64))
        return cls(clf.get_booster(), reads)

    def features(self, prep: Any) -> np.ndarray | None:
        """The columns of ``prep`` (:class:`teller.rca.batch.Prepared`) this expert reads, or None
        where they were not prepared."""
        return prep.unit_ctx if self.reads == "context" else prep.unit_feat

    def proba(self, X: np.ndarray) -> np.ndarray:
        """(n,) abnormal probabilities."""
        xgb = xgb_module()
        X = np.asarray(X, np.float32)
        if not len(X):
            return np.zeros(0, np.float64)
        return np.asarray(self.booster.predict(xgb.DMatrix(X)), np.float64).reshape(len(X))

    def save(self, directory: str | Path) -> Path:
        return save_booster(self.booster, Path(directory) / FLAG_EXPERT_FILE, teller_expert="flag", teller_reads=self.reads)

    @classmethod
    def load(cls, directory: str | Path) -> "FlagExpert":
        path = Path(directory) / FLAG_EXPERT_FILE
        b, _ = load_booster(path, "flag expert", "teller rca flagexpert MODEL DATASET", "teller_expert")
        reads = b.attr("teller_reads") or "stats"  # an expert saved before the context: the layer mix
        if reads not in READS:
            raise InputError(path, f"a flag expert that reads {reads!r} (this version knows {', '.join(READS)})",
                             "run `teller rca flagexpert MODEL DATASET` again")
        return cls(b, reads)


def mix(p_head: np.ndarray, p_expert: np.ndarray, weight: float | np.ndarray) -> np.ndarray:
    """The abnormal probability ``(1 − weight) · p_head + weight · p_expert`` (``weight``: one, or
    one per unit)."""
    w = np.asarray(weight, np.float64)
    return (1.0 - w) * np.asarray(p_head, np.float64) + w * np.asarray(p_expert, np.float64)


def fuse(probs: np.ndarray, p_expert: np.ndarray, weight: float | np.ndarray) -> np.ndarray:
    """The six class probabilities (normal first) with the abnormal mass mixed with the expert's
    (:func:`mix`) and shared among the five types as the head shares it (uniformly where the
    head gives them nothing)."""
    probs = np.asarray(probs, np.float64)
    if not np.any(weight):
        return probs
    ab = np.clip(probs[:, 1:], 0.0, None)
    mass = ab.sum(1, keepdims=True)
    shares = np.divide(ab, mass, out=np.full_like(ab, 1.0 / ab.shape[1]), where=mass > 0)
    new = np.clip(mix(mass[:, 0], p_expert, weight), 0.0, 1.0)[:, None]
    out = np.empty_like(probs)
    out[:, :1] = 1.0 - new
    out[:, 1:] = new * shares
    return out
