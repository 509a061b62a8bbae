"""Two training recipes read over several trainings each, from the goal files of
`benchmarks/goal_check.py --json` (docs/results.md, "The workload blocks trained for 12 epochs"):

    python benchmarks/recipe_compare.py --row teller_sustained_family \\
        --recipe "8 epochs=benchmarks/results/goal_h200_v2_all.json,benchmarks/results/goal_h200_v2_all_third.json" \\
        --recipe "12 epochs=benchmarks/results/goal_h200_v2_all_ep12.json" -o COMPARE.md --json COMPARE.json

A recipe is ``NAME=GOAL.json[,GOAL.json...]``, each file one training of every block it holds. Per
split and view that every recipe holds, and per goal column (step F1, Macro₊ F1, fault-type F1, F1
at a 10% prior), each recipe's trainings are listed (seed by seed, file by file; a block two files
read from the same results file is one training, listed once), with their mean and how many of them
meet the cell. The blocks of one split share their test steps whatever the seed (the seed is the
training's), so a split's trainings are pooled over the seeds; the last recipe is then read against
the first by the exact one-sided rank-sum test, each way: the share of all ways to pick as many of
the pooled values as the last recipe has whose rank sum is at least as high (the last recipe above
the first), or at least as low (below; ties share their rank). One training of a recipe gives no
spread; a p-value says how often labels drawn at random would look at least this far apart, nothing
more.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goal_check  # noqa: E402  (the goal's columns, verdicts and split order)

#: the goal's columns, as goal_check.py names them in its checks
COLUMNS = tuple(name for name, _ in goal_check.COLUMNS) + ("F1 at 10%",)


def rank_sum_p(first: list[float], last: list[float]) -> float:
    """Exact one-sided p of the rank-sum test that ``last`` ranks higher than ``first``: the share of
    the subsets of the pooled values, of ``last``'s size, whose rank sum is at least ``last``'s
    (ranks ascending, ties averaged)."""
    pooled = sorted(first + last)
    rank = {}
    for v in set(pooled):
        where = [i + 1 for i, x in enumerate(pooled) if x == v]
        rank[v] = sum(where) / len(where)
    ranks = [rank[v] for v in first + last]
    mine = sum(rank[v] for v in last)
    subsets = list(combinations(range(len(ranks)), len(last)))
    return sum(1 for s in subsets if sum(ranks[i] for i in s) >= mine - 1e-9) / len(subsets)


def read_recipe(spec: str, row: str) -> tuple[str, dict[tuple[str, str], list[dict[str, Any]]]]:
    """``NAME=FILE[,FILE...]`` → the name and, per (split, view), the row's blocks of every file
    (each with its seed and file), in file order then seed order."""
    name, sep, files = spec.partition("=")
    if not sep or not name or not files:
        raise ValueError(f"--recipe {spec!r}: expected NAME=GOAL.json[,GOAL.json...]")
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    seen: set[tuple[str, str, int, str]] = set()
    for f in files.split(","):
        try:
            checks = json.loads(Path(f).read_text())["checks"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{f}: not a goal file of `benchmarks/goal_check.py --json` ({e})") from e
        mine = sorted((c for c in checks if c["row"] == row), key=lambda c: c["seed"])
        if not mine:
            raise ValueError(f"{f}: no blocks of the row {row}; give --row one of "
                             f"{', '.join(sorted({c['row'] for c in checks}))}")
        for c in mine:
            # one training read by two goal files (a block both took from the same results file,
            # e.g. the scoreboard's request model in every goal file) counts once
            key = (c["split"], c["view"], c["seed"], c.get("source"))
            if c.get("source") is not None and key in seen:
                continue
            seen.add(key)
            out.setdefault((c["split"], c["view"]), []).append({**c, "file": f})
    return name, out


def compare(recipes: list[tuple[str, dict]]) -> list[dict[str, Any]]:
    """Per split and view every recipe holds, per column: each recipe's values, mean and cells met,
    and the last recipe against the first (rank-sum p)."""
    keys = set.intersection(*(set(r) for _, r in recipes))
    out = []
    for split, view in sorted(keys, key=lambda k: (goal_check.SPLIT_ORDER.get(k[0], 9), k[1] != "vertical")):
        entry: dict[str, Any] = {"split": split, "view": view, "columns": {}}
        for col in COLUMNS:
            per = []
            for name, r in recipes:
                blocks = [b for b in r[(split, view)] if b["cells"][col]["value"] is not None]
                vals = [b["cells"][col]["value"] for b in blocks]
                per.append({"recipe": name, "values": vals, "seeds": [b["seed"] for b in blocks],
                            "mean": sum(vals) / len(vals) if vals else None,
                            "met": sum(goal_check.counts_as_met(b["cells"][col]) for b in blocks)})
            got: dict[str, Any] = {"recipes": per}
            if len(per) > 1 and per[0]["values"] and per[-1]["values"]:
                got["p_last_above_first"] = rank_sum_p(per[0]["values"], per[-1]["values"])
                # the other side: the same test on the values negated (the last recipe lower)
                got["p_last_below_first"] = rank_sum_p([-v for v in per[0]["values"]], [-v for v in per[-1]["values"]])
            entry["columns"][col] = got
        out.append(entry)
    return out


def markdown(rows: list[dict[str, Any]], names: list[str]) -> str:
    lines = ["| split, view | column | " + " | ".join(f"{n}: trainings ; mean ; met" for n in names)
             + f" | rank-sum p: {names[-1]} above {names[0]} ; below |", "|---|---|" + "---|" * (len(names) + 1)]
    for e in rows:
        for col in COLUMNS:
            c = e["columns"][col]
            cells = [" / ".join(f"{v:.3f}" for v in r["values"]) + (f" ; {r['mean']:.3f} ; {r['met']} of {len(r['values'])}"
                                                                     if r["values"] else "—") for r in c["recipes"]]
            p, q = c.get("p_last_above_first"), c.get("p_last_below_first")
            lines.append(f"| {e['split']}, {e['view']} | {col} | " + " | ".join(cells)
                         + f" | {'—' if p is None else f'{p:.3f} ; {q:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", action="append", required=True, help="NAME=GOAL.json[,GOAL.json...] (two or more)")
    ap.add_argument("--row", default="teller_sustained_family")
    ap.add_argument("-o", "--out", help="markdown file (default: stdout)")
    ap.add_argument("--json", help="the comparison as JSON")
    a = ap.parse_args(argv)
    try:
        recipes = [read_recipe(s, a.row) for s in a.recipe]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if len(recipes) < 2:
        print("--recipe: give two or more recipes to compare", file=sys.stderr)
        return 2
    rows = compare(recipes)
    if not rows:
        print("the recipes share no split and view: " + "; ".join(
            f"{n}: {', '.join(sorted(f'{s} {v}' for s, v in r))}" for n, r in recipes), file=sys.stderr)
        return 2
    md = markdown(rows, [n for n, _ in recipes])
    if a.out:
        Path(a.out).write_text(f"Row `{a.row}`; recipes: " + "; ".join(a.recipe) + "\n\n" + md + "\n")
    else:
        print(md)
    if a.json:
        Path(a.json).write_text(json.dumps({"row": a.row, "recipes": a.recipe, "comparison": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
