"""Numeric candidate localization (docs/design.md §6): features, the per-family GMM, step scores.

- :mod:`.features`: operator instances and their feature vectors φ(x) from ``forest.parquet``,
  and the step each instance belongs to;
- :mod:`.gmm`: :class:`GMMLocalizer`, the scikit-learn-style estimator (fit on reference runs,
  a(x) = 1 − ρ(x), family suspiciousness, one ``.npz`` artefact);
- here: :func:`fit_localizer` (reference runs → fitted estimator) and :func:`localize` (a run's
  instances → step scores, candidate families Õ_s and suspicious instances I_s with evidence).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from teller.errors import TellerError
from teller.localize.deployment import deployment_shape, merge_shapes
from teller.localize.features import (
    FEATURES,
    OP_FEATURES,
    SCORED_LAYERS,
    Instances,
    RunFeatures,
    run_features,
)
from teller.reconstruct._np import cumcount
from teller.reconstruct.ensure import ensure_reconstructed

if TYPE_CHECKING:
    from teller.localize.gmm import GMMLocalizer, StepScores

__all__ = ["GMMLocalizer", "fit_localizer", "fit_once", "fit_self_reference", "localize", "own_reference_steps", "Localization", "FEATURES", "run_features"]

#: Per-feature |z| at or above which a feature is named as evidence.
EVIDENCE_Z = 2.0
#: Features named per suspect at most.
EVIDENCE_MAX = 4
#: Instances named per (step, family) raised by the shift test alone.
COLLECTIVE_SUSPECTS = 3


def no_reference_error(run: str | os.PathLike | None = None) -> TellerError:
    """The error for a diagnosis without reference data, naming the commands that make some."""
    target = f" {run}" if run else " RUN"
    return TellerError(
        "no reference data: the numeric stage compares a run with normal operation. Record a reference run "
        "(e.g. `teller record -o REF -- CMD`, or `teller ingest TRACE -o REF`), then `teller reconstruct REF` and "
        f"`teller diagnose{target} --reference REF`, or fit once with `teller localize fit REF -o localizer.npz` "
        f"and pass `--localizer localizer.npz`"
    )


def feature_matrix(est: GMMLocalizer, inst: Instances) -> np.ndarray:
    """``inst.X`` in the estimator's feature order (an artefact fitted with fewer features, e.g.
    before the runtime-call mix existed, gets its own columns; features it has and the
    instances lack are NaN)."""
    names = [str(x) for x in est.feature_names_in_]
    if tuple(names) == FEATURES[: len(names)] and inst.X.shape[1] >= len(names):
        return inst.X[:, : len(names)]
    pos = {f: i for i, f in enumerate(FEATURES)}
    X = np.full((inst.n, len(names)), np.nan)
    for j, f in enumerate(names):
        if f in pos and pos[f] < inst.X.shape[1]:
            X[:, j] = inst.X[:, pos[f]]
    return X


def reference_mask(f: RunFeatures, keep_warmup: bool = False) -> np.ndarray:
    """Instances of ``f`` a reference is fitted on: those in steps, warm-up steps left out
    (:attr:`teller.localize.features.StepTable.warmup`) unless ``keep_warmup``."""
    keep = f.instances.step >= 0
    if not keep_warmup and f.steps.warmup is not None and len(f.steps.warmup):
        keep &= ~f.steps.warmup[np.maximum(f.instances.step, 0)]
    return keep


def fit_localizer(runs: list[str | os.PathLike] | list[RunFeatures], window_ns: int | None = None,
                  layers: tuple[str, ...] | None = None, keep_warmup: bool = False,
                  max_steps: int | None = None, leave_out: list[np.ndarray | None] | None = None,
                  **params: Any) -> GMMLocalizer:
    """Fit a :class:`GMMLocalizer` on the in-step instances of reference ``runs``; warm-up steps
    (a process's first steps, warm-up requests) are left out unless ``keep_warmup``. A reference
    of more than ``max_steps`` such steps (all runs together) is fitted on ``max_steps`` of them
    drawn uniformly at random (seeded: the same reference gives the same model; None: all
    steps): every part of the fit (robust scales, mixtures, radii, the shift test's radius, the
    in-sample flag rate) then costs what that many steps cost.

    A reference run not reconstructed yet (or whose forest predates steps decided in
    reconstruction) is reconstructed first, with ``window_ns`` for its fixed-window steps; a run
    already reconstructed keeps the steps ``teller reconstruct`` decided.

    ``leave_out``: per run, None or a boolean per step (``steps.n``) of steps the reference leaves
    out besides warm-up steps (:func:`fit_self_reference`: those outside the run's reference half,
    and those a fit on it flags).

    ``extra_`` of the result records the reference runs, instance layers and how many of the
    reference's own steps the fitted model flags (its in-sample false-positive rate)."""
    if not runs:
        raise no_reference_error()
    if leave_out is not None and len(leave_out) != len(runs):
        raise ValueError(f"leave_out: {len(leave_out)} step masks for {len(runs)} runs")
    feats = [r if isinstance(r, RunFeatures) else run_features(ensure_reconstructed(r, window_ns=window_ns), layers=layers)
             for r in runs]
    if layers is None:
        # all reference runs must use the same instance layers; FE/BE/COMM wins when any has them
        lays = {tuple(f.instances.layers) for f in feats}
        if len(lays) > 1:
            layers = SCORED_LAYERS
            feats = [run_features(f.path, layers=layers) for f in feats]
    # family codes over the union of the runs' family names (a name per family, not per instance)
    all_names = sorted(set().union(*(f.instances.families for f in feats)))
    X_parts, fam_parts, grp_parts, b_parts = [], [], [], []
    offset = warm_left = 0
    warmup_note = ""
    if not keep_warmup and not any(reference_mask(f).any() for f in feats):
        # a reference of warm-up steps only (a short foreign trace): better than none
        keep_warmup = True
        warmup_note = "the reference holds warm-up steps only: they were kept"
    keeps = [reference_mask(f, keep_warmup) for f in feats]
    for i, out in enumerate(leave_out or []):
        if out is not None:
            out = np.asarray(out, bool)
            if len(out) != feats[i].steps.n:
                raise ValueError(f"leave_out[{i}]: {len(out)} values for the {feats[i].steps.n} steps of {feats[i].path}")
            keeps[i] = keeps[i] & ~out[np.maximum(feats[i].instances.step, 0)]
    shape = merge_shapes([run_shape(f, keep_warmup) for f in feats])  # before the rows are compacted below
    # steps of the reference (run by run), and the sample of them the fit uses
    ref_steps = [np.flatnonzero(np.bincount(f.instances.step[k], minlength=f.steps.n)) for f, k in zip(feats, keeps, strict=True)]
    n_ref_steps = sum(len(x) for x in ref_steps)
    sampled = max_steps is not None and n_ref_steps > max_steps
    if sampled:
        pick = np.zeros(n_ref_steps, bool)
        pick[np.random.default_rng(int(params.get("random_state", 0))).choice(n_ref_steps, int(max_steps), replace=False)] = True
        lo = 0
        for i, (f, st) in enumerate(zip(feats, ref_steps, strict=True)):
            use = np.zeros(f.steps.n + 1, bool)
            use[st[pick[lo:lo + len(st)]]] = True
            keeps[i] = keeps[i] & use[f.instances.step]
            lo += len(st)
    # features read here (not given by the caller) are this function's own: their rows are
    # compacted in place and their forests let go before the fit (the fit needs neither)
    own = [f is not r for f, r in zip(feats, runs, strict=True)]
    for f, keep, mine in zip(feats, keeps, own, strict=True):
        if not keep_warmup and f.steps.warmup is not None:
            warm_left += int(f.steps.warmup.sum())
        X_parts.append(f.instances.X if keep.all() else _take_rows(f.instances.X, keep) if mine else f.instances.X[keep])
        if mine:
            f.forest = f.comm_edges = None
        to_all = np.searchsorted(np.asarray(all_names, dtype=object), np.asarray(f.instances.families, dtype=object))
        fam_parts.append(to_all.astype(np.int64)[f.instances.family[keep]] if len(to_all) else np.zeros(int(keep.sum()), np.int64))
        grp_parts.append(f.instances.step[keep] + offset)  # steps of different runs stay apart
        b_parts.append(f.instances.batch[keep] if f.instances.batch is not None else np.full(int(keep.sum()), np.nan))
        offset += f.steps.n
    def cat(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else empty

    X = cat(X_parts, np.zeros((0, len(FEATURES))))
    fam = cat(fam_parts, np.zeros(0, np.int64))
    groups = cat(grp_parts, np.zeros(0, np.int64))
    batch = cat(b_parts, np.zeros(0))
    if not len(X):
        raise TellerError(
            f"reference run(s) {', '.join(str(f.path) for f in feats)} hold no operator instances inside steps"
            + ("" if keep_warmup else " outside warm-up steps") + "; record a reference with hook ranges "
            "(`teller record -o REF -- CMD`) and run `teller reconstruct REF`"
            + ("" if keep_warmup else ", or keep its warm-up steps (`--keep-warmup`)")
        )
    from teller.localize.gmm import GMMLocalizer

    est = GMMLocalizer(**params).fit(X, families=fam, groups=groups, batch=batch, family_names=all_names)
    # the fit scores its own reference steps (the steps above, warm-up left out unless kept)
    flagged, total = est.reference_steps_flagged_, est.reference_steps_
    est.extra_ = {
        "reference_runs": [str(f.path) for f in feats],
        "instance_layers": list(feats[0].instances.layers),
        "reference_instances": int(len(X)),
        "reference_steps": total,
        "reference_steps_flagged": flagged,
        **({"reference_steps_sampled_from": n_ref_steps} if sampled else {}),
        **_calibration_note(est),
        "reference_warmup_steps": warm_left if not keep_warmup else 0,
        "keep_warmup": bool(keep_warmup),
        **({"warmup_note": warmup_note} if warmup_note else {}),
        "step_rules": sorted({f.steps.rule for f in feats}),
        "deployment": shape,
    }
    return est


#: steps a self-reference keeps at least after leaving out those its fit flags (fewer: none are
#: left out)
SELF_REFERENCE_MIN_STEPS = 20
#: steps each half of a run needs for one half to be the other's reference (fewer: the whole run
#: is; on the bundled recordings' halves of 28–37 steps a fault-free run read 4 and 13 false
#: verdicts against its other half, docs/results.md)
SELF_REFERENCE_HALF_STEPS = 40


def own_reference_steps(step_num: np.ndarray, usable: np.ndarray, fit_flags: Any,
                        min_steps: int = SELF_REFERENCE_MIN_STEPS, halves: bool = True,
                        half_steps: int = SELF_REFERENCE_HALF_STEPS) -> tuple[np.ndarray, dict[str, Any]]:
    """The steps of a run its own reference is fitted on, when no reference recording is given
    (:func:`fit_self_reference`, and the evaluation's ``teller_numeric_self``): of the ``usable``
    steps (warm-up out), cut at their median step number into a first and a second span when each
    holds ``half_steps`` or more, the span the other departs from more (the stage fitted on each span
    flags the other's steps: a fault confined to one span is a departure of that span, and the
    other, healthier one is the reference; a tie keeps the first);
    then without the steps a stage fitted on that span flags in it (when ``min_steps`` remain).
    ``fit_flags(mask)``: per step, the flags of the stage fitted on the steps of ``mask``. Returns
    the reference's step mask and what was decided. ``halves=False``: every usable step, less
    what a fit on them flags (measured against it, docs/results.md)."""
    usable = np.asarray(usable, bool)
    ref = usable.copy()
    info: dict[str, Any] = {"steps": int(usable.sum()), "min_steps": int(min_steps)}
    flags = None
    if halves and ref.sum() >= 2 * half_steps:
        cut = float(np.median(step_num[usable]))
        first = usable & (step_num <= cut)
        second = usable & ~first
        if first.sum() >= half_steps and second.sum() >= half_steps:
            on_first, on_second = np.asarray(fit_flags(first), bool), np.asarray(fit_flags(second), bool)
            second_departs, first_departs = int((on_first & second).sum()), int((on_second & first).sum())
            keep_first = second_departs >= first_departs
            ref, flags = (first, on_first) if keep_first else (second, on_second)
            info.update(spans={"cut_step": cut, "first": int(first.sum()), "second": int(second.sum()),
                               "second_departs": second_departs, "first_departs": first_departs,
                               "reference": "first" if keep_first else "second"})
    if flags is None:  # the whole run
        flags = np.asarray(fit_flags(ref), bool)
    left = flags & ref
    if left.any() and int((ref & ~left).sum()) >= min_steps:
        ref = ref & ~left
    else:
        left[:] = False
    info.update(left_out=int(left.sum()), reference_steps=int(ref.sum()))
    return ref, info


def fit_once(fit: Any) -> Any:
    """``fit(mask)`` (a stage fitted on the steps of a boolean step mask of one run) fitted once per
    mask: :func:`own_reference_steps` asks again for a mask it fitted before (a reference half with
    nothing left out is that half's own fit)."""
    fitted: dict[bytes, Any] = {}

    def once(mask: np.ndarray) -> Any:
        key = np.packbits(mask).tobytes()
        if key not in fitted:
            fitted[key] = fit(mask)
        return fitted[key]

    return once


def fit_self_reference(rf: RunFeatures, keep_warmup: bool = False, **params: Any) -> GMMLocalizer:
    """The stage fitted on the diagnosed run's own steps, for a run with no reference recording
    (`teller diagnose RUN` alone): on the steps :func:`own_reference_steps` picks (warm-up out
    unless ``keep_warmup``): the half of the run the other half departs from more, without the
    steps a fit on it flags, so that a fault confined to one half is read against the other (the
    dataset's labelling rule reads a run against its own steps outside the fault windows in the
    same spirit, docs/faults.md). A fault present in both halves, one repeated over the run or
    lasting most of it, is in the reference and is absorbed (docs/results.md, "Diagnosing a run
    without a reference"): a fault-free recording (``--reference``) is the reference to prefer.
    ``extra_["self_reference"]``: what was decided (:func:`own_reference_steps`)."""
    usable = np.ones(rf.steps.n, bool)
    if not keep_warmup and rf.steps.warmup is not None and len(rf.steps.warmup) == rf.steps.n and not rf.steps.warmup.all():
        usable = ~np.asarray(rf.steps.warmup, bool)

    fit = fit_once(lambda mask: fit_localizer([rf], keep_warmup=keep_warmup, leave_out=[~mask], **params))

    def fit_flags(mask: np.ndarray) -> np.ndarray:
        loc = localize(fit(mask), rf.instances)
        out = np.zeros(rf.steps.n, bool)
        out[loc.steps.steps[loc.steps.flag]] = True
        return out

    ref, info = own_reference_steps(rf.steps.step_num, usable, fit_flags)
    est = fit(ref)
    est.extra_["self_reference"] = info
    return est


def self_reference_source(est: GMMLocalizer) -> str:
    """The reference's description for a self-reference (:func:`fit_self_reference`)."""
    sr = est.extra_["self_reference"]
    sp = sr.get("spans")

    def n(k: int) -> str:
        return f"{k} step" + ("" if k == 1 else "s")

    if sp:
        side = "up to" if sp["reference"] == "first" else "after"
        what = (f"the {sp['reference']} half of its {n(sr['steps'])} outside warm-up ({side} step {sp['cut_step']:g}), "
                "which the other departs from more")
    else:
        what = f"its {n(sr['steps'])} outside warm-up"
    return f"the run's own steps (no reference given: {what}; {sr['left_out']} left out as departures, {n(sr['reference_steps'])} kept)"


#: what `teller diagnose` warns of when it reads a run against its own steps
SELF_REFERENCE_WARNING = ("no reference given: the run is compared with its own steps, so the numeric stage finds steps unlike "
                          "the rest of the run and a departure that repeats over several steps can look normal to it (the "
                          "root-cause model reads each step alone); pass --reference with a fault-free recording of the same "
                          "deployment")


def run_shape(f: RunFeatures, keep_warmup: bool = False) -> dict[str, Any]:
    """The deployment shape of a run (:func:`teller.localize.deployment.deployment_shape`), its
    warm-up steps left out unless ``keep_warmup``."""
    use = None
    if not keep_warmup and f.steps.warmup is not None and len(f.steps.warmup) and not f.steps.warmup.all():
        use = ~f.steps.warmup
    return deployment_shape(f.instances.families, f.instances.family, f.instances.step, f.steps.rank, use)


def _take_rows(X: np.ndarray, keep: np.ndarray, block: int = 65536) -> np.ndarray:
    """``X[keep]`` written over the first rows of ``X`` itself (a view of them is returned): rows
    move only towards the front, block by block, so no second matrix is made. ``X`` is lost."""
    idx = np.flatnonzero(keep)
    for lo in range(0, len(idx), block):
        take = idx[lo:lo + block]
        X[lo:lo + len(take)] = X[take]  # the block is read (a copy) before it is written
    return X[:len(idx)]


def _calibration_note(est: GMMLocalizer) -> dict[str, Any]:
    """``extra_`` entries saying which families were calibrated on a sample (none: no entry)."""
    rows = getattr(est, "calibration_rows_", None)
    if rows is None or not (rows < est.n_samples_).any():
        return {}
    part = rows < est.n_samples_
    return {"calibration_sample": {"max_per_family": est.max_calibration_samples, "families_sampled": int(part.sum()),
                                   "instances": int(rows.sum()), "of_instances": int(est.n_samples_.sum())}}


@dataclass
class StepResult:
    """Localization of one flagged step."""

    step: int
    candidates: list[dict[str, Any]]  # family, suspiciousness, instances, unseen
    suspects: np.ndarray  # instance indices, most suspicious first
    explained: dict[int, int] = field(default_factory=dict)  # explained instance → explaining one


@dataclass
class Localization:
    """Output of :func:`localize`: per-instance scores, per-step scores and per flagged step the
    candidate families and suspects."""

    a: np.ndarray
    m2: np.ndarray
    unseen: np.ndarray
    z: np.ndarray  # per-feature deviations of the instances ``z_rows`` (all of them when None)
    component: np.ndarray
    steps: StepScores
    flagged: dict[int, StepResult]
    summary: dict[str, Any]
    collective: np.ndarray  # suspects standing for a family raised by the shift test alone
    z_rows: np.ndarray | None = None  # the instances ``z`` holds (sorted): the suspicious ones of flagged steps

    def z_of(self, idx: np.ndarray) -> np.ndarray | None:
        """``z`` of the instances ``idx``; None when some of them are not held."""
        if self.z_rows is None:
            return self.z[idx]
        pos = np.minimum(np.searchsorted(self.z_rows, idx), max(len(self.z_rows) - 1, 0))
        if not len(self.z_rows) or not np.array_equal(self.z_rows[pos], idx):
            return None
        return self.z[pos]


def _z_rows(est: GMMLocalizer, X: np.ndarray, inst: Instances, rows: np.ndarray) -> np.ndarray:
    """The per-feature deviations z (:meth:`GMMLocalizer.details`) of the instances ``rows`` only."""
    return est.details(X[rows], inst.family[rows], None if inst.batch is None else inst.batch[rows],
                       family_names=inst.families, with_z_ref=False)["z"]


def localize(est: GMMLocalizer, inst: Instances, also: np.ndarray | None = None) -> Localization:
    """Score ``inst`` and, for every flagged step, name candidate families and suspects. ``also``:
    steps (indices, as ``inst.step``) another reader flagged (`teller diagnose`'s root-cause model
    reading every step) that get candidates and suspects as well, found by the same rules; the
    stage's own flags (``steps.flag``, the summary's ``steps_flagged``) are unchanged."""
    X = feature_matrix(est, inst)
    # no (instances × features) deviation matrix: the shift statistic comes family by family, and
    # the deviations of the few suspicious instances are computed for them alone (below)
    det = est.details(X, inst.family, inst.batch, family_names=inst.families, with_z_ref=False, with_z=False,
                      steps=inst.step)
    a = det["a"]
    ss = est.score_steps(a, inst.family, inst.step, codes=det["family"], shift_groups=det["shift"])
    flagged_steps = ss.steps[ss.flag]
    if also is not None and len(also):  # steps with instances only (the others have nothing to name)
        extra = np.asarray(also, np.int64)
        flagged_steps = np.union1d(flagged_steps, extra[np.isin(extra, ss.steps)])
    # candidate (step, family) pairs
    is_flag_step = np.zeros(int(inst.step.max(initial=-1)) + 2, bool)
    is_flag_step[flagged_steps] = True
    cand_pair = (ss.sf_susp >= est.family_threshold) & is_flag_step[ss.sf_step]
    pair_key = ss.sf_step * (len(inst.families) + 1) + ss.sf_family
    inst_key = inst.step * (len(inst.families) + 1) + inst.family
    in_cand = np.isin(inst_key, pair_key[cand_pair]) & (inst.step >= 0)
    # S0: suspicious instances of flagged steps (any family)
    s0 = (a >= est.instance_threshold) & (inst.step >= 0) & is_flag_step[np.maximum(inst.step, 0)]
    # candidate families raised by the shift test may have no single instance above the threshold:
    # their most deviating instances (up to COLLECTIVE_SUSPECTS per step) stand for the family
    coll = np.flatnonzero(in_cand & ~np.isin(inst_key, inst_key[s0]))
    collective = np.zeros(inst.n, bool)
    if len(coll):
        o = np.lexsort((-np.nan_to_num(det["m2"][coll], nan=-np.inf), inst_key[coll]))
        collective[coll[o][cumcount(inst_key[coll][o]) < COLLECTIVE_SUSPECTS]] = True
    S = s0 | collective
    # explain-away: walk up the instance-ancestor chains from every instance of S
    has_desc = np.zeros(inst.n, bool)
    explainer = np.full(inst.n, -1, np.int64)
    explains_cand = np.zeros(inst.n, bool)
    start = np.flatnonzero(S)
    cur = inst.parent[start]
    while True:
        live = cur >= 0
        if not live.any():
            break
        st, cu = start[live], cur[live]
        hit = S[cu]
        has_desc[cu[hit]] = True
        first = hit & (explainer[cu] < 0)
        explainer[cu[first]] = st[first]
        explains_cand[st[hit & in_cand[cu]]] = True
        cur = np.where(live, inst.parent[np.maximum(cur, 0)], -1)
    z_rows = np.flatnonzero(S)  # every suspect and every instance that may be explained away is one
    z = _z_rows(est, X, inst, z_rows)
    self_col = list(est.feature_names_in_).index("self_ns") if "self_ns" in list(est.feature_names_in_) else None
    own = np.zeros(inst.n, bool)
    if self_col is not None:
        own[z_rows] = np.abs(np.nan_to_num(z[:, self_col])) >= est.own_z
    explained = S & has_desc & ~own
    suspect = S & ~explained & (in_cand | explains_cand)
    # per flagged step: candidates and suspects (loop over flagged steps; arrays inside)
    flagged: dict[int, StepResult] = {}
    sus_idx = np.flatnonzero(suspect)  # sorted by step, then most suspicious first
    sus_sorted = sus_idx[np.lexsort((-np.nan_to_num(det["m2"][sus_idx], nan=np.inf), -a[sus_idx], inst.step[sus_idx]))]
    sus_steps = inst.step[sus_sorted]
    exp_idx = np.flatnonzero(explained)
    exp_idx = exp_idx[np.argsort(inst.step[exp_idx], kind="stable")]  # by step, in instance order
    exp_steps = inst.step[exp_idx]
    n_fam = len(inst.families) + 1

    def pair_pos(step: int, fam: int) -> int | None:
        """Row of (step, family) in the step-family table (its keys ascend)."""
        i = int(np.searchsorted(pair_key, step * n_fam + fam))
        return i if i < len(pair_key) and pair_key[i] == step * n_fam + fam else None

    for s in flagged_steps.tolist():
        lo, hi = np.searchsorted(sus_steps, [s, s + 1])
        sus = sus_sorted[lo:hi]
        cands = []
        for fcode in dict.fromkeys(inst.family[sus].tolist()):  # the suspects' families, in order
            p = pair_pos(s, fcode)
            susp = float(ss.sf_susp[p]) if p is not None else float("nan")
            cnt = int(ss.sf_count[p]) if p is not None else 0
            best_a = float(a[sus[inst.family[sus] == fcode]].max())
            shift = float(ss.sf_shift[p]) if p is not None else 0.0
            cands.append({"family": inst.families[fcode], "code": fcode, "suspiciousness": susp, "shift": shift, "instances": cnt,
                          "max_a": best_a, "unseen": bool(det["unseen"][sus[inst.family[sus] == fcode][0]])})
        cands.sort(key=lambda c: (-np.nan_to_num(c["suspiciousness"]), -c["max_a"]))
        cands = cands[: est.max_candidates]
        keep_fams = {c["code"] for c in cands}
        sus = sus[np.isin(inst.family[sus], list(keep_fams))][: est.max_suspects]
        elo, ehi = np.searchsorted(exp_steps, [s, s + 1])
        e = exp_idx[elo:ehi]
        flagged[s] = StepResult(s, cands, sus, {int(i): int(explainer[i]) for i in e.tolist()})
    n_unseen = int(det["unseen"].sum())
    summary = {
        "instances_scored": int(inst.n),
        "instances_in_steps": int((inst.step >= 0).sum()),
        "unseen_instances": n_unseen,
        "unseen_families": sorted({str(inst.families[c]) for c in np.unique(inst.family[det["unseen"]]).tolist()}),
        # operator features only: the STEP/OTHER and iteration columns are NaN by design elsewhere
        "nan_feature_values": int((~np.isfinite(X[:, : min(len(OP_FEATURES), X.shape[1])])).sum()),
        "steps_scored": int(len(ss.steps)),
        "steps_flagged": int(ss.flag.sum()),
        "suspicious_instances": int(s0.sum()),
        "explained_away": int(explained.sum()),
        "collective_suspects": int(collective.sum()),
    }
    return Localization(a, det["m2"], det["unseen"], z, det["component"], ss, flagged, summary, collective, z_rows)


def evidence(est: GMMLocalizer, inst: Instances, loc: Localization, idx: np.ndarray) -> list[list[dict[str, Any]]]:
    """For instances ``idx``: the features that deviate most from the reference (|z| ≥
    :data:`EVIDENCE_Z`, at most :data:`EVIDENCE_MAX`, else the single largest), each with the
    value, the reference's typical value (centre of the nearest central component), the ratio
    and z (in that component's standard deviations)."""
    if not len(idx):
        return []
    fam = np.asarray(inst.families, dtype=object)[inst.family[idx]]  # these instances' names only
    ref = est.reference_value(fam, loc.component[idx], None if inst.batch is None else inst.batch[idx])
    X = feature_matrix(est, inst)
    Z = loc.z_of(idx)
    if Z is None:  # instances the localization did not keep deviations for
        Z = _z_rows(est, X, inst, idx)
    X = X[idx]
    names = list(est.feature_names_in_)
    out = []
    for j in range(len(idx)):  # suspects only
        if loc.unseen[idx[j]]:
            out.append([{"feature": "family", "note": "operator family not seen in the reference"}])
            continue
        zj = np.nan_to_num(Z[j], nan=0.0)
        # one-sided scores are driven by excesses only: name those (else the largest deviation)
        key = zj if est.one_sided and (zj > 0).any() else np.abs(zj)
        order = np.argsort(-key, kind="stable")
        sel = [k for k in order[:EVIDENCE_MAX] if key[k] >= EVIDENCE_Z] or [int(order[0])]
        items = []
        for k in sel:
            v, r = float(X[j, k]), float(ref[j, k])
            items.append({"feature": str(names[k]), "value": v, "reference": r,
                          "ratio": (v / r) if r > 0 else None, "z": float(zj[k])})
        out.append(items)
    return out


def load_or_fit(reference: list[str | os.PathLike] | None, localizer: str | os.PathLike | None,
                window_ns: int | None = None, run: str | os.PathLike | None = None, keep_warmup: bool = False,
                **params: Any) -> tuple[GMMLocalizer, str]:
    """The estimator from ``--localizer`` or fitted on ``--reference`` runs, and a description."""
    if localizer is not None and reference:
        raise TellerError("give either --reference RUN... or --localizer PATH, not both")
    if localizer is not None:
        from teller.localize.gmm import GMMLocalizer

        return GMMLocalizer.load(localizer), f"localizer {localizer}"
    if not reference:
        raise no_reference_error(run)
    est = fit_localizer([Path(r) for r in reference], window_ns=window_ns, keep_warmup=keep_warmup, **params)
    return est, "reference " + ", ".join(str(r) for r in reference) + (" (warm-up steps kept)" if keep_warmup else "")


def __getattr__(name: str) -> Any:
    """The estimator (scikit-learn, scipy) loads on first use, so `teller --help` and the stage
    CLIs that only register commands stay light."""
    if name in ("GMMLocalizer", "StepScores"):
        from teller.localize import gmm

        return getattr(gmm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
