"""What step sampling (``teller record --detail-every K``) keeps, per step, on a real recording.

    python benchmarks/detail_sampling.py RUN [RUN ...] [--json OUT]

For each reconstructed run: the steps marked ``detail=0`` and the others, and per class the
kernels, memory copies, runtime calls and BE ranges bound to the step (medians and totals), so a
sampled recording can be set beside one with every step in detail (``--detail-every 1``): a
detailed step of a sampled run should hold what every step of the full run holds, a sampled-out
step none of it. Also the detail gate's own figures from ``run.json`` (steps, detailed, collector
switches and their time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from teller.forest import Forest
from teller.reconstruct.steps import without_detail
from teller.rundir import LAYER_CODE, RunDir


def step_counts(run: str | Path) -> dict[str, Any]:
    rd = RunDir(run).require()
    fa = Forest.read(rd.path)
    steps = rd.read_table("steps")
    names = [x or "" for x in steps.column("name").to_pylist()]
    detailed = ~without_detail(names)
    n = len(names)
    sidx = fa.step_idx
    inside = sidx >= 0
    kinds = {
        "kernels": fa.kind_or_layer("KERNEL", "K") & fa.is_gpu,
        "copies": (fa.kind_or_layer("MEMCPY", "MEM") | fa.kind_or_layer("MEMSET", "MEM")) & fa.is_gpu,
        "runtime_calls": fa.kind_or_layer("RUNTIME", "RT") & ~fa.is_gpu,
        "be_ranges": fa.layer == LAYER_CODE["BE"],
        "fe_ranges": fa.layer == LAYER_CODE["FE"],
    }
    out: dict[str, Any] = {"run": str(rd.path), "steps": n, "detailed": int(detailed.sum())}
    for cls, mask in (("detailed", detailed), ("sampled_out", ~detailed)):
        row: dict[str, Any] = {"steps": int(mask.sum())}
        for name, m in kinds.items():
            c = np.bincount(sidx[m & inside], minlength=n)[:n]
            v = c[mask]
            row[name] = {"median": float(np.median(v)) if len(v) else None, "total": int(v.sum()),
                         "steps_with_none": int((v == 0).sum())}
        out[cls] = row
    info = json.loads((rd.path / "run.json").read_text())
    gates = []
    for p in info.get("processes", []) or []:
        coll = p.get("collector") or {}
        if coll.get("detail"):
            gates.append(coll["detail"])
    out["gates"] = gates
    out["cupti_switches"] = [c.get("detail_switches") for p in info.get("processes", []) or []
                             for c in (p.get("collectors") or []) if isinstance(c, dict) and c.get("name") == "cupti"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = [step_counts(r) for r in a.runs]
    text = json.dumps(res, indent=1)
    if a.json:
        Path(a.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
