"""TELLER's root-cause models as rows of ``teller evaluate`` (``teller_mot``, ``teller_single``).

The models are trained beforehand (``teller rca train DATASET --split S``, on the GPU; the package
ships a MoT with the family operator head trained on the request split of the union of dataset v2's
four parts, ``runs/h200_v2_all``, reading whole engine iterations), so
"fit" only finds and loads the one
for the split evaluated and checks that it may be scored here: the dataset folder it was trained
on must be this one and its split the one evaluated, otherwise the test steps could be steps it
learnt from, and the row is an error that says so. ``teller evaluate --models DIR`` names a
folder of trained models (one sub-folder each, any names): a row takes the one of its variant,
inputs, unit, split and seed; without it (or when none fits) the row of the shipped model's
recipe (``teller_mot_family``) takes the shipped model. ``teller_mot`` reads engine iterations (``RCAConfig.unit`` ``iteration``: the STEP subtree
with the iteration's schedule/update ranges and untraced gaps), ``teller_mot_step`` is the same
model on STEP subtrees alone (the unit ablation); ``teller_mot_family`` is the MoT whose operator
head scores each operator family of the iteration (``RCAConfig.op_unit`` ``family``); the other
rows read STEP subtrees.
The modality ablations (``teller_mot_trace``, ``teller_mot_log``) and the prompt-style baseline
(``teller_prompt``: the single-stream backbone reading a text summary of the step and its log
lines) are rows of the same kind, each taking the model trained with its ``inputs``. Predict encodes each test step from the dataset's subtrees (the whole step tree,
TPE-encoded, with its aligned log lines: exactly the units ``teller rca`` trains and scores on;
both sides split steps by :func:`teller.dataset.splits.step_representatives`) and reads:

- ``score``: the abnormal probability; ``flag``: the model's abnormal decision;
- ``fault_type``: the model's type given abnormal (``fault_type_best``, so a missed step still
  has its type scored, as ``teller rca predict`` does);
- ``operators``: the evidence operators' families of a flagged step (empty otherwise).

Explanations are not generated here (their BLEU is ``teller rca predict``'s).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from teller.baselines.base import REGISTRY, Method, Prediction, make, register
from teller.baselines.steps import StepSet, norm_label
from teller.localize.episodes import MIN_EPISODE, STAGE_EPISODE, SUSTAIN_FLOOR
from teller.rca import EPISODE_FLOOR, LASTING_NOVELTY, SCREEN_FLOOR


def _dataset_name(path: str | Path) -> str:
    return Path(str(path)).resolve().name


def _meta(path: Path) -> dict[str, Any]:
    """A model's ``config.json``, or {} when it cannot be read."""
    try:
        meta = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def step_units(steps: StepSet, idx: np.ndarray, unit: str = "iteration") -> tuple[Any, np.ndarray]:
    """The ``teller rca`` dataset of ``steps`` serialized as ``unit`` (read once per StepSet, kept
    in ``steps.extra``) and the unit of each step ``idx`` (the same run, view and rank steps)."""
    from teller.rca.data import load_dataset

    cache = steps.extra.setdefault("rca_datasets", {})
    ds = cache.get(unit)
    if ds is None:
        ds = cache[unit] = load_dataset(steps.dataset, unit=unit)
    where = steps.extra.setdefault("rca_unit_index", {}).get(unit)
    if where is None:
        u = ds.units
        where = steps.extra["rca_unit_index"][unit] = {
            (r, v, tuple(s.tolist())): i for i, (r, v, s) in enumerate(zip(u.run_id.tolist(), u.view.tolist(), u.step_ids, strict=True))}
    out = np.empty(len(idx), np.int64)
    for k, i in enumerate(np.asarray(idx, np.int64).tolist()):
        units = steps.unit_key[steps.unit_idx[steps.unit_ptr[i]:steps.unit_ptr[i + 1]]]
        sid = tuple(int(x) for x in (units & ((1 << 40) - 1)).tolist())  # each rank's step, in order
        key = (str(steps.runs[steps.run_code[i]]), steps.view, sid)
        if key not in where:
            raise ValueError(f"step {key} of the evaluation is not a unit of the model's dataset")
        out[k] = where[key]
    return ds, out


@register("teller_mot")
class RCAModel(Method):
    label = "TELLER MoT (root-cause model)"
    kind = "teller"
    features = "engine iteration tree (TPE) + log lines"
    fit_on = "trained beforehand on the split's train steps"

    variant = "mot"
    inputs = "trace+log"
    unit = "iteration"
    op_unit = "token"

    def __init__(self, seed: int = 0, model: str | Path | None = None, batch_size: int = 64):
        self.seed = seed
        self.model = model
        self.batch_size = batch_size

    def _models(self, folder: Path, split: str | None) -> list[tuple[Path, int]]:
        """The models under ``folder`` (``config.json`` one level down) of this row's variant,
        inputs, unit and operator head trained on ``split``, each with its seed, in name order."""
        found = []
        for cfg in sorted(Path(folder).glob("*/config.json")):
            meta = _meta(cfg)
            tr = meta.get("training", {})
            if self._recipe(meta) and tr.get("split") == split:
                found.append((cfg.parent, int(tr.get("seed", -1))))
        return found

    def _recipe(self, meta: dict[str, Any]) -> bool:
        """Whether a model's ``config.json`` (``meta``) is of this row's variant, inputs, unit and
        operator head."""
        c = meta.get("config", {})
        return (c.get("variant") == self.variant and c.get("inputs", "trace+log") == self.inputs
                and c.get("unit", "step") == self.unit and c.get("op_unit", "token") == self.op_unit)

    def _find(self, folder: Path, split: str | None) -> Path | None:
        """The model under ``folder`` of this row (:meth:`_models`) trained with this seed;
        several that fit are an error (which one the row scores must not depend on folder names)."""
        found = [p for p, seed in self._models(folder, split) if seed == self.seed]
        if len(found) > 1:
            raise ValueError(f"{len(found)} {self.variant} models (inputs {self.inputs}, unit {self.unit}, operator head "
                             f"{self.op_unit}, split {split}, "
                             f"seed {self.seed}) "
                             f"under {folder}: {', '.join(p.name for p in found)}; pass a folder that holds one")
        return found[0] if found else None

    def _load(self, path: Path, steps: StepSet) -> Any:
        """The model at ``path``, checked to be one this row may score on ``steps``: its unit and
        operator head are the row's, its split the one evaluated, its dataset this one (otherwise
        the test steps could be steps it learnt from)."""
        try:
            from teller.rca import load
        except ImportError as e:  # torch / transformers not installed
            raise ValueError(f"the root-cause model needs `pip install 'teller[rca]'` ({e})") from None
        split = steps.extra.get("split")
        m = load(path, device=steps.extra.get("rca_device", "cpu"))
        tr = m.meta.get("training", {})
        if m.cfg.unit != self.unit:
            raise ValueError(f"the model at {path} reads {m.cfg.unit} units, the row {self.name!r} scores {self.unit} units")
        if m.cfg.op_unit != self.op_unit:
            raise ValueError(f"the model at {path} scores operators per {m.cfg.op_unit}, the row {self.name!r} per {self.op_unit}")
        if tr.get("split") != split:
            raise ValueError(f"the model at {path} was trained on the {tr.get('split')!r} split, not {split!r}: "
                             f"train one with `teller rca train {steps.dataset} --split {split}` and pass it")
        if _dataset_name(tr.get("dataset", "")) != _dataset_name(steps.dataset):
            raise ValueError(f"the model at {path} was trained on {tr.get('dataset')!r}, not {steps.dataset!r}")
        return m

    def resolve(self, steps: StepSet) -> tuple[Path, bool]:
        """The model this row reads on ``steps`` (its ``model``, else the one of its recipe, split
        and seed under ``--models``, else the shipped model where it is of the row's recipe) and
        whether it is the shipped one; weights are not read."""
        from teller.rca import DEFAULT_MODEL

        split = steps.extra.get("split")
        path = Path(self.model) if self.model is not None else None
        if path is None and steps.extra.get("rca_models"):
            path = self._find(Path(steps.extra["rca_models"]), split)
        if path is not None:
            return path, False
        # the row of the shipped model's recipe falls back on it (one training: its seed is its own)
        if not self._recipe(_meta(DEFAULT_MODEL / "config.json")):
            where = steps.extra.get("rca_models")
            raise ValueError(f"no {self.variant} model (inputs {self.inputs}, unit {self.unit}, operator head {self.op_unit}, "
                             f"split {split}, seed {self.seed}) " + (f"under {where}" if where else "given: pass `--models DIR`")
                             + f"; train one with `teller rca train {steps.dataset} --variant {self.variant} "
                             f"--inputs {self.inputs} --unit {self.unit} --op-unit {self.op_unit} --split {split}`")
        return DEFAULT_MODEL, True

    def fit(self, steps: StepSet, idx: np.ndarray) -> "RCAModel":
        path, shipped = self.resolve(steps)
        m = self._load(path, steps)
        tr = m.meta.get("training", {})
        if not shipped and int(tr.get("seed", self.seed)) != self.seed:
            raise ValueError(f"the model at {path} was trained with seed {tr.get('seed')}, not {self.seed}")
        self.model_ = m
        self.model_path_ = str(path)
        self.fitted_steps_ = int(tr.get("steps", 0))
        return self

    def _units(self, steps: StepSet, idx: np.ndarray) -> tuple[Any, np.ndarray]:
        """The ``teller rca`` dataset (read once per StepSet) and the unit of each step ``idx``."""
        return step_units(steps, idx, self.model_.cfg.unit)

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        from teller.rca.data import run_workloads
        from teller.rca.train import prepare_units

        m = self.model_
        ds, uidx = self._units(steps, idx)
        # the units of each workload shape apart: the flag expert reads only shapes the model was trained on
        shapes = run_workloads(ds)
        shape = np.asarray([shapes.get(r, "") for r in ds.units.run_id[uidx].tolist()], dtype=object)
        pred: list[dict[str, Any]] = [{}] * len(uidx)
        self.flag_expert_ = {}
        for w in sorted(set(shape.tolist())):
            part = np.flatnonzero(shape == w)
            self.flag_expert_[w or "not recorded"] = bool(m.use_flag_expert(w or None))
            prep, _ = prepare_units(ds, uidx[part], m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
            for k, p in zip(part.tolist(), m.predict(prep, batch_size=self.batch_size, explain=False), strict=True):
                pred[k] = p
        flag = np.asarray([bool(p["abnormal"]) for p in pred], bool)
        return Prediction(
            score=np.asarray([float(p["abnormal_prob"]) for p in pred], float),
            flag=flag,
            fault_type=np.asarray([p.get("fault_type_best") or "" for p in pred], dtype=object),
            operators=[sorted({norm_label(o) for o in p["evidence_operators"]}) if f else []
                       for p, f in zip(pred, flag.tolist(), strict=True)],
        )

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if hasattr(self, "model_path_"):
            d["model"] = self.model_path_
        if getattr(self, "flag_expert_", None):
            d["flag_expert_used"] = self.flag_expert_  # per workload shape of the scored steps
        return d


#: the other model rows: (method, label, variant, inputs, unit, features, kind)
MODEL_ROWS = (
    ("teller_mot_family", "TELLER MoT, family operator head", "mot", "trace+log", "iteration",
     "engine iteration tree (TPE) + log lines; operators scored per family", "teller"),
    ("teller_mot_step", "TELLER MoT on STEP subtrees (unit ablation)", "mot", "trace+log", "step",
     "step tree (TPE) + log lines", "teller"),
    ("teller_single", "TELLER single-stream (root-cause model)", "single", "trace+log", "step",
     "step tree (TPE) + log lines", "teller"),
    ("teller_mot_trace", "TELLER MoT w/o log (trace only; ablation)", "mot", "trace", "step", "step tree (TPE)", "teller"),
    ("teller_mot_log", "TELLER MoT w/o trace (log only; ablation)", "mot", "log", "step", "log lines", "teller"),
    ("teller_prompt", "prompt-style (single-stream on a text summary of the step)", "single", "summary+log", "step",
     "step summary text + log lines", "prompt"),
)
for _name, _label, _variant, _inputs, _unit, _features, _kind in MODEL_ROWS:
    register(_name)(type(f"RCAModel_{_name}", (RCAModel,), {"label": _label, "variant": _variant, "inputs": _inputs,
                                                           "unit": _unit, "features": _features, "kind": _kind,
                                                           "op_unit": "family" if _name.endswith("_family") else "token"}))


@register("teller_mot_family_ensemble")
class RCAEnsembleRow(RCAModel):
    """The family-head MoT as an ensemble (:class:`teller.rca.ensemble.Ensemble`) of every
    training of it under ``--models`` for the split evaluated, whatever their seeds (the row's
    seed draws nothing here); at least two. ``describe`` lists the members and their seeds."""

    label = "TELLER MoT, family operator head, ensemble of its trainings"
    features = "engine iteration tree (TPE) + log lines; operators scored per family; heads averaged over trainings"
    fit_on = "trained beforehand on the split's train steps, one model per seed"
    op_unit = "family"

    def fit(self, steps: StepSet, idx: np.ndarray) -> "RCAEnsembleRow":
        split = steps.extra.get("split")
        where = steps.extra.get("rca_models")
        paths = [p for p, _ in self._models(Path(where), split)] if where else []
        if len(paths) < 2:
            raise ValueError(f"{len(paths)} {self.variant} models (inputs {self.inputs}, unit {self.unit}, operator head "
                             f"{self.op_unit}, split {split}) " + (f"under {where}" if where else "given: pass `--models DIR`")
                             + f"; an ensemble needs two or more: train them with `teller rca train {steps.dataset} --split {split} "
                             f"--op-unit family --unit iteration --seed N`, one seed each")
        members = [self._load(path, steps) for path in paths]
        from teller.rca.ensemble import Ensemble

        self.model_ = Ensemble(members, [p.name for p in paths])
        self.model_path_ = [str(p) for p in paths]
        self.seeds_ = [m.meta.get("training", {}).get("seed") for m in members]
        self.fitted_steps_ = int(members[0].meta.get("training", {}).get("steps", 0))
        return self

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if hasattr(self, "seeds_"):
            d["seeds"] = self.seeds_
            d["abnormal_cut"] = round(self.model_.abnormal_cut, 6)
        return d


@register("teller")
class TellerPipeline(Method):
    """TELLER whole: the numeric stage and the root-cause model side by side on every step.

    The numeric stage (fitted on the normal train steps) flags what departs from normal operation,
    known fault or not; the model (trained on the split's labelled train steps) flags the faults
    it learnt and names their type and evidence. A step is flagged when either flags it; both
    scores are on one scale (the model's abnormal probability and the stage's step
    suspiciousness, each flagging at 0.5), so the step score is the larger. The fault type and
    the operators are the model's where the model flags the step, else, where the stage flags
    it, the stage's (the type its evidence points to, its candidate families). When ``teller evaluate`` has already run
    ``teller_mot`` and ``teller_numeric`` on the same test steps, their predictions are reused."""

    label = "TELLER (numeric stage + MoT root-cause model)"
    #: the row of the numeric stage (its reference rule): ``teller_numeric`` (every normal train
    #: step) or ``teller_numeric_deploy`` (the fault-free runs of the step's deployment)
    stage = "teller_numeric"
    #: the row of the root-cause model whose answers are fused: ``teller_mot`` (token operator
    #: head) or ``teller_mot_family`` (the family head; the ``*_family`` rows)
    mot = "teller_mot"
    rule = "or"
    tau = 0.5  # the floor on the model's probability of the and / screen rules
    kind = "teller"
    needs_instances = True  # its numeric stage
    features = "operator instances (stage) + engine iteration tree (TPE) + log lines (model)"
    fit_on = "stage: normal train steps, warm-up out; model: trained beforehand on the split's train steps"

    def __init__(self, seed: int = 0, model: str | Path | None = None):
        self.seed = seed
        self.model = model

    def fit(self, steps: StepSet, idx: np.ndarray) -> "TellerPipeline":
        self.parts_: dict[str, Method] = {}
        self.fitted_parts_: set[str] = set()
        for name, m in ((self.stage, make(self.stage, self.seed)), (self.mot, REGISTRY[self.mot](seed=self.seed, model=self.model))):
            m.name = name
            if _cached(steps, name, None) is None:  # fitted and scored already by its own row: nothing to fit
                m.fit(steps, idx)
                self.fitted_parts_.add(name)
            self.parts_[name] = m
        return self

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        got = {name: _answers(steps, name, m, name in self.fitted_parts_, idx) for name, m in self.parts_.items()}
        self.answers_ = got  # the parts' own answers on these steps (the episodes' floor reads the model's)
        return fuse(got[self.stage], got[self.mot], self.rule, self.tau)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        m = getattr(self, "parts_", {}).get(self.mot)
        if m is not None and hasattr(m, "model_path_"):
            d["model"] = m.model_path_
        return d


def _cached(steps: StepSet, name: str, idx: np.ndarray | None) -> Prediction | None:
    """The prediction ``teller evaluate`` kept of row ``name`` on the current split (the same test
    steps ``idx``; None: any test steps of the split)."""
    hit = steps.extra.get("predictions", {}).get((steps.extra.get("split"), name))
    if hit is None:
        return None
    te, pred = hit
    if idx is not None and not np.array_equal(te, np.asarray(idx)):
        return None
    return pred


def _answers(steps: StepSet, name: str, part: Method, fitted: bool, idx: np.ndarray) -> Prediction:
    """Row ``name``'s answers on the steps ``idx``: those ``teller evaluate`` kept, else ``part``'s
    own, which it can give only when it was fitted here (``fitted``; not when its row's answers
    were reused at fit time)."""
    got = _cached(steps, name, idx)
    if got is None:
        if not fitted:
            raise ValueError(f"{name} was not fitted here (its row's predictions were reused at fit time) and "
                             "has none for these steps: fit this row again")
        got = part.predict(steps, idx)
    return got


def fuse(num: Prediction, mot: Prediction, rule: str = "or", tau: float = 0.5) -> Prediction:
    """The numeric stage's and the model's predictions of the same steps as one. ``or``
    (:class:`TellerPipeline`): flagged when either flags, score the larger, operators the model's
    where it flags and the stage's otherwise. ``and`` (:class:`TellerConfirm`): flagged when the
    stage flags and the model gives the step at least ``tau`` (0.5: when both flag), score
    ``min(stage, model / tau / 2)``. ``screen`` (:class:`TellerScreened`): flagged when the model
    flags, or as ``and``; score ``max(model, min(stage, model / tau / 2))``. Both scores cross 0.5
    exactly where the step is flagged and rise with either input. ``model``
    (:class:`TellerSustained`): the model's flags and scores alone, its type. Operators, every rule: the
    model's where the model flags the step (its own 0.5), else the stage's (a model row's answers
    carry no evidence under 0.5, where `teller diagnose` asks the model for it); the fault type
    likewise (:func:`fused_types`)."""
    nf, mf = np.asarray(num.flag, bool), np.asarray(mot.flag, bool)
    ns, ms = np.asarray(num.score, float), np.asarray(mot.score, float)
    if rule in ("and", "screen") and not 0.0 < tau <= 0.5:
        raise ValueError(f"{rule} rule: tau {tau} must lie in (0, 0.5] (the model flags at 0.5)")
    if rule == "and":
        flag, score = nf & (ms >= tau), np.minimum(ns, ms / (2.0 * tau))
    elif rule == "screen":
        flag, score = mf | (nf & (ms >= tau)), np.maximum(ms, np.minimum(ns, ms / (2.0 * tau)))
    elif rule == "model":  # the model's answers alone (the stage's lasting departures are added by TellerEpisodes)
        flag, score = mf.copy(), ms.copy()
    else:
        flag, score = nf | mf, np.maximum(ns, ms)
    ops = [list(mo) if m else (list(no) if f else [])
           for f, m, mo, no in zip(flag.tolist(), (mf & flag).tolist(), mot.operators or [[]] * len(flag),
                                   num.operators or [[]] * len(flag), strict=True)]
    return Prediction(score=score, flag=flag, fault_type=mot.fault_type if rule == "model" else fused_types(num, mot),
                      operators=ops)


def fused_types(num: Prediction, mot: Prediction) -> np.ndarray | None:
    """The fault type of each step, from the part whose flag stands: the stage's evidence type
    (:mod:`teller.localize.faulttype`) where the stage flags the step and the model does not (a
    fault the model does not recognise, typed by where its time went), else the model's type given
    abnormal (the model's where neither flags: the model's is the one trained to answer it)."""
    if mot.fault_type is None or num.fault_type is None:
        return mot.fault_type
    nt = np.asarray(num.fault_type, dtype=object)
    stage = np.asarray(num.flag, bool) & ~np.asarray(mot.flag, bool) & (nt != "")
    return np.where(stage, nt, np.asarray(mot.fault_type, dtype=object))


@register("teller_confirm")
class TellerConfirm(TellerPipeline):
    """TELLER with the model screening the numeric stage's flags, the screen of `teller diagnose`:
    the stage flags, the model reads the flagged steps and a step stays abnormal only when the
    model does not rule it out (abnormal probability of at least :data:`teller.rca.SCREEN_FLOOR`;
    below it diagnose shows the step as one the model reads as normal, ``model_says_normal``);
    type and evidence are the model's where it flags the step, else the stage's (:func:`fuse`).
    With the episodes `teller diagnose` keeps past the screen it is :class:`TellerDiagnose`."""

    label = "TELLER, the model screening the stage's flags (the screen of `teller diagnose`)"
    rule = "and"
    tau = SCREEN_FLOOR


@register("teller_screened")
class TellerScreened(TellerPipeline):
    """TELLER with the model screening the stage's flags: a step is flagged when the model flags
    it, or when the stage flags it and the model does not rule it out (abnormal probability of
    at least :attr:`tau`). The stage's flags on steps the model all but excludes are mostly normal
    steps unlike the reference (another model shape, another run's pace), while on a fault the
    model never saw it may give too little (docs/results.md measures both). ``tau``
    (:data:`teller.rca.SCREEN_FLOOR`) was chosen among 0.001, 0.003, 0.01, 0.03 and 0.1 as the best
    mean step F1 of the two views of the shipped model's answers on dataset v2 parts 1-2 (request
    split), before it was applied to the union (``benchmarks/fusion_tau.py``)."""

    label = "TELLER, the model's flags and the stage's it does not rule out (probability >= 0.1)"
    rule = "screen"
    tau = SCREEN_FLOOR


_DEPLOY = ("; the stage fitted on the fault-free runs of the step's deployment (``teller_numeric_deploy``),"
           " as `teller diagnose --reference` takes fault-free recordings")


_DEPLOY_FIT = "stage: normal train steps of the fault-free runs of the step's deployment, warm-up out; model: trained beforehand"
#: the three fused rows on the deployment stage: name, plain row, label
DEPLOY_ROWS = (
    ("teller_deploy", TellerPipeline, "TELLER (stage or model), reference: the deployment's fault-free runs"),
    ("teller_confirm_deploy", TellerConfirm,
     "TELLER as `teller diagnose --reference` (the stage's flags the model keeps), reference: the deployment's fault-free runs"),
    ("teller_screened_deploy", TellerScreened,
     "TELLER, the model's flags and the stage's it does not rule out, reference: the deployment's fault-free runs"),
)
for _name, _plain, _label in DEPLOY_ROWS:
    register(_name)(type(f"{_plain.__name__}Deploy", (_plain,), {"__doc__": f"{_plain.__doc__}{_DEPLOY}", "label": _label,
                                                                 "stage": "teller_numeric_deploy", "fit_on": _DEPLOY_FIT}))


class RowFloor(NamedTuple):
    """The floor a row rules lasting departures out under (:meth:`TellerEpisodes.model_floor`)."""

    value: float
    #: the model's own (``calibration.episode_floor`` of the model the row reads), not the absolute one
    own: bool
    #: where it comes from, in words (the row's describe: ``episode_floor_from``)
    source: str


@register("teller_episodes")
class TellerEpisodes(TellerScreened):
    """TELLER with the deployment's fault-free runs as the stage's reference, the model screening
    the stage's flags, and the stage's sustained departures kept: a step is flagged when the model
    flags it, when the stage flags it and the model gives it at least :attr:`tau`, or when the
    stage flags it as part of an episode of at least :attr:`min_episode` flagged steps of its
    rank (:mod:`teller.localize.episodes`, every step of the test runs scored by the stage,
    warm-up steps left out as `teller diagnose` leaves them out) and
    the stage's reference is of the step's deployment. A fault the model never saw gets little
    probability from it, but it lasts; a deployment without a fault-free recording (the stage's
    fallback reference) gets the screen alone."""

    label = "TELLER, the model's flags, the stage's it does not rule out and its episodes (deployment reference)"
    stage = "teller_numeric_deploy"
    fit_on = _DEPLOY_FIT
    #: stage flags in a row from which the episode is a lasting departure, with the absolute
    #: floor or none (the setting that floor was chosen with)
    min_episode = MIN_EPISODE
    #: the same where the model keeps its own floor (chosen with it on the nested folds)
    own_floor_episode = STAGE_EPISODE
    #: a stage flag in a lasting episode stays only where the model gives the step at least its
    #: floor (0: always; the rows `teller diagnose` reports: the model's own,
    #: :meth:`model_floor`, with episodes of :attr:`own_floor_episode`, else this absolute one,
    #: :data:`teller.rca.EPISODE_FLOOR`, with episodes of :attr:`min_episode`)
    episode_floor = 0.0
    #: where the step is unlike every training step (:mod:`teller.rca.novelty`) in an episode of
    #: :attr:`novel_episode` or more such steps the stage flags, the type its evidence points to
    #: (the rows `teller diagnose` reports)
    novel_types = False
    novel_episode = MIN_EPISODE
    #: in a novel episode, a step whose model type is the type the evidence cannot rule out
    #: (:attr:`teller.localize.faulttype.TypeCall.alternative`) keeps the model's type (measured)
    keep_model_alternative = False
    #: a lasting departure stays only where the step's novelty is above this (None: always; the
    #: rows `teller diagnose` reports: :data:`teller.rca.LASTING_NOVELTY`)
    lasting_novelty: float | None = None

    def fit(self, steps: StepSet, idx: np.ndarray) -> "TellerEpisodes":
        super().fit(steps, idx)
        if self.stage not in self.fitted_parts_:  # its answers were reused: the episodes need every step of the test runs
            self.parts_[self.stage].fit(steps, idx)
            self.fitted_parts_.add(self.stage)
        if self.novel_types or self.lasting_novelty is not None:
            self.novelty_ = self._novelty(steps)
        return self

    def _trace_tok(self) -> Any:
        """The model row's trace tokenizer, else the shipped model's (the units are serialized
        for their statistics, which count every node whatever the tokenizer)."""
        part = getattr(self.parts_.get(self.mot), "part_", self.parts_.get(self.mot))
        tok = getattr(getattr(part, "model_", None), "trace_tok", None)
        if tok is None:
            from teller.rca import DEFAULT_MODEL
            from teller.tpe.tokenizer import TraceTokenizer

            tok = TraceTokenizer.load(Path(DEFAULT_MODEL) / "trace_tokenizer")
        return tok

    def _novelty(self, steps: StepSet) -> Any:
        """The novelty of a model trained on the split evaluated, over the split's training units
        (:func:`teller.rca.novelty.split_novelty`: what `teller rca novelty` keeps with such a
        model; it reads no weights, so a row whose answers were reused gets the same). Fitted once
        per split and view: the rows that read it share it (``steps.extra``)."""
        from teller.rca.novelty import split_novelty

        split = steps.extra.get("split")
        if not split:
            raise ValueError("the novelty needs the split evaluated (steps.extra['split'])")
        cache = steps.extra.setdefault("rca_novelty", {})
        if split not in cache:
            ds, _ = step_units(steps, np.zeros(0, np.int64))
            cache[split] = split_novelty(ds, split, self._trace_tok(), views=[steps.view])
        return cache[split]

    def step_novelty(self, steps: StepSet, every: np.ndarray) -> np.ndarray:
        """Per step ``every``, its novelty against the split's training units (:meth:`_novelty`)."""
        from teller.rca.context import dataset_context_features

        ds, uidx = step_units(steps, every)
        return self.novelty_.ratio(dataset_context_features(ds, uidx, self._trace_tok()), [steps.view] * len(every))

    def novel_episodes(self, steps: StepSet, every: np.ndarray, whole: Prediction, ratio: np.ndarray) -> np.ndarray:
        """Per step ``every`` (every step of the test runs; ``ratio``: their novelty): whether it
        lies in an episode of :attr:`novel_episode` or more steps the stage flags with an evidence
        type and the model's training steps are all far from (novelty above 1; warm-up steps out)."""
        from teller.baselines.numeric import step_lanes, warm_steps
        from teller.localize.episodes import episode_lengths

        typed = np.asarray(whole.fault_type if whole.fault_type is not None else [""] * len(every), dtype=object) != ""
        mask = (ratio > 1.0) & np.asarray(whole.flag, bool) & typed & ~warm_steps(steps)[every]
        _, length = episode_lengths(step_lanes(steps)[every], steps.step_num[every], mask)
        self.novel_steps_ = int(mask.sum())
        return length >= self.novel_episode

    def model_floor(self, steps: StepSet) -> "RowFloor":
        """The floor under which the model rules out a lasting departure on ``steps``' view,
        whether it is the model's own, and where it comes from: the model's own
        (:func:`teller.rca.own_episode_floor`, its config.json, weights not read: its answers may
        be reused) where the row's model is one trained on the split evaluated, else
        :attr:`episode_floor`."""
        from teller.rca import own_episode_floor

        part = self.parts_.get(self.mot)
        if isinstance(part, RCASustained):  # a row read over time: the model row under it (made here when its answers were reused)
            part = getattr(part, "part_", None) or REGISTRY[part.base](seed=self.seed, model=self.model)
        if not isinstance(part, RCAModel) or isinstance(part, RCAEnsembleRow):
            return RowFloor(self.episode_floor, False, "absolute (no single model)")
        try:
            path, _ = part.resolve(steps)
        except ValueError:
            return RowFloor(self.episode_floor, False, "absolute (no model found)")
        meta = _meta(Path(path) / "config.json")
        tr = meta.get("training") or {}
        if tr.get("split") != steps.extra.get("split") or _dataset_name(tr.get("dataset", "")) != _dataset_name(steps.dataset):
            return RowFloor(self.episode_floor, False, f"absolute (the model at {path} is not of this split and dataset)")
        own = own_episode_floor(meta, steps.view)
        if own is None:
            return RowFloor(self.episode_floor, False, f"absolute (the model at {path} keeps none: `teller rca floor`)")
        return RowFloor(own, True, f"the model's ({path})")

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        from teller.baselines.numeric import deployments, step_lanes, warm_steps
        from teller.localize.episodes import episode_lengths

        idx = np.asarray(idx)
        base = super().predict(steps, idx)
        st = self.parts_[self.stage]
        every = np.flatnonzero(np.isin(steps.run_code, np.unique(steps.run_code[idx])))
        whole = st.shared_predict(steps, every)  # the same for every episodes row on these steps
        # warm-up steps (left out of references) are no part of an episode, as in `teller diagnose`
        _, length = episode_lengths(step_lanes(steps)[every], steps.step_num[every], whole.flag & ~warm_steps(steps)[every])
        pos = np.searchsorted(every, idx)
        own = np.isin(deployments(steps)[idx], np.asarray(list(st.models_), np.int64))
        sflag, sscore = whole.flag[pos], whole.score[pos]
        self.episode_used_ = self.min_episode
        if self.episode_floor > 0:
            floor = self.model_floor(steps)
            self.floor_, self.floor_from_ = floor.value, floor.source
            if floor.own:  # the model's floor and the length chosen with it
                self.episode_used_ = self.own_floor_episode
        keep = sflag & ~base.flag & (length[pos] >= self.episode_used_) & own
        if self.episode_floor > 0:  # the model rules the step out: not even a lasting departure stays
            low = keep & (np.asarray(self.answers_[self.mot].score, float) < self.floor_)
            self.ruled_out_by_floor_ = int(low.sum())
            keep &= ~low
        ratio = self.step_novelty(steps, every) if hasattr(self, "novelty_") else None
        self.stage_whole_, self.step_novelty_ = whole, ratio  # per step of the test runs (`every`), for instrumented rows
        if self.lasting_novelty is not None and ratio is not None:  # near the training steps: a kind the model knows
            near = keep & (ratio[pos] <= self.lasting_novelty)  # an unknown (NaN) novelty gates nothing
            self.near_training_ = int(near.sum())
            keep &= ~near
        sops = whole.operators or [[]] * len(every)
        ops = [list(sops[p]) if k else o for k, p, o in zip(keep.tolist(), pos.tolist(), base.operators, strict=True)]
        self.kept_by_episode_ = int(keep.sum())
        ft = base.fault_type
        if ft is not None and whole.fault_type is not None:  # a kept step: the type the stage's evidence points to
            sft = np.asarray(whole.fault_type, dtype=object)[pos]
            ft = np.where(keep & (sft != ""), sft, np.asarray(ft, dtype=object))
            if self.novel_types:  # unlike every training step, lasting: the evidence's type
                novel = self.novel_episodes(steps, every, whole, ratio)[pos]
                alt = None if whole.alternative is None or not self.keep_model_alternative else \
                    np.asarray(whole.alternative, dtype=object)[pos]
                ft, self.retyped_novel_, kept = novel_retype(ft, novel, sft, alt)
                if alt is not None:
                    self.kept_model_alternative_ = kept
        return Prediction(score=np.where(keep, np.maximum(base.score, sscore), base.score), flag=base.flag | keep,
                          fault_type=ft, operators=ops)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["min_episode"] = self.min_episode
        d["own_floor_episode"] = self.own_floor_episode
        if hasattr(self, "episode_used_"):
            d["episode_used"] = self.episode_used_
        d["episode_floor"] = self.episode_floor  # the absolute one, where the model keeps none
        if hasattr(self, "floor_"):  # the floor the last prediction applied, and where it came from
            d["episode_floor_used"] = self.floor_
            d["episode_floor_from"] = self.floor_from_
        d["novel_types"] = self.novel_types
        d["novel_episode"] = self.novel_episode
        d["lasting_novelty"] = self.lasting_novelty
        d["keep_model_alternative"] = self.keep_model_alternative
        for k in ("kept_by_episode", "ruled_out_by_floor", "near_training", "novel_steps", "retyped_novel",
                  "kept_model_alternative"):
            if hasattr(self, k + "_"):
                d[k] = getattr(self, k + "_")
        if hasattr(self, "novelty_"):
            d["novelty"] = self.novelty_.describe()
        return d


@register("teller_diagnose")
class TellerDiagnose(TellerEpisodes):
    """TELLER as `teller diagnose --reference` reports, with the deployment's fault-free runs as
    the stage's reference: the stage flags; the model reads the flagged steps (no other); a step
    stays abnormal when the model does not rule it out (``teller_confirm_deploy``) or, ruled out,
    when it lies in an episode of at least :attr:`min_episode` flagged steps of its rank and the
    reference is of its deployment (diagnose's ``unknown_fault``, typed by the stage's evidence).
    Unlike :class:`TellerEpisodes` a step the stage does not flag is never flagged: the model
    does not read it."""

    label = "TELLER as `teller diagnose --reference` reports (the stage's flags the model keeps, and those in episodes of 5+)"
    rule = "and"
    episode_floor = EPISODE_FLOOR
    novel_types = True
    lasting_novelty = LASTING_NOVELTY


#: the fused rows on the family-head model's answers (``teller_mot_family``): name, row
FAMILY_ROWS = (("teller_confirm_deploy_family", "teller_confirm_deploy"),
               ("teller_screened_deploy_family", "teller_screened_deploy"),
               ("teller_episodes_family", "teller_episodes"),
               ("teller_diagnose_family", "teller_diagnose"))
for _name, _row in FAMILY_ROWS:
    _cls = REGISTRY[_row]
    register(_name)(type(f"{_cls.__name__}Family", (_cls,), {"mot": "teller_mot_family",
                                                             "label": f"{_cls.label}; the MoT with the family operator head"}))


def novel_retype(types: np.ndarray, novel: np.ndarray, evidence: np.ndarray,
                 alternative: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """The types of steps in novel episodes (``novel``) replaced by their evidence's type
    (``evidence``; "" none: the step keeps its type); with ``alternative`` (per step, the type
    the evidence cannot rule out, "" none), a step whose type is that alternative keeps it: the
    evidence cannot tell the two apart and the model chose one of them. Returns the types, how
    many steps changed type and how many kept theirs by the alternative."""
    types = np.asarray(types, dtype=object)
    evidence = np.asarray(evidence, dtype=object)
    novel = np.asarray(novel, bool) & (evidence != "")
    kept = np.zeros(len(types), bool)
    if alternative is not None:
        alternative = np.asarray(alternative, dtype=object)
        kept = novel & (alternative != "") & (alternative == types)
        novel &= ~kept
    return np.where(novel, evidence, types), int((novel & (evidence != types)).sum()), int(kept.sum())


def sustained(steps: StepSet, idx: np.ndarray, pred: Prediction, floor: float = SUSTAIN_FLOOR,
              min_flagged: int = MIN_EPISODE) -> tuple[Prediction, dict[str, int]]:
    """A model's answers on the steps ``idx`` read over time (one lane per run and rank;
    :func:`teller.localize.episodes.over_time`, as `teller diagnose` reads them): a step the model
    gives at least ``floor`` joins an episode of ``min_flagged`` or more of its flags, with the
    families at least half of that episode's flagged steps name; every step of an episode takes
    the fault type most of its steps are given (ties: the larger summed probability). Steps
    outside episodes keep their answers. Returns the prediction and how many steps joined and
    changed type."""
    from teller.baselines.numeric import step_lanes
    from teller.localize.episodes import over_time

    idx = np.asarray(idx)
    r = over_time(step_lanes(steps)[idx], steps.step_num[idx], pred.flag, pred.score, pred.fault_type,
                  pred.operators, floor, min_flagged)
    return (Prediction(score=np.asarray(pred.score, float), flag=r["flag"], fault_type=r["types"], operators=r["operators"]),
            {"joined": int(r["joined"].sum()), "retyped": r["retyped"]})


class RCASustained(Method):
    """A root-cause model row read over time, as a fault lasts: its answers on the test steps, then
    :func:`sustained` (hysteresis on its episodes, the episode's type). The model's own row's
    answers are reused when ``teller evaluate`` has them for the same test steps."""

    kind = "teller"
    #: the model row whose answers are read over time
    base = "teller_mot_family"
    floor = SUSTAIN_FLOOR
    min_flagged = MIN_EPISODE

    def __init__(self, seed: int = 0, model: str | Path | None = None):
        self.seed = seed
        self.model = model

    def fit(self, steps: StepSet, idx: np.ndarray) -> "RCASustained":
        m = REGISTRY[self.base](seed=self.seed, model=self.model)
        m.name = self.base
        self.fitted_ = _cached(steps, self.base, None) is None  # else its row's answers are reused
        if self.fitted_:
            m.fit(steps, idx)
        self.part_ = m
        return self

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        got = _answers(steps, self.base, self.part_, self.fitted_, idx)
        pred, self.counts_ = sustained(steps, idx, got, self.floor, self.min_flagged)
        return pred

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"base": self.base, "floor": self.floor, "min_flagged": self.min_flagged})
        if hasattr(getattr(self, "part_", None), "model_path_"):
            d["model"] = self.part_.model_path_
        d.update(getattr(self, "counts_", {}))
        return d


#: the model rows read over time: name, model row
SUSTAINED_ROWS = (("teller_mot_family_sustained", "teller_mot_family"),
                  ("teller_mot_family_ensemble_sustained", "teller_mot_family_ensemble"))
for _name, _row in SUSTAINED_ROWS:
    _cls = REGISTRY[_row]
    register(_name)(type(f"RCASustained_{_name}", (RCASustained,), {
        "base": _row, "label": f"{_cls.label}; read over time (a step at even odds next to 5+ flags joins them; the episode's type)",
        "features": _cls.features, "fit_on": _cls.fit_on}))


@register("teller_sustained_family")
class TellerSustained(TellerEpisodes):
    """TELLER read over time: the family-head model's answers read over time
    (``teller_mot_family_sustained``: its flags, the steps at even odds next to an episode of 5+
    of them, each episode's majority type) and, where the model flags nothing, the deployment
    stage's lasting departures (a stage flag in an episode of :attr:`min_episode` or more flagged
    steps of its rank, against a reference of the step's deployment; typed by the stage's
    evidence). The stage's other flags are dropped: a step the stage flags alone, outside a
    lasting episode, is mostly a normal step unlike the reference (docs/results.md, "Episodes")."""

    label = "TELLER, the model read over time and the stage's lasting departures it does not flag (deployment reference)"
    mot = "teller_mot_family_sustained"
    rule = "model"
    episode_floor = EPISODE_FLOOR
    novel_types = True
    lasting_novelty = LASTING_NOVELTY


register("teller_sustained_family_alt")(type("TellerSustainedAlternative", (TellerSustained,), {
    "keep_model_alternative": True,
    "label": f"{TellerSustained.label}; in a novel episode the model's type where the evidence cannot rule it out"}))

register("teller_sustained_ensemble")(type("TellerSustainedEnsemble", (TellerSustained,), {
    "mot": "teller_mot_family_ensemble_sustained",
    "label": f"{TellerSustained.label}; the model: the ensemble of the recipe's trainings"}))

register("teller_sustained_self")(type("TellerSustainedSelf", (TellerSustained,), {
    "__doc__": f"{TellerSustained.__doc__}\n\n    The stage reads each run against its own steps (``teller_numeric_self``): what `teller diagnose RUN` reports given no reference.",
    "stage": "teller_numeric_self",
    "fit_on": "stage: the test run's own steps, labels unread, warm-up out (teller_numeric_self); model: trained beforehand",
    "label": "TELLER, the model read over time and the stage's lasting departures against the run's own steps (no reference recording)"}))
