"""The TELLER numeric stage (the GMM localizer of :mod:`teller.localize`) as an evaluation method,
and the instances of a labelled dataset as ``teller diagnose`` builds them from a run.

Per run, the dataset's subtree rows become instances as ``teller diagnose`` builds them
(:func:`keyed_instances`: ``teller.forest.Forest`` → steps, one per STEP node holding every row
with its ``step_idx``, i.e. the engine iteration's schedule/update ranges and GAP rows beside the
STEP subtree → FE/BE/COMM, OTHER and STEP instances and their features), with each step's
context from the dataset (:func:`teller.localize.context.dataset_context`): the iteration columns and batch of
``iterations.parquet``, the admission delay from ``logs.parquet`` and the records, the warm-up
flag; pageable copies where the subtrees keep CUPTI memory kinds. A dataset without
``iterations.parquet`` (built before engine iterations) leaves those columns NaN and takes the
batch from the STEP names' ``reqs=`` lists and the warm-up rule from
:func:`teller.forest.warmup_steps`. ``GMMLocalizer()`` with its defaults is fitted on the
instances of the **normal** train steps (a one-class reference of normal operation), warm-up
steps left out as ``teller diagnose`` leaves them out (``keep_warmup=True`` keeps them). A test
step is flagged when its step score reaches the stage's threshold, and its operator set is
what `teller diagnose` names (its ``operators``, :mod:`teller.localize.naming`): the family its
evidence's type was decided by (:func:`teller.localize.faulttype.step_fault_types`: a collective
run more often than the reference ever ran it, a family the reference never saw, the family
whose feature departs), then its candidate families, a framework op (``BE``) among them lifted
to the modules (``FE``) that enclose the step's suspects of it (:func:`lift_to_modules`; one that
no module encloses stays: the labels name modules, collectives, the engine's ranges and the
step, never an op inside a module), at most :data:`teller.localize.naming.MAX_OPERATORS`. In the horizontal view a step is flagged when one of its rank
steps is, its score is the largest of theirs and its operators are the union of theirs. The
stage has no fault-type head of its own: its type is the one its evidence points to (that of a
horizontal step's most suspicious rank). ``benchmarks/eval_localize_h200.py`` builds its instances with the
same two functions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.baselines.base import Method, Prediction, register
from teller.baselines.steps import StepSet
from teller.forest import Forest, step_blocks, warmup_steps, with_iterations
from teller.localize import GMMLocalizer, Localization, localize
from teller.localize.context import dataset_context, keys_of
from teller.localize.faulttype import TypeCall, step_fault_types
from teller.localize.features import (
    FEATURES,
    SCORED_LAYERS,
    Instances,
    instance_features,
    pageable_of,
)
from teller.localize.naming import MAX_OPERATORS, named_operators, ranked_families
from teller.rundir import LAYER_CODE, dict_codes, str_array


def enclosing_modules(inst: Instances) -> np.ndarray:
    """Per instance: the index of the nearest ``FE`` instance among itself and its ancestors
    (``inst.parent``), -1 where none encloses it."""
    fe_fam = np.asarray([str(f).split(" ", 1)[0] == "FE" for f in inst.families], bool)
    is_fe = fe_fam[inst.family] if inst.n else np.zeros(0, bool)
    out = np.where(is_fe, np.arange(inst.n), -1)
    cur = np.asarray(inst.parent, np.int64).copy()
    todo = (out < 0) & (cur >= 0)
    while todo.any():  # one pass per level of nesting (a handful)
        hit = todo & is_fe[np.maximum(cur, 0)]
        out[hit] = cur[hit]
        cur = np.where(todo & ~hit, inst.parent[np.maximum(cur, 0)], -1)
        todo = (out < 0) & (cur >= 0)
    return out


def lift_to_modules(families: list[str], suspects: np.ndarray, inst: Instances, module: np.ndarray,
                    limit: int | None = None) -> list[str]:
    """``families`` (a flagged step's operator families) with every framework op (``BE``) among
    them replaced by the families of the modules enclosing the step's ``suspects`` of it
    (``module``: :func:`enclosing_modules`); a ``BE`` family none of whose suspects a module
    encloses stays. Order kept, duplicates out, at most ``limit``
    (:func:`teller.localize.naming.named_operators`)."""
    names = np.asarray(inst.families, dtype=object)
    sus = np.asarray(suspects, np.int64).tolist()
    pairs = [(str(names[inst.family[k]]), str(names[inst.family[module[k]]]) if module[k] >= 0 else None) for k in sus]
    return named_operators(families, pairs, limit)


def _step_context(fa: Forest, step_node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Requests served (from the STEP name's ``reqs=`` list) and warm-up flag of each step of a
    dataset forest (``step_node``: the steps' STEP node ids, ascending)."""
    import pyarrow.compute as pc

    rows = fa.rows_of(step_node)
    names = np.asarray(fa.names, dtype=object)[fa.name_codes[rows]].astype(str)
    t = pa.table({"name": names, "pid": fa.pid[rows], "start_ns": fa.start[rows]})
    warm = warmup_steps(t)
    reqs = pc.extract_regex(pa.array(names), r"reqs=(?P<r>\S*)").field("r") if len(names) else pa.array([], pa.string())
    lists = pc.split_pattern(reqs.fill_null(""), ",")
    n = np.asarray(pc.list_value_length(lists).to_numpy(zero_copy_only=False), np.float64)
    empty = np.asarray(pc.equal(reqs.fill_null(""), "").to_numpy(zero_copy_only=False), bool)
    return np.where(empty, np.nan, n), warm


def _iteration_blocks(fa: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Steps of a dataset forest as ``teller diagnose`` sees them: one per STEP node, holding every
    row with the STEP row's ``step_idx`` (the engine iteration: schedule/update ranges and GAP rows
    beside the STEP subtree); forests without ``step_idx`` fall back to ``step_blocks``. Returns
    the step index of every row (-1: in no step) and the STEP node id of each step, ascending."""
    step_of_row, ids = step_blocks(fa)
    if "step_idx" not in fa.table.column_names or not len(ids):
        return step_of_row, ids
    sidx = fa.table.column("step_idx").to_numpy(zero_copy_only=False).astype(np.int64)
    srow = np.flatnonzero(fa.layer == LAYER_CODE["STEP"])
    srow = srow[np.argsort(fa.node_id[srow], kind="stable")]
    key = sidx[srow]
    if (key < 0).any() or len(np.unique(key)) != len(key):
        return step_of_row, ids  # no usable step_idx: the STEP subtrees alone
    o = np.argsort(key)
    pos = np.clip(np.searchsorted(key[o], sidx), 0, len(key) - 1)
    hit = (sidx >= 0) & (key[o][pos] == sidx)
    return np.where(hit, o[pos], step_of_row).astype(np.int64), ids


def _steps_digest(idx: np.ndarray) -> tuple[int, str]:
    """A key for the steps ``idx`` in the stage's caches (:meth:`TellerNumeric._fit_on`,
    :meth:`TellerNumeric.shared_predict`): their count and a digest of them."""
    ids = np.ascontiguousarray(idx, np.int64)
    return len(ids), hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def run_rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table.take(rows)`` for ascending ``rows`` (one run's, in DFS order): taken from the slice
    they span, so that a table of many chunks is not gathered whole for every run."""
    if not len(rows):
        return table.slice(0, 0)
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if (np.diff(rows) <= 0).any():  # not ascending: the plain take
        return table.take(pa.array(rows))
    return table.slice(lo, hi - lo).take(pa.array(rows - lo))


def keyed_instances(subtrees: pa.Table, runs: np.ndarray, keys: np.ndarray, context: dict[str, Any] | None,
                    layers: tuple[str, ...] = SCORED_LAYERS) -> tuple[Instances, dict[str, Any]]:
    """Instances of the steps ``keys`` (sorted ``run_code << 40 | step_id`` of the sorted run
    names ``runs``) from the dataset's subtree rows, run by run; ``step`` indexes ``keys`` (-1:
    a row outside them). ``context`` (:func:`teller.localize.context.dataset_context`, or None) gives each step its
    iteration columns and batch; without it, or where a step has no iteration row, the batch is
    the STEP name's request list. Also returns counts and the warm-up flag of every key by the
    STEP-name rule (``name_warmup``)."""
    rcodes, rdict = dict_codes(subtrees, "run_id")
    order = np.argsort(rcodes, kind="stable")  # a run's rows keep their DFS order
    bounds = np.searchsorted(rcodes[order], np.arange(len(rdict) + 1))
    sid_all = subtrees.column("step_id").to_numpy()
    sidx_all = subtrees.column("step_idx").to_numpy() if "step_idx" in subtrees.column_names else None
    is_step = np.asarray(pc.equal(subtrees.column("layer").cast(pa.string()), "STEP").to_numpy(zero_copy_only=False), bool)
    keep_cols = [c for c in subtrees.column_names if c not in ("run_id", "args")]
    parts: list[Instances] = []
    name_warm = np.zeros(len(keys), bool)
    info = {"runs": 0, "runs_with_memory_kinds": 0, "step_nodes_without_keys": 0}
    for r, name in enumerate(rdict):  # runs: tens
        g = int(np.searchsorted(runs, name))
        if g >= len(runs) or runs[g] != name:
            continue
        rows = order[bounds[r]:bounds[r + 1]]
        ukeys = keys[(keys >> 40) == g] & ((1 << 40) - 1)
        keep = np.isin(sid_all[rows], ukeys)
        if sidx_all is not None:  # the iteration's rows outside its STEP (schedule, update, GAP): by step_idx
            keep = with_iterations(keep, is_step[rows], sid_all[rows], sidx_all[rows])
        rows = rows[keep]
        if not len(rows):
            continue
        part = run_rows(subtrees, rows)
        args = part.column("args") if "args" in part.column_names else None
        fa = Forest.from_table(part.select(keep_cols))
        del part
        step_of_row, step_node = _iteration_blocks(fa)
        k = np.int64(g) << 40 | step_node
        pos = np.clip(np.searchsorted(keys, k), 0, len(keys) - 1)
        hit = keys[pos] == k
        unit = np.where(hit, pos, -1)
        info["step_nodes_without_keys"] += int((~hit).sum())
        name_batch, warm = _step_context(fa, step_node)
        name_warm[unit[warm & hit]] = True
        gs = np.maximum(unit, 0)
        batch, it = name_batch, None
        if context is not None:
            has = hit & context["has"][gs]
            batch = np.where(has, context["batch"][gs], name_batch)
            it = np.where(hit[:, None], context["iter"][gs], np.nan)
        pg = pageable_of(fa, args) if args is not None else None
        info["runs"] += 1
        info["runs_with_memory_kinds"] += pg is not None
        inst = instance_features(fa, step_of_row, layers, step_batch=batch, step_iter=it, pageable=pg)
        step = np.where(inst.step >= 0, unit[np.maximum(inst.step, 0)], -1)
        parts.append(Instances(inst.rows, inst.family, inst.families, step, inst.X, inst.parent, inst.layers, inst.batch))
        del fa
    families = sorted({f for p in parts for f in p.families})
    fidx = {f: i for i, f in enumerate(families)}
    off = np.cumsum([0] + [p.n for p in parts])
    inst = Instances(
        rows=np.concatenate([p.rows for p in parts]) if parts else np.zeros(0, np.int64),
        family=np.concatenate([np.array([fidx[f] for f in p.families], np.int32)[p.family] if p.n else np.zeros(0, np.int32)
                               for p in parts]) if parts else np.zeros(0, np.int32),
        families=families,
        step=np.concatenate([p.step for p in parts]) if parts else np.zeros(0, np.int64),
        X=np.concatenate([p.X for p in parts]) if parts else np.zeros((0, len(FEATURES))),
        parent=np.concatenate([np.where(p.parent >= 0, p.parent + o, -1) for p, o in zip(parts, off[:-1], strict=True)])
        if parts else np.zeros(0, np.int64),
        layers=tuple(layers),
        batch=np.concatenate([p.batch for p in parts]) if parts else np.zeros(0))
    info["name_warmup"] = name_warm
    return inst, info


def unit_instances(steps: StepSet, subtrees: pa.Table) -> Instances:
    """Operator instances of every unit (rank step) of ``steps`` (:func:`keyed_instances`, with
    the context of the dataset at ``steps.dataset``); ``step`` is the unit index (-1: outside
    the kept steps). Sets ``steps.extra["unit_warmup"]``: the iterations' warm-up column where a
    unit has a row, else the STEP-name rule."""
    ctx = dataset_context(steps.dataset, steps.runs, steps.unit_key) if steps.dataset else None
    inst, info = keyed_instances(subtrees, steps.runs, steps.unit_key, ctx)
    warm = info["name_warmup"]
    if ctx is not None:
        warm = np.where(ctx["has"], ctx["warmup"], warm)
    steps.extra["unit_warmup"] = warm
    return inst


def shared_unit_instances(steps: StepSet, subtrees: pa.Table, shared: dict[str, Any] | None) -> Instances:
    """:func:`unit_instances` of ``steps``, built once for the views of one evaluation: where an
    earlier view's units (kept in ``shared``) hold every unit of ``steps`` (the horizontal view's
    rank steps are vertical ones), its instances of those units are taken (:func:`units_taken`);
    else they are built and kept for the next view. ``shared`` None, or ``shared["last"]`` (the
    last view): nothing is kept, and what was is let go."""
    last = shared is None or bool(shared.get("last"))
    got = None if shared is None else shared.pop("unit_instances", None) if last else shared.get("unit_instances")
    if got is not None and got[0] == steps.dataset:
        taken = units_taken(got[1], got[2], got[3], got[4], steps)
        if taken is not None:
            steps.extra["unit_warmup"] = taken[1]
            return taken[0]
    del got
    inst = unit_instances(steps, subtrees)
    if not last:
        shared["unit_instances"] = (steps.dataset, inst, np.asarray(steps.runs), steps.unit_key.copy(),
                                    np.asarray(steps.extra["unit_warmup"], bool).copy())
    return inst


def units_taken(inst: Instances, runs: np.ndarray, keys: np.ndarray, warm: np.ndarray,
                steps: StepSet) -> tuple[Instances, np.ndarray] | None:
    """The instances of the units of ``steps`` taken from ``inst``, the instances of the units
    ``keys`` (sorted ``run_code << 40 | step_id`` of the sorted run names ``runs``; ``warm``: their
    warm-up flags) of the same dataset, with ``step`` indexing ``steps``' units; and those units'
    warm-up flags. None where a unit of ``steps`` is not among ``keys``. A unit's instances are
    those :func:`unit_instances` builds for it whatever other steps are read (its STEP subtree and
    iteration rows, its context by its key); the rows outside every unit of ``steps`` are left out
    (every reader of the instances skips them) and the families are those of the rows kept, in
    name order (codes into a shorter list of the same names)."""
    mine = steps.unit_key
    if not len(mine):
        return None
    low = (1 << 40) - 1
    pos = keys_of(np.asarray(runs), np.asarray(steps.runs)[mine >> 40], mine & low, keys)
    if (pos < 0).any():
        return None
    to = np.full(len(keys) + 1, -1, np.int64)
    to[pos] = np.arange(len(mine))
    step = np.where(inst.step >= 0, to[np.where(inst.step >= 0, inst.step, len(keys))], -1)
    sel = np.flatnonzero(step >= 0)
    sub = inst.subset(sel)
    present = np.flatnonzero(np.bincount(sub.family.astype(np.int64), minlength=len(inst.families)))
    code = np.full(len(inst.families), -1, np.int32)
    code[present] = np.arange(len(present), dtype=np.int32)
    return (Instances(sub.rows, code[sub.family], [inst.families[i] for i in present.tolist()], step[sel], sub.X,
                      sub.parent, sub.layers, sub.batch), np.asarray(warm, bool)[pos])


def _unit_mask(steps: StepSet, idx: np.ndarray) -> np.ndarray:
    m = np.zeros(len(steps.unit_key) + 1, bool)
    lens = np.diff(steps.unit_ptr)[idx]
    starts = steps.unit_ptr[idx]
    for a, n in zip(starts.tolist(), lens.tolist(), strict=True):  # steps (vectorizable, but cheap)
        m[steps.unit_idx[a:a + n]] = True
    return m


def warm_steps(steps: StepSet) -> np.ndarray:
    """Per step: whether any of its units is a warm-up step (``steps.extra["unit_warmup"]``)."""
    warm = steps.extra.get("unit_warmup")
    wu = np.zeros(len(steps.unit_key), bool)
    if warm is not None:
        wu[:len(warm)] = np.asarray(warm, bool)[:len(wu)]
    if not steps.n:
        return np.zeros(0, bool)
    return np.add.reduceat(wu[steps.unit_idx].astype(np.int64), steps.unit_ptr[:-1]) > 0


def fault_free_steps(steps: StepSet) -> np.ndarray:
    """Per step: whether its run is fault-free (none of its steps in a fault window or abnormal)."""
    faulty = np.zeros(len(steps.runs), bool)
    np.logical_or.at(faulty, steps.run_code, steps.in_window | steps.is_anomaly)
    return ~faulty[steps.run_code]


@dataclass
class StageReading:
    """What the stage read on some steps' units: the fitted stage (``model``), the units'
    ``instances``, its ``localization`` of them, the type each flagged unit's evidence points to
    (``calls``, :func:`teller.localize.faulttype.step_fault_types`) and whether that type could
    read the collectives' counts (``own``: the reference is of the steps' deployment)."""

    model: GMMLocalizer
    instances: Instances
    localization: Localization
    calls: dict[int, TypeCall]
    own: bool


@register("teller_numeric")
class TellerNumeric(Method):
    label = "TELLER numeric stage"
    kind = "teller"
    features = "operator, OTHER and STEP instances, batch-normalised"
    fit_on = "normal train steps, warm-up out"
    needs_instances = True

    #: which normal train steps the stage is fitted on: ``normal`` (every normal train step, fault
    #: runs' steps outside their windows too) or ``fault_free`` (those of the runs without any
    #: fault window, as `teller diagnose --reference` reads fault-free recordings; every normal
    #: train step when the train part holds none). docs/results.md compares the two.
    reference = "normal"

    #: the most operators a flagged unit names (None: every candidate and the evidence's family)
    max_operators: int | None = MAX_OPERATORS
    #: whether the answers are a function of the fitted stage(s) alone (:meth:`shared_predict`)
    answers_from_fit = True

    def __init__(self, seed: int = 0, keep_warmup: bool = False, **params):
        self.seed = seed
        self.keep_warmup = keep_warmup
        self.params = params

    def _inst(self, steps: StepSet) -> Instances:
        inst = steps.extra.get("instances")
        if inst is None:
            raise ValueError("steps.extra['instances'] is empty: compute it with teller.baselines.numeric.unit_instances")
        return inst

    def fit(self, steps: StepSet, idx: np.ndarray) -> "TellerNumeric":
        idx = np.asarray(idx)
        idx = idx[~steps.is_anomaly[idx]]
        self.reference_ = "normal"
        if self.reference == "fault_free":
            ff = idx[fault_free_steps(steps)[idx]]
            if len(ff):
                idx, self.reference_ = ff, "fault_free"
        self.model_ = self._fit_on(steps, idx)
        self.fitted_steps_ = int(len(idx))
        return self

    def _fit_on(self, steps: StepSet, idx: np.ndarray) -> GMMLocalizer:
        """The stage fitted on the instances of the steps ``idx`` (warm-up out unless kept); one
        fit per instances, settings and steps, kept in ``steps.extra`` for the other rows that fit
        the same stage (the pipeline rows fit their own; the fit reads nothing else and draws from
        its own fixed seed, so the fits would be equal)."""
        inst = self._inst(steps)
        key = (id(inst), self.keep_warmup, repr(sorted(self.params.items())), *_steps_digest(idx))
        cache = steps.extra.setdefault("stage_fits", {})
        got = cache.get(key)
        if got is None or got[0] is not inst:  # (the instances kept: an id is reused only once they are gone)
            got = cache[key] = (inst, self._fit_stage(steps, inst, idx))
        return got[1]

    def _fit_stage(self, steps: StepSet, inst: Instances, idx: np.ndarray) -> GMMLocalizer:
        um = _unit_mask(steps, idx)
        warm = steps.extra.get("unit_warmup")
        if not self.keep_warmup and warm is not None:
            um[:len(warm)] &= ~warm
        rows = um[inst.step] & (inst.step >= 0)
        if not rows.any():
            raise ValueError("TELLER numeric stage: the normal train steps hold no operator instances")
        return GMMLocalizer(**self.params).fit(inst.X[rows], families=inst.family[rows], family_names=inst.families,
                                               groups=inst.step[rows], batch=None if inst.batch is None else inst.batch[rows])

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        return self._predict_with(self.model_, steps, np.asarray(idx))

    def shared_predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        """:meth:`predict`, kept in ``steps.extra`` for the rows that read the same fitted stage
        (:meth:`_fit_on`'s) over the same steps: the episodes of `teller_diagnose*` and
        `teller_sustained*` read every step of the test runs. Each caller gets its own copy. A
        stage whose answers are not a function of its fitted models alone (its own steps as
        reference, fitted while it predicts) is not kept."""
        idx = np.asarray(idx)
        if not self.answers_from_fit:
            return self.predict(steps, idx)
        inst = self._inst(steps)
        fitted = [getattr(self, "model_", None), *(v for _, v in sorted(getattr(self, "models_", {}).items()))]
        key = (type(self).__name__, self.max_operators, id(inst), tuple(sorted(getattr(self, "models_", {}))),
               tuple(id(m) for m in fitted), *_steps_digest(idx))
        cache = steps.extra.setdefault("stage_answers", {})
        got = cache.get(key)
        if got is None or got[0] is not inst or any(a is not b for a, b in zip(got[1], fitted, strict=True)):
            got = cache[key] = (inst, fitted, self.predict(steps, idx))
        p = got[2]
        return Prediction(score=p.score.copy(), flag=p.flag.copy(), operators=[list(o) for o in p.operators],
                          fault_type=p.fault_type.copy(), alternative=None if p.alternative is None else p.alternative.copy())

    def _read_with(self, model: GMMLocalizer, steps: StepSet, idx: np.ndarray, counts: bool = False) -> StageReading:
        """The stage ``model`` reading the units of the steps ``idx``: their instances, the
        localization and the type each flagged unit's evidence points to; ``counts``: the model's
        reference is of these steps' deployment, so the evidence's type may read the collectives'
        counts per step (:func:`teller.localize.faulttype.step_fault_types`; a reference mixing
        deployments may not)."""
        inst = self._inst(steps)
        um = _unit_mask(steps, idx)
        sub = inst.subset(np.flatnonzero(um[inst.step] & (inst.step >= 0)))
        loc = localize(model, sub)
        return StageReading(model, sub, loc, step_fault_types(model, sub, loc, counts=counts), counts)

    def _predict_with(self, model: GMMLocalizer, steps: StepSet, idx: np.ndarray, counts: bool = False) -> Prediction:
        """The stage's answers on the steps ``idx`` (:meth:`_read_with`, :meth:`_answers`)."""
        return self._answers(steps, idx, self._read_with(model, steps, idx, counts=counts))

    def _answers(self, steps: StepSet, idx: np.ndarray, reading: StageReading) -> Prediction:
        """The answers on the steps ``idx`` of the stage's ``reading`` of their units: a step is
        flagged where one of its units is, its score is theirs at most, its operators the named
        ones of its flagged units, its type that of its most suspicious unit."""
        sub, loc, calls = reading.instances, reading.localization, reading.calls
        nu = len(steps.unit_key)
        uflag = np.zeros(nu, bool)
        uflag[loc.steps.steps[loc.steps.flag]] = True
        uscore = np.full(nu, -np.inf)
        uscore[loc.steps.steps] = loc.steps.score
        module = enclosing_modules(sub)
        uops: dict[int, set[str]] = {}
        for s, res in loc.flagged.items():  # flagged units: the family the evidence's type was decided by
            fams = ranked_families(res.candidates, calls.get(s))  # (diagnose's verdict names it first), then candidates
            uops[int(s)] = set(lift_to_modules(fams, res.suspects, sub, module, self.max_operators))
        n = len(idx)
        flag = np.zeros(n, bool)
        score = np.full(n, -np.inf)
        ops: list[list[str]] = []
        ftype = np.full(n, "", dtype=object)
        falt = np.full(n, "", dtype=object)
        for i, s in enumerate(idx.tolist()):  # test steps
            units = steps.unit_idx[steps.unit_ptr[s]:steps.unit_ptr[s + 1]]
            flag[i] = bool(uflag[units].any())
            score[i] = float(uscore[units].max()) if len(units) else -np.inf
            ops.append(sorted(set().union(*(uops.get(int(u), set()) for u in units.tolist()))) if flag[i] else [])
            if len(units):  # the type of the step's most suspicious unit (a horizontal step: its ranks')
                c = calls.get(int(units[np.argmax(uscore[units])]))
                if c is not None:
                    ftype[i], falt[i] = c.fault_type or "", c.alternative or ""
        finite = np.isfinite(score)
        score[~finite] = (score[finite].min() - 1.0) if finite.any() else 0.0
        return Prediction(score=score, flag=flag, operators=ops, fault_type=ftype, alternative=falt)


@register("teller_numeric_ff")
class TellerNumericFaultFree(TellerNumeric):
    """The numeric stage fitted on the normal train steps of the fault-free runs only (the
    reference ablation of ``teller_numeric``)."""

    label = "TELLER numeric stage, fault-free runs as reference (ablation)"
    fit_on = "normal train steps of the fault-free runs, warm-up out"
    reference = "fault_free"


def deployments(steps: StepSet) -> np.ndarray:
    """Per step: its run's deployment code (one code per workload shape and number of ranks, read
    from the dataset's records; kept in ``steps.extra``)."""
    got = steps.extra.get("deployment")
    if got is not None and len(got) == steps.n:
        return got
    path = Path(steps.dataset) / "records.parquet"
    have = set(pq.ParquetFile(path).schema_arrow.names)
    t = pq.read_table(path, columns=[c for c in ("run_id", "workload", "rank") if c in have])
    if "workload" not in have:  # a dataset built before workload shapes were recorded: one shape
        t = t.append_column("workload", pa.array([""] * t.num_rows, pa.string()))
    g = t.group_by(["run_id", "workload"]).aggregate([("rank", "count_distinct")])
    names = str_array(g.column("run_id"))
    shape = [f"{w} / {n} rank(s)" for w, n in zip(str_array(g.column("workload")).tolist(),
                                                     g.column("rank_count_distinct").to_pylist(), strict=True)]
    if len(set(names.tolist())) != len(names):
        raise ValueError(f"{steps.dataset}: a run has records of two workloads; rebuild the dataset")
    labels, code = np.unique(np.asarray(shape, dtype=object).astype(str), return_inverse=True)
    by_run = dict(zip(names.tolist(), code.reshape(-1).tolist(), strict=True))
    run_code = np.asarray([by_run.get(r, -1) for r in np.asarray(steps.runs).tolist()], np.int64)
    out = run_code[steps.run_code]
    steps.extra["deployment"] = out
    steps.extra["deployment_names"] = labels.tolist()
    return out


@register("teller_numeric_deploy")
class TellerNumericDeployment(TellerNumeric):
    """The numeric stage as `teller diagnose --reference` is meant to be used: fitted on fault-free
    recordings of the deployment being diagnosed. One stage per deployment (workload shape and
    number of ranks, :func:`deployments`), fitted on the normal train steps of the fault-free runs
    of that deployment; a test step of a deployment without fault-free train steps (a model shape
    never recorded, as under the workload split) is scored by the stage fitted on every normal
    train step (``teller_numeric``)."""

    label = "TELLER numeric stage, fault-free runs of the same deployment as reference"
    fit_on = "normal train steps of the fault-free runs of the step's deployment (shape and ranks), warm-up out; else every normal train step"
    reference = "deployment"

    def fit(self, steps: StepSet, idx: np.ndarray) -> "TellerNumericDeployment":
        idx = np.asarray(idx)
        idx = idx[~steps.is_anomaly[idx]]
        dep = deployments(steps)
        ff = idx[fault_free_steps(steps)[idx]]
        self.models_: dict[int, GMMLocalizer] = {}
        self.fitted_: dict[str, int] = {}
        names = steps.extra["deployment_names"]
        for d in np.unique(dep[ff]).tolist():
            mine = ff[dep[ff] == d]
            self.models_[int(d)] = self._fit_on(steps, mine)
            self.fitted_[names[d]] = int(len(mine))
        self.model_ = self._fit_on(steps, idx)  # for deployments without a fault-free recording
        self.fitted_steps_ = int(len(idx))
        return self

    def readings(self, steps: StepSet, idx: np.ndarray) -> list[tuple[np.ndarray, StageReading]]:
        """Per deployment of the steps ``idx``: the positions in ``idx`` of its steps and the stage's
        reading of them (:meth:`_read_with`) by its own reference (``reading.own``), else by the one
        fitted on every normal train step."""
        idx = np.asarray(idx)
        dep = deployments(steps)[idx]
        out = []
        for d in np.unique(dep).tolist():
            at = np.flatnonzero(dep == d)
            own = int(d) in self.models_  # a reference of this deployment (else every normal train step)
            out.append((at, self._read_with(self.models_[int(d)] if own else self.model_, steps, idx[at], counts=own)))
        return out

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        idx = np.asarray(idx)
        return _gather(len(idx), [(at, self._answers(steps, idx[at], r)) for at, r in self.readings(steps, idx)])

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if hasattr(self, "fitted_"):
            d["reference_steps"] = dict(self.fitted_)
        return d


def _gather(n: int, parts: list[tuple[np.ndarray, Prediction]]) -> Prediction:
    """One prediction of ``n`` steps from predictions of parts of them (``at``: their positions)."""
    flag, score = np.zeros(n, bool), np.zeros(n)
    ops: list[list[str]] = [[] for _ in range(n)]
    ftype = np.full(n, "", dtype=object)
    alt = np.full(n, "", dtype=object)
    for at, p in parts:
        flag[at], score[at], ftype[at] = p.flag, p.score, p.fault_type
        if p.alternative is not None:
            alt[at] = p.alternative
        for i, o in zip(at.tolist(), p.operators or [[]] * len(at), strict=True):
            ops[i] = o
    return Prediction(score=score, flag=flag, operators=ops, fault_type=ftype, alternative=alt)


@register("teller_numeric_self")
class TellerNumericSelf(TellerNumeric):
    """The numeric stage as `teller diagnose RUN` reads a run given no reference
    (:func:`teller.localize.fit_self_reference`): each test run's steps (every step of the run the
    dataset holds, labels unread; warm-up out) read against the stage fitted on the steps
    :func:`teller.localize.own_reference_steps` picks: the half of the run the other departs from
    more, or the whole run when a half would hold fewer than
    :data:`teller.localize.SELF_REFERENCE_HALF_STEPS`, less the steps a fit on it flags. The
    dataset keeps a sample of each run's normal steps (``dataset build --max-normal``), so a run's
    faults weigh more in its own reference here than in the recording."""

    label = "TELLER numeric stage, the run's own steps as reference (no reference recording)"
    fit_on = "the test run's own steps, labels unread, warm-up out: the half the other departs from more, less what a fit on it flags"
    reference = "own_steps"
    #: the run's steps cut in this many spans of consecutive steps, each read against the others
    #: (1: every step against the run's reference; measured, not what diagnose does)
    blocks = 1
    #: the reference: the half of the run the other departs from more (diagnose's rule), else the
    #: whole run (measured)
    halves = True
    #: steps each half needs (None: :data:`teller.localize.SELF_REFERENCE_HALF_STEPS`, as diagnose)
    half_steps: int | None = None
    answers_from_fit = False  # each run's stage is fitted as it is read

    def fit(self, steps: StepSet, idx: np.ndarray) -> "TellerNumericSelf":
        # every run is read against itself: a reference of its own deployment (the episodes' rows read models_)
        self.models_ = {int(d): None for d in np.unique(deployments(steps)).tolist()}
        self.runs_: dict[Any, GMMLocalizer] = {}  # per run (or run and span): its stage
        self.left_out_: dict[str, dict[str, Any]] = {}  # per run: what own_reference_steps decided
        return self

    def _run_model(self, steps: StepSet, run: int, part: np.ndarray | None = None, block: int = 0) -> Any:
        """The stage of run ``run`` (or of its steps ``part``, span ``block`` of :attr:`blocks`):
        fitted on the steps :func:`teller.localize.own_reference_steps` picks, as diagnose does."""
        from teller.localize import fit_once, own_reference_steps

        key = run if part is None else (run, block)
        if key not in self.runs_:
            every = np.flatnonzero(steps.run_code == run) if part is None else part
            usable = np.ones(len(every), bool) if self.keep_warmup else ~warm_steps(steps)[every]
            fit = fit_once(lambda mask: self._fit_on(steps, every[mask]))

            def fit_flags(mask: np.ndarray) -> np.ndarray:
                return self._predict_with(fit(mask), steps, every, counts=True).flag

            ref, info = own_reference_steps(steps.step_num[every], usable, fit_flags, halves=self.halves,
                                            **({} if self.half_steps is None else {"half_steps": self.half_steps}))
            name = str(steps.runs[run])
            self.left_out_[name if part is None else f"{name} (span {block + 1} of {self.blocks} left out)"] = info
            self.runs_[key] = fit(ref)
        return self.runs_[key]

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        idx = np.asarray(idx)
        rc = steps.run_code[idx]
        parts = []
        for r in np.unique(rc).tolist():
            at = np.flatnonzero(rc == r)
            if self.blocks <= 1:
                parts.append((at, self._predict_with(self._run_model(steps, int(r)), steps, idx[at], counts=True)))
                continue
            every = np.flatnonzero(steps.run_code == r)
            every = every[np.argsort(steps.step_num[every], kind="stable")]
            span = np.array_split(every, self.blocks)
            block_of = np.zeros(steps.n, np.int64)
            for b, sp in enumerate(span):
                block_of[sp] = b
            for b in range(len(span)):
                mine = at[block_of[idx[at]] == b]
                if len(mine):
                    others = np.sort(np.concatenate([x for k, x in enumerate(span) if k != b]))
                    model = self._run_model(steps, int(r), others, b)
                    parts.append((mine, self._predict_with(model, steps, idx[mine], counts=True)))
        return _gather(len(idx), parts)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if getattr(self, "left_out_", None):
            v = list(self.left_out_.values())
            d["own_steps"] = {"runs": len(v), "steps": sum(x["steps"] for x in v), "left_out": sum(x["left_out"] for x in v),
                              "reference_steps": sum(x["reference_steps"] for x in v),
                              "reference_half": {h: sum(1 for x in v if x.get("spans", {}).get("reference") == h) for h in ("first", "second")}}
        return d


def step_lanes(steps: StepSet) -> np.ndarray:
    """Per step: its lane for episodes (:mod:`teller.localize.episodes`): one code per run and rank
    in the vertical view, per run in the horizontal one."""
    rank = steps.rank if steps.view == "vertical" and steps.rank is not None else np.zeros(steps.n, np.int64)
    return steps.run_code.astype(np.int64) * 1024 + np.clip(rank, 0, 1023)


for _k in (2, 4):
    register(f"teller_numeric_self_b{_k}")(type(f"TellerNumericSelfB{_k}", (TellerNumericSelf,), {
        "blocks": _k, "halves": False, "label": f"{TellerNumericSelf.label}; {_k} spans of the run, each against the others (measured)"}))
register("teller_numeric_self_whole")(type("TellerNumericSelfWhole", (TellerNumericSelf,), {
    "halves": False, "label": f"{TellerNumericSelf.label}; the whole run, without what a fit on it flags (measured)"}))
