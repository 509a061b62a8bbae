"""The TELLER numeric stage (the GMM localizer of :mod:`teller.localize`) as an evaluation method.

Per run, the dataset's subtree rows become instances as ``teller diagnose`` builds them
(``teller.forest.Forest`` → steps by STEP ranges → FE/BE/COMM, OTHER and STEP instances and their
features, each with its step's request count for the batch normalisation); ``GMMLocalizer()``
with its defaults is fitted on the instances of the **normal** train steps (a one-class
reference of normal operation), warm-up steps left out as ``teller diagnose`` leaves them out
(:func:`teller.forest.warmup_steps` on the dataset's STEP nodes; ``keep_warmup=True`` keeps
them). The dataset stores no ``iterations.parquet`` and no memory kinds, so those columns are
NaN. A test step is flagged when its step score reaches the stage's threshold, and its
operator set is its candidate families (at most 5). In the horizontal view a step is flagged
when one of its rank steps is, its score is the largest of theirs and its operators are the
union of theirs. The stage has no fault-type head.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from teller.baselines.base import Method, Prediction, register
from teller.baselines.steps import StepSet
from teller.forest import Forest, step_blocks, warmup_steps
from teller.localize import GMMLocalizer, localize
from teller.localize.features import (
    FEATURES,
    SCORED_LAYERS,
    Instances,
    instance_features,
)
from teller.rundir import dict_codes


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


def unit_instances(steps: StepSet, subtrees: pa.Table) -> Instances:
    """Operator instances of every unit (rank step) of ``steps``; ``step`` is the unit index
    (-1: outside the kept steps)."""
    rcodes, rdict = dict_codes(subtrees, "run_id")
    order = np.argsort(rcodes, kind="stable")  # a run's rows keep their DFS order
    bounds = np.searchsorted(rcodes[order], np.arange(len(rdict) + 1))
    sid_all = subtrees.column("step_id").to_numpy()
    keep_cols = [c for c in subtrees.column_names if c not in ("run_id", "args")]
    parts: list[Instances] = []
    warm_parts: list[np.ndarray] = []
    for r, name in enumerate(rdict):  # runs: tens
        g = int(np.searchsorted(steps.runs, name))
        if g >= len(steps.runs) or steps.runs[g] != name:
            continue
        rows = order[bounds[r]:bounds[r + 1]]
        ukeys = steps.unit_key[(steps.unit_key >> 40) == g] & ((1 << 40) - 1)
        rows = rows[np.isin(sid_all[rows], ukeys)]
        if not len(rows):
            continue
        fa = Forest.from_table(subtrees.take(pa.array(rows)).select(keep_cols))
        step_of_row, step_node = step_blocks(fa)
        batch, warm = _step_context(fa, step_node)
        inst = instance_features(fa, step_of_row, SCORED_LAYERS, step_batch=batch)
        k = np.int64(g) << 40 | step_node
        pos = np.clip(np.searchsorted(steps.unit_key, k), 0, len(steps.unit_key) - 1)
        unit = np.where(steps.unit_key[pos] == k, pos, -1)
        step = np.where(inst.step >= 0, unit[np.maximum(inst.step, 0)], -1)
        parts.append(Instances(inst.rows, inst.family, inst.families, step, inst.X, inst.parent, inst.layers, inst.batch))
        warm_parts.append(unit[warm & (unit >= 0)])
        del fa
    families = sorted({f for p in parts for f in p.families})
    fidx = {f: i for i, f in enumerate(families)}
    off = np.cumsum([0] + [p.n for p in parts])
    unit_warm = np.zeros(len(steps.unit_key), bool)
    for w in warm_parts:
        unit_warm[w] = True
    steps.extra["unit_warmup"] = unit_warm
    return Instances(
        rows=np.concatenate([p.rows for p in parts]) if parts else np.zeros(0, np.int64),
        family=np.concatenate([np.array([fidx[f] for f in p.families], np.int32)[p.family] if p.n else np.zeros(0, np.int32)
                               for p in parts]) if parts else np.zeros(0, np.int32),
        families=families,
        step=np.concatenate([p.step for p in parts]) if parts else np.zeros(0, np.int64),
        X=np.concatenate([p.X for p in parts]) if parts else np.zeros((0, len(FEATURES))),
        parent=np.concatenate([np.where(p.parent >= 0, p.parent + o, -1) for p, o in zip(parts, off[:-1], strict=True)])
        if parts else np.zeros(0, np.int64),
        layers=SCORED_LAYERS,
        batch=np.concatenate([p.batch for p in parts]) if parts else np.zeros(0))


def _unit_mask(steps: StepSet, idx: np.ndarray) -> np.ndarray:
    m = np.zeros(len(steps.unit_key) + 1, bool)
    lens = np.diff(steps.unit_ptr)[idx]
    starts = steps.unit_ptr[idx]
    for a, n in zip(starts.tolist(), lens.tolist(), strict=True):  # steps (vectorizable, but cheap)
        m[steps.unit_idx[a:a + n]] = True
    return m


@register("teller_numeric")
class TellerNumeric(Method):
    label = "TELLER numeric stage"
    kind = "teller"
    features = "operator, OTHER and STEP instances, batch-normalised"
    fit_on = "normal train steps, warm-up out"

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
        inst = self._inst(steps)
        idx = np.asarray(idx)
        idx = idx[~steps.is_anomaly[idx]]
        um = _unit_mask(steps, idx)
        warm = steps.extra.get("unit_warmup")
        if not self.keep_warmup and warm is not None:
            um[:len(warm)] &= ~warm
        rows = um[inst.step] & (inst.step >= 0)
        if not rows.any():
            raise ValueError("TELLER numeric stage: the normal train steps hold no operator instances")
        self.model_ = GMMLocalizer(**self.params).fit(inst.X[rows], families=inst.family_of()[rows], groups=inst.step[rows],
                                                      batch=None if inst.batch is None else inst.batch[rows])
        self.fitted_steps_ = int(len(idx))
        return self

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        inst = self._inst(steps)
        idx = np.asarray(idx)
        um = _unit_mask(steps, idx)
        sel = np.flatnonzero(um[inst.step] & (inst.step >= 0))
        loc = localize(self.model_, inst.subset(sel))
        nu = len(steps.unit_key)
        uflag = np.zeros(nu, bool)
        uflag[loc.steps.steps[loc.steps.flag]] = True
        uscore = np.full(nu, -np.inf)
        uscore[loc.steps.steps] = loc.steps.score
        uops: dict[int, set[str]] = {}
        for s, res in loc.flagged.items():  # flagged units
            uops[int(s)] = {c["family"] for c in res.candidates}
        n = len(idx)
        flag = np.zeros(n, bool)
        score = np.full(n, -np.inf)
        ops: list[list[str]] = []
        for i, s in enumerate(idx.tolist()):  # test steps
            units = steps.unit_idx[steps.unit_ptr[s]:steps.unit_ptr[s + 1]]
            flag[i] = bool(uflag[units].any())
            score[i] = float(uscore[units].max()) if len(units) else -np.inf
            ops.append(sorted(set().union(*(uops.get(int(u), set()) for u in units.tolist()))) if flag[i] else [])
        finite = np.isfinite(score)
        score[~finite] = (score[finite].min() - 1.0) if finite.any() else 0.0
        return Prediction(score=score, flag=flag, operators=ops)
