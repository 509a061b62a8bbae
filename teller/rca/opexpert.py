"""The operator expert of a MoT with a family head that reads the unit statistics (docs/design.md
§9, "Operator expert").

The family head scores each operator family of a unit (a *slot*) from the trace states and the
family's summed times against the reference. Gradient-boosted trees on the same numbers, each
slot set beside its unit's others (its excess over the unit's most deviant family, its rank) and
beside the unit's layer mix, rank the slots of held-out runs better on their own in places and
worse in others (docs/results.md, "The operator expert"); the two are mixed. A flagged unit names
the slots whose

    s = (1 − w) · σ(logit − t) + w · p_expert

reaches 0.5 (the best one when none does), ``t`` the head's calibrated threshold
(:attr:`teller.rca.api.RCA.op_threshold`) and ``w`` the weight chosen on the val part
(:func:`teller.rca.train.fit_op_expert`). With ``w = 0`` this is the head at its threshold.

Saved as ``operator_expert.ubj`` (XGBoost's binary JSON, read without pickle) beside the weights;
``config.json``'s ``calibration`` holds ``op_weight`` and the block it was chosen from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from teller.errors import InputError, TellerError
from teller.rca.typer import load_booster, save_booster, xgb_module

if TYPE_CHECKING:
    from teller.rca.batch import Prepared
    from teller.rca.data import ReferenceStats

#: the expert's file in a model directory
OP_EXPERT_FILE = "operator_expert.ubj"
#: weights of the expert tried on the val part (0: the head alone, 1: the expert alone)
OP_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: the trees: rounds, depth, learning rate, row and column subsampling (deeper than the type
#: expert's: on both splits' val parts 400 rounds of depth 6 scored above 200 of depth 4)
TREES = dict(n_estimators=400, max_depth=6, learning_rate=0.1, subsample=0.8, colsample_bytree=0.8, tree_method="hist")
#: the label layers of docs/faults.md, one column each (a family of another layer gets the last)
LAYERS = ("FE", "COMM", "OTHER")


def slot_features(prep: "Prepared", ref: "ReferenceStats") -> np.ndarray:
    """Per family slot of ``prep`` (float32, one row per slot, in slot order): the slot's features
    against the reference (``prep.slot_feat``: log time / count / span and their robust z); per z
    column, its difference from the unit's largest and its rank among the unit's slots (0: the
    largest); its layer (one-hot over :data:`LAYERS` and "other"); its family's row in the
    reference (−1: a family the reference never saw); the unit's slot count; and the unit's layer
    mix (``prep.unit_feat``)."""
    sl, inp = prep.slots, prep.inputs
    if sl is None or prep.slot_feat is None or prep.unit_feat is None:
        raise TellerError("the operator expert reads family slots and unit statistics: a MoT with --op-unit family and --unit-stats")
    n = len(inp)
    nslot = np.diff(sl.offsets).astype(np.int64)
    su = np.repeat(np.arange(n, dtype=np.int64), nslot)
    sf = np.asarray(prep.slot_feat, np.float64)
    cols = [sf]
    pos = np.arange(len(su), dtype=np.int64) - np.repeat(sl.offsets[:-1].astype(np.int64), nslot)
    for c in range(1, sf.shape[1], 2):  # the z columns
        z = sf[:, c]
        top = np.full(n, -np.inf)
        np.maximum.at(top, su, z)
        rank = np.empty(len(z), np.float64)
        rank[np.lexsort((-z, su))] = pos
        cols += [(z - top[su])[:, None], rank[:, None]]
    layer_of = {name: k for k, name in enumerate(LAYERS)}
    fam_layer = np.asarray([layer_of.get(x, len(LAYERS)) for x in inp.family_layer.tolist()], np.int64)
    fam = sl.family.astype(np.int64)
    cols.append(np.eye(len(LAYERS) + 1)[fam_layer[fam]])
    cols.append(ref.family_rows(inp.families)[fam][:, None].astype(np.float64))
    cols.append(nslot[su][:, None].astype(np.float64))
    cols.append(np.asarray(prep.unit_feat, np.float64)[su])
    return np.hstack(cols).astype(np.float32)


class OperatorExpert:
    """Gradient-boosted trees giving each family slot the probability that its family is one of the
    unit's operator labels."""

    def __init__(self, booster: Any, n_features: int):
        self.booster, self.n_features = booster, int(n_features)

    @classmethod
    def fit(cls, X: np.ndarray, y: np.ndarray, seed: int = 0, threads: int = 2) -> "OperatorExpert":
        """``X``: :func:`slot_features` of abnormal units' slots; ``y``: 1 where the slot's family is
        one of its unit's operator labels."""
        xgb = xgb_module()
        y = np.asarray(y, np.int64)
        if len(np.unique(y)) < 2:
            raise TellerError("the operator expert needs labelled and unlabelled family slots among the abnormal training units")
        clf = xgb.XGBClassifier(**TREES, random_state=seed, n_jobs=threads)
        clf.fit(np.asarray(X, np.float32), y)
        return cls(clf.get_booster(), np.asarray(X).shape[1])

    def proba(self, X: np.ndarray) -> np.ndarray:
        """Per row of ``X``: the probability that the slot's family is an operator label."""
        xgb = xgb_module()
        X = np.asarray(X, np.float32)
        if X.ndim != 2 or (len(X) and X.shape[1] != self.n_features):
            raise TellerError(f"the operator expert reads {self.n_features} features per slot, got an array of shape {X.shape}")
        if not len(X):
            return np.zeros(0, np.float64)
        return np.asarray(self.booster.predict(xgb.DMatrix(X)), np.float64).reshape(len(X))

    def save(self, directory: str | Path) -> Path:
        return save_booster(self.booster, Path(directory) / OP_EXPERT_FILE, teller_features=str(self.n_features))

    @classmethod
    def load(cls, directory: str | Path) -> "OperatorExpert":
        p = Path(directory) / OP_EXPERT_FILE
        b, raw = load_booster(p, "operator expert", "teller rca opexpert MODEL DATASET", "teller_features")
        n = int(raw) if raw.isdigit() else 0
        if n <= 0 or b.num_features() != n:
            raise InputError(p, f"it declares {n} features per slot and its trees read {b.num_features()}",
                             "run `teller rca opexpert MODEL DATASET` again")
        return cls(b, n)


def fuse_logits(logits: np.ndarray, expert: np.ndarray, weight: float, threshold: float) -> np.ndarray:
    """The family logits as the mix sees them: ``threshold + logit(s)`` with
    ``s = (1 − weight) · σ(logits − threshold) + weight · expert``, so that ``> threshold`` means
    ``s > 0.5`` and the order is the order of ``s`` (−inf/NaN logits count as σ = 0)."""
    lg = np.nan_to_num(np.asarray(logits, np.float64), nan=-np.inf)
    with np.errstate(over="ignore"):
        head = 1.0 / (1.0 + np.exp(-(lg - threshold)))
    s = np.clip((1.0 - weight) * head + weight * np.asarray(expert, np.float64), 1e-9, 1.0 - 1e-9)
    return threshold + np.log(s / (1.0 - s))
