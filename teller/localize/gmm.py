"""The numeric localizer (docs/design.md §6): one Gaussian mixture per operator family.

``GMMLocalizer`` follows scikit-learn's estimator conventions: hyper-parameters in ``__init__``,
``fit`` returns ``self``, learned state in attributes ending with ``_``, ``score_samples`` and
``predict`` on new data. Inputs are a feature matrix ``X`` (rows = operator instances, columns =
:data:`teller.localize.features.FEATURES`) and, as a keyword, each row's operator ``families``.

Fitting, per family f (reference runs: normal operation):

1. z = (log(1 + max(x, 0)) − median_f) / scale_f, with scale_f = max(IQR_f / 1.349, ``min_scale``)
   per feature (robust standardization; the floor keeps constant features usable: in log space a
   change of ``min_scale`` is one unit).
2. A diagonal-covariance Gaussian mixture with 1..``max_components`` components, the number
   chosen by BIC, on at most ``max_fit_samples`` sampled instances (:func:`diag_mixture`:
   scikit-learn's ``GaussianMixture`` fit, computed in numpy; families with fewer than
   ``min_family_size`` instances get one component at the mean). Component variances are floored so that no component is narrower than ``min_scale``
   in log space (a family whose feature never varied still gives a finite, meaningful distance).
3. Central components: those with weight ≥ ``min_central_weight`` (always the heaviest one).
   Rare modes of the reference (warm-up, hiccups) are thereby treated as suspicious.
4. The outlier radius T_f: the larger of the χ² quantile at 1 − ``tail`` (degrees of freedom =
   features that vary) and the reference's own 1 − ``tail`` point of the squared Mahalanobis
   distance to the nearest central component, extrapolated from its 1 − ``calibration_quantile``
   percentile with the χ² shape (so a few hiccups in the reference do not set the radius). With
   ``calibration="crossfit"`` (default) held-out distances count as well: the reference steps are
   split in two folds (even and odd steps) and each fold is measured against a mixture fitted on
   the other, so T_f also reflects new data, not only the data the mixture has already seen.

A family of more than ``max_calibration_samples`` reference instances is fitted (steps 1–4, the
batch slope, the shift test's radius and the in-sample flag rate) on a calibration sample of
that many: whole reference steps taken in one seeded random order of the steps, until they hold
``max_calibration_samples`` of the family's instances (the same reference gives the same
sample; None: every instance). The fit then costs what the sample costs, whatever the length of
the reference; the in-sample flag rate counts the steps that every family's sample holds.

Scoring an instance x of family f:

- m²_k(x): squared Mahalanobis distance to component k; r_k(x): its posterior responsibility;
- g_k(x) = 1 / (1 + exp((m²_k − T_f) / 2)): the posterior of "inside k" against a flat
  background that matches component k's density at distance T_f (the exp(−m²/2) of a Gaussian
  against a constant: this is why the width is 2);
- ρ(x) = Σ_{k central} r_k(x) · g_k(x), the posterior mass on the central components, and the
  anomaly score **a(x) = 1 − ρ(x)** ∈ [0, 1].

Per-feature test (``feature_test``, the layers whose families take it; default ``("STEP",
"OTHER")``): a step-level instance carries some 30 features, and a single one far beyond anything
the reference showed (a 40 ms admission delay, a sleeping scheduler's self time, allocations in
a step that never allocates) moves the joint distance by less than the radius of 30 degrees of
freedom. For these families each feature j also gets its own radius T_fj: the χ²(1) point at
``tail`` / (features that vary), raised to the reference's held-out 1 − ℓ point of max(z_j, 0)²
extrapolated with the χ²(1) shape, ℓ = max(``calibration_quantile``, :data:`TAIL_POINTS` / n)
so that the reference's few largest values never set it (z_j: the deviation from the nearest
central component, in its standard deviations), and a(x) is the larger of 1 − ρ(x) and
max_j 1 − expit((T_fj − max(z_j, 0)²) / 2). Operator families (dozens of instances per step,
whose suspiciousness is a quantile over them) keep the joint test only, and so does the
``overlap`` share of every family (:data:`FEATURE_TEST_EXEMPT`).

With ``one_sided`` (default) only the features where x exceeds a component's centre count in
m²_k: slower, more calls, more bytes are anomalies; less of everything is not a root cause. A
responsibility under such a distance means nothing (every row below a component would sit "at"
it, and a rare high mode would claim all of them), so ρ(x) is then the best central explanation,
max_{k central} g_k(x): x is normal when it lies within the radius of some central component,
counting excesses only; a rare mode (a non-central component) still explains nothing.

Batch normalisation (``batch_norm``, default on, when ``fit`` is given each instance's
``batch``: the requests its step served): before step 1, each log feature of family f is
regressed on log(batch) over the reference (least squares, slope clipped to
[0, ``max_slope``]) and the slope's share is taken out, L' = L − b_f (log batch − centre_f).
An attention op of a 60-request decode step is compared with what the reference's trend says
60 requests cost, not with the median of small steps; a feature that does not follow the batch
keeps b = 0. ``context_features`` (default the batch size, its token counts and the requests
waiting) are context only: never scored (a large batch or a queue is load, not a fault: a queue
left behind by a fault that has passed would otherwise flag the healthy steps that drain it).

NaN features are marginalized (left out of the distances and densities). Instances of a family
never seen in the reference get ``a = unseen_score`` and are reported as unseen.

Step level: the suspiciousness of family f in step s is the k-th largest a(x) among f's n
instances in s, k = max(⌈``quantile``·n⌉, min(n, ``min_instances``)) (``aggregate="kth"``,
default): a family is as suspicious as its k-th most suspicious instance, so with
``min_instances`` = 2 one instance alone raises a family only when it is the family's only
instance in the step. A single slow instance among several is what a descheduled thread or a
page fault makes of any operator (the runs of a campaign recorded side by side on shared cores
have more of them than their reference), while a fault of the family repeats in its instances:
fitted on three of the four one-process fault-free runs of ``data/h200_v2`` and scoring the
fourth (and the two tensor-parallel ones against each other), the reference's held-out steps
flagged fall from 113 of 958 (11.8%) with the top instance alone to 71 (7.4%).
``aggregate="mean"`` (artefacts written before this rule, which load with ``min_instances`` = 1):
the mean of the top k scores. The step score is
the largest family suspiciousness, and a step is flagged when it reaches ``step_threshold``. The
candidate families Õ_s are the families at or above ``family_threshold`` (at most
``max_candidates``); the suspicious instances I_s are their instances with a(x) ≥
``instance_threshold``, minus those *explained away* by a suspicious descendant instance (an FE
module is slow because an op inside it is slow) unless their own self time deviates by at least
``own_z`` standard deviations; at most ``max_suspects`` per step.

Artefact: ``save(path)`` writes one ``.npz`` file (arrays plus a JSON header, no pickled objects);
``GMMLocalizer.load(path)`` reads it back.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import chdtri, expit

from teller import __version__
from teller.errors import TellerError
from teller.localize.features import FEATURES

ARTEFACT_KIND = "teller.localize.GMMLocalizer"
ARTEFACT_VERSION = 2
_LOG2PI = math.log(2 * math.pi)


#: rows per block in the distance computations (bounds the (rows × components × features) temporaries)
_BLOCK = 16384

#: features the per-feature test leaves to the joint distance: the share of an instance's kernel
#: time overlapped by other GPU work is set by how the whole run's work falls on the device's
#: streams (another deployment, another process on the GPU moves it for every step at once),
#: and a share has no tail far beyond the reference's: 0.5 against a reference of 0.2-0.4 is
#: a large z and no fault of the step
FEATURE_TEST_EXEMPT = ("overlap",)

#: reference values left above the calibration point of a per-feature radius (:meth:`GMMLocalizer._feature_radius`)
TAIL_POINTS = 5

#: samples per varying dimension each mixture component needs (:meth:`GMMLocalizer._mixture`)
MIN_SAMPLES_PER_DIM = 10


def diag_mixture(X: np.ndarray, k: int, reg_covar: float, random_state: int, max_iter: int = 200,
                 tol: float = 1e-3) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """A diagonal-covariance Gaussian mixture of ``k`` components on ``X`` (n × d) by EM: the
    fit of scikit-learn's ``GaussianMixture(k, covariance_type="diag", init_params="k-means++",
    reg_covar=reg_covar, random_state=random_state, max_iter=max_iter, tol=tol)`` (same
    initialisation, updates and stopping rule, without its per-iteration validation overhead).
    Returns weights (k,), means and variances (k × d) and the BIC on ``X``."""
    n, d = X.shape
    X2 = X * X
    # responsibilities and log densities are (k × n): the reductions over components run along
    # the first axis, one vectorized pass over the rows per component
    if k == 1:  # EM converges to the sample's mean and variance from any start
        resp = np.ones((1, n))
    else:
        resp = np.zeros((k, n))
        resp[np.arange(k), _kmeans_pp(X, k, random_state, X2.sum(axis=1))] = 1.0
    const = d * _LOG2PI
    eps10 = 10 * np.finfo(np.float64).eps
    XX = np.concatenate([X, X2], axis=1)  # one product gives both moments
    XXt = np.ascontiguousarray(XX.T)

    def m_step(resp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        nk = resp.sum(axis=1) + eps10
        mom = (resp @ XX) / nk[:, None]
        means = mom[:, :d]
        var = mom[:, d:] - means ** 2 + reg_covar
        if (var <= 0).any():
            raise ValueError("diag_mixture: a component variance is not positive; increase reg_covar")
        return nk, means, var

    def e_step(w: np.ndarray, means: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Responsibilities (k × n) and each row's log-likelihood."""
        pc = 1.0 / np.sqrt(var)  # the precision's Cholesky factor, as scikit-learn computes it
        prec = pc ** 2
        lp = np.concatenate([(-2.0 * (means * prec)), prec], axis=1) @ XXt  # (k, n)
        lp += ((means ** 2 * prec).sum(axis=1) + const)[:, None]
        lp *= -0.5
        lp += (np.log(pc).sum(axis=1) + np.log(w))[:, None]
        top = lp.max(axis=0)
        lp -= top
        with np.errstate(under="ignore"):
            np.exp(lp, out=lp)
        tot = lp.sum(axis=0)
        lp /= tot
        return lp, np.log(tot) + top

    nk, means, var = m_step(resp)
    w = nk / n if k > 1 else nk / nk.sum()
    lower = -np.inf
    for _ in range(max_iter if k > 1 else 0):
        prev = lower
        resp, norm = e_step(w, means, var)
        nk, means, var = m_step(resp)
        w = nk / nk.sum()
        lower = float(norm.mean())
        if abs(lower - prev) < tol:
            break
    _, norm = e_step(w, means, var)
    bic = -2.0 * float(norm.mean()) * n + (2 * k * d + k - 1) * math.log(n)
    return w, means, var, bic


def _robust_stats(L: np.ndarray, nan: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per column of ``L`` (``nan``: its NaN mask): median, 75th and 25th percentiles ignoring
    NaN, and the number of columns that vary. Columns without NaN in one vectorized call each
    (the same numbers as the nan-functions, which go column by column)."""
    d = L.shape[1]
    if not len(L):
        return np.zeros(d), np.zeros(d), np.zeros(d), 0
    med, q75, q25 = np.empty(d), np.empty(d), np.empty(d)
    holes = nan.any(axis=0)
    full = np.flatnonzero(~holes)
    if len(full):
        Lf = L[:, full]
        med[full] = np.median(Lf, axis=0)
        q75[full], q25[full] = np.percentile(Lf, [75, 25], axis=0)
    part = np.flatnonzero(holes)
    if len(part):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (features of other layers)
            Lp = L[:, part]
            med[part] = np.nanmedian(Lp, axis=0)
            q75[part], q25[part] = np.nanpercentile(Lp, [75, 25], axis=0)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        varying = int((np.nan_to_num(np.nanstd(L, axis=0)) > 0).sum())
    return med, q75, q25, varying


def _sq_dist(C: np.ndarray, X: np.ndarray, sq_norms: np.ndarray) -> np.ndarray:
    """Squared euclidean distances of the rows of ``C`` to the rows of ``X`` (``sq_norms``: the
    rows' squared norms) as |c|² − 2 c·x + |x|², clipped at 0."""
    d = -2.0 * (C @ X.T)
    d += np.einsum("ij,ij->i", C, C)[:, None]
    d += sq_norms[None, :]
    return np.maximum(d, 0.0, out=d)


def _kmeans_pp(X: np.ndarray, k: int, random_state: int, sq_norms: np.ndarray) -> np.ndarray:
    """Rows greedy k-means++ picks as the ``k`` initial centres: the first uniformly, then each
    next one the best of 2 + ⌊ln k⌋ candidates drawn in proportion to the squared distance to
    the nearest centre so far (the one that leaves the smallest total). The draws come from
    ``np.random.RandomState(random_state)`` in scikit-learn's order and the arithmetic is its
    own, so the mixture starts where its ``GaussianMixture(init_params="k-means++")`` starts
    (``tests/test_localize.py`` compares the fits) without importing ``sklearn.cluster``
    (about 0.3 s)."""
    rs = np.random.RandomState(random_state)
    n = len(X)
    ones = np.ones(n)
    trials = 2 + int(np.log(k))
    picked = np.full(k, -1, dtype=np.int64)
    picked[0] = rs.choice(n, p=ones / ones.sum())
    closest = _sq_dist(X[picked[:1]], X, sq_norms)
    pot = closest @ ones
    for c in range(1, k):
        cand = np.searchsorted(np.cumsum(ones * closest), rs.uniform(size=trials) * pot)
        np.clip(cand, None, closest.size - 1, out=cand)
        dist = _sq_dist(X[cand], X, sq_norms)
        np.minimum(closest, dist, out=dist)
        pots = dist @ ones.reshape(-1, 1)
        best = int(np.argmin(pots))
        pot, closest, picked[c] = pots[best], dist[best], cand[best]
    return picked


class _Priorities:
    """A seeded random priority per reference step (rows without a step: one each), from which a
    family's calibration sample takes the steps of lowest priority: the sample holds whole steps
    (the folds, the shift statistic and the step scores see every instance of a step they see),
    and one order serves every family, so a prefix of it is in all samples."""

    def __init__(self, random_state: int, n_groups: int, g: np.ndarray | None):
        self._rng = np.random.default_rng([int(random_state), 1])
        self._step = self._rng.random(n_groups)
        self._g = g

    def of_steps(self) -> np.ndarray:
        return self._step

    def sample(self, idx: np.ndarray, cap: int) -> tuple[np.ndarray, float]:
        """The rows of ``idx`` (ascending) in the steps of lowest priority holding at least ``cap``
        of them, and the highest priority taken."""
        if self._g is None:
            pr = self._rng.random(len(idx))
        else:
            gi = self._g[idx]
            pr = np.where(gi >= 0, self._step[np.maximum(gi, 0)], 1.0 + self._rng.random(len(idx)))
        last = float(np.partition(pr, cap - 1)[cap - 1])
        return idx[pr <= last], last


def _distinct_rows(Z: np.ndarray, cap: int) -> int:
    """Number of distinct rows of ``Z``, counted up to ``cap``."""
    count, rest = 0, Z
    while len(rest) and count < cap:
        count += 1
        rest = rest[(rest != rest[0]).any(axis=1)]
    return count


@dataclass
class StepScores:
    """Step-level output of :meth:`GMMLocalizer.score_steps`, all arrays."""

    steps: np.ndarray  # step indices (sorted, unique) that have instances
    score: np.ndarray  # per step: max family suspiciousness
    flag: np.ndarray  # per step: score >= step_threshold
    top_family: np.ndarray  # per step: family code of the max (-1 none)
    # (step, family) table
    sf_step: np.ndarray
    sf_family: np.ndarray
    sf_susp: np.ndarray
    sf_count: np.ndarray
    sf_shift: np.ndarray  # the family-shift part of the suspiciousness (0 when not tested)


def _chi2_isf(p: float, dof: float) -> float:
    """The χ² quantile with upper tail ``p`` at ``dof`` degrees of freedom (what
    ``scipy.stats.chi2.isf`` computes, through the same special function, without importing
    ``scipy.stats``)."""
    return float(chdtri(dof, p))


class _Params:
    """``get_params`` / ``set_params`` over the ``__init__`` arguments, as scikit-learn
    estimators have them (``sklearn.base.clone`` works on it), without importing scikit-learn,
    which pulls in ``scipy.stats`` (about a second of a `teller diagnose` run)."""

    @classmethod
    def _param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return sorted(p.name for p in sig.parameters.values()
                      if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._param_names()}

    def set_params(self, **params: Any) -> "_Params":
        names = set(self._param_names())
        for k, v in params.items():
            if k not in names:
                raise ValueError(f"invalid parameter {k!r} for {type(self).__name__}; valid: {', '.join(sorted(names))}")
            setattr(self, k, v)
        return self

    def __repr__(self) -> str:
        defaults = {p.name: p.default for p in inspect.signature(type(self).__init__).parameters.values()}
        changed = [f"{k}={v!r}" for k, v in self.get_params().items() if not (k in defaults and _same(v, defaults[k]))]
        return f"{type(self).__name__}({', '.join(changed)})"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def step_count_p99(family: np.ndarray, step: np.ndarray | None, n_families: int) -> np.ndarray:
    """Per family: the 99th percentile of its instances per step, over the steps (``step`` ≥ 0)
    that hold it; NaN without steps. How many times a step runs a collective or a module is fixed
    by the deployment: many more (a collective split in chunks) says where a fault acts
    (:mod:`teller.localize.faulttype`)."""
    out = np.full(n_families, np.nan)
    if step is None or not len(step):
        return out
    ok = step >= 0
    span = int(step.max(initial=0)) + 1
    keys, counts = np.unique(family[ok].astype(np.int64) * span + step[ok], return_counts=True)
    fam = keys // span
    o = np.lexsort((counts, fam))
    fam, counts = fam[o], counts[o]
    lo = np.searchsorted(fam, np.arange(n_families))
    hi = np.searchsorted(fam, np.arange(n_families), side="right")
    has = hi > lo
    pos = lo + np.floor(0.99 * (hi - lo - 1)).astype(np.int64)  # the lower 99th-percentile order statistic
    out[has] = counts[pos[has]]
    return out


class GMMLocalizer(_Params):
    """Per-family Gaussian-mixture anomaly scores a(x) = 1 − ρ(x) (module docstring)."""

    def __init__(
        self,
        max_components: int = 4,
        min_scale: float = 0.05,
        count_scale: float = 0.25,
        tail: float = 1e-4,
        one_sided: bool = True,
        shift_test: bool = True,
        shift_margin: float = 1.25,
        calibration: str = "crossfit",
        calibration_quantile: float = 0.001,
        min_central_weight: float = 0.001,
        quantile: float = 0.1,
        step_threshold: float = 0.5,
        family_threshold: float = 0.5,
        instance_threshold: float = 0.5,
        own_z: float = 3.0,
        max_candidates: int = 5,
        max_suspects: int = 10,
        unseen_score: float = 1.0,
        min_family_size: int = 8,
        max_fit_samples: int = 5000,
        max_calibration_samples: int | None = 50000,
        reg_covar: float = 1e-4,
        random_state: int = 0,
        batch_norm: bool = True,
        max_slope: float = 1.0,
        context_features: tuple[str, ...] = ("batch.n_requests", "batch.prefill", "batch.decode",
                                             "batch.waiting"),
        feature_test: tuple[str, ...] = ("STEP", "OTHER"),
        min_instances: int = 2,
        aggregate: str = "kth",
    ):
        self.max_components = max_components
        self.min_scale = min_scale
        self.count_scale = count_scale
        self.tail = tail
        self.one_sided = one_sided
        self.shift_test = shift_test
        self.shift_margin = shift_margin
        self.calibration = calibration
        self.calibration_quantile = calibration_quantile
        self.min_central_weight = min_central_weight
        self.quantile = quantile
        self.step_threshold = step_threshold
        self.family_threshold = family_threshold
        self.instance_threshold = instance_threshold
        self.own_z = own_z
        self.max_candidates = max_candidates
        self.max_suspects = max_suspects
        self.unseen_score = unseen_score
        self.min_family_size = min_family_size
        self.max_fit_samples = max_fit_samples
        self.max_calibration_samples = max_calibration_samples
        self.reg_covar = reg_covar
        self.random_state = random_state
        self.batch_norm = batch_norm
        self.max_slope = max_slope
        self.context_features = context_features
        self.feature_test = feature_test
        self.min_instances = min_instances
        self.aggregate = aggregate

    # ---------------------------------------------------------------------------------------
    # fitting

    def fit(self, X: np.ndarray, y: Any = None, *, families: np.ndarray, groups: np.ndarray | None = None,
            feature_names: tuple[str, ...] = FEATURES, batch: np.ndarray | None = None,
            family_names: Any = None) -> "GMMLocalizer":
        """Fit one mixture per family on reference instances ``X`` (n × d) of ``families`` (n,);
        ``groups`` (the step of each instance) keeps a step's instances in one calibration fold
        and calibrates the family shift test; ``batch`` (n,: requests of each instance's step,
        NaN unknown) sets the batch normalisation (module docstring). With ``family_names``,
        ``families`` are integer codes into it (no string per row)."""
        X = np.asarray(X, dtype=np.float64)
        fam = np.asarray(families) if family_names is not None else np.asarray(families).astype(str)
        if X.ndim != 2 or len(X) != len(fam):
            raise ValueError(f"X must be (n, d) with one family per row; got X {X.shape}, families {fam.shape}")
        if len(X) == 0:
            raise TellerError("no operator instances in the reference data: the reference runs hold no FE/BE/COMM "
                              "(or RT/DRV) nodes inside steps; record a reference with `teller record -o REF -- CMD` "
                              "and `teller reconstruct REF`")
        if self.calibration not in ("crossfit", "in-sample"):
            raise ValueError("calibration must be 'crossfit' or 'in-sample'")
        d = X.shape[1]
        if family_names is not None:  # the names of the codes present, sorted
            present = np.flatnonzero(np.bincount(fam.astype(np.int64), minlength=len(family_names)))
            names, remap = np.unique(np.asarray(family_names, dtype=object)[present].astype(str), return_inverse=True)
            to_name = np.zeros(len(family_names), np.int64)
            to_name[present] = remap.reshape(-1)
            inv = to_name[fam.astype(np.int64)]
        else:
            names, inv = np.unique(fam, return_inverse=True)
            inv = inv.reshape(-1)
        F, K = len(names), max(int(self.max_components), 1)
        self.families_ = names
        self.feature_names_in_ = np.asarray(feature_names[:d] if len(feature_names) >= d else [f"x{i}" for i in range(d)])
        self.n_features_in_ = d
        self.median_ = np.zeros((F, d))
        self.scale_ = np.ones((F, d))
        self.weights_ = np.zeros((F, K))
        self.means_ = np.zeros((F, K, d))
        self.covariances_ = np.ones((F, K, d))
        self.central_ = np.zeros((F, K), bool)
        self.n_components_ = np.zeros(F, np.int64)
        self.n_samples_ = np.bincount(inv, minlength=F).astype(np.int64)
        self.radius_ = np.zeros(F)
        self.feature_radius_ = np.full((F, d), np.inf)
        self.shift_radius_ = np.zeros(F)
        self.varying_ = np.zeros(F, np.int64)
        self.slope_ = np.zeros((F, d))
        self.batch_center_ = np.zeros(F)
        self.nan_values_ = 0
        u_all = self._log_batch(batch, len(X))
        rng = np.random.default_rng(self.random_state)
        g = None if groups is None else np.asarray(groups).astype(np.int64)
        self.count_p99_ = step_count_p99(inv, g, F)
        fold = (np.abs(g) % 2) if g is not None else rng.integers(0, 2, len(X))
        order = np.argsort(inv, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(self.n_samples_)])
        fin_all = np.isfinite(X)
        self.nan_values_ = int(fin_all.size - np.count_nonzero(fin_all))
        ctx = self._context_mask()
        n_groups = int(g.max(initial=-1)) + 1 if g is not None else 0
        # the calibration sample: a family of more than max_calibration_samples instances is
        # calibrated on whole reference steps drawn in one seeded random order (the same order for
        # every family, so the first steps of it hold every family's instances)
        cap = self.max_calibration_samples
        prio = _Priorities(self.random_state, n_groups, g)
        covered = np.inf  # steps of priority below this are in every family's sample
        self.calibration_rows_ = np.zeros(F, np.int64)
        # per reference step: the in-sample step score (max over families), -inf without instances
        step_max = np.full(n_groups, -np.inf)
        for f in range(F):  # one loop turn per family (tens to hundreds)
            idx = order[bounds[f]:bounds[f + 1]]
            if cap is not None and len(idx) > cap:
                idx, last = prio.sample(idx, int(cap))
                covered = min(covered, last)
            self.calibration_rows_[f] = len(idx)
            cols = np.flatnonzero(fin_all[idx].any(axis=0) & ~ctx)  # the family's columns with values
            z_held, a_in, z_in = self._fit_family(f, X[np.ix_(idx, cols)], cols, fold[idx], rng, u_all[idx])
            # shift radius: chi-square floor, raised to the reference steps' own 1 - tail quantile
            # of the held-out shift statistic ((step, family) groups are one family's rows)
            radius = float(_chi2_isf(self.tail, max(int(self.varying_[f]), 1)))
            if g is None:
                self.shift_radius_[f] = radius * self.shift_margin
                continue
            gf = g[idx]
            okf = gf >= 0
            if self.shift_test and okf.any():
                _, gid = np.unique(gf[okf], return_inverse=True)
                gid = gid.reshape(-1)
                gsize = np.bincount(gid)
                m2s = self._group_m2(z_held[okf], gid, len(gsize))
                use = gsize >= 2
                if use.any():
                    radius = max(radius, float(np.quantile(m2s[use], 1 - self.tail)))
            self.shift_radius_[f] = radius * self.shift_margin
            # the fitted model's own step scores on the reference (its in-sample flag rate)
            ss = self.score_steps(a_in[okf], np.zeros(int(okf.sum()), np.int64), gf[okf], z_in[okf],
                                  np.full(int(okf.sum()), f))
            step_max[ss.steps] = np.maximum(step_max[ss.steps], ss.score)
        seen = step_max > -np.inf
        if np.isfinite(covered):  # the flag rate of the steps every family's sample holds
            seen &= prio.of_steps() <= covered
        self.reference_steps_ = int(seen.sum()) if g is not None else None
        self.reference_steps_flagged_ = int((step_max[seen] >= self.step_threshold).sum()) if g is not None else None
        return self

    def _min_scale(self) -> np.ndarray:
        """Per-feature floor of the log-space spread: ``count_scale`` for counts (names ending in
        ``_n``: one call more or less is not an anomaly by itself), ``min_scale`` elsewhere."""
        names = [str(x) for x in self.feature_names_in_]
        return np.array([self.count_scale if x.endswith("_n") else self.min_scale for x in names])

    def _context_mask(self) -> np.ndarray:
        """Per feature: a context feature (never scored)."""
        ctx = set(self.context_features or ())
        return np.array([str(x) in ctx for x in self.feature_names_in_], bool)

    @staticmethod
    def _log_raw(Xc: np.ndarray) -> np.ndarray:
        """log(1 + max(x, 0)), NaN where x is not finite."""
        L = np.log1p(np.maximum(Xc, 0.0))
        L[~np.isfinite(Xc)] = np.nan
        return L

    def _debatch_cols(self, f: int, L: np.ndarray, u: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """:meth:`_debatch` of the feature columns ``cols`` only."""
        b = self.slope_[f, cols]
        if not b.any():
            return L
        du = np.where(np.isfinite(u), u - self.batch_center_[f], 0.0)
        return L - du[:, None] * b

    def _log_batch(self, batch: np.ndarray | None, n: int) -> np.ndarray:
        """log(batch) per row (NaN where unknown or when batch normalisation is off)."""
        if batch is None or not self.batch_norm:
            return np.full(n, np.nan)
        b = np.asarray(batch, np.float64)
        if b.shape != (n,):
            raise ValueError(f"batch must have one value per row ({n}), got shape {b.shape}")
        with np.errstate(all="ignore"):
            return np.where(b > 0, np.log(b), np.nan)

    def _fit_slope(self, f: int, L: np.ndarray, u: np.ndarray, cols: np.ndarray | None = None) -> None:
        """Per-feature slope of the log features on log(batch) over family f's reference rows
        (``L``: the feature columns ``cols``, default all)."""
        ok = np.isfinite(u)
        if ok.sum() < max(self.min_family_size, 2) or float(np.std(u[ok])) < 0.1:
            return  # the reference saw one batch size: nothing to learn
        uc = float(np.mean(u[ok]))
        du = u[ok] - uc
        Lk = L[ok]
        fin = np.isfinite(Lk)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mL = np.nanmean(np.where(fin, Lk, np.nan), axis=0)
            cov = np.nansum(np.where(fin, (Lk - mL) * du[:, None], np.nan), axis=0)
            var = np.sum(np.where(fin, du[:, None] ** 2, 0.0), axis=0)
            b = np.where((var > 0) & np.isfinite(cov), cov / np.where(var > 0, var, 1.0), 0.0)
        self.slope_[f, slice(None) if cols is None else cols] = np.clip(b, 0.0, self.max_slope)
        self.batch_center_[f] = uc

    def _mixture(self, Z: np.ndarray, floor: np.ndarray, k: int | None, rng: np.random.Generator):
        """Weights, means and floored variances of a diagonal mixture on ``Z`` (k components, or
        1..max_components chosen by BIC when k is None)."""
        if len(Z) > self.max_fit_samples:
            Z = Z[rng.choice(len(Z), self.max_fit_samples, replace=False)]
        n = len(Z)
        if n < self.min_family_size:
            # too few samples to trust a spread: one robust unit at least
            return np.ones(1), Z.mean(axis=0, keepdims=True), np.maximum(np.maximum(Z.var(axis=0, keepdims=True), floor), 1.0)
        # columns constant over the sample (features a family never moves, missing values at the
        # median) are left out of the EM: every component has them at their value with variance
        # reg_covar, adding the same log-likelihood to each, so the fit, the responsibilities
        # and the BIC order (its parameter count is corrected below) are those of the full data
        kcap = self.weights_.shape[1]
        moving = np.flatnonzero(Z.max(axis=0) > Z.min(axis=0))
        n_const = Z.shape[1] - len(moving)
        distinct = _distinct_rows(Z[:, moving], kcap)
        if k is None:
            # a diagonal component holds 2 parameters per varying dimension: at least
            # MIN_SAMPLES_PER_DIM samples per dimension and component, or the extra components
            # fit the reference's own noise (a step-level family of 150 steps in 8 dimensions
            # gets one component; operator families of thousands keep their choice)
            dims = max(1, int((Z.std(axis=0) > 0).sum()))
            kmax = min(kcap, max(1, n // max(self.min_family_size, 1)), distinct,
                       max(1, n // (MIN_SAMPLES_PER_DIM * dims)))
            ks = range(1, kmax + 1)
        else:
            ks = [max(1, min(k, distinct))]
        if not len(moving):  # one point: one component at it
            return np.ones(1), Z[:1].copy(), np.maximum(np.full((1, Z.shape[1]), self.reg_covar), floor)
        Zm = Z[:, moving]
        best = None
        for kk in ks:
            w, m, v, bic = diag_mixture(Zm, kk, self.reg_covar, self.random_state)
            bic = bic + 2 * kk * n_const * math.log(n) if len(ks) > 1 else 0.0
            if best is None or bic < best[0]:
                best = (bic, w, m, v)
        _, w, m, v = best
        mu = np.repeat(Z[:1], len(w), axis=0)
        var = np.full((len(w), Z.shape[1]), self.reg_covar)
        mu[:, moving], var[:, moving] = m, v
        return w, mu, np.maximum(var, floor)

    def _tail_radius(self, m2: np.ndarray, dof: int) -> float:
        """The 1 − ``tail`` point of the reference's distances, extrapolated from their
        1 − ``calibration_quantile`` percentile with the χ² shape (q · χ²(1 − tail) / χ²(1 − cq)):
        a handful of hiccups in the reference (a descheduled thread, a GC pause) must not become
        the radius of the family."""
        m2 = m2[np.isfinite(m2)]
        if not len(m2):
            return 0.0
        q = float(np.quantile(m2, 1 - self.calibration_quantile))
        return q * float(_chi2_isf(self.tail, dof) / _chi2_isf(self.calibration_quantile, dof))

    def _feature_radius(self, z: np.ndarray, dof: int) -> np.ndarray:
        """Per feature column of ``z`` (the reference's held-out deviations from their nearest
        central component): the squared deviation beyond which that feature alone makes an
        instance suspicious. The χ²(1) point at ``tail`` / ``dof`` (one test per varying feature),
        raised to the reference's own 1 − ℓ point extrapolated with the χ²(1) shape, as
        :meth:`_tail_radius` does for the joint distance (ℓ: see the module docstring)."""
        e = self._excess2(z)
        base = float(_chi2_isf(self.tail / max(dof, 1), 1))
        if not len(e):
            return np.full(z.shape[1], base)
        # the calibration point leaves the reference's TAIL_POINTS largest values above it: in a
        # reference of a few hundred steps the 1 - calibration_quantile point is its maximum, and
        # one hiccup (a 0.8 s iteration among 90 ms ones) would set the radius of every feature
        level = max(self.calibration_quantile, TAIL_POINTS / len(e))
        if level >= 0.5:
            return np.full(z.shape[1], base)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # columns without values
            q = np.nanquantile(e, 1 - level, axis=0)
        # max(z, 0)² exceeds t with half the χ²(1) probability: the one-sided level is 2·level
        q = np.where(np.isfinite(q), q, 0.0) * base / float(_chi2_isf(2 * level if self.one_sided else level, 1))
        return np.maximum(base, q)

    def _excess2(self, z: np.ndarray) -> np.ndarray:
        """Squared per-feature deviations that count (excesses only with ``one_sided``); NaN
        where the feature is missing."""
        return (np.maximum(z, 0.0) if self.one_sided else np.abs(z)) ** 2

    def _central(self, w: np.ndarray) -> np.ndarray:
        central = w >= self.min_central_weight
        central[np.argmax(w)] = True
        return central

    def _fit_family(self, f: int, Xc: np.ndarray, cols: np.ndarray, fold: np.ndarray, rng: np.random.Generator,
                    u: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Fit family f on its rows' feature columns ``cols`` (``Xc``: those columns; the columns
        it has values in, context columns left out: the others keep median 0, the scale floor
        and a unit component at 0, as a column without data would get). Returns its rows'
        (held-out, when cross-fitting) deviations z, and their in-sample scores a and
        deviations z under the fitted model (z: the columns ``cols``)."""
        min_scale_all = self._min_scale()
        self.scale_[f] = min_scale_all
        L = self._log_raw(Xc)
        if u is not None:
            self._fit_slope(f, L, u, cols)
            L = self._debatch_cols(f, L, u, cols)
        nan = np.isnan(L)
        med, q75, q25, varying = _robust_stats(L, nan)
        med = np.where(np.isfinite(med), med, 0.0)
        iqr = np.where(np.isfinite(q75 - q25), q75 - q25, 0.0)
        min_scale = min_scale_all[cols]
        scale = np.maximum(iqr / 1.349, min_scale)
        self.median_[f, cols], self.scale_[f, cols] = med, scale
        Z = (L - med) / scale
        Zfit = np.where(nan, 0.0, Z)  # fit on the median where a value is missing
        floor = (min_scale / scale) ** 2  # component variance floor, in z units
        w, mu, var = self._mixture(Zfit, floor, None, rng)
        k = len(w)
        self.n_components_[f] = k
        self.weights_[f, :k] = w
        self.means_[f, :k][:, cols], self.covariances_[f, :k][:, cols] = mu, var
        self.central_[f, :k] = self._central(w)
        self.varying_[f] = varying
        # radius: the chi-square quantile, or the reference's own 1 - tail quantile of the distance
        # to the nearest central component (held out: from a mixture fitted on the other fold)
        own = np.full(len(Z), np.nan)
        z = np.full(Z.shape, np.nan)
        folds = [fold == b for b in (0, 1)]
        crossfit = self.calibration == "crossfit" and all(m.sum() >= max(self.min_family_size, 2 * k) for m in folds)
        parts = [(~m, m) for m in folds] if crossfit else [(np.ones(len(Z), bool), np.ones(len(Z), bool))]
        for train, test in parts:
            if crossfit:
                pw, pmu, pvar = self._mixture(Zfit[train], floor, k, rng)
            else:
                pw, pmu, pvar = w, mu, var
            central = self._central(pw)
            m2, _ = self._comp_stats(Z[test], ~nan[test], pw, pmu, pvar, logp=False)
            best, z[test] = self._best_z(Z[test], ~nan[test], m2, central, pmu, pvar)
            own[test] = m2[np.arange(len(best)), best]
        own = own[np.isfinite(own)]
        dof = max(varying, 1)
        r_emp = self._tail_radius(own, dof)
        if crossfit:  # the final mixture's own distances too: it may be sharper than the folds'
            m2, _ = self._comp_stats(Z, ~nan, w, mu, var, logp=False)
            r_emp = max(r_emp, self._tail_radius(self._best_m2(m2, self._central(w)), dof))
        self.radius_[f] = max(float(_chi2_isf(self.tail, dof)), r_emp)
        if str(self.families_[f]).split(" ", 1)[0] in set(self.feature_test or ()):
            tested = ~np.isin(self.feature_names_in_[cols], FEATURE_TEST_EXEMPT)
            self.feature_radius_[f, cols[tested]] = self._feature_radius(z[:, tested], dof)
        # in-sample scores of the final model (m2: its distances, from the last pass above)
        a_in, _, _, z_in = self._score_family(f, Z, ~nan, cols, m2)
        return z, a_in, z_in

    # ---------------------------------------------------------------------------------------
    # scoring

    def _comp_stats(self, Z: np.ndarray, finite: np.ndarray, w: np.ndarray, mu: np.ndarray, var: np.ndarray,
                    logp: bool = True):
        """Per row and component: the squared distance m²_k (with ``one_sided`` only excesses
        over the component's centre count) and, with ``logp``, log(π_k N_k) of the full Gaussian
        (else None). NaNs are marginalized: ``finite`` is ``~isnan(Z)``. Columns with no finite
        value are left out (they add nothing); rows are taken in blocks (bounded temporaries)."""
        k, n = len(w), len(Z)
        cols = np.flatnonzero(finite.any(axis=0)) if n else np.zeros(0, np.int64)
        if len(cols) < Z.shape[1]:
            Z, finite, mu, var = Z[:, cols], finite[:, cols], mu[:, cols], var[:, cols]
        ivar = 1.0 / var
        m2 = np.empty((n, k))
        lp = np.empty((n, k)) if logp else None
        if logp:
            logw = np.log(np.maximum(w, 1e-300))
            lognorm = np.log(var) + _LOG2PI  # (k, d)
        for lo in range(0, n, _BLOCK):
            Zb, fb = Z[lo:lo + _BLOCK], finite[lo:lo + _BLOCK]
            D = Zb[:, None, :] - mu[None]  # (b, k, d); NaN where Z is missing
            if logp or not self.one_sided:
                full = np.einsum("bkd,kd->bk", np.where(fb[:, None, :], D * D, 0.0), ivar)
                if logp:
                    lp[lo:lo + _BLOCK] = logw - 0.5 * (fb.astype(np.float64) @ lognorm.T) - 0.5 * full
                if not self.one_sided:
                    m2[lo:lo + _BLOCK] = full
            if self.one_sided:
                np.fmax(D, 0.0, out=D)  # missing values (NaN) count 0
                D *= D
                m2[lo:lo + _BLOCK] = np.einsum("bkd,kd->bk", D, ivar)
        return m2, lp

    def _score_family(self, f: int, Z: np.ndarray, finite: np.ndarray, cols: np.ndarray, m2: np.ndarray | None = None):
        """a(x), the nearest central component, the squared distance to it and the per-feature
        deviations z from it of rows of family f (``Z``: their standardized feature columns
        ``cols``; ``m2``: their one-sided distances to every component when already known)."""
        k = int(self.n_components_[f])
        central = self.central_[f, :k]
        mu, var = self.means_[f, :k][:, cols], self.covariances_[f, :k][:, cols]
        logp = None
        if m2 is None or not self.one_sided:
            m2, logp = self._comp_stats(Z, finite, self.weights_[f, :k], mu, var, logp=not self.one_sided)
        g = expit((self.radius_[f] - m2) / 2.0)
        if self.one_sided:  # the best central explanation (see the module docstring)
            rho = np.where(central, g, 0.0).max(axis=1)
        else:
            logp -= logp.max(axis=1, keepdims=True)
            r = np.exp(logp)
            r /= r.sum(axis=1, keepdims=True)
            rho = (r * g)[:, central].sum(axis=1)
        best, zc = self._best_z(Z, finite, m2, central, mu, var)
        a = np.clip(1.0 - rho, 0.0, 1.0)
        if self.feature_test and len(zc) and np.isfinite(self.feature_radius_[f]).any():
            # one feature far beyond what the reference ever showed is suspicious by itself, even
            # when the joint distance over every feature stays inside the radius
            e = np.nan_to_num(self._excess2(zc), nan=0.0)
            a = np.maximum(a, 1.0 - expit((self.feature_radius_[f, cols] - e) / 2.0).min(axis=1))
        return a, best, m2[np.arange(len(Z)), best], zc

    @staticmethod
    def _best_m2(m2: np.ndarray, central: np.ndarray) -> np.ndarray:
        return np.where(central, m2, np.inf).min(axis=1)

    @staticmethod
    def _best_z(Z: np.ndarray, finite: np.ndarray, m2: np.ndarray, central: np.ndarray, mu: np.ndarray,
                var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Nearest central component of each row and the row's deviation from it, per feature, in
        that component's standard deviations (NaN where the feature is missing)."""
        best = np.argmin(np.where(central, m2, np.inf), axis=1)
        z = np.empty(Z.shape)
        sd = np.sqrt(var)
        for j in np.flatnonzero(np.bincount(best, minlength=len(mu))).tolist():  # components in use
            rows = np.flatnonzero(best == j) if len(mu) > 1 else slice(None)
            z[rows] = (Z[rows] - mu[j]) / sd[j]
        z[~finite] = np.nan
        return best, z

    def _check(self) -> None:
        if not hasattr(self, "families_"):
            from sklearn.exceptions import NotFittedError

            raise NotFittedError("GMMLocalizer is not fitted; call fit() or GMMLocalizer.load(path)")

    def family_codes(self, families: np.ndarray) -> np.ndarray:
        """Index of each family in ``families_``; -1 for families never seen in the reference."""
        self._check()
        fam = np.asarray(families).astype(str)
        pos = np.clip(np.searchsorted(self.families_, fam), 0, max(len(self.families_) - 1, 0))
        hit = (self.families_[pos] == fam) if len(self.families_) else np.zeros(len(fam), bool)
        return np.where(hit, pos, -1)

    def details(self, X: np.ndarray, families: np.ndarray, batch: np.ndarray | None = None,
                family_names: Any = None, with_z_ref: bool = True, with_z: bool = True,
                steps: np.ndarray | None = None) -> dict[str, Any]:
        """a(x) plus what explains it: ``a``, ``unseen`` (bool), ``m2`` (squared distance to the
        nearest central component), ``component`` (its index), ``z`` (n × d: per-feature deviation
        from that component in its standard deviations; None unless ``with_z``), ``z_ref`` (n × d:
        robust z against the family median; None unless ``with_z_ref``). ``batch``: requests of
        each row's step (the batch normalisation). With ``family_names``, ``families`` are integer
        codes into it. With ``steps`` (each row's step, < 0: none), also ``shift``: the shift
        statistic m²_shift of every (family, step) group (:meth:`score_steps` takes it instead of
        ``z``), as arrays (family code, step, m²) ordered by family, then step: computed family by
        family, so no (n × d) matrix is needed for it."""
        self._check()
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != self.n_features_in_:
            raise ValueError(f"X must have {self.n_features_in_} features, got shape {X.shape}")
        n, d = X.shape
        if family_names is not None:
            codes = np.r_[self.family_codes(family_names), -1][np.asarray(families, np.int64)] if n else np.zeros(0, np.int64)
        else:
            codes = self.family_codes(families)
        u_all = self._log_batch(batch, n)
        a = np.full(n, np.nan)
        m2_out = np.full(n, np.nan)
        comp = np.full(n, -1, np.int64)
        z = np.full((n, d), np.nan, order="F") if with_z else None  # column-major: the shift test reads it by feature
        z_ref = np.full((n, d), np.nan, order="F") if with_z_ref else None
        shift: list[tuple[np.ndarray, np.ndarray]] = []
        step_all = None if steps is None else np.asarray(steps).astype(np.int64)
        order = np.argsort(codes, kind="stable")
        sc = codes[order]
        bounds = np.searchsorted(sc, np.arange(-1, len(self.families_) + 1))
        ctx = self._context_mask()
        fin_all = np.isfinite(X)
        for f in range(len(self.families_)):  # loop over families, vectorized inside
            idx = order[bounds[f + 1]:bounds[f + 2]]
            if not len(idx):
                continue
            # the family's columns with any value (operator families leave the STEP/OTHER ones NaN)
            cols = np.flatnonzero(fin_all[idx].any(axis=0) & ~ctx)
            L = self._debatch_cols(f, self._log_raw(X[np.ix_(idx, cols)]), u_all[idx], cols)
            finite = ~np.isnan(L)
            Z = (L - self.median_[f, cols]) / self.scale_[f, cols]
            a[idx], comp[idx], m2_out[idx], zc = self._score_family(f, Z, finite, cols)
            if z is not None:
                z[np.ix_(idx, cols)] = zc
            if z_ref is not None:
                z_ref[np.ix_(idx, cols)] = Z
            if step_all is not None:  # the groups score_steps forms: rows in a step with a finite score
                live = (step_all[idx] >= 0) & np.isfinite(a[idx])
                us, gid = np.unique(step_all[idx][live], return_inverse=True)
                shift.append((us, self._group_m2(np.asfortranarray(zc[live]), gid.reshape(-1), len(us))))
        unseen = codes < 0
        a[unseen] = self.unseen_score
        out = {"a": a, "unseen": unseen, "m2": m2_out, "component": comp, "z": z, "z_ref": z_ref, "family": codes}
        if step_all is not None:
            fams = [f for f in range(len(self.families_)) if bounds[f + 2] > bounds[f + 1]]
            out["shift"] = (np.concatenate([np.full(len(u), f, np.int64) for f, (u, _) in zip(fams, shift, strict=True)] or [np.zeros(0, np.int64)]),
                            np.concatenate([u for u, _ in shift] or [np.zeros(0, np.int64)]),
                            np.concatenate([m for _, m in shift] or [np.zeros(0)]))
        return out

    def score_samples(self, X: np.ndarray, families: np.ndarray, batch: np.ndarray | None = None) -> np.ndarray:
        """Anomaly score a(x) = 1 − ρ(x) of every instance (``unseen_score`` for unseen families)."""
        return self.details(X, families, batch, with_z_ref=False)["a"]

    def predict(self, X: np.ndarray, families: np.ndarray, batch: np.ndarray | None = None) -> np.ndarray:
        """Suspicious instances: a(x) ≥ ``instance_threshold``."""
        return self.score_samples(X, families, batch) >= self.instance_threshold

    def reference_value(self, families: np.ndarray, component: np.ndarray, batch: np.ndarray | None = None) -> np.ndarray:
        """Raw feature values at the centre of each row's component (n × d): the reference's
        typical value (at the row's batch size, when given)."""
        codes = self.family_codes(families)
        out = np.full((len(codes), self.n_features_in_), np.nan)
        ok = (codes >= 0) & (component >= 0)
        c, k = codes[ok], component[ok]
        out[ok] = self._raw_at_batch(self.means_[c, k] * self.scale_[c] + self.median_[c], c, batch, ok)
        return out

    def reference_median(self, families: np.ndarray, batch: np.ndarray | None = None) -> np.ndarray:
        """Raw feature values at each row's family median in the reference (n × d; at the row's
        batch size, when given): the family's typical value whatever mode a row falls in. NaN for
        families the reference never saw."""
        codes = self.family_codes(families)
        out = np.full((len(codes), self.n_features_in_), np.nan)
        ok = codes >= 0
        c = codes[ok]
        out[ok] = self._raw_at_batch(self.median_[c], c, batch, ok)
        return out

    def _raw_at_batch(self, L: np.ndarray, c: np.ndarray, batch: np.ndarray | None, ok: np.ndarray) -> np.ndarray:
        """Log-space values ``L`` of the rows ``ok`` (families ``c``) as raw feature values at
        those rows' batch sizes (the family's batch slope applied; no shift without a batch)."""
        u = self._log_batch(batch, len(ok))[ok]
        return np.expm1(L + np.where(np.isfinite(u), u - self.batch_center_[c], 0.0)[:, None] * self.slope_[c])

    def _group_m2(self, z: np.ndarray, gid: np.ndarray, n_groups: int) -> np.ndarray:
        """m²_shift of row groups: ``gid`` is each row's group (< 0: none). One pass per feature
        over the rows where it has a value (a column-major ``z`` reads fastest)."""
        out = np.zeros(n_groups)
        live = gid >= 0
        for j in range(z.shape[1]):  # features (tens)
            col = z[:, j]
            fin = np.isfinite(col) & live
            if not fin.any():
                continue
            g = gid[fin]
            sums = np.bincount(g, weights=col[fin], minlength=n_groups)
            cnt = np.bincount(g, minlength=n_groups)
            t = sums / np.sqrt(np.maximum(cnt, 1.0))
            out += np.maximum(t, 0.0) ** 2 if self.one_sided else t ** 2
        return out

    def score_steps(self, a: np.ndarray, family: np.ndarray, step: np.ndarray, z: np.ndarray | None = None,
                    codes: np.ndarray | None = None, shift_groups: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> StepScores:
        """Family suspiciousness per (step, family) and the step scores (vectorized).

        ``family`` are integer codes of the run's families, ``step`` step indices; rows with
        step < 0 or NaN scores are ignored. With ``z`` and ``codes`` (from :meth:`details`) and
        ``shift_test``, a family whose instances in a step are all somewhat off also scores:
        a_shift = 1 − expit((T_shift − m²_shift) / 2), and the family's suspiciousness is the
        larger of that and the k-th instance score (module docstring). ``shift_groups`` (with ``codes``): the
        groups' m²_shift as :meth:`details` gives them with ``steps``, instead of ``z``."""
        a = np.asarray(a, dtype=np.float64)
        ok = (step >= 0) & np.isfinite(a)
        a, fam, st = a[ok], np.asarray(family)[ok].astype(np.int64), np.asarray(step)[ok].astype(np.int64)
        if not len(a):
            e = np.zeros(0, np.int64)
            return StepScores(e, np.zeros(0), np.zeros(0, bool), e, e, e, np.zeros(0), e, np.zeros(0))
        nf = int(fam.max(initial=0)) + 1
        o = np.lexsort((-a, st * nf + fam))  # by (step, family), least confident first
        a, fam, st = a[o], fam[o], st[o]
        new = np.r_[True, (st[1:] != st[:-1]) | (fam[1:] != fam[:-1])]
        gstart = np.flatnonzero(new)
        gsize = np.diff(np.r_[gstart, len(a)])
        gid = np.cumsum(new) - 1
        # k per group: the top ⌈quantile·n⌉, at least min(n, min_instances), at least one
        top = np.maximum(np.maximum(np.ceil(self.quantile * gsize), np.minimum(gsize, self.min_instances)), 1).astype(np.int64)
        if self.aggregate == "kth":  # groups are sorted least confident first: the k-th row of each
            susp = a[gstart + top - 1]
        elif self.aggregate != "mean":
            raise ValueError(f"aggregate must be 'kth' or 'mean', got {self.aggregate!r}")
        else:
            take = np.arange(len(a)) - gstart[gid] < top[gid]  # the top k rows of each group
            susp = np.bincount(gid[take], weights=a[take], minlength=len(gstart)) / top
        shift = np.zeros(len(gstart))
        if self.shift_test and (z is not None or shift_groups is not None) and codes is not None:
            gc = np.asarray(codes)[ok][o][gstart]
            if shift_groups is not None:  # precomputed per (family, step): look the groups up
                sh_f, sh_s, sh_m2 = (np.asarray(x) for x in shift_groups)
                span = int(max(st.max(initial=0), sh_s.max(initial=0))) + 1
                keys = sh_f * span + sh_s
                want = gc * span + st[gstart]
                pos = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
                hit = (keys[pos] == want) if len(keys) else np.zeros(len(want), bool)
                m2 = np.where(hit, sh_m2[pos] if len(keys) else 0.0, 0.0)
            else:
                row_gid = np.full(len(ok), -1, np.int64)  # each input row's group (rows left out: -1)
                row_gid[np.flatnonzero(ok)[o]] = gid
                m2 = self._group_m2(np.asarray(z), row_gid, len(gstart))
            use = (gsize >= 2) & (gc >= 0)
            shift[use] = 1.0 - expit((self.shift_radius_[gc[use]] - m2[use]) / 2.0)
            susp = np.maximum(susp, shift)
        sf_step, sf_family = st[gstart], fam[gstart]
        steps, first = np.unique(sf_step, return_index=True)
        # max per step: groups are sorted by step; reduceat over the step blocks
        score = np.maximum.reduceat(susp, first)
        # family of the max (first family reaching it)
        sidx = np.searchsorted(steps, sf_step)
        is_max = susp >= score[sidx]
        cand = np.where(is_max, np.arange(len(susp)), len(susp))
        best = np.minimum.reduceat(cand, first)
        return StepScores(steps, score, score >= self.step_threshold, sf_family[best], sf_step, sf_family, susp, gsize, shift)

    # ---------------------------------------------------------------------------------------
    # persistence

    def save(self, path: str | os.PathLike) -> None:
        """Write the fitted model as one ``.npz`` artefact (arrays + JSON header, no pickle)."""
        self._check()
        header = {
            "kind": ARTEFACT_KIND,
            "version": ARTEFACT_VERSION,
            "tool_version": __version__,
            "params": self.get_params(),
            "extra": getattr(self, "extra_", {}),
            "nan_values": int(self.nan_values_),
        }
        arrays = {
            "families": np.asarray(self.families_, dtype=str),
            "feature_names": np.asarray(self.feature_names_in_, dtype=str),
            "median": self.median_, "scale": self.scale_, "weights": self.weights_, "means": self.means_,
            "covariances": self.covariances_, "central": self.central_, "n_components": self.n_components_,
            "n_samples": self.n_samples_, "radius": self.radius_, "feature_radius": self.feature_radius_,
            "shift_radius": self.shift_radius_, "varying": self.varying_,
            "slope": self.slope_, "batch_center": self.batch_center_,
            "count_p99": getattr(self, "count_p99_", np.full(len(self.families_), np.nan)),
        }
        path = os.fspath(path)
        tmp = path + ".tmp.npz"
        with open(tmp, "wb") as fh:
            np.savez_compressed(fh, header=np.asarray(json.dumps(header)), **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "GMMLocalizer":
        """Read an artefact written by :meth:`save`."""
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(str(z["header"]))
                data = {k: z[k] for k in z.files if k != "header"}
        except FileNotFoundError:
            raise TellerError(f"{path}: no such localizer file; make one with `teller localize fit REF_RUN... -o {path}`") from None
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise TellerError(f"{path}: not a localizer artefact ({e}); make one with `teller localize fit REF_RUN... -o {path}`") from e
        if header.get("kind") != ARTEFACT_KIND:
            raise TellerError(f"{path}: not a localizer artefact (kind {header.get('kind')!r}); make one with `teller localize fit`")
        if header.get("version", 0) > ARTEFACT_VERSION:
            raise TellerError(f"{path}: localizer artefact version {header['version']} is newer than this teller; upgrade teller")
        known = cls().get_params()
        params = {k: v for k, v in header["params"].items() if k in known}
        for k in ("context_features", "feature_test"):
            if isinstance(params.get(k), list):  # JSON has no tuples
                params[k] = tuple(params[k])
        if "feature_test" not in header["params"]:  # artefacts before the feature test
            params["feature_test"] = ()
        if "aggregate" not in header["params"]:  # artefacts before the k-th instance rule: the top-quantile mean
            params["min_instances"], params["aggregate"] = 1, "mean"
        est = cls(**params)
        est.families_ = data["families"]
        est.feature_names_in_ = data["feature_names"]
        est.n_features_in_ = len(est.feature_names_in_)
        est.median_, est.scale_ = data["median"], data["scale"]
        est.weights_, est.means_, est.covariances_ = data["weights"], data["means"], data["covariances"]
        est.central_ = data["central"].astype(bool)
        est.n_components_, est.n_samples_, est.radius_ = data["n_components"], data["n_samples"], data["radius"]
        est.shift_radius_, est.varying_ = data["shift_radius"], data["varying"]
        F, d = est.median_.shape
        # version 1 artefacts: no batch normalisation
        est.slope_ = data["slope"] if "slope" in data else np.zeros((F, d))
        est.batch_center_ = data["batch_center"] if "batch_center" in data else np.zeros(F)
        # artefacts before the feature test: no per-feature radii (the test never fires)
        est.feature_radius_ = data["feature_radius"] if "feature_radius" in data else np.full((F, d), np.inf)
        # artefacts before per-step counts were kept: unknown (no count rule)
        est.count_p99_ = data["count_p99"] if "count_p99" in data else np.full(F, np.nan)
        est.nan_values_ = int(header.get("nan_values", 0))
        est.extra_ = header.get("extra", {})
        return est
