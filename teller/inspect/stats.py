"""`teller stats`: counts per layer and kind, binding coverage, repairs, requests and log alignment."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow.compute as pc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from teller.forest import Forest
from teller.rundir import (
    KINDS,
    LAYER_CODE,
    LAYERS,
    RunDir,
    flag_counts,
    kind_codes,
    np_col,
    recording_state,
)

#: reconstruct.json counters and how to say them (the count goes first).
_REPAIR_WORDS = (
    ("truncated", "ranges were still open when their thread (or the recording) ended and were closed at its last event (truncated)"),
    ("repaired_negative_duration", "events ended before they started and became instants (repaired)"),
    ("repaired_partial_overlap", "events stuck out of their parent and were clipped to it (repaired)"),
    ("repaired_pops_without_push", "range ends had no start and were dropped"),
    ("unbound", "GPU rows matched no launch call and stay roots (unbound)"),
    ("duplicate", "ranges reuse an id already seen (kept, flagged duplicate)"),
    ("dropped_copied_events", "events of copied events files were left out (not counted twice)"),
)


def collect_stats(run: str | os.PathLike) -> dict[str, Any]:
    """All figures `teller stats` prints, as a dict (also used by tests and reports)."""
    rd = RunDir(run).require()
    out: dict[str, Any] = {"run": str(rd.path)}
    ev = rd.read_events(columns=["kind", "flags"])
    kc = kind_codes(ev)
    out["events"] = ev.num_rows
    out["events_per_kind"] = {KINDS[i]: int(c) for i, c in enumerate(np.bincount(kc, minlength=len(KINDS))) if c}
    out["event_flags"] = flag_counts(np_col(ev, "flags"))
    if rd.has_table("forest"):
        f = Forest.read(rd.path, columns=["kind", "device", "flags"])
        out["nodes"] = f.n
        out["nodes_per_layer"] = {LAYERS[i]: int(c) for i, c in enumerate(np.bincount(f.layer, minlength=len(LAYERS))) if c}
        gpu = f.is_gpu_work  # kernels (NCCL's, tagged COMM, too), copies and sets
        bound = gpu & (f.parent >= 0) & np.isin(f.layer[np.clip(f.parent, 0, None)], [LAYER_CODE["RT"], LAYER_CODE["DRV"]])
        out["gpu_nodes"] = int(gpu.sum())
        out["binding_coverage"] = float(bound.sum() / gpu.sum()) if gpu.sum() else None
        out["node_flags"] = flag_counts(f.flags)
        out["steps"] = int((f.layer == LAYER_CODE["STEP"]).sum())
    if rd.has_table("requests"):
        req = rd.read_table("requests")
        out["requests"] = len(pc.unique(req.column("request_id")))
        out["request_step_pairs"] = req.num_rows
    if rd.has_table("comm_edges"):
        out["comm_edges"] = rd.read_table("comm_edges").num_rows
    if rd.has_table("log_alignment"):
        la = rd.read_table("log_alignment", "")
        rules = pc.value_counts(la.column("rule").cast("string")).to_pylist()
        out["log_lines"] = la.num_rows
        out["log_rules"] = {r["values"]: int(r["counts"]) for r in rules}
    rj = rd.path / "reconstruct.json"
    if rj.is_file():
        out["reconstruct"] = json.loads(rj.read_text())
    info = rd.read_info()
    out["source"] = info.source
    if info.dropped_records:
        out["dropped_records"] = info.dropped_records
    out["health"] = run_health(rd.path, out.get("reconstruct"))
    return out


def run_health(run: str | os.PathLike, reconstruct: dict[str, Any] | None = None) -> dict[str, Any]:
    """What is wrong with a run, in words: partial-run status (:func:`teller.rundir.recording_state`),
    the readers' warnings (``run.json``), reconstruction's warnings (clock skew, copied files) and
    its repairs and drops. Returns ``status``, ``partial``, ``lost`` and ``lines``."""
    rd = RunDir(run)
    rec = recording_state(rd)
    lines = list(rec["words"])
    info = rd.read_info()
    warns = info.extra.get("warnings") or (info.counts or {}).get("warnings") or []
    lines += [f"input: {w}" for w in warns if isinstance(w, str)]
    if reconstruct is None and (rd.path / "reconstruct.json").is_file():
        try:
            reconstruct = json.loads((rd.path / "reconstruct.json").read_text())
        except ValueError:
            reconstruct = None
    if isinstance(reconstruct, dict):
        rec_words = set(rec["words"])
        lines += [w for w in reconstruct.get("warnings") or [] if isinstance(w, str) and w not in rec_words]
        for key, what in _REPAIR_WORDS:
            v = reconstruct.get(key)
            if isinstance(v, int) and v:
                lines.append(f"{v:,} {what}")
        cr = (reconstruct.get("flags") or {}).get("clock_repaired")
        if cr:
            lines.append(f"{cr:,} rows had their thread's clock repaired (clock_repaired)")
    return {"status": rec["status"], "partial": rec["partial"], "lost": rec["lost"], "lines": lines}


def stats(run: str | os.PathLike, console: Console | None = None) -> dict[str, Any]:
    s = collect_stats(run)
    console = console or Console()
    console.print(f"[bold]{s['run']}[/]  source: {s.get('source') or '?'}  events: {s['events']:,}")
    t = Table("kind", "events", title="events per kind")
    for k, v in s["events_per_kind"].items():
        t.add_row(k, f"{v:,}")
    console.print(t)
    if "nodes" in s:
        t = Table("layer", "nodes", title="forest nodes per layer")
        for k, v in s["nodes_per_layer"].items():
            t.add_row(k, f"{v:,}")
        console.print(t)
        cov = s["binding_coverage"]
        console.print(f"binding coverage: {'n/a (no GPU activity)' if cov is None else f'{cov:.1%}'} of {s['gpu_nodes']:,} GPU nodes bound to a host call")
        console.print(f"steps: {s['steps']:,}  requests: {s.get('requests', 0):,}  comm edges: {s.get('comm_edges', 0):,}")
    else:
        console.print(f"[yellow]not reconstructed yet[/]: run `teller reconstruct {s['run']}`")
    repairs = {**{f"events {k}": v for k, v in s["event_flags"].items()}, **{f"nodes {k}": v for k, v in s.get("node_flags", {}).items()}}
    rec = s.get("reconstruct", {})
    repairs.update({k: v for k, v in rec.items() if isinstance(v, int) and v and any(w in k for w in ("repair", "drop", "unbound", "truncat", "unmatched", "without"))})
    if repairs:
        t = Table("what", "count", title="repaired / flagged")
        for k, v in repairs.items():
            t.add_row(k, f"{v:,}")
        console.print(t)
    else:
        console.print("nothing repaired")
    if "log_lines" in s:
        console.print(f"log lines: {s['log_lines']:,}  aligned by: " + ", ".join(f"{k} {v:,}" for k, v in s["log_rules"].items()))
    if any(v for v in (s.get("dropped_records") or {}).values() if isinstance(v, (int, float))):
        console.print(f"[yellow]dropped records while recording[/]: {s['dropped_records']}")
    h = s["health"]
    state = "partial" if h["partial"] else "complete"
    console.print(f"[bold]run: {state}[/]" + (f" ({h['status']})" if h["status"] != state else ""))
    for line in h["lines"]:
        console.print(f"[yellow]warning[/]: {escape(line)}", highlight=False, soft_wrap=True)
    return s
