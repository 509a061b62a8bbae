"""Issue 14's goal read from `teller evaluate` results: per split, view and seed, a TELLER row
against the best baseline of each column, and its F1 at a 10% fault prior against the goal's
floor (docs/results.md, "Where the goal stands"):

    python benchmarks/goal_check.py docs/evaluate_v2_all/results_s*.json \\
        --rows teller_sustained_family,teller_mot_family -o docs/evaluate_v2_all/goal.md --json goal.json

A column is met where the row is ahead of every method of another kind (``kind`` other than
``teller``: the unsupervised, supervised and log baselines) that has the column: step F1, operator
Macro₊ F1, fault-type macro-F1 (a method without a type head has no fault-type column); "tie"
where the best baseline has the same figure (which the goal does not count as ahead), "ceiling"
where both are 1 (no method can be ahead of it: counted as met). The 10%
prior column is met where the mean F1 of the evaluation's draws at a 10% prior reaches
:data:`PRIOR_GOAL` of the view. Only blocks that hold the row and at least one baseline are read;
every figure comes from the files given, nothing is typed in.

A new training's rows can be read against baselines scored earlier on the same test steps:
``--baselines OLD/results.json ...`` joins to each block the baseline rows of the block with the
same split, view and seed there (a baseline the block has itself is kept); blocks whose test steps
differ (count, abnormal count or part) are refused:

    python benchmarks/goal_check.py NEW/results.json --baselines docs/evaluate_v2_all/seed0/results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: the goal's floor on step F1 at a 10% fault prior, per view (issue 14)
PRIOR_GOAL = {"vertical": 0.90, "horizontal": 0.85}
#: the columns compared with the baselines: (name, path in a method's row)
COLUMNS = (("step F1", ("step", "f1")), ("Macro₊ F1", ("operator", "macro_plus_f1")),
           ("fault-type F1", ("fault_type", "macro_f1")))
SPLIT_ORDER = {"request": 0, "run": 1, "mechanism": 2, "workload": 3}
#: the verdicts that meet a cell (n/a: a column the block does not have)
MET = ("ahead", "ceiling", "met", "n/a")


def counts_as_met(cell: dict[str, Any]) -> bool:
    """A cell the block has (not n/a) and meets: what the cell counts add up."""
    return cell["verdict"] in MET and cell["verdict"] != "n/a"


def figure(row: dict[str, Any], path: tuple[str, ...]) -> float | None:
    """The figure at ``path`` of a method's row, None where the row has none (no such head, or an
    error row)."""
    v: Any = row
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return None if v is None else float(v)


#: where a method's row keeps its mean F1 over the draws at a 10% prior
PRIOR_PATH = ("low_prior", "0.1", "f1_mean")


def check_block(block: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The row ``name`` of one result block against the block's baselines; None where the block
    lacks the row (or an error stands in its place) or holds no baseline."""
    rows = [m for m in block.get("methods", []) if "error" not in m]
    mine = [m for m in rows if m.get("method") == name]
    base = [m for m in rows if m.get("kind") != "teller"]
    if not mine or not base:
        return None
    row = mine[0]
    cells: dict[str, Any] = {}
    for col, path in COLUMNS:
        v = figure(row, path)
        have = [(figure(b, path), b["method"]) for b in base]
        have = [(x, n) for x, n in have if x is not None]
        if v is None or not have:
            cells[col] = {"value": v, "best_baseline": None, "verdict": "n/a"}
            continue
        best, who = max(have, key=lambda t: t[0])
        verdict = "ahead" if v > best else ("ceiling" if v >= 1.0 else "tie") if v == best else "behind"
        cells[col] = {"value": v, "best_baseline": best, "baseline": who, "verdict": verdict}
    p = figure(row, PRIOR_PATH)
    goal = PRIOR_GOAL.get(block.get("view", ""), PRIOR_GOAL["vertical"])
    bp = [(x, b["method"]) for b in base if (x := figure(b, PRIOR_PATH)) is not None]
    cells["F1 at 10%"] = {"value": p, "goal": goal, "verdict": "n/a" if p is None else "met" if p >= goal else "under"}
    if bp:
        cells["F1 at 10%"]["best_baseline"], cells["F1 at 10%"]["baseline"] = max(bp)
    return {"split": block.get("split"), "view": block.get("view"), "seed": block.get("seed"), "row": name,
            "test_steps": block.get("test_steps"), "test_abnormal": block.get("test_abnormal"), "cells": cells,
            "met": all(c["verdict"] in MET for c in cells.values())}


#: what two blocks must share for one's baselines to be read beside the other's rows
SAME_STEPS = ("test_steps", "test_abnormal", "part")


def join_baselines(results: list[dict[str, Any]], others: list[dict[str, Any]]) -> None:
    """Add to each block of ``results`` the baseline rows of the block of ``others`` with the same
    split, view and seed (rows the block already has by name are kept as they are). Raises
    ValueError naming both files where such blocks were scored on different test steps."""
    by_key: dict[tuple, tuple[dict[str, Any], str]] = {}
    for res in others:
        for b in res.get("results", []):
            if "skipped" not in b:
                by_key.setdefault((b.get("split"), b.get("view"), b.get("seed")), (b, res.get("_path", "")))
    for res in results:
        for b in res.get("results", []):
            got = by_key.get((b.get("split"), b.get("view"), b.get("seed")))
            if "skipped" in b or got is None:
                continue
            ob, where = got
            diff = [k for k in SAME_STEPS if b.get(k) != ob.get(k)]
            if diff:
                raise ValueError(f"{res.get('_path', '')} and {where}: the {b.get('split')}, {b.get('view')}, seed "
                                 f"{b.get('seed')} blocks differ in {', '.join(f'{k} ({b.get(k)} against {ob.get(k)})' for k in diff)}; "
                                 "their baselines were scored on other test steps: score them with this evaluation's split and seed")
            have = {m.get("method") for m in b.get("methods", [])}
            b["methods"] = list(b.get("methods", [])) + [m for m in ob.get("methods", [])
                                                         if m.get("kind") != "teller" and m.get("method") not in have]
            b["baselines_from"] = where


def check(results: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    out = []
    for res in results:
        for block in res.get("results", []):
            if "skipped" in block:
                continue
            for name in names:
                got = check_block(block, name)
                if got is not None:
                    got["source"] = res.get("_path", "")
                    out.append(got)
    rank = {n: i for i, n in enumerate(names)}
    out.sort(key=lambda c: (rank[c["row"]], SPLIT_ORDER.get(c["split"], 9), c["view"] != "vertical", c["seed"]))
    return out


def _cell(c: dict[str, Any]) -> str:
    if c["value"] is None:
        return "—"
    v = f"{c['value']:.3f}"
    if "goal" in c:
        return (f"**{v}**" if c["verdict"] == "met" else v) + (f" (best baseline {c['best_baseline']:.3f})" if "best_baseline" in c else "")
    if c["best_baseline"] is None:
        return v
    b = f"{c['best_baseline']:.3f}"
    if v == b and c["verdict"] in ("ahead", "behind"):  # apart by less than the third decimal: show the fourth
        v, b = f"{c['value']:.4f}", f"{c['best_baseline']:.4f}"
    mark = {"ahead": f"**{v}**", "ceiling": f"**{v}** (tie at the ceiling)", "tie": f"{v} (tie)",
            "behind": f"{v} (behind)"}[c["verdict"]]
    return f"{mark} against {b} ({c['baseline']})"


def markdown(checks: list[dict[str, Any]]) -> str:
    lines = []
    for name in dict.fromkeys(c["row"] for c in checks):
        mine = [c for c in checks if c["row"] == name]
        cols = [k for k, _ in COLUMNS] + ["F1 at 10%"]
        met = sum(1 for c in mine for k in cols if counts_as_met(c["cells"][k]))
        counted = sum(1 for c in mine for k in cols if c["cells"][k]["verdict"] != "n/a")
        lines += [f"**`{name}`**: {met} of {counted} cells met; blocks met whole: "
                  f"{sum(c['met'] for c in mine)} of {len(mine)}. Bold: ahead of every baseline, or tied with one at 1.000 "
                  f"(the first three columns), or at the goal's floor (10% prior: {PRIOR_GOAL['vertical']:.2f} vertical, "
                  f"{PRIOR_GOAL['horizontal']:.2f} horizontal).", "",
                  "| split, view, seed (test steps, abnormal) | " + " | ".join(cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for c in mine:
            head = f"{c['split']}, {c['view']}, seed {c['seed']} ({c['test_steps']:,}, {c['test_abnormal']:,})"
            lines.append(f"| {head} | " + " | ".join(_cell(c["cells"][k]) for k in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def read_results(paths: list[str]) -> list[dict[str, Any]]:
    """The results files at ``paths``, each marked with its path; ValueError naming a file that is
    not one."""
    out = []
    for p in paths:
        try:
            res = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: not a results file of `teller evaluate` ({e})") from e
        res["_path"] = p
        out.append(res)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json files of `teller evaluate`")
    ap.add_argument("--rows", default="teller_sustained_family", help="TELLER rows to check (comma-separated)")
    ap.add_argument("-o", "--out", help="markdown file (default: stdout)")
    ap.add_argument("--json", help="the checks as JSON")
    ap.add_argument("--baselines", nargs="+", default=[], help="results.json files whose baseline rows are read beside "
                    "the rows of the blocks with the same split, view and seed (a new training against baselines scored before)")
    a = ap.parse_args(argv)
    try:
        results, others = read_results(a.results), read_results(a.baselines)
        join_baselines(results, others)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    checks = check(results, [r for r in a.rows.split(",") if r])
    if not checks:
        print(f"none of the rows {a.rows} is in a block with a baseline in {', '.join(a.results)}", file=sys.stderr)
        return 2
    md = markdown(checks)
    if a.out:  # a file of its own says what it was read from
        md = ("# Issue 14's goal, cell by cell (`benchmarks/goal_check.py`)\n\nRead from: "
              + ", ".join(f"`{p}`" for p in a.results)
              + ("; baselines from: " + ", ".join(f"`{p}`" for p in a.baselines) if a.baselines else "") + "\n\n" + md)
        Path(a.out).write_text(md + "\n")
    else:
        print(md)
    if a.json:
        head = {"sources": a.results, **({"baselines": a.baselines} if a.baselines else {})}
        Path(a.json).write_text(json.dumps({**head, "rows": a.rows.split(","), "prior_goal": PRIOR_GOAL, "checks": checks},
                                           indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
