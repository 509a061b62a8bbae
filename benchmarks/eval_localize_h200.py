"""The numeric stage (GMM localizer, teller/localize/) on the labelled H200 dataset, from the dataset alone.

    python benchmarks/eval_localize_h200.py                      # data/h200_v1 → benchmarks/results/localize_h200.json
    python benchmarks/eval_localize_h200.py --ds DS --out FILE

Vertical view only: one step = one rank's step, i.e. one ``(run_id, step_id)`` of
``records.parquet``; its request rows are collapsed (the labels are per step). The forest rows of
every kept step come from the dataset's subtrees (``read_subtrees``); per run they are turned into the localizer's
operator instances exactly as ``teller diagnose`` does on a run directory (``Forest`` →
``step_blocks``: each subtree block one step, the rule "STEP ranges" → ``instance_features``), then all runs are concatenated
(instance parents and steps renumbered).

The estimator models normal operation (a one-class reference, docs/design.md §6): it is fitted on the
NORMAL steps (``is_anomaly`` false) of the train side only, with its default hyper-parameters,
nothing tuned. Protocols (train side → scored steps):

- ``split_request``: the splits are drawn per (run, request) and a step holds many requests, so a
  step's requests usually fall in several splits. A step is *test* when any of its requests is in
  test (every test record is scored), *train* when it holds a train request and no test request;
  fitted and scored steps are disjoint, but the reference is left with small batches (a big batch
  almost always holds a test request).
- ``split_run``: whole runs; a step's records share one split.
- ``fault_free_reference``: the fault-free runs (``normal-*``) → every step of the other runs, as
  ``teller diagnose --reference`` is meant to be used.
- ``split_request_first_record`` (a variant): a step takes the split of its first record.

Reference variants (``reference_variants`` in the JSON; ``--no-variants`` skips them): all normal
train steps, without the labeller's warm-up steps, outside fault windows, fault-free runs only.

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
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.dataset.codec import read_subtrees
from teller.evaluate.metrics import operator_metrics, step_metrics
from teller.forest import Forest, family_names, step_blocks
from teller.localize import GMMLocalizer, localize
from teller.localize.features import (
    INSTANCE_LAYERS,
    Instances,
    instance_features,
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
    cols = ["run_id", "request_id", "step_id", "step_num", "rank", "view", "is_anomaly", "in_window", "fault_type", "mechanism",
            "operator_labels", "split_request", "split_run", "split_mechanism"]
    t = pq.read_table(ds / "records.parquet", columns=cols)
    t = t.filter(pc.equal(t.column("view"), "vertical"))
    run = _str(t.column("run_id"))
    runs, run_code = np.unique(run.astype(str), return_inverse=True)
    sid = t.column("step_id").to_numpy().astype(np.int64)
    key = run_code.astype(np.int64) << 40 | sid
    ukey, first, inv = np.unique(key, return_index=True, return_inverse=True)
    n = len(ukey)
    ab = t.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    if (np.bincount(inv, weights=ab, minlength=n) % np.bincount(inv, minlength=n)).any():
        raise SystemExit("is_anomaly differs between the request rows of one step")
    split = {}
    for s in ("split_request", "split_run", "split_mechanism"):
        x = _str(t.column(s)).astype(str)
        split[s] = {name: np.bincount(inv, weights=(x == name), minlength=n) > 0 for name in ("train", "val", "test")}
        split[s]["first"] = x[first]  # the split of the step's first record
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
    }
    # warm-up as the labeller sees it (teller.inject.labels.warmup_steps): steps serving warm-up
    # requests only, and a process's first two steps (step numbers start at 0 on every rank)
    warm_req = np.char.startswith(_str(t.column("request_id")).astype(str), "warmup_")
    only_warm = np.bincount(inv, weights=warm_req, minlength=n) == np.bincount(inv, minlength=n)
    steps["warmup"] = only_warm | (steps["step_num"] < 2)
    return steps


# ------------------------------------------------------------------------------------------------
# instances of every step, from the dataset's subtrees


def load_instances(ds: Path, steps: dict[str, Any]) -> tuple[Instances, dict[str, Any]]:
    """Operator instances of all kept steps; ``step`` indexes ``steps`` (-1: outside a kept step)."""
    t0 = time.perf_counter()
    sub = read_subtrees(ds)
    t_read = time.perf_counter() - t0
    rcol = sub.column("run_id").combine_chunks()
    rdict = np.asarray(rcol.dictionary.to_pylist(), dtype=object).astype(str)
    rcode = rcol.indices.to_numpy()
    order = np.argsort(rcode, kind="stable")  # rows of one run stay in their DFS order
    bounds = np.searchsorted(rcode[order], np.arange(len(rdict) + 1))
    runs = steps["runs"]
    key_steps = steps["run_code"] << 40 | steps["step_id"]
    korder = np.argsort(key_steps)
    parts: list[Instances] = []
    fam_sets: list[list[str]] = []
    missing_steps = 0
    rules: set[str] = set()
    for r, name in enumerate(rdict.tolist()):  # runs: 50
        rows = order[bounds[r]:bounds[r + 1]]
        if not len(rows):
            continue
        g = int(np.searchsorted(runs, name))
        if g >= len(runs) or runs[g] != name:
            continue  # a run without vertical records
        fa = Forest.from_table(sub.take(pa.array(rows)).drop_columns(["run_id"]))
        step_of_row, step_node = step_blocks(fa)
        rules.add("STEP ranges")
        inst = instance_features(fa, step_of_row, INSTANCE_LAYERS)
        # step index → global step index via the STEP node id
        k = np.int64(g) << 40 | step_node
        pos = np.clip(np.searchsorted(key_steps, k, sorter=korder), 0, len(korder) - 1)
        hit = key_steps[korder[pos]] == k
        gstep = np.where(hit, korder[pos], -1)
        missing_steps += int((~hit).sum())
        step = np.where(inst.step >= 0, gstep[np.maximum(inst.step, 0)], -1)
        parts.append(Instances(inst.rows, inst.family, inst.families, step, inst.X, inst.parent, inst.layers))
        fam_sets.append(inst.families)
        del fa
    families = sorted({f for fs in fam_sets for f in fs})
    fidx = {f: i for i, f in enumerate(families)}
    off = np.cumsum([0] + [p.n for p in parts])
    inst = Instances(
        rows=np.concatenate([p.rows for p in parts]),
        family=np.concatenate([np.array([fidx[f] for f in p.families], np.int32)[p.family] if p.n else np.zeros(0, np.int32)
                               for p in parts]),
        families=families,
        step=np.concatenate([p.step for p in parts]),
        X=np.concatenate([p.X for p in parts]),
        parent=np.concatenate([np.where(p.parent >= 0, p.parent + o, -1) for p, o in zip(parts, off[:-1], strict=True)]),
        layers=INSTANCE_LAYERS,
    )
    covered = np.zeros(len(key_steps), bool)
    covered[inst.step[inst.step >= 0]] = True
    info = {"forest_rows": int(sub.num_rows), "instances": int(inst.n), "instances_outside_kept_steps": int((inst.step < 0).sum()),
            "families": len(families), "step_rules": sorted(rules), "step_nodes_without_records": missing_steps,
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
                 test_steps: np.ndarray) -> dict[str, Any]:
    """Fit on ``fit_steps``, localize ``test_steps``; per step the flag, the candidate families and
    the candidates lifted to label granularity (the suspects' :func:`lifted_families`)."""
    t0 = time.perf_counter()
    fit_rows = _mask_rows(inst, fit_steps)
    est = GMMLocalizer().fit(inst.X[fit_rows], families=inst.family_of()[fit_rows], groups=inst.step[fit_rows])
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
        "step": step_metrics(ab[test_steps], flag[test_steps]),
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
    warm, win = steps["warmup"], steps["in_window"]
    out["false_positives"] = {
        k: {"steps": int(m.sum()), "flagged": int((m & flag).sum()), "rate": float((m & flag).sum() / m.sum()) if m.any() else None}
        for k, m in (("all", norm), ("in_window_no_effect", norm & win), ("outside_windows", norm & ~win),
                     ("warmup", norm & warm), ("outside_windows_not_warmup", norm & ~win & ~warm))}
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
    ap.add_argument("--ds", default=str(ROOT / "data" / "h200_v1"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "localize_h200.json"))
    ap.add_argument("--no-variants", action="store_true", help="skip the reference-set variants")
    a = ap.parse_args(argv)
    ds = Path(a.ds)
    w0, c0 = time.perf_counter(), time.process_time()
    steps = load_steps(ds)
    t_steps = time.perf_counter() - w0
    inst, info = load_instances(ds, steps)
    lifted = lifted_families(inst)
    sp = steps["split"]
    normal = ~steps["is_anomaly"]
    fault_free = np.isin(steps["runs"][steps["run_code"]], [r for r in steps["runs"].tolist() if r.startswith("normal-")])
    req = sp["split_request"]
    first = req["first"]
    # name: (train steps, test steps, main row); the reference is the train steps' normal ones
    protocols = {
        # every step holding a test request is test (every test record is scored); the reference is
        # the steps holding no test request: mostly small batches, since a big batch almost always holds one
        "split_request": (req["train"] & ~req["test"], req["test"], True),
        "split_run": (sp["split_run"]["train"], sp["split_run"]["test"], True),
        # a normal reference recorded apart (the fault-free runs), every step of the other runs scored
        "fault_free_reference": (fault_free, ~fault_free, True),
        # a step takes the split of its first record: no batch-size bias, but a few long requests
        # decide the split of many consecutive steps
        "split_request_first_record": (first == "train", first == "test", False),
    }
    refs = {
        "normal train steps": normal,
        "without warm-up steps": normal & ~steps["warmup"],
        "outside fault windows": normal & ~steps["in_window"],
        "fault-free runs only": normal & fault_free,
    }
    main_rows, variants = {}, []
    for pname, (train, test, is_main) in protocols.items():
        for rname, ref in refs.items():
            if rname != "normal train steps" and (a.no_variants or pname == "fault_free_reference" and rname != "without warm-up steps"):
                continue
            r = run_protocol(steps, inst, lifted, train & ref, test)
            if is_main and rname == "normal train steps":
                main_rows[pname] = summarize(pname, steps, test, r)
            variants.append({"reference": rname, **summarize(pname, steps, test, r, detail=False)})
    out = {
        "dataset": str(ds.relative_to(ROOT) if ds.is_relative_to(ROOT) else ds),
        "view": "vertical",
        "steps": int(len(steps["step_id"])), "records": steps["records"],
        "abnormal_steps": int(steps["is_anomaly"].sum()),
        "labels_renamed_by_family_names": steps["labels_renamed"],
        "fit": "GMMLocalizer() defaults, fitted on the normal steps (is_anomaly false) of the train split: "
               "a one-class reference of normal operation",
        "instances": info,
        "protocols": main_rows,
        "reference_variants": variants,
        "seconds": {"steps": round(t_steps, 2), "total_wall": round(time.perf_counter() - w0, 1),
                    "total_cpu": round(time.process_time() - c0, 1)},
        "peak_rss_mib": round(_peak_mib(), 0),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    for v in variants:
        s, op, ol = v["step"], v["operator"], v["operator_lifted"]
        print(f"{v['protocol']:26s} {v['reference']:22s} fit {v['fit_steps']:4d} test {v['test_steps']:4d} ({v['test_abnormal']:4d} abn): "
              f"step P {s['precision']:.2f} R {s['recall']:.2f} F1 {s['f1']:.2f} | op M+ P {op['macro_plus_precision']:.2f} "
              f"R {op['macro_plus_recall']:.2f} F1 {op['macro_plus_f1']:.2f} J {op['macro_plus_jaccard']:.2f} | lifted F1 "
              f"{ol['macro_plus_f1']:.2f} | " + " ".join(f"{k[:4]} {x:.2f}" for k, x in v["recall_per_category"].items()))
    for v in main_rows.values():
        print(f"{v['protocol']}: per mechanism recall " + ", ".join(f"{k} {x['flagged']}/{x['abnormal']}" for k, x in v["per_mechanism"].items()))
    print(f"total {out['seconds']['total_wall']} s wall, {out['seconds']['total_cpu']} s CPU, peak RSS {out['peak_rss_mib']:.0f} MiB -> {a.out}")
    return out


if __name__ == "__main__":
    main()
