"""The novelty gate on the stage's lasting departures (:data:`teller.rca.LASTING_NOVELTY`), its
cut chosen from the per-step columns `benchmarks/gap_anatomy.py` keeps.

    python benchmarks/lasting_novelty.py OUT [OUT ...] [--view vertical] [--grid 0,0.2,...] -o RESULT.json

Each OUT is a run of gap_anatomy.py (its ``steps.parquet``: the row's answers with its lasting
departures before the gate, and every step's novelty). For each cut of the grid a lasting
departure stays only where its step's novelty is above the cut (0: every one, the row before the
gate); a dropped step takes the model's answer again, as in gap_anatomy's rules. Per block: step
F1, F1 at a 10% prior (the evaluation's draws, its seed), fault-type macro-F1 and the faults and
normal steps dropped. The cut chosen: the highest mean over the blocks of step F1 + F1 at a 10%
prior, ties (three decimals) to the smaller cut. docs/results.md ("Lasting departures where the
model has not seen the kind") says which blocks chose the shipped cut: the nested mechanism folds'
test parts and the request split's val part, no split's test part."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gap_anatomy import novelty_gate, read_steps, rule_scores  # noqa: E402

GRID = (0.0, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8, 1.0)


def block(out: str | Path, view: str) -> tuple[dict[str, np.ndarray], int]:
    """One gap_anatomy OUT's columns for ``view`` and the seed of its low-prior draws."""
    cols, ev = read_steps(out)
    m = cols["view"] == view
    if not m.any():
        raise SystemExit(f"{Path(out) / 'steps.parquet'}: no {view} steps (run gap_anatomy.py with --view {view})")
    return {k: x[m] for k, x in cols.items()}, int(ev.get("seed", 0))


def gated(t: dict[str, np.ndarray], cut: float, seed: int) -> dict[str, Any]:
    """The row's scores with its lasting departures kept only above ``cut`` (0: all)."""
    r = rule_scores(t, novelty_gate(t, cut) if cut > 0 else t["flag"], seed)
    r["kept_before"] = int((t["test"] & t["flag"] & ~t["sustained_flag"]).sum())
    return r


def sweep(outs: list[str], view: str = "vertical", grid: tuple[float, ...] = GRID) -> dict[str, Any]:
    blocks = {str(o): block(o, view) for o in outs}
    rows = []
    for cut in grid:
        per = {name: gated(t, cut, seed) for name, (t, seed) in blocks.items()}
        obj = float(np.mean([r["step_f1"] + r["prior_0.1_f1"] for r in per.values()]))
        rows.append({"cut": cut, "objective": obj, "blocks": per})
    best = max(rows, key=lambda r: (round(r["objective"], 3), -r["cut"]))
    return {"view": view, "grid": list(grid), "blocks": list(blocks), "rows": rows, "chosen": best["cut"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outs", nargs="+", metavar="OUT")
    ap.add_argument("--view", default="vertical")
    ap.add_argument("--grid", default=",".join(str(g) for g in GRID))
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args()
    res = sweep(a.outs, a.view, tuple(float(x) for x in a.grid.split(",")))
    for r in res["rows"]:
        cells = "  ".join(f"{Path(n).name} {b['step_f1']:.3f}/{b['prior_0.1_f1']:.3f} (-{b['dropped_abnormal']}a -{b['dropped_normal']}n)"
                          for n, b in r["blocks"].items())
        print(f"{r['cut']:<5} {r['objective']:.4f}  {cells}")
    print(f"chosen: {res['chosen']}")
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
