"""Shared helpers for the reconstruction tests: tiny runs from row lists, a forest checker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from teller.reconstruct import reconstruct
from teller.rundir import RunDir, events_table

COLS = ("kind", "name", "tid", "start_ns", "end_ns", "corr_id")


def write_run(path: Path, rows: list[dict], **defaults) -> RunDir:
    """A run directory holding ``rows`` (dicts of event columns; pid 100, rank 0 by default)."""
    base = {"pid": 100, "rank": 0, "node": 0, "tid": 1, "device": -1, "stream": -1, "end_ns": -1, "corr_id": -1, "name": ""}
    base.update(defaults)
    full = [{**base, **r} for r in rows]
    keys = {k for r in full for k in r}
    fill = {"layer": "", "args": None}
    cols = {k: [r.get(k, fill.get(k, -1)) for r in full] for k in keys}
    rd = RunDir(path)
    rd.write_events(events_table(cols, len(full)))
    return rd


def run_and_read(path: Path, rows: list[dict], step_patterns=None, **defaults) -> tuple[dict, list[dict], RunDir]:
    rd = write_run(path, rows, **defaults)
    summary = reconstruct(path, step_patterns=step_patterns)
    return summary, rd.read_table("forest").to_pylist(), rd


def by_name(forest: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in forest}


def parent_names(forest: list[dict]) -> dict[str, str | None]:
    """name → parent's name (None for roots); names must be unique."""
    names = [r["name"] for r in forest]
    return {r["name"]: (names[r["parent_id"]] if r["parent_id"] >= 0 else None) for r in forest}


def check_forest(table: pa.Table) -> None:
    """Invariants every forest must satisfy (slow Python checks, fine for small test runs)."""
    f = table.to_pydict()
    n = len(f["node_id"])
    assert f["node_id"] == list(range(n))
    parent, depth, size, step = f["parent_id"], f["depth"], f["size"], f["step_id"]
    layer, start, end = f["layer"], f["start_ns"], f["end_ns"]
    ref_size = [1] * n
    for i in range(n - 1, -1, -1):
        p = parent[i]
        assert -1 <= p < i, f"row {i}: parent {p} does not precede it"
        if p >= 0:
            ref_size[p] += ref_size[i]
    for i in range(n):
        p = parent[i]
        assert depth[i] == (depth[p] + 1 if p >= 0 else 0), f"row {i}: depth"
        # the subtree of i is the block [i, i + size)
        assert size[i] == ref_size[i], f"row {i}: size {size[i]} != {ref_size[i]}"
        if i + size[i] < n:
            q = parent[i + size[i]]
            while q > i:
                q = parent[q]
            assert q != i, f"row {i + size[i]} lies in {i}'s subtree but after its block"
        # innermost STEP at or above
        a, want = i, -1
        while a >= 0:
            if layer[a] == "STEP":
                want = a
                break
            a = parent[a]
        assert step[i] == want, f"row {i}: step_id {step[i]} != {want}"
        assert end[i] >= start[i], f"row {i}: end before start"
        # host children lie inside their host parent (GPU rows run later, on the device)
        if p >= 0 and f["tid"][i] >= 0 and f["tid"][p] >= 0 and f["tid"][i] == f["tid"][p]:
            assert start[p] <= start[i] and end[i] <= end[p], f"row {i} not inside its parent {p}"


def reconciles(s: dict) -> bool:
    """Events in = forest rows made from events (all but the GAP rows) + pops consumed + pops dropped."""
    return s["reconciled"] and s["events_in"] == s["nodes"] - s.get("gap_nodes", 0) + s["pops_consumed"] + s["repaired_pops_without_push"]


def as_np(table: pa.Table, col: str) -> np.ndarray:
    return table.column(col).to_numpy()
