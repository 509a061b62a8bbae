"""`teller diagnose`: the numeric stage end to end — features → localizer → slices → diagnosis.json.

``diagnose(RUN, reference=[REF...] | localizer=PATH)`` scores every step of RUN against normal
operation, names for each flagged step the candidate operator families, the suspicious instances
with their evidence (which features deviate from the reference and by how much) and the causal
slice around them, writes ``diagnosis.json`` (and with ``html=True`` the self-contained
``report.html``), and returns the diagnosis as a dict.

``diagnosis.json``::

    {"format": "teller.diagnosis", "version": 1, "run": ..., "reference": ...,
     "steps_rule": {"rule": "STEP ranges" | "profiler steps" | "fixed windows", "detail": ...},
     "localizer": {hyper-parameters, families, reference summary},
     "summary": {steps, flagged, instances, unseen families, counts that reconcile, seconds},
     "steps": [ per step, in time order:
        {"index", "step_num", "rank", "node_id", "name", "start_ns", "end_ns", "instances",
         "score", "flag", "top_family",
         flagged steps also: "requests", "candidates": [{family, suspiciousness, instances, max_a, unseen}],
         "suspects": [{node_id, family, layer, name, start_ns, dur_ns, a, distance, evidence:
                       [{feature, value, reference, ratio, z}]}],
         "explained": [{node_id, family, by}],
         "slice": {"nodes": [{id, parent, layer, name, start_ns, dur_ns, relevance, suspect}],
                   "edges": {"p": [[u, v]...], "t": [...], "c": [...]}, "dropped", "info"}} ]}

Node ids are forest ``node_id`` values (``teller show RUN --step N`` prints the same tree).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from teller import __version__
from teller.inspect.tree import fmt_ns
from teller.localize import (
    GMMLocalizer,
    Localization,
    evidence,
    load_or_fit,
    localize,
    no_reference_error,
)
from teller.localize.features import RunFeatures, run_features
from teller.reconstruct.ensure import ensure_reconstructed
from teller.report.html import write_html
from teller.rundir import LAYERS, RunDir
from teller.slicing import SliceConfig, StepIndex, build_slice, comm_pairs_rows

FORMAT = "teller.diagnosis"
FORMAT_VERSION = 1


def _f(x: float, nd: int = 4) -> float | None:
    """A JSON-safe float (NaN/inf → None)."""
    x = float(x)
    return round(x, nd) if math.isfinite(x) else None


def _requests_by_step(path: Path, step_ids: list[int]) -> dict[int, list[str]]:
    """Request ids of the given STEP node ids (from ``requests.parquet``)."""
    rd = RunDir(path)
    if not rd.has_table("requests") or not step_ids:
        return {}
    import pyarrow as pa
    import pyarrow.compute as pc

    t = rd.read_table("requests")
    t = t.filter(pc.is_in(t.column("step_id"), value_set=pa.array(step_ids, pa.int64())))
    out: dict[int, list[str]] = {}
    for sid, rq in zip(t.column("step_id").to_pylist(), t.column("request_id").to_pylist(), strict=True):
        out.setdefault(int(sid), []).append(rq)
    return out


def build_diagnosis(rf: RunFeatures, est: GMMLocalizer, loc: Localization, source: str,
                    slice_config: SliceConfig | None = None) -> dict[str, Any]:
    """The diagnosis dict of one run (slices built for flagged steps only)."""
    t0 = time.perf_counter()
    fa, st, inst = rf.forest, rf.steps, rf.instances
    cfg = slice_config or SliceConfig()
    ss = loc.steps
    n_steps = st.n
    score = np.full(n_steps, np.nan)
    flag = np.zeros(n_steps, bool)
    top = np.full(n_steps, -1, np.int64)
    score[ss.steps], flag[ss.steps], top[ss.steps] = ss.score, ss.flag, ss.top_family
    n_inst = np.bincount(inst.step[inst.step >= 0], minlength=n_steps) if n_steps else np.zeros(0, np.int64)
    reqs = _requests_by_step(rf.path, [int(st.node_id[i]) for i in loc.flagged]) if st.rule == "STEP ranges" else {}
    # per-row anomaly score for the slice builder
    row_a = np.zeros(fa.n)
    row_a[inst.rows] = np.nan_to_num(loc.a, nan=0.0)
    gpu = fa.is_gpu
    pairs = comm_pairs_rows(fa, rf.comm_edges)
    index = StepIndex(st.step_of_row)
    names = np.asarray(fa.names, dtype=object)
    fam_names = inst.families
    steps_out: list[dict[str, Any]] = []
    order = np.lexsort((st.rank, st.start))
    slice_nodes = 0
    for i in order.tolist():  # one entry per step (thousands at most); details for flagged ones
        d: dict[str, Any] = {
            "index": i, "step_num": int(st.step_num[i]), "rank": int(st.rank[i]), "node_id": int(st.node_id[i]),
            "name": st.names[i], "start_ns": int(st.start[i]), "end_ns": int(st.end[i]),
            "instances": int(n_inst[i]) if n_steps else 0, "score": _f(score[i]), "flag": bool(flag[i]),
            "top_family": fam_names[top[i]] if top[i] >= 0 else None,
        }
        res = loc.flagged.get(i)
        if res is not None:
            if reqs:
                d["requests"] = reqs.get(int(st.node_id[i]), [])
            d["candidates"] = [{"family": c["family"], "suspiciousness": _f(c["suspiciousness"]), "shift": _f(c["shift"]),
                                "instances": c["instances"], "max_a": _f(c["max_a"]), "unseen": c["unseen"]}
                               for c in res.candidates]
            sus = res.suspects
            ev = evidence(est, inst, loc, sus)
            srows = inst.rows[sus]
            d["suspects"] = [
                {"node_id": int(fa.node_id[r]), "family": fam_names[inst.family[k]], "layer": LAYERS[fa.layer[r]],
                 "name": str(names[fa.name_codes[r]]), "start_ns": int(fa.start[r]), "dur_ns": int(fa.end[r] - fa.start[r]),
                 "a": _f(loc.a[k]), "distance": _f(loc.m2[k], 2), "collective": bool(loc.collective[k]),
                 "evidence": [{kk: (_f(v) if isinstance(v, float) else v) for kk, v in item.items()} for item in e]}
                for k, r, e in zip(sus.tolist(), srows.tolist(), ev, strict=True)
            ]
            d["explained"] = [{"node_id": int(fa.node_id[inst.rows[k]]), "family": fam_names[inst.family[k]],
                               "by": int(fa.node_id[inst.rows[b]])} for k, b in list(res.explained.items())[:50]]
            rows = index.rows(i)
            sl = build_slice(fa, rows, srows, row_a[rows], pairs, cfg, gpu)
            slice_nodes += len(sl.rows)
            par_ids = np.where(sl.parent >= 0, fa.node_id[np.maximum(sl.parent, 0)], -1)
            d["slice"] = {
                "nodes": [
                    {"id": int(fa.node_id[r]), "parent": int(p), "layer": LAYERS[fa.layer[r]],
                     "name": str(names[fa.name_codes[r]]), "start_ns": int(fa.start[r]),
                     "dur_ns": int(fa.end[r] - fa.start[r]), "relevance": _f(rv, 3), "suspect": bool(sm)}
                    for r, p, rv, sm in zip(sl.rows.tolist(), par_ids.tolist(), sl.relevance.tolist(), sl.suspect.tolist(), strict=True)
                ],
                "edges": {k: fa.node_id[v].tolist() for k, v in (("p", sl.edges_p), ("t", sl.edges_t), ("c", sl.edges_c))},
                "dropped": int(sl.dropped),
                "info": sl.info,
            }
        steps_out.append(d)
    unseen_in_steps = sorted({fam_names[f] for f in np.unique(inst.family[loc.unseen & (inst.step >= 0)]).tolist()})
    in_steps = int((inst.step >= 0).sum())
    summary = {
        "steps": int(n_steps),
        "steps_scored": int(len(ss.steps)),
        "steps_without_instances": int(n_steps - len(ss.steps)),
        "steps_flagged": int(flag.sum()),
        "instances": int(inst.n),
        "instances_in_steps": in_steps,
        "instances_outside_steps": int(inst.n - in_steps),
        "unseen_families": unseen_in_steps,
        "unseen_instances_in_steps": int((loc.unseen & (inst.step >= 0)).sum()),
        "suspicious_instances": loc.summary["suspicious_instances"],
        "explained_away": loc.summary["explained_away"],
        "nan_feature_values": loc.summary["nan_feature_values"],
        "slice_nodes": int(slice_nodes),
        "reconciled": bool(in_steps + (inst.n - in_steps) == inst.n and int(n_inst.sum()) == in_steps),
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    if in_steps and summary["unseen_instances_in_steps"] > 0.2 * in_steps:
        summary["warning"] = (f"{summary['unseen_instances_in_steps']} of {in_steps} instances belong to families the "
                              "reference never saw: the reference does not cover this run's workload")
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tool_version": __version__,
        "run": str(rf.path),
        "reference": source,
        "steps_rule": {"rule": st.rule, "detail": st.detail},
        "instance_layers": list(inst.layers),
        "features": [str(x) for x in est.feature_names_in_],
        "localizer": {"params": est.get_params(), "families": int(len(est.families_)),
                      **{k: v for k, v in getattr(est, "extra_", {}).items()}},
        "slice_config": asdict(cfg),
        "summary": summary,
        "steps": steps_out,
    }


def diagnose(run: str | os.PathLike, reference: list[str | os.PathLike] | None = None,
             localizer: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
             html: bool = False, window_ns: int | None = None, slice_config: SliceConfig | None = None,
             params: dict[str, Any] | None = None, note: Any = None) -> dict[str, Any]:
    """Diagnose ``run``; writes ``diagnosis.json`` (and ``report.html``) into ``out`` (default: RUN).

    ``run`` and the ``reference`` runs are read as ``teller reconstruct`` left them; one that was
    not reconstructed yet is reconstructed here, once, through the same public call
    (:func:`ensure_reconstructed`), so its steps are decided by the same rule either way.
    Returns the diagnosis dict with ``"paths"`` added (the files written)."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    if localizer is None and not reference:
        raise no_reference_error(run)
    run = ensure_reconstructed(run, note, window_ns)
    for r in reference or []:
        ensure_reconstructed(r, note, window_ns)
    est, source = load_or_fit(reference, localizer, window_ns=window_ns, run=run, **(params or {}))
    t_fit = time.perf_counter() - t0
    layers = tuple(getattr(est, "extra_", {}).get("instance_layers", ())) or None
    rf = run_features(run, layers=layers)
    t_feat = time.perf_counter() - t0 - t_fit
    loc = localize(est, rf.instances)
    t_loc = time.perf_counter() - t0 - t_fit - t_feat
    diag = build_diagnosis(rf, est, loc, source, slice_config)
    diag["summary"]["seconds"] = {"fit_or_load": round(t_fit, 3), "features": round(t_feat, 3),
                                  "localize": round(t_loc, 3), "slices_and_json": diag["summary"].pop("build_seconds")}
    out_dir = Path(out) if out is not None else Path(run)
    if out_dir.suffix == ".json":
        json_path, out_dir = out_dir, out_dir.parent
    else:
        json_path = out_dir / "diagnosis.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".json.tmp")
    with open(tmp, "w") as fh:
        json.dump(diag, fh, separators=(",", ":"))
    tmp.replace(json_path)
    paths = {"json": str(json_path)}
    if html:
        paths["html"] = str(write_html(diag, out_dir / "report.html"))
    diag["summary"]["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    diag["summary"]["cpu_seconds"] = round(time.process_time() - c0, 3)
    diag["paths"] = paths
    return diag


# ------------------------------------------------------------------------------------------------
# console summary


def _fmt_value(feature: str, v: float | None) -> str:
    if v is None:
        return "?"
    if feature.endswith("_ns"):
        return fmt_ns(v)
    if feature.endswith("bytes"):
        for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if v >= k:
                return f"{v / k:.1f} {unit}"
        return f"{v:.0f} B"
    if feature == "overlap":
        return f"{100 * v:.0f}%"
    return f"{v:.3g}"


def evidence_text(item: dict[str, Any]) -> str:
    """One evidence item as text: ``self_ns 12.3 µs vs 4.1 µs (3.0×, z=+8.2)``."""
    if "note" in item:
        return item["note"]
    f = item["feature"]
    ratio = f"{item['ratio']:.1f}×, " if item.get("ratio") else ""
    return f"{f} {_fmt_value(f, item['value'])} vs {_fmt_value(f, item['reference'])} ({ratio}z={item['z']:+.1f})"


def print_summary(diag: dict[str, Any], console: Any = None, top: int = 10, detail: int = 3) -> None:
    """Readable summary: the worst steps, their suspects and the evidence."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    s = diag["summary"]
    rule = diag["steps_rule"]
    con.print(f"[bold]diagnosis[/] of {diag['run']} against {diag['reference']}")
    con.print(f"steps: {s['steps']} ({rule['rule']}"
              + (f": {rule['detail']}" if rule["rule"] != "STEP ranges" else "") + f"), flagged [bold red]{s['steps_flagged']}[/]; "
              f"instances {s['instances_in_steps']} in steps ({', '.join(diag['instance_layers'])})")
    if s.get("unseen_families"):
        shown = ", ".join(s["unseen_families"][:6]) + (" …" if len(s["unseen_families"]) > 6 else "")
        con.print(f"[yellow]unseen in the reference[/]: {len(s['unseen_families'])} families ({shown})")
    if s.get("warning"):
        con.print(f"[yellow]warning[/]: {s['warning']}")
    steps = [x for x in diag["steps"] if x["score"] is not None]
    worst = sorted(steps, key=lambda x: (-x["score"], x["start_ns"]))[:top]
    if not worst:
        con.print("no step has operator instances to score")
        return
    t = Table(title="worst steps", show_lines=False)
    for col in ("step", "rank", "duration", "score", "flag", "candidates / top family"):
        t.add_column(col)
    for x in worst:
        fams = ", ".join(c["family"] for c in x.get("candidates", [])) or (x["top_family"] or "")
        t.add_row(str(x["step_num"]), str(x["rank"]), fmt_ns(x["end_ns"] - x["start_ns"]), f"{x['score']:.2f}",
                  "[bold red]yes[/]" if x["flag"] else "no", fams)
    con.print(t)
    for x in [w for w in worst if w["flag"]][:detail]:
        con.print(f"[bold]step {x['step_num']}[/] (rank {x['rank']}, node {x['node_id']}, score {x['score']:.2f}):")
        for sp in x.get("suspects", [])[:5]:
            con.print(f"  [red]{sp['family']}[/] node {sp['node_id']} a={sp['a']:.2f} {fmt_ns(sp['dur_ns'])}")
            for item in sp["evidence"]:
                con.print(f"      {evidence_text(item)}")
        if x.get("slice"):
            con.print(f"  slice: {len(x['slice']['nodes'])} nodes")
