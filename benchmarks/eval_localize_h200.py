"""The numeric stage (GMM localizer, teller/localize/) on the labelled H200 dataset, from the dataset alone.

    python benchmarks/eval_localize_h200.py                      # data/h200_v2 → benchmarks/results/localize_h200_v2.json
    python benchmarks/eval_localize_h200.py --ds data/h200_v1 --out benchmarks/results/localize_h200.json
    python benchmarks/eval_localize_h200.py --ds DS --out FILE [--campaign TOML] [--keep-warmup] [--no-variants]

Vertical view only: one step = one rank's step, i.e. one ``(run_id, step_id)`` of
``records.parquet``; its request rows are collapsed (the labels are per step). The forest rows of
every kept step come from the dataset's subtrees (``read_subtrees``); per run they are turned into the localizer's
instances as ``teller diagnose`` does on a run directory: ``Forest`` → steps (the STEP nodes; a row
belongs to the step whose STEP row has its ``step_idx``, so the schedule/update ranges and GAP rows
of the engine iteration count with it) → ``instance_features`` over :data:`SCORED_LAYERS` (FE/BE/COMM,
OTHER and STEP), with each step's batch (requests served, for the batch normalisation), its
iteration columns (``iterations.parquet`` rows of the dataset, joined on ``(run_id, step_id)``;
NaN where the dataset has none, as in ``data/h200_v1``) and the pageable-copy flag where the
subtrees keep CUPTI memory kinds. All runs are then concatenated (instance parents and steps renumbered).

The estimator models normal operation (a one-class reference, docs/design.md §6): it is fitted on the
NORMAL steps (``is_anomaly`` false) of the train side only, with its default hyper-parameters,
nothing tuned. Protocols (train side → scored steps):

- ``split_request``: the splits are drawn per (run, request) and a step holds many requests, so a
  step's requests usually fall in several splits. A step takes the split of one representative
  record, picked by a hash of the step's key (``teller.dataset.splits.step_representatives``, the
  rule of ``teller evaluate`` and the root-cause models): about 80/10/10 of the steps, with no
  batch-size bias.
- ``split_request_any_test`` (a variant, the rule before): a step is *test* when any of its
  requests is in test, *train* when it holds a train request and no test request; the reference
  is left with small batches (a big batch almost always holds a test request).
- ``split_run``: whole runs; a step's records share one split.
- ``fault_free_reference``: the fault-free runs (``normal-*``) → every step of the other runs.
- ``fault_free_same_deployment``: as the next, with the served model too (the dataset's
  ``workload`` column): each run against the fault-free runs of the same parallelism and model
  (in v2: ``normal-a,b`` for the 2-layer one-process runs, ``normal-c,d`` for the 4-layer ones,
  ``normal-tp-a,b`` and ``normal-tp-c,d`` for the tensor-parallel ones).
- ``fault_free_same_parallelism``: as ``teller diagnose RUN --reference REF`` is meant to be used,
  each run against the fault-free runs of its own deployment shape: the one-process runs against
  the one-process fault-free runs, the tensor-parallel runs against the tensor-parallel ones (the
  ranks a run's steps carry); one fit per shape.
- ``split_workload``: the dataset's ``split_workload`` column (two or more model shapes, as
  ``data/h200_v2``: repetitions a/b 2 decoder layers, c 4), by the representative rule; for a
  dataset built before that column, from the campaign spec: fitted on the runs of the shallowest
  model, every step of the other runs scored. Skipped when neither gives two shapes.
- ``split_request_first_record`` (a variant): a step takes the split of its first record.

The reference is the normal train steps without warm-up steps, as ``teller diagnose`` leaves them
out (``iterations.parquet``'s ``warmup`` column where the dataset has one, else the labeller's rule;
``--keep-warmup`` keeps them). Reference variants (``reference_variants`` in the JSON;
``--no-variants`` skips them): with warm-up steps, outside fault windows, fault-free runs only.
``fault_free_held_out_runs`` (also skipped by ``--no-variants``): each fault-free run scored against a
fit on the other fault-free runs of its deployment shape, under the default step rule and the rule
before it (:data:`HELD_OUT_RULES`): the normal steps flagged where no fault and no label is involved.

Normal steps flagged (``false_positives``) are counted in buckets: in a window without the
effect, outside every window, warm-up, and outside every window with a lockstep partner in one
(the same step number of the run on another rank: a fault on one rank of a tensor-parallel run
holds the others up in its collectives, and the labels mark the faulty rank's steps only).

Predictions per step: flagged or not (the step score reaches ``step_threshold``) and, when
flagged, its candidate families (at most 5), as ``teller.evaluate.metrics.evaluate`` reads a
diagnosis. Labels: ``is_anomaly`` and ``operator_labels``. Both sides name families with
``teller.forest.family_names`` (``LAYER name`` with key=value words removed and numbers
replaced by ``#``): the labeller builds its locator from it, and the script re-applies it to the
labels (a no-op, checked) so that the two sides cannot drift. Metrics: docs/design.md §11 through
``step_metrics`` and ``operator_metrics`` of :mod:`teller.evaluate.metrics`; ``operator_lifted``
also compares, as a reading aid, the suspects with each BE op replaced by its enclosing FE module
(the labels name modules).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.baselines.numeric import keyed_instances
from teller.dataset.codec import read_subtrees
from teller.evaluate.metrics import operator_metrics, step_metrics
from teller.evaluate.scores import auroc
from teller.forest import family_names
from teller.localize import GMMLocalizer, localize
from teller.localize.context import dataset_context
from teller.localize.features import (
    INSTANCE_LAYERS,
    ITER_FEATURES,
    SCORED_LAYERS,
    Instances,
)

ROOT = Path(__file__).resolve().parent.parent
CATEGORIES = ("communication", "kernel", "memory", "runtime", "scheduling")
INSTANCE_PREFIXES = tuple(f"{x} " for x in INSTANCE_LAYERS)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _str(col: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(col.cast(pa.string()).to_numpy(zero_copy_only=False), dtype=object)


def norm_label(label: str) -> str:
    """A label family renamed with family_names (``STEP`` has no name and stays as it is)."""
    layer, _, name = label.partition(" ")
    return family_names(layer, [name])[0] if name else label


# ------------------------------------------------------------------------------------------------
# steps and their labels


def load_steps(ds: Path) -> dict[str, Any]:
    """One entry per vertical (run_id, step_id): labels and split membership."""
    cols = ["record_id", "run_id", "request_id", "step_id", "step_ids", "step_num", "rank", "view", "is_anomaly", "in_window",
            "fault_type", "mechanism", "operator_labels", "split_request", "split_run", "split_mechanism"]
    have = pq.read_schema(ds / "records.parquet").names
    splits = [c for c in ("split_request", "split_run", "split_mechanism", "split_workload") if c in have]
    t = pq.read_table(ds / "records.parquet", columns=cols + [c for c in splits if c not in cols]
                      + (["workload"] if "workload" in have else []))
    t = t.filter(pc.equal(t.column("view"), "vertical")).sort_by("record_id")
    run = _str(t.column("run_id"))
    runs, run_code = np.unique(run.astype(str), return_inverse=True)
    sid = t.column("step_id").to_numpy().astype(np.int64)
    key = run_code.astype(np.int64) << 40 | sid
    ukey, first, inv = np.unique(key, return_index=True, return_inverse=True)
    n = len(ukey)
    ab = t.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    if (np.bincount(inv, weights=ab, minlength=n) % np.bincount(inv, minlength=n)).any():
        raise SystemExit("is_anomaly differs between the request rows of one step")
    # the representative record of each step (teller evaluate's and the models' rule)
    from teller.dataset.splits import representatives_of

    rep_of = representatives_of(t, inv, n)
    split = {}
    for s in splits:
        x = _str(t.column(s)).astype(str)
        split[s] = {name: np.bincount(inv, weights=(x == name), minlength=n) > 0 for name in ("train", "val", "test")}
        split[s]["first"] = x[first]  # the split of the step's first record
        split[s]["rep"] = x[rep_of]  # the split of the step's representative record
    labels_raw = t.column("operator_labels").take(pa.array(first)).to_pylist()
    labels = [sorted({norm_label(x) for x in (lab or [])}) for lab in labels_raw]
    changed = sum(sorted(set(lab or [])) != lb for lab, lb in zip(labels_raw, labels, strict=True))
    is_ab = ab[first]
    steps = {
        "runs": runs, "run_code": (ukey >> 40).astype(np.int64), "step_id": ukey & ((1 << 40) - 1),
        "step_num": t.column("step_num").to_numpy()[first], "rank": t.column("rank").to_numpy()[first],
        "is_anomaly": is_ab, "in_window": t.column("in_window").to_numpy(zero_copy_only=False)[first].astype(bool),
        "fault_type": _str(t.column("fault_type"))[first].astype(str),
        "mechanism": _str(t.column("mechanism"))[first].astype(str),
        "labels": [lb if a else [] for lb, a in zip(labels, is_ab, strict=True)], "split": split,
        "labels_renamed": int(changed), "records": int(t.num_rows), "requests": np.bincount(inv, minlength=n),
        "workload": (_str(t.column("workload"))[first].astype(str) if "workload" in t.column_names
                     else np.full(n, "", object).astype(str)),
    }
    # a step outside every window whose lockstep partner (same run and step number, another rank)
    # is inside one: a fault on one rank of a tensor-parallel run holds the other ranks up in the
    # next collective, though the labels mark the faulty rank's steps only
    pkey = steps["run_code"] * (1 << 32) + steps["step_num"].astype(np.int64)
    win_keys = np.unique(pkey[steps["in_window"]])
    steps["partner_in_window"] = ~steps["in_window"] & np.isin(pkey, win_keys)
    # warm-up as the labeller sees it (teller.inject.labels.warmup_steps): steps serving warm-up
    # requests only, and a process's first two steps (step numbers start at 0 on every rank)
    warm_req = np.char.startswith(_str(t.column("request_id")).astype(str), "warmup_")
    only_warm = np.bincount(inv, weights=warm_req, minlength=n) == np.bincount(inv, minlength=n)
    steps["warmup"] = only_warm | (steps["step_num"] < 2)
    steps["warmup_rule"] = "labeller (warm-up requests only, first two steps)"
    steps["iter"] = np.full((n, len(ITER_FEATURES)), np.nan)
    steps["batch"] = np.full(n, np.nan)
    steps["iterations"] = 0
    ctx = dataset_context(ds, runs, ukey)  # teller evaluate's teller_numeric reads the same context
    if ctx is not None:
        steps["iter"], steps["batch"] = ctx["iter"], ctx["batch"]
        steps["warmup"] = np.where(ctx["has"], ctx["warmup"], steps["warmup"])
        steps["iterations"] = int(ctx["has"].sum())
        steps["context"] = ctx
        steps["warmup_rule"] = "iterations.parquet warmup column (the labeller's rule where a step has no row)"
    return steps


# ------------------------------------------------------------------------------------------------
# instances of every step, from the dataset's subtrees


def load_instances(ds: Path, steps: dict[str, Any], layers: tuple[str, ...] = SCORED_LAYERS) -> tuple[Instances, dict[str, Any]]:
    """Instances of all kept steps (:func:`teller.baselines.numeric.keyed_instances`, the code of
    ``teller evaluate``'s ``teller_numeric``); ``step`` indexes ``steps`` (-1: outside a kept step)."""
    t0 = time.perf_counter()
    sub = read_subtrees(ds)
    t_read = time.perf_counter() - t0
    keys = steps["run_code"] << 40 | steps["step_id"]
    ctx = steps.get("context")
    if ctx is None:  # no iterations.parquet: the batch from the request rows, as before iterations
        n = len(keys)
        ctx = {"iter": steps["iter"], "batch": steps["requests"].astype(np.float64), "warmup": steps["warmup"],
               "has": np.ones(n, bool)}
    inst, kinfo = keyed_instances(sub, steps["runs"], keys, ctx, layers)
    covered = np.zeros(len(keys), bool)
    covered[inst.step[inst.step >= 0]] = True
    fams = np.asarray(inst.families, dtype=str)
    info = {"forest_rows": int(sub.num_rows), "instances": int(inst.n), "instances_outside_kept_steps": int((inst.step < 0).sum()),
            "families": len(inst.families), "layers": list(layers),
            "step_rules": ["STEP ranges (rows by step_idx)" if "step_idx" in sub.column_names else "STEP ranges"],
            "runs_with_memory_kinds": kinfo["runs_with_memory_kinds"], "steps_with_iterations": int(steps["iterations"]),
            "instances_per_layer": {x: int((np.char.startswith(fams, f"{x} ") | (fams == x))[inst.family].sum()) for x in layers},
            "step_nodes_without_records": kinfo["step_nodes_without_keys"],
            "steps_without_instances": int((~covered).sum()), "read_s": round(t_read, 2),
            "features_s": round(time.perf_counter() - t0 - t_read, 2)}
    return inst, info


# ------------------------------------------------------------------------------------------------
# evaluation


def lifted_families(inst: Instances) -> np.ndarray:
    """Per instance, the family the labels would use for it: a BE op is named by its nearest
    enclosing FE module (``BE aten::sum`` inside ``FE LlamaAttention`` → ``FE LlamaAttention``);
    FE and COMM instances, and BE ops outside every module, keep their own family."""
    fams = np.asarray(inst.families, dtype=object)
    is_fe = np.char.startswith(fams.astype(str), "FE ")[inst.family]
    is_be = np.char.startswith(fams.astype(str), "BE ")[inst.family]
    owner = np.full(inst.n, -1, np.int64)
    cur = np.where(is_be, inst.parent, -1)
    while (cur >= 0).any():  # instance depth: a handful of turns
        c = np.maximum(cur, 0)
        hit = (cur >= 0) & is_fe[c]
        owner[hit] = cur[hit]
        cur = np.where((cur >= 0) & ~hit, inst.parent[c], -1)
    return fams[inst.family[np.where(owner >= 0, owner, np.arange(inst.n))]]


def _ops_metrics(truth: list[list[str]], pred: list[set[str]], sel: np.ndarray) -> dict[str, float]:
    idx = np.flatnonzero(sel)
    return operator_metrics([set(truth[i]) for i in idx], [pred[i] for i in idx])


def _top(sets: list[set[str]] | list[list[str]], sel: np.ndarray, k: int = 4) -> dict[str, int]:
    c: dict[str, int] = {}
    for i in np.flatnonzero(sel).tolist():
        for x in sets[i]:
            c[x] = c.get(x, 0) + 1
    return dict(sorted(c.items(), key=lambda x: (-x[1], x[0]))[:k])


def _mask_rows(inst: Instances, steps: np.ndarray) -> np.ndarray:
    m = np.zeros(len(steps) + 1, bool)
    m[:-1] = steps
    return m[inst.step] & (inst.step >= 0)


def run_protocol(steps: dict[str, Any], inst: Instances, lifted: np.ndarray, fit_steps: np.ndarray,
                 test_steps: np.ndarray, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fit on ``fit_steps``, localize ``test_steps``; per step the flag, the candidate families and
    the candidates lifted to label granularity (the suspects' :func:`lifted_families`).
    ``params``: ``GMMLocalizer`` hyper-parameters (default: its defaults)."""
    t0 = time.perf_counter()
    fit_rows = _mask_rows(inst, fit_steps)
    est = GMMLocalizer(**(params or {})).fit(inst.X[fit_rows], families=inst.family_of()[fit_rows], groups=inst.step[fit_rows],
                             batch=None if inst.batch is None else inst.batch[fit_rows])
    t_fit = time.perf_counter() - t0
    ref = localize(est, inst.subset(fit_rows))  # in-sample flag rate (fit_localizer's reference_steps_flagged)
    ref_flagged = int(ref.steps.flag.sum())
    del ref
    t1 = time.perf_counter()
    test_idx = np.flatnonzero(_mask_rows(inst, test_steps))
    loc = localize(est, inst.subset(test_idx))
    t_loc = time.perf_counter() - t1
    n = len(test_steps)
    flag = np.zeros(n, bool)
    flag[loc.steps.steps[loc.steps.flag]] = True
    score = np.full(n, np.nan)
    score[loc.steps.steps] = loc.steps.score
    pred: list[set[str]] = [set() for _ in range(n)]
    pred_lifted: list[set[str]] = [set() for _ in range(n)]
    for s, res in loc.flagged.items():  # flagged steps: thousands at most
        pred[s] = {c["family"] for c in res.candidates}
        pred_lifted[s] = set(lifted[test_idx[res.suspects]].tolist()) if len(res.suspects) else set()
    return {"flag": flag, "score": score, "pred": pred, "pred_lifted": pred_lifted, "fit_steps": int(fit_steps.sum()),
            "fit_instances": int(fit_rows.sum()), "families_fitted": int(len(est.families_)),
            "fit_requests_per_step_median": float(np.median(steps["requests"][fit_steps])) if fit_steps.any() else None,
            "fit_steps_flagged_in_sample": ref_flagged, "unseen_families_in_test": sorted(loc.summary["unseen_families"]),
            "seconds": {"fit": round(t_fit, 2), "localize": round(t_loc, 2)}}


def run_groups(steps: dict[str, Any], inst: Instances, lifted: np.ndarray,
               groups: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """:func:`run_protocol` once per (fit steps, test steps) group, test sets disjoint; the
    per-step results joined, the counts summed."""
    n = len(steps["is_anomaly"])
    out: dict[str, Any] = {"flag": np.zeros(n, bool), "score": np.full(n, np.nan), "pred": [set() for _ in range(n)],
                           "pred_lifted": [set() for _ in range(n)], "fit_steps": 0, "fit_instances": 0,
                           "families_fitted": 0, "fit_steps_flagged_in_sample": 0, "fit_requests_per_step_median": None,
                           "unseen_families_in_test": [], "seconds": {"fit": 0.0, "localize": 0.0}, "groups": []}
    for fit_steps, test_steps in groups:
        r = run_protocol(steps, inst, lifted, fit_steps, test_steps)
        idx = np.flatnonzero(test_steps)
        out["flag"][idx], out["score"][idx] = r["flag"][idx], r["score"][idx]
        for i in idx.tolist():
            out["pred"][i], out["pred_lifted"][i] = r["pred"][i], r["pred_lifted"][i]
        for k in ("fit_steps", "fit_instances", "fit_steps_flagged_in_sample"):
            out[k] += r[k]
        out["families_fitted"] = max(out["families_fitted"], r["families_fitted"])
        out["unseen_families_in_test"] = sorted(set(out["unseen_families_in_test"]) | set(r["unseen_families_in_test"]))
        for k in ("fit", "localize"):
            out["seconds"][k] = round(out["seconds"][k] + r["seconds"][k], 2)
        out["groups"].append({"fit_steps": r["fit_steps"], "test_steps": int(test_steps.sum())})
    return out


#: step rules compared on held-out fault-free runs (:func:`reference_held_out`)
HELD_OUT_RULES = {"default (k-th instance, min_instances 2)": {},
                  "top-quantile mean (the rule before)": {"min_instances": 1, "aggregate": "mean"}}


def reference_held_out(steps: dict[str, Any], inst: Instances, lifted: np.ndarray, fault_free: np.ndarray,
                       par: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    """Normal steps flagged in a fault-free run never seen by the fit: per deployment shape, each
    fault-free run scored against a fit on the shape's other fault-free runs (``ref``: the steps a
    reference may hold, warm-up out), for each rule of :data:`HELD_OUT_RULES`. No faulty run and
    no label is involved: this is what the stage does to normal operation recorded apart."""
    out = {}
    codes = steps["run_code"]
    for name, params in HELD_OUT_RULES.items():
        per_run, tot, fl = {}, 0, 0
        for p in np.unique(par[fault_free]).tolist():
            shape = fault_free & (par == p)
            for c in np.unique(codes[shape]).tolist():
                test = shape & ref & (codes == c)
                fit = shape & ref & (codes != c)
                if not fit.any() or not test.any():
                    continue
                r = run_protocol(steps, inst, lifted, fit, test, params)
                k, n = int((r["flag"] & test).sum()), int(test.sum())
                per_run[str(steps["runs"][c])] = {"flagged": k, "steps": n}
                tot, fl = tot + n, fl + k
        out[name] = {"params": params, "flagged": fl, "steps": tot, "rate": fl / max(tot, 1), "per_run": per_run}
    return out


def _auroc(truth: np.ndarray, score: np.ndarray) -> float | None:
    """AUROC of the step score (steps without instances score below every scored step)."""
    s = np.asarray(score, np.float64).copy()
    fin = np.isfinite(s)
    s[~fin] = (s[fin].min() - 1.0) if fin.any() else 0.0
    if truth.all() or not truth.any():
        return None
    return float(auroc(truth, s))


def run_layers(campaign: Path | None) -> dict[str, int]:
    """Decoder layers of every run of a campaign spec (``[workload] layers``, a run's
    ``workload = {layers = N}`` overriding it), keyed by the run name; {} without a spec."""
    if campaign is None or not campaign.exists():
        return {}
    spec = tomllib.loads(campaign.read_text())
    base = int(spec.get("workload", {}).get("layers", 0))
    return {r["name"]: int(r.get("workload", {}).get("layers", base)) for r in spec.get("runs", [])}


def summarize(name: str, steps: dict[str, Any], test_steps: np.ndarray, r: dict[str, Any], detail: bool = True) -> dict[str, Any]:
    flag, pred, pred_lifted = r["flag"], r["pred"], r["pred_lifted"]
    labels = steps["labels"]
    ab = steps["is_anomaly"]
    sel_ab = test_steps & ab
    out: dict[str, Any] = {
        "protocol": name,
        **{k: r[k] for k in ("fit_steps", "fit_instances", "families_fitted", "fit_steps_flagged_in_sample",
                             "fit_requests_per_step_median")},
        "test_steps": int(test_steps.sum()), "test_abnormal": int(sel_ab.sum()),
        "test_requests_per_step_median": float(np.median(steps["requests"][test_steps])) if test_steps.any() else None,
        "test_steps_without_instances": int((test_steps & ~np.isfinite(r["score"])).sum()),
        "step": {**step_metrics(ab[test_steps], flag[test_steps]), "auroc": _auroc(ab[test_steps], r["score"][test_steps])},
        "normal_flagged": {"steps": int((test_steps & ~ab).sum()), "flagged": int((test_steps & ~ab & flag).sum()),
                           "rate": float((test_steps & ~ab & flag).sum() / max(int((test_steps & ~ab).sum()), 1))},
        "operator": _ops_metrics(labels, pred, test_steps),
        "operator_lifted": _ops_metrics(labels, pred_lifted, test_steps),
        "recall_per_category": {c: float((sel_ab & (steps["fault_type"] == c) & flag).sum() / m)
                                for c in CATEGORIES if (m := int((sel_ab & (steps["fault_type"] == c)).sum()))},
        "seconds": r["seconds"],
    }
    if not detail:
        return out
    out["test_runs"] = sorted({str(steps["runs"][c]) for c in np.unique(steps["run_code"][test_steps]).tolist()})
    out["unseen_families_in_test"] = r["unseen_families_in_test"]
    # abnormal steps whose labels name an instance family (FE/BE/COMM): the only ones the stage can name
    reach = np.array([any(x.startswith(INSTANCE_PREFIXES) for x in lb) for lb in labels], bool)
    out["abnormal_with_instance_label"] = int((sel_ab & reach).sum())
    out["operator_reachable"] = _ops_metrics(labels, pred, test_steps & (reach | ~ab))
    out["operator_lifted_reachable"] = _ops_metrics(labels, pred_lifted, test_steps & (reach | ~ab))
    for field, key in (("fault_type", "per_category"), ("mechanism", "per_mechanism")):
        d = {}
        for k in sorted(set(steps[field][sel_ab].tolist())):
            m = sel_ab & (steps[field] == k)
            om, ol = _ops_metrics(labels, pred, m), _ops_metrics(labels, pred_lifted, m)
            d[k] = {"abnormal": int(m.sum()), "flagged": int((m & flag).sum()), "recall": float((m & flag).sum() / m.sum()),
                    "macro_plus_f1": om["macro_plus_f1"], "macro_plus_jaccard": om["macro_plus_jaccard"],
                    "lifted_macro_plus_f1": ol["macro_plus_f1"], "lifted_macro_plus_jaccard": ol["macro_plus_jaccard"],
                    "labels": _top(labels, m), "predicted": _top(pred, m & flag), "predicted_lifted": _top(pred_lifted, m & flag)}
        out[key] = d
    norm = test_steps & ~ab
    warm, win, mate = steps["warmup"], steps["in_window"], steps["partner_in_window"]
    out["false_positives"] = {
        k: {"steps": int(m.sum()), "flagged": int((m & flag).sum()), "rate": float((m & flag).sum() / m.sum()) if m.any() else None}
        for k, m in (("all", norm), ("in_window_no_effect", norm & win), ("outside_windows", norm & ~win),
                     ("warmup", norm & warm), ("outside_windows_not_warmup", norm & ~win & ~warm),
                     ("outside_windows_partner_in_window", norm & mate),
                     ("outside_windows_no_partner_in_window", norm & ~win & ~mate),
                     ("outside_windows_not_warmup_no_partner_in_window", norm & ~win & ~warm & ~mate))}
    out["false_positive_families"] = _top(pred, norm & flag, 8)
    per_run = {}
    for c in np.unique(steps["run_code"][test_steps]).tolist():
        m = test_steps & (steps["run_code"] == c)
        a, nm = m & ab, m & ~ab
        per_run[str(steps["runs"][c])] = {"steps": int(m.sum()), "abnormal": int(a.sum()), "abnormal_flagged": int((a & flag).sum()),
                                          "normal_flagged": int((nm & flag).sum())}
    out["per_run"] = per_run
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ds", default=str(ROOT / "data" / "h200_v2"))
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/localize_<dataset name>.json)")
    ap.add_argument("--campaign", default=None,
                    help="campaign spec giving each run's model depth, for split_workload (default campaigns/<dataset name>.toml)")
    ap.add_argument("--keep-warmup", action="store_true", help="keep warm-up steps in the reference (teller diagnose --keep-warmup)")
    ap.add_argument("--eval-split", choices=("test", "val"), default="test",
                    help="score the request/run splits' val side instead of test (for choosing changes)")
    ap.add_argument("--protocols", default=None, help="comma-separated subset of the protocols (default all)")
    ap.add_argument("--no-variants", action="store_true", help="skip the reference-set variants")
    a = ap.parse_args(argv)
    ds = Path(a.ds)
    out_path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"localize_{ds.name}.json"
    campaign = Path(a.campaign) if a.campaign else ROOT / "campaigns" / f"{ds.name}.toml"
    w0, c0 = time.perf_counter(), time.process_time()
    steps = load_steps(ds)
    t_steps = time.perf_counter() - w0
    inst, info = load_instances(ds, steps)
    lifted = lifted_families(inst)
    sp = steps["split"]
    normal = ~steps["is_anomaly"]
    run_of_step = steps["runs"][steps["run_code"]]
    fault_free = np.isin(run_of_step, [r for r in steps["runs"].tolist() if r.startswith("normal-")])
    # ranks per run (1: one process; 2 and more: tensor parallel), from the steps' ranks
    ranks = np.zeros(len(steps["runs"]), np.int64)
    np.maximum.at(ranks, steps["run_code"], steps["rank"].astype(np.int64) + 1)
    par = ranks[steps["run_code"]]
    dep = np.char.add(np.char.add(par.astype(str), " ranks, "), steps["workload"])
    same_deployment = [dep == d for d in np.unique(dep).tolist()]
    no_deployment_ref = ~np.isin(dep, dep[fault_free])
    ev = a.eval_split
    req = sp["split_request"]
    first = req["first"]
    # name: (train steps, test steps, main row); the reference is the train steps' normal ones
    protocols = {
        # a step takes its representative record's split (teller evaluate's and the models' rule)
        "split_request": (req["rep"] == "train", req["rep"] == ev, True),
        # every step holding a test request is test (every test record is scored); the reference is
        # the steps holding no test request: mostly small batches, since a big batch almost always holds one
        "split_request_any_test": (req["train"] & ~req["test"] & ~req["val"] if ev == "val" else req["train"] & ~req["test"],
                                   req[ev], False),
        "split_run": (sp["split_run"]["rep"] == "train", sp["split_run"]["rep"] == ev, True),
        # a normal reference recorded apart (the fault-free runs), every step of the other runs scored
        "fault_free_reference": (fault_free, ~fault_free, True),
        # as `teller diagnose RUN --reference REF` is used: each run against the fault-free runs of
        # its own deployment shape (tensor-parallel runs against the tensor-parallel ones)
        "fault_free_same_parallelism": ([(fault_free & (par == p), ~fault_free & (par == p)) for p in np.unique(par).tolist()],
                                        ~fault_free, True),
        # the same with the served model too (the dataset's workload column: layers, hidden size),
        # each run against the fault-free runs of its own deployment (skipped when a group has none)
        "fault_free_same_deployment": ([(fault_free & g, ~fault_free & g) for g in same_deployment
                                        if (fault_free & g).any()], ~fault_free & ~no_deployment_ref, True),
        # a step takes the split of its first record: no batch-size bias, but a few long requests
        # decide the split of many consecutive steps
        "split_request_first_record": (first == "train", first == ev, False),
    }
    layers_of = run_layers(campaign)
    depth = np.array([layers_of.get(r.rsplit("-r", 1)[0], 0) for r in run_of_step.tolist()], np.int64)
    depths = sorted(set(depth[depth > 0].tolist()))
    workload = None
    if "split_workload" in sp:  # the dataset's own column
        w = sp["split_workload"]["rep"]
        protocols["split_workload"] = (w == "train", w == ev, True)
        workload = {"from": "the dataset's split_workload column (representative record per step)",
                    "train_runs": sorted(set(run_of_step[w == "train"].tolist())),
                    "test_runs": sorted(set(run_of_step[w == ev].tolist()))}
    elif len(depths) > 1 and (depth > 0).all():
        # train on the runs of the shallowest model, score every step of the deeper ones
        protocols["split_workload"] = (depth == depths[0], depth != depths[0], True)
        workload = {"campaign": str(campaign.relative_to(ROOT) if campaign.is_relative_to(ROOT) else campaign),
                    "train_layers": depths[0], "test_layers": depths[1:],
                    "runs_per_layers": {int(d): sorted({r for r, x in zip(run_of_step.tolist(), depth.tolist(), strict=True) if x == d})
                                        for d in depths}}
    if a.protocols:
        want = a.protocols.split(",")
        unknown = sorted(set(want) - set(protocols))
        if unknown:
            raise SystemExit(f"--protocols: unknown {unknown}; choose from {sorted(protocols)}")
        protocols = {k: v for k, v in protocols.items() if k in want}
    base = normal if a.keep_warmup else normal & ~steps["warmup"]
    base_name = "normal train steps" + ("" if a.keep_warmup else ", warm-up out")
    refs = {
        base_name: base,
        "normal train steps, warm-up kept" if not a.keep_warmup else "normal train steps, warm-up out":
            normal if not a.keep_warmup else normal & ~steps["warmup"],
        "outside fault windows": base & ~steps["in_window"],
        "fault-free runs only": base & fault_free,
    }
    main_rows, variants = {}, []
    for pname, (train, test, is_main) in protocols.items():
        for rname, ref in refs.items():
            if rname != base_name and (a.no_variants or pname.startswith("fault_free") or pname == "split_workload"):
                continue
            if isinstance(train, list):  # one fit per group (train, test), the results joined
                r = run_groups(steps, inst, lifted, [(tr & ref, te) for tr, te in train])
            else:
                r = run_protocol(steps, inst, lifted, train & ref, test)
            if is_main and rname == base_name:
                main_rows[pname] = summarize(pname, steps, test, r)
            variants.append({"reference": rname, **summarize(pname, steps, test, r, detail=False)})
    held_out = None if a.no_variants else reference_held_out(steps, inst, lifted, fault_free, par, base)
    out = {
        "dataset": str(ds.relative_to(ROOT) if ds.is_relative_to(ROOT) else ds),
        "view": "vertical",
        "steps": int(len(steps["step_id"])), "records": steps["records"],
        "abnormal_steps": int(steps["is_anomaly"].sum()),
        "labels_renamed_by_family_names": steps["labels_renamed"],
        "fit": "GMMLocalizer() defaults, fitted on the normal steps (is_anomaly false) of the train split "
               f"({base_name}): a one-class reference of normal operation, batch-normalised",
        "eval_split": ev,
        "warmup_rule": steps["warmup_rule"],
        "split_workload": workload,
        "instances": info,
        "protocols": main_rows,
        "reference_variants": variants,
        "fault_free_held_out_runs": held_out,
        "seconds": {"steps": round(t_steps, 2), "total_wall": round(time.perf_counter() - w0, 1),
                    "total_cpu": round(time.process_time() - c0, 1)},
        "peak_rss_mib": round(_peak_mib(), 0),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as fh:
        json.dump(out, fh, indent=1)
    for v in variants:
        s, op, ol = v["step"], v["operator"], v["operator_lifted"]
        print(f"{v['protocol']:26s} {v['reference']:22s} fit {v['fit_steps']:4d} test {v['test_steps']:4d} ({v['test_abnormal']:4d} abn): "
              f"step P {s['precision']:.2f} R {s['recall']:.2f} F1 {s['f1']:.2f} AUROC {s['auroc'] or float('nan'):.3f} "
              f"normal flagged {v['normal_flagged']['rate']:.3f} | op M+ P {op['macro_plus_precision']:.2f} "
              f"R {op['macro_plus_recall']:.2f} F1 {op['macro_plus_f1']:.2f} J {op['macro_plus_jaccard']:.2f} | lifted F1 "
              f"{ol['macro_plus_f1']:.2f} | " + " ".join(f"{k[:4]} {x:.2f}" for k, x in v["recall_per_category"].items()))
    for v in main_rows.values():
        print(f"{v['protocol']}: per mechanism recall " + ", ".join(f"{k} {x['flagged']}/{x['abnormal']}" for k, x in v["per_mechanism"].items()))
    for k, v in (held_out or {}).items():
        print(f"fault-free runs held out, {k}: {v['flagged']}/{v['steps']} normal steps flagged ({v['rate']:.3f}) "
              + ", ".join(f"{r} {x['flagged']}/{x['steps']}" for r, x in v["per_run"].items()))
    print(f"total {out['seconds']['total_wall']} s wall, {out['seconds']['total_cpu']} s CPU, peak RSS {out['peak_rss_mib']:.0f} MiB -> {out_path}")
    return out


if __name__ == "__main__":
    main()
