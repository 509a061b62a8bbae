"""The classical baselines of docs/design.md §11 on the step features of :mod:`.features`.

**Unsupervised** (scikit-learn; standard statistical features, ``log1p`` then standardized):
KMeans, DBSCAN, Isolation Forest and GMM. Each is fitted as a one-class model on the **normal**
train steps (as the numeric stage is: the labels only choose the reference), which is how
these methods are used for anomaly detection with a clean reference; ``fit_on="all"`` fits on
every train step instead (the fully unsupervised setting). Scores and flags:

- KMeans (k = 8): distance to the nearest centre;
- DBSCAN (min_samples = 5, eps = the 95th percentile of the fitted steps' distance to their
  5th neighbour): distance to the nearest core sample; flagged when farther than eps (DBSCAN's
  own rule: such a point is noise);
- Isolation Forest (200 trees): minus ``score_samples``;
- GMM (4 full-covariance components): minus the log-likelihood;

KMeans, Isolation Forest and GMM flag a step whose score exceeds the 95th percentile of the
fitted steps' own scores. They have no fault-type head. Their operator set (for a flagged step)
is the top ``k = 3`` families by deviation: the robust z-score (median, 1.4826 × MAD of the
fitted steps) of ``log1p`` of each family's summed duration in the step, over the families of
the layers the labels name (FE, COMM, OTHER, and ``STEP`` for the step's own time); z ≥ 3 only,
a family never seen in the fitted steps counts as z = ∞.

**Supervised** (fitted on every train step with its labels): SVM (RBF, class-balanced), Random
Forest (200 trees, class-balanced) and XGBoost (100 rounds, depth 6, 64 bins, positive weight =
normal / abnormal), each once on the standard features and once with the name features added
(``*_names``). Three heads, all of the same model type:

- abnormal: a binary classifier over all train steps (score: probability or decision value;
  flag: the classifier's own decision);
- fault type: a multi-class classifier over the abnormal train steps' fault types;
- operators: a multi-label classifier over the label families (a family named by the labels
  of at least 3 abnormal train steps; one named by all of them is always predicted), fitted on the abnormal train steps (SVM: one
  binary SVC per family; Random Forest: one multi-output forest; XGBoost: its multi-label
  mode); a flagged step gets the families with probability ≥ 0.5 (SVM: decision value ≥ 0) or,
  when none reaches it, the most probable one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from teller.baselines.base import Method, Prediction, register
from teller.baselines.features import FeatureMaker, StepFeatures
from teller.baselines.steps import StepSet

#: layers whose families the labels name (docs/faults.md); the unsupervised operator sets use them
LABEL_LAYERS = ("FE", "COMM", "OTHER")


def _feats(steps: StepSet) -> StepFeatures:
    if steps.features is None:
        raise ValueError("steps.features is empty: compute them with teller.baselines.features.step_features")
    return steps.features


class _Scaled:
    """log1p features → standardized (mean 0, sd 1 on the fitted steps; constant columns kept at 0)."""

    def __init__(self, names: bool):
        self.maker = FeatureMaker(names=names)

    def fit(self, steps: StepSet, idx: np.ndarray) -> np.ndarray:
        f = _feats(steps)
        self.maker.fit(f, idx)
        X = self.maker.transform(f, idx)
        self.mu_ = X.mean(0)
        sd = X.std(0)
        self.sd_ = np.where(sd > 1e-9, sd, 1.0)
        return (X - self.mu_) / self.sd_

    def transform(self, steps: StepSet, idx: np.ndarray) -> np.ndarray:
        return (self.maker.transform(_feats(steps), idx) - self.mu_) / self.sd_


class _Deviation:
    """Top-k operator families by robust z of their summed duration against the fitted steps."""

    def __init__(self, k: int = 3, z_min: float = 3.0):
        self.k, self.z_min = k, z_min

    def fit(self, f: StepFeatures, idx: np.ndarray) -> "_Deviation":
        keep = [i for i, x in enumerate(f.families) if x == "STEP" or x.split(" ", 1)[0] in LABEL_LAYERS]
        self.cols_ = np.asarray(keep, np.int64)
        self.names_ = [f.families[i] for i in keep]
        X = np.log1p(f.fam_dur[idx][:, self.cols_].toarray())
        self.med_ = np.median(X, 0) if len(X) else np.zeros(len(keep))
        mad = np.median(np.abs(X - self.med_), 0) if len(X) else np.zeros(len(keep))
        self.scale_ = np.maximum(1.4826 * mad, 0.05)
        self.seen_ = (f.fam_count[idx][:, self.cols_] > 0).toarray().any(0) if len(X) else np.zeros(len(keep), bool)
        return self

    def predict(self, f: StepFeatures, idx: np.ndarray, flag: np.ndarray) -> list[list[str]]:
        X = np.log1p(f.fam_dur[idx][:, self.cols_].toarray())
        present = (f.fam_count[idx][:, self.cols_] > 0).toarray()
        z = (X - self.med_) / self.scale_
        z = np.where(present & ~self.seen_, np.inf, z)
        out: list[list[str]] = []
        order = np.argsort(-z, axis=1, kind="stable")[:, : self.k]
        for i in range(len(idx)):  # test steps
            if not flag[i]:
                out.append([])
                continue
            out.append([self.names_[j] for j in order[i].tolist() if z[i, j] >= self.z_min])
        return out


class _Unsupervised(Method):
    kind = "unsupervised"
    features = "standard"

    def __init__(self, seed: int = 0, fit_on: str = "normal", quantile: float = 0.95):
        if fit_on not in ("normal", "all"):
            raise ValueError("fit_on: 'normal' or 'all'")
        self.seed, self.quantile = seed, quantile
        self.fit_on = "normal train steps" if fit_on == "normal" else "all train steps"
        self._normal_only = fit_on == "normal"

    def _fit_model(self, X: np.ndarray) -> None:
        raise NotImplementedError

    def _score(self, X: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _threshold(self, X: np.ndarray) -> float:
        return float(np.quantile(self._score(X), self.quantile))

    def fit(self, steps: StepSet, idx: np.ndarray) -> "_Unsupervised":
        idx = np.asarray(idx)
        if self._normal_only:
            idx = idx[~steps.is_anomaly[idx]]
        if not len(idx):
            raise ValueError(f"{self.label}: no {self.fit_on} to fit on")
        self.scaler_ = _Scaled(names=False)
        X = self.scaler_.fit(steps, idx)
        self._fit_model(X)
        self.threshold_ = self._threshold(X)
        self.ops_ = _Deviation().fit(_feats(steps), idx)
        self.fitted_steps_ = int(len(idx))
        return self

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        X = self.scaler_.transform(steps, idx)
        s = self._score(X)
        flag = s > self.threshold_
        return Prediction(score=s, flag=flag, operators=self.ops_.predict(_feats(steps), idx, flag))


@register("kmeans")
class KMeansDetector(_Unsupervised):
    label = "KMeans"

    def __init__(self, seed: int = 0, n_clusters: int = 8, **kw: Any):
        super().__init__(seed, **kw)
        self.n_clusters = n_clusters

    def _fit_model(self, X: np.ndarray) -> None:
        from sklearn.cluster import KMeans

        self.model_ = KMeans(n_clusters=min(self.n_clusters, len(X)), n_init=4, random_state=self.seed).fit(X)

    def _score(self, X: np.ndarray) -> np.ndarray:
        return self.model_.transform(X).min(1)


@register("dbscan")
class DBSCANDetector(_Unsupervised):
    label = "DBSCAN"

    def __init__(self, seed: int = 0, min_samples: int = 5, eps_quantile: float = 0.95, **kw: Any):
        super().__init__(seed, **kw)
        self.min_samples, self.eps_quantile = min_samples, eps_quantile

    def _fit_model(self, X: np.ndarray) -> None:
        from sklearn.cluster import DBSCAN
        from sklearn.neighbors import NearestNeighbors

        k = min(self.min_samples, len(X))
        d, _ = NearestNeighbors(n_neighbors=k).fit(X).kneighbors(X)
        self.eps_ = max(float(np.quantile(d[:, -1], self.eps_quantile)), 1e-6)
        db = DBSCAN(eps=self.eps_, min_samples=k).fit(X)
        core = X[db.core_sample_indices_] if len(db.core_sample_indices_) else X
        self.core_ = NearestNeighbors(n_neighbors=1).fit(core)
        self.n_clusters_ = int(len(set(db.labels_.tolist()) - {-1}))

    def _score(self, X: np.ndarray) -> np.ndarray:
        return self.core_.kneighbors(X)[0][:, 0]

    def _threshold(self, X: np.ndarray) -> float:
        return self.eps_


@register("iforest")
class IsolationForestDetector(_Unsupervised):
    label = "Isolation Forest"

    def _fit_model(self, X: np.ndarray) -> None:
        from sklearn.ensemble import IsolationForest

        self.model_ = IsolationForest(n_estimators=200, random_state=self.seed).fit(X)

    def _score(self, X: np.ndarray) -> np.ndarray:
        return -self.model_.score_samples(X)


@register("gmm")
class GMMDetector(_Unsupervised):
    label = "GMM"

    def __init__(self, seed: int = 0, n_components: int = 4, **kw: Any):
        super().__init__(seed, **kw)
        self.n_components = n_components

    def _fit_model(self, X: np.ndarray) -> None:
        from sklearn.mixture import GaussianMixture

        self.model_ = GaussianMixture(n_components=min(self.n_components, len(X)), covariance_type="full",
                                      reg_covar=1e-3, random_state=self.seed).fit(X)

    def _score(self, X: np.ndarray) -> np.ndarray:
        return -self.model_.score_samples(X)


# ------------------------------------------------------------------------------------------------
# supervised


class _Constant:
    """Stands in for a head whose train labels hold one class only."""

    def __init__(self, value: Any):
        self.value = value


class _Supervised(Method):
    kind = "supervised"
    fit_on = "all train steps (labels)"
    min_family_steps = 3

    def __init__(self, seed: int = 0, names: bool = False):
        self.seed, self.names = seed, names
        self.features = "standard + names" if names else "standard"

    def _model(self, y: np.ndarray, multiclass: bool = False) -> Any:
        raise NotImplementedError

    def _proba1(self, model: Any, X: np.ndarray) -> np.ndarray:
        """Probability (or decision value) of class 1 of a binary head."""
        return model.predict_proba(X)[:, 1]

    def _fit_head(self, X: np.ndarray, y: np.ndarray, multiclass: bool = False) -> Any:
        if len(np.unique(y)) < 2:
            return _Constant(y[0] if len(y) else 0)
        return self._model(y, multiclass).fit(X, y)

    def fit(self, steps: StepSet, idx: np.ndarray) -> "_Supervised":
        idx = np.asarray(idx)
        self.scaler_ = _Scaled(names=self.names)
        X = self.scaler_.fit(steps, idx)
        y = steps.is_anomaly[idx].astype(np.int64)
        self.detector_ = self._fit_head(X, y)
        ab = y == 1
        types = steps.fault_type[idx][ab]
        self.types_ = sorted(set(types.tolist()))
        self.type_head_ = (self._fit_head(X[ab], np.searchsorted(self.types_, types), multiclass=True)
                           if len(self.types_) else _Constant(-1))
        fams = sorted({x for i in idx[ab].tolist() for x in steps.labels[i]})
        lab_ab = [set(steps.labels[i]) for i in idx[ab].tolist()]
        Y = np.array([[fam in s for fam in fams] for s in lab_ab], np.int64).reshape(len(lab_ab), len(fams))
        keep = Y.sum(0) >= self.min_family_steps if len(Y) else np.zeros(len(fams), bool)
        self.families_ = [f for f, k in zip(fams, keep.tolist(), strict=True) if k]
        # a family every abnormal train step names is always predicted; the others get a model
        self.always_ = (Y[:, keep].sum(0) == len(Y)) if len(Y) else np.zeros(0, bool)
        vary = ~self.always_
        self.ops_head_ = self._fit_ops(X[ab], Y[:, keep][:, vary]) if vary.any() else None
        return self

    def _fit_ops(self, X: np.ndarray, Y: np.ndarray) -> Any:
        """The operator head: one binary model per label family (columns of ``Y``)."""
        return [self._fit_head(X, Y[:, j]) for j in range(Y.shape[1])]

    def _ops_proba(self, head: Any, X: np.ndarray) -> np.ndarray:
        """(steps, families): probability (or decision value, then compared with 0) of each family."""
        return np.column_stack([h.predict_proba(X)[:, 1] for h in head])

    #: a family is predicted when its head's output reaches this
    ops_threshold = 0.5

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        X = self.scaler_.transform(steps, idx)
        n = len(idx)
        d = self.detector_
        if isinstance(d, _Constant):
            score = np.full(n, float(d.value))
            flag = np.full(n, bool(d.value))
        else:
            score = self._proba1(d, X)
            flag = d.predict(X).astype(bool)
        th = self.type_head_
        if isinstance(th, _Constant):
            ft = np.full(n, self.types_[0] if self.types_ else "", dtype=object)
        else:
            ft = np.asarray(self.types_, dtype=object)[np.asarray(th.predict(X), np.int64)]
        P = np.zeros((n, len(self.families_)))
        if self.families_:
            P[:, self.always_] = np.inf
            if self.ops_head_ is not None:
                P[:, ~self.always_] = self._ops_proba(self.ops_head_, X)
        ops: list[list[str]] = []
        for i in range(n):  # test steps
            if not flag[i] or not self.families_:
                ops.append([])
                continue
            pick = np.flatnonzero(P[i] >= self.ops_threshold)
            if not len(pick):
                pick = [int(np.argmax(P[i]))]
            ops.append([self.families_[j] for j in pick])
        return Prediction(score=score, flag=flag, fault_type=ft.astype(str), operators=ops)


class _SVM(_Supervised):
    label = "SVM"
    ops_threshold = 0.0  # decision values

    def _model(self, y: np.ndarray, multiclass: bool = False) -> Any:
        from sklearn.svm import SVC

        return SVC(kernel="rbf", C=1.0, gamma="scale", class_weight="balanced", random_state=self.seed)

    def _proba1(self, model: Any, X: np.ndarray) -> np.ndarray:
        return model.decision_function(X)

    def _ops_proba(self, head: Any, X: np.ndarray) -> np.ndarray:
        return np.column_stack([np.full(len(X), 1.0 if h.value else -1.0) if isinstance(h, _Constant)
                                else h.decision_function(X) for h in head])


class _RF(_Supervised):
    label = "Random Forest"

    def _model(self, y: np.ndarray, multiclass: bool = False) -> Any:
        from sklearn.ensemble import RandomForestClassifier

        return RandomForestClassifier(n_estimators=200, class_weight="balanced", n_jobs=1, random_state=self.seed)

    def _fit_ops(self, X: np.ndarray, Y: np.ndarray) -> Any:
        return self._model(Y).fit(X, Y if Y.shape[1] > 1 else Y.ravel())  # one multi-output forest for every family

    def _ops_proba(self, head: Any, X: np.ndarray) -> np.ndarray:
        proba = head.predict_proba(X)  # one (n, 2) array when a single family is fitted, else one per family
        return np.column_stack([p[:, 1] for p in (proba if isinstance(proba, list) else [proba])])


class _XGB(_Supervised):
    label = "XGBoost"

    def _model(self, y: np.ndarray, multiclass: bool = False) -> Any:
        from xgboost import XGBClassifier

        kw: dict[str, Any] = {}
        if not multiclass:
            pos = max(int((y == 1).sum()), 1)
            kw["scale_pos_weight"] = float((y == 0).sum()) / pos
        return XGBClassifier(n_estimators=100, max_depth=6, learning_rate=0.1, tree_method="hist", max_bin=64,
                             n_jobs=1, random_state=self.seed, verbosity=0, **kw)

    def _fit_ops(self, X: np.ndarray, Y: np.ndarray) -> Any:
        self.n_ops_ = Y.shape[1]  # one family: a binary model, whose probabilities have two columns
        return self._model(np.zeros(1), multiclass=True).fit(X, Y)  # XGBoost's own multi-label mode

    def _ops_proba(self, head: Any, X: np.ndarray) -> np.ndarray:
        p = np.asarray(head.predict_proba(X)).reshape(len(X), -1)
        return p[:, 1:] if getattr(self, "n_ops_", 0) == 1 and p.shape[1] == 2 else p

    def _fit_head(self, X: np.ndarray, y: np.ndarray, multiclass: bool = False) -> Any:
        u = np.unique(y)
        if len(u) < 2:
            return _Constant(y[0] if len(y) else 0)
        if multiclass and not np.array_equal(u, np.arange(len(u))):
            # XGBoost wants classes 0..k-1: fit on the ranks, map back in predict
            m = self._model(y, True).fit(X, np.searchsorted(u, y))
            return _Remap(m, u)
        return self._model(y, multiclass).fit(X, y)


class _Remap:
    def __init__(self, model: Any, classes: np.ndarray):
        self.model, self.classes = model, classes

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.classes[np.asarray(self.model.predict(X), np.int64)]


for _name, _cls in (("svm", _SVM), ("rf", _RF), ("xgb", _XGB)):
    for _names in (False, True):
        def _factory(seed: int = 0, _cls: type = _cls, _names: bool = _names) -> Method:
            m = _cls(seed=seed, names=_names)
            m.label = _cls.label + (" + names" if _names else "")
            return m

        register(_name + ("_names" if _names else ""))(_factory)
