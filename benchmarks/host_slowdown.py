"""Whether the numeric stage's evidence can tell GIL contention (scheduling) from host CPU
contention (memory): both slow the host operators, and `teller.localize.faulttype` types a step
whose evidence is a host operator's own time (``dur_ns``/``self_ns`` of an FE/BE family) memory.

    python benchmarks/host_slowdown.py DATASET:SPLIT [...] [--read DATASET:SPLIT ...] -o OUT.json

For each dataset, the stage (`teller_numeric_deploy`: the deployment's fault-free train runs as
reference) is fitted on the split's train part and reads its test part; for every step it flags
whose evidence typed it memory through a host operator's own time, the step's host slowdown is
measured against the reference (per FE/BE family with 20 µs or more of reference time per step,
the step's time over the reference median's):

- ``self_p90``, ``self_f3``: the spread — the 90th percentile of the families' self-time ratios,
  the share of families over 3× (a thread holding the GIL is expected to stall a few operators a
  lot, co-runners on the cores to slow all of them a little);
- ``self_tot``, ``fe_self_tot``, ``be_self_tot``: all host families' self time over the
  reference's (all, modules only, aten ops only);
- ``rt_call``: the time per CUDA runtime/driver call under those operators over the reference's
  (runtime calls run with the GIL released, so a GIL wait should not lengthen them).

Writes each statistic's quantiles (10/50/90%) per mechanism and truth, and, over the pooled
abnormal steps whose truth is scheduling or memory of the datasets named first (the selection:
the nested mechanism folds, whose held-out parts are host CPU contention and GIL contention), the
best single threshold per statistic (retyping the steps above or below it as scheduling) with the
steps it types right, against keeping them all memory; then, on each ``--read`` dataset, the
steps those thresholds type right. docs/results.md ("GIL or CPU contention: what the evidence can tell")
reads it. ``--steps STEPS.parquet``: also count, in `benchmarks/gap_anatomy.py` step tables, the
flagged abnormal test steps the row typed by the evidence against the model's type (truth, row,
model), the steps a rule deferring to the model would change.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

STATS = ("self_p90", "self_f3", "self_tot", "fe_self_tot", "be_self_tot", "rt_call")
#: families with less reference time per step than this are left out of the ratios (ns)
MIN_REF_NS = 2e4


def step_stats(x: np.ndarray, ref: np.ndarray, fam: np.ndarray, layer: np.ndarray, rt: np.ndarray,
               rt_ref: np.ndarray) -> dict[str, float]:
    """One step's host slowdown: ``x``/``ref`` the self time of its FE/BE instances and the
    reference median's, ``fam`` their families, ``layer`` 'FE'/'BE', ``rt``/``rt_ref`` (n × 4)
    their rt_ns, drv_ns, rt_n, drv_n and the reference's."""
    out: dict[str, float] = dict.fromkeys(STATS, float("nan"))
    ok = np.isfinite(ref) & (ref > 0) & np.isfinite(x)
    if ok.any():
        uf, inv = np.unique(fam[ok], return_inverse=True)
        xs, rs = np.bincount(inv, x[ok]), np.bincount(inv, ref[ok])
        big = rs >= MIN_REF_NS
        if big.any():
            rat = xs[big] / rs[big]
            out.update(self_p90=float(np.quantile(rat, 0.9)), self_f3=float((rat > 3).mean()),
                       self_tot=float(xs[big].sum() / rs[big].sum()))
        for lay in ("FE", "BE"):
            m = ok & (layer == lay)
            if m.any():
                out[lay.lower() + "_self_tot"] = float(x[m].sum() / ref[m].sum())
    good = np.isfinite(rt).all(1) & np.isfinite(rt_ref).all(1) & (rt_ref[:, 2] + rt_ref[:, 3] > 0)
    if good.any():
        a, b = rt[good].sum(0), rt_ref[good].sum(0)
        calls, ref_calls = a[2] + a[3], b[2] + b[3]
        if calls > 0:
            out["rt_call"] = float(((a[0] + a[1]) / calls) / max((b[0] + b[1]) / ref_calls, 1e-9))
    return out


def read_dataset(ds: str, split: str) -> list[dict[str, Any]]:
    """Every test step the stage flags and types memory by a host operator's own time, with its
    truth and :func:`step_stats`."""
    from teller.baselines import make
    from teller.baselines.features import read_dataset_features
    from teller.baselines.numeric import unit_instances
    from teller.baselines.steps import load_steps, split_masks
    from teller.dataset.codec import read_subtrees
    from teller.localize.features import FEATURES

    steps = load_steps(ds, "vertical")
    steps.features = read_dataset_features(ds, steps)
    steps.extra["instances"] = unit_instances(steps, read_subtrees(ds))
    tr, te, _ = split_masks(steps, split)
    m = make("teller_numeric_deploy", seed=0).fit(steps, np.flatnonzero(tr))
    want = np.flatnonzero(te)
    unit_step = {}
    for i in want.tolist():
        for u in steps.unit_idx[steps.unit_ptr[i]:steps.unit_ptr[i + 1]].tolist():
            unit_step[int(u)] = i
    cself = FEATURES.index("self_ns")
    crt = [FEATURES.index(f) for f in ("rt_ns", "drv_ns", "rt_n", "drv_n")]
    truth = np.asarray(steps.fault_type, dtype=object)
    mech = np.asarray(steps.mechanism, dtype=object)
    runs = np.asarray(steps.runs, dtype=object)
    out = []
    for _, reading in m.readings(steps, want):
        if not reading.own:  # a deployment without a fault-free training run: not read here
            continue
        est, sub, loc, calls = reading.model, reading.instances, reading.localization, reading.calls
        fams = np.asarray(sub.families, dtype=object)
        lay_of = np.array([str(f).partition(" ")[0] for f in fams])
        layer = lay_of[sub.family] if len(fams) else np.zeros(0, str)
        host = np.isin(layer, ["FE", "BE"])
        refm = est.reference_median(fams[sub.family], sub.batch)
        for s in loc.flagged:
            c = calls.get(s)
            i = unit_step.get(int(s))
            if c is None or i is None or c.fault_type != "memory" or c.feature not in ("dur_ns", "self_ns") \
                    or c.family.partition(" ")[0] not in ("FE", "BE"):
                continue
            r = np.flatnonzero((sub.step == s) & host)
            d = {"dataset": ds, "split": split, "run": str(runs[steps.run_code[i]]), "step": int(steps.step_num[i]),
                 "abnormal": bool(steps.is_anomaly[i]), "truth": str(truth[i]), "mechanism": str(mech[i]),
                 "family": c.family, "feature": c.feature}
            d.update(step_stats(sub.X[r, cself], refm[r, cself], sub.family[r], layer[r], sub.X[r][:, crt], refm[r][:, crt]))
            out.append(d)
    return out


def best_threshold(values: np.ndarray, is_sched: np.ndarray) -> dict[str, Any]:
    """The single threshold on ``values`` (either side) that types the most steps right when the
    steps on its side become scheduling and the others stay memory."""
    ok = np.isfinite(values)
    best = {"correct": int((~is_sched).sum()), "threshold": None, "above": None}
    for t in np.unique(values[ok]):
        for above in (True, False):
            sched = ok & ((values > t) if above else (values < t))
            correct = int((sched & is_sched).sum() + (~sched & ~is_sched).sum())
            if correct > best["correct"]:
                best = {"correct": correct, "threshold": float(t), "above": above}
    return best


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for d in rows:
        groups[f"{d['mechanism'] or '-'} / {d['truth'] if d['abnormal'] else 'normal'}"].append(d)
    quant = {}
    for k, v in sorted(groups.items()):
        q = {}
        for s in STATS:
            a = np.array([d[s] for d in v], float)
            q[s] = [round(float(x), 3) for x in np.nanquantile(a, [0.1, 0.5, 0.9])] if np.isfinite(a).any() else None
        quant[k] = {"steps": len(v), "q10_q50_q90": q}
    pool = [d for d in rows if d["abnormal"] and d["truth"] in ("scheduling", "memory")]
    is_sched = np.array([d["truth"] == "scheduling" for d in pool], bool)
    thresholds = {s: best_threshold(np.array([d[s] for d in pool], float), is_sched) for s in STATS}
    return {"by_mechanism": quant, "pooled": {"steps": len(pool), "scheduling": int(is_sched.sum()),
                                               "all_memory_correct": int((~is_sched).sum()),
                                               "best_threshold": thresholds}}


def apply(rows: list[dict[str, Any]], thresholds: dict[str, Any]) -> dict[str, Any]:
    """Steps of ``rows`` (abnormal, truth scheduling or memory) each threshold types right."""
    pool = [d for d in rows if d["abnormal"] and d["truth"] in ("scheduling", "memory")]
    is_sched = np.array([d["truth"] == "scheduling" for d in pool], bool)
    out: dict[str, Any] = {"steps": len(pool), "scheduling": int(is_sched.sum()), "all_memory_correct": int((~is_sched).sum())}
    for s, b in thresholds.items():
        if b["threshold"] is None:
            out[s] = out["all_memory_correct"]
            continue
        v = np.array([d[s] for d in pool], float)
        sched = np.isfinite(v) & ((v > b["threshold"]) if b["above"] else (v < b["threshold"]))
        out[s] = int((sched & is_sched).sum() + (~sched & ~is_sched).sum())
    return out


def disagreements(path: str) -> dict[str, int]:
    """In a gap_anatomy steps table: the flagged abnormal vertical test steps the row typed by the
    evidence against the model, counted by (truth, row, model)."""
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["view", "test", "flag", "abnormal", "true_type", "fault_type", "model_type",
                                     "stage_type"]).to_pydict()
    a = {k: np.asarray(v) for k, v in t.items()}
    m = (a["view"] == "vertical") & a["test"] & a["flag"] & a["abnormal"]
    ev = m & (a["fault_type"] == a["stage_type"]) & (a["fault_type"] != a["model_type"])
    c = Counter(zip(a["true_type"][ev].tolist(), a["fault_type"][ev].tolist(), a["model_type"][ev].tolist(), strict=True))
    return {f"{t} / {r} / {mo}": n for (t, r, mo), n in c.most_common()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="+", help="DATASET:SPLIT (split: request|run|mechanism|workload)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--read", nargs="*", default=[], help="DATASET:SPLIT read with the selection's thresholds")
    ap.add_argument("--steps", nargs="*", default=[], help="gap_anatomy steps.parquet tables to count")
    a = ap.parse_args(argv)
    t0 = time.time()
    per: dict[str, Any] = {}
    got: dict[str, list[dict[str, Any]]] = {}
    for spec in [*a.data, *a.read]:
        ds, _, split = spec.rpartition(":")
        if not ds:
            ap.error(f"{spec}: give DATASET:SPLIT")
        got[spec] = read_dataset(ds, split)
        per[spec] = summarize(got[spec])
    selection = summarize([d for spec in a.data for d in got[spec]])
    thresholds = selection["pooled"]["best_threshold"]
    res = {"selection": a.data, "min_reference_ns": MIN_REF_NS, "per_dataset": per, "selected": selection,
           "read": {spec: apply(got[spec], thresholds) for spec in a.read},
           "evidence_against_model": {p: disagreements(p) for p in a.steps},
           "steps": [d for spec in got for d in got[spec]], "seconds": round(time.time() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"selected": selection["pooled"], "read": res["read"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
