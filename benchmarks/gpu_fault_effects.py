"""Effect sizes of the fault mechanisms on recorded GPU runs (docs/faults.md, H200 section).

    python benchmarks/gpu_fault_effects.py RUN [RUN ...] [-o ROWS.json]

Reads labelled, reconstructed run directories (``forest``, ``steps``, ``step_labels`` and
``labels.json``; raw events are not needed) and prints one Markdown row per applied window of
every faulty run: steps in the window, step p50 and p99 outside → inside (ms), step GPU time p50
outside → inside (kernels, copies and sets in the step's subtree), the families whose host time
and whose GPU time grew most, and the labelled abnormal / in-window step counts.

The baseline is the run's own steps outside every window. Where fewer than ``MIN_REF`` such
steps exist (whole-run mechanisms such as ``kv_cache_pressure``) it is a fault-free run among the
arguments with the same workload up to the seed (the one the labeller used when it is there).
Runs that were not recorded (``status: skipped``) are listed under the table with their reason.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from teller.inject import CATEGORY_TITLES
from teller.inject.labels import MIN_REF, read_step_labels

CATEGORY_ORDER = list(CATEGORY_TITLES)


def _labels(run: Path) -> dict[str, Any]:
    p = run / "labels.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _same_workload(a: dict[str, Any], b: dict[str, Any]) -> bool:
    drop = ("seed",)
    return {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def _reference(run: Path, lab: dict[str, Any], normals: dict[str, tuple[Path, dict[str, Any]]]) -> Path | None:
    """The fault-free run to compare a whole-run window with: the labeller's, else the first of
    the same workload (seed aside), else the first of the same workload kind."""
    named = (lab.get("label_summary") or {}).get("reference")
    if named in normals:
        return normals[named][0]
    wl = lab.get("workload") or {}
    for path, nl in normals.values():
        if _same_workload(wl, nl.get("workload") or {}):
            return path
    for path, nl in normals.values():
        if (nl.get("workload") or {}).get("kind") == wl.get("kind"):
            return path
    return None


def _label_counts(run: Path) -> dict[str, tuple[int, int]]:
    """Per window id: (abnormal steps, in-window steps) as labelled in ``step_labels.parquet``."""
    t = read_step_labels(run)
    if t is None:
        return {}
    wid = np.asarray(t.column("window_id").to_numpy(zero_copy_only=False), dtype=object)
    anom = np.asarray(t.column("is_anomaly").to_numpy(zero_copy_only=False), bool)
    inw = np.asarray(pc.fill_null(t.column("in_window"), False).to_numpy(zero_copy_only=False), bool)
    return {str(w): (int((anom & (wid == w)).sum()), int((inw & (wid == w)).sum())) for w in set(wid[inw].tolist())}


def effects_rows(runs: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Effect rows of every applied window (one per window id and run), and the skipped runs."""
    from teller.inject.effects import window_effects

    labs = {r: _labels(r) for r in runs}
    normals = {r.name: (r, lab) for r, lab in labs.items()
               if lab.get("status") == "finished" and not lab.get("windows")}
    rows, skipped = [], []
    for run, lab in labs.items():
        if lab.get("status") != "finished":
            skipped.append({"run_id": lab.get("run_id", run.name), "status": lab.get("status"),
                            "skipped": lab.get("skipped", [])})
            continue
        if not lab.get("windows"):
            continue
        counts = _label_counts(run)
        effects = window_effects(run)
        ref = None
        if any(e["out_n"] < MIN_REF for e in effects):
            ref = _reference(run, lab, normals)
            if ref is not None:
                by_win = {e["window"]: e for e in window_effects(run, ref)}
                effects = [by_win[e["window"]] if e["out_n"] < MIN_REF else e for e in effects]
        seen: dict[str, dict[str, Any]] = {}
        applied = [w for w in lab["windows"] if w.get("start_tau_ns") is not None]
        for w, e in zip(applied, effects, strict=True):
            if e["window"] in seen:  # one fault applied on several ranks: one window per process
                seen[e["window"]]["ranks"].append(w.get("rank"))
                continue
            e = dict(e, run=run.name, ranks=[w.get("rank")],
                     baseline_run=ref.name if ref is not None and e["baseline"] == "reference run" else None)
            e["labelled_abnormal"], e["labelled_in_window"] = counts.get(e["window"], (0, 0))
            seen[e["window"]] = e
            rows.append(e)
    rows.sort(key=lambda e: (CATEGORY_ORDER.index(e["category"]) if e["category"] in CATEGORY_ORDER else 99,
                             e["mechanism"], e["run"], e["window"]))
    return rows, skipped


def short_family(f: str, width: int = 44) -> str:
    """A family name fit for a table cell: kernel names lose ``void``, templates and arguments."""
    layer, _, name = f.partition(" ")
    if layer == "K":  # C++ signature → qualified name: no templates, no parameters, no return type
        name = name.replace("(anonymous namespace)::", "")
        while re.search(r"<[^<>]*>", name):
            name = re.sub(r"<[^<>]*>", "", name)
        name = (name.split("(", 1)[0].split() or [name])[-1]
    name = name if len(name) <= width else name[: width - 1] + "…"
    return f"{layer} {name}"


def _growth(items: list[str], top: int) -> str:
    out = []
    for s in items[:top]:
        fam, _, g = s.rpartition(" +")
        out.append(f"{short_family(fam)} +{g}")
    return "; ".join(out) or "-"


def _ms(x: float) -> str:
    return "-" if not np.isfinite(x) else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def markdown(rows: list[dict[str, Any]], skipped: list[dict[str, Any]], top: int = 3) -> str:
    head = ("| run | mechanism | category | magnitude | steps in window | step p50 out → in (ms) "
            "| step p99 out → in (ms) | step GPU p50 out → in (ms) | largest growth of family time "
            "| largest growth of GPU time under family | abnormal / in window |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for e in rows:
        run = e["run"] + (f" (vs {e['baseline_run']})" if e.get("baseline_run") else "")
        if len(e["ranks"]) > 1:
            run += f" (ranks {', '.join(str(r) for r in e['ranks'])})"
        lines.append(
            f"| {run} | {e['mechanism']} | {CATEGORY_TITLES.get(e['category'], e['category'])} | {e['magnitude']:g} "
            f"| {e['in_n']} | {_ms(e['out_p50_ms'])} → {_ms(e['in_p50_ms'])} | {_ms(e['out_p99_ms'])} → {_ms(e['in_p99_ms'])} "
            f"| {_ms(e['gpu_out_p50_ms'])} → {_ms(e['gpu_in_p50_ms'])} | {_growth(e['affected_layers'], top)} "
            f"| {_growth(e['affected_layers_gpu'], top)} | {e['labelled_abnormal']} / {e['labelled_in_window']} |")
    for s in skipped:
        why = "; ".join(f"{k['mechanism']}: {k.get('reason', '')}" for k in s["skipped"]) or "no reason recorded"
        lines.append(f"\nNot recorded: {s['run_id']} ({s['status']}; {why}).")
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    """NaN (no steps on one side) becomes null; numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else None
    return x.item() if isinstance(x, np.generic) else x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="labelled run directories")
    ap.add_argument("-o", "--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--top", type=int, default=3, help="families per growth cell")
    a = ap.parse_args(argv)
    rows, skipped = effects_rows([r for r in a.runs if r.is_dir()])
    print(markdown(rows, skipped, a.top))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(_jsonable({"rows": rows, "skipped": skipped}), indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
