"""The datasheet: counts per category, mechanism, view and split; the fault prior; the runs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.dataset.splits import SPLIT_COLUMNS


def _counts(t: pa.Table, col: str, where: Any = None) -> dict[str, int]:
    vals = t.column(col).to_pylist()
    if where is not None:
        vals = [v for v, w in zip(vals, where, strict=False) if w]
    return dict(sorted(Counter(str(v) for v in vals).items()))


def _step_counts(records: pa.Table) -> dict[str, Any]:
    """Counts of distinct steps (one rank's step; vertical records), not of (request, step) records."""
    v = records.filter(pc.equal(records.column("view"), "vertical"))
    key = pc.binary_join_element_wise(v.column("run_id"), pc.cast(v.column("step_id"), pa.string()), "\x1f")
    _, first = np.unique(np.asarray(key.to_pylist(), dtype=object), return_index=True)
    st = v.take(pa.array(first))
    ab = st.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    cats = _counts(st, "fault_type", ab.tolist())
    na = int(ab.sum())
    return {"steps": st.num_rows, "abnormal_steps": na, "abnormal_steps_by_category": cats,
            "category_share_of_abnormal_steps": {k: c / na for k, c in cats.items()} if na else {},
            "abnormal_steps_by_mechanism": _counts(st, "mechanism", ab.tolist())}


def write_datasheet(records: pa.Table, runs: list[dict[str, Any]], out: Path, seed: int = 0,
                    held_out: dict[str, list[str]] | None = None, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``datasheet.json`` and ``datasheet.md``; returns the JSON dict."""
    ab = records.column("is_anomaly").to_pylist()
    n, na = records.num_rows, sum(bool(x) for x in ab)
    held_out = held_out or {}
    split_cols = [c for c in SPLIT_COLUMNS if c in records.column_names]
    sheet: dict[str, Any] = {
        "records": n, "abnormal": na, "fault_prior": (na / n) if n else 0.0, "seed": seed,
        "by_view": _counts(records, "view"),
        "abnormal_by_category": _counts(records, "fault_type", ab),
        "abnormal_by_mechanism": _counts(records, "mechanism", ab),
        "by_split": {s: _counts(records, s) for s in split_cols},
        "abnormal_by_split": {s: _counts(records, s, ab) for s in split_cols},
        "requests": len(set(zip(records.column("run_id").to_pylist(), records.column("request_id").to_pylist(), strict=False))),
        "runs": runs, "held_out_mechanisms": held_out.get("mechanisms", []),
        "in_window_without_effect": int(sum(1 for a, w in zip(ab, records.column("in_window").to_pylist(), strict=False) if w and not a)),
        "tpe_fields": "null until a tokenizer is attached (teller.dataset.build.attach_tpe)",
    }
    cats = sheet["abnormal_by_category"]
    sheet["category_share_of_abnormal"] = {k: v / na for k, v in cats.items()} if na else {}
    sheet.update(_step_counts(records))
    if "workload" in records.column_names:
        sheet["by_workload"] = _counts(records, "workload")
        sheet["held_out_workloads"] = held_out.get("workloads", [])
    sheet["sampling"] = sampling or {"normal_every": 1, "rule": "all steps"}
    sheet["steps_recorded"] = sum(int(r.get("steps", 0)) for r in runs)
    (out / "datasheet.json").write_text(json.dumps(sheet, indent=2, default=str))
    lines = [f"# Datasheet: {out.name}", "",
             f"{n} step records ({na} abnormal, fault prior {sheet['fault_prior']:.3f}) from {len(runs)} runs, "
             f"{sheet['requests']} requests; split seed {seed}. A record is one request in one step (and view).", "",
             f"Steps: {sheet['steps']} kept of {sheet['steps_recorded']} recorded (one rank's step each; "
             f"{sheet['abnormal_steps']} abnormal). Sampling: {sheet['sampling']['rule']}.", "",
             "| view | records |", "|---|---|"] + [f"| {k} | {v} |" for k, v in sheet["by_view"].items()]
    lines += ["", "| fault type | abnormal records | share |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {v / na:.2f} |" for k, v in cats.items()] if na else ["| - | 0 | - |"]
    sc = sheet["abnormal_steps_by_category"]
    lines += ["", "| fault type | abnormal steps | share |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {v / sheet['abnormal_steps']:.2f} |" for k, v in sc.items()] if sc else ["| - | 0 | - |"]
    lines += ["", "| mechanism | abnormal records | abnormal steps |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {sheet['abnormal_steps_by_mechanism'].get(k, 0)} |" for k, v in sheet["abnormal_by_mechanism"].items()]
    if "by_workload" in sheet:
        lines += ["", "| workload (model shape) | records |", "|---|---|"]
        lines += [f"| {k or '(unknown)'} | {v} |" for k, v in sheet["by_workload"].items()]
    for s in split_cols:
        lines += ["", f"| {s} | records | abnormal |", "|---|---|---|"]
        lines += [f"| {k} | {v} | {sheet['abnormal_by_split'][s].get(k, 0)} |" for k, v in sheet["by_split"][s].items()]
    wl_line = ([f"Held-out workloads (workload-disjoint test): {', '.join(sheet['held_out_workloads']) or 'none'}.", ""]
               if "split_workload" in records.column_names else [])
    lines += ["", f"Held-out mechanisms (mechanism-disjoint test): {', '.join(sheet['held_out_mechanisms']) or 'none'}.", "",
              *wl_line,
              "| run | status | steps recorded | steps kept | records | skipped faults |", "|---|---|---|---|---|---|"]
    for r in runs:
        sk = "; ".join(f"{x['mechanism']}: {x['reason']}" for x in r.get("skipped", []))
        lines.append(f"| {r['run_id']} | {r['status']} | {r.get('steps', 0)} | {r.get('steps_kept', 0)} | {r['records']} | {sk} |")
    lines += ["", f"Steps inside a fault window that showed no effect (labelled normal): "
              f"{sheet['in_window_without_effect']}.", ""]
    (out / "datasheet.md").write_text("\n".join(lines))
    return sheet
