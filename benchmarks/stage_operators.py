"""How many operators the numeric stage names for a flagged step (:data:`teller.localize.naming.MAX_OPERATORS`),
measured on the nested mechanism hold-outs, where every lasting departure the rows keep is the stage's.

    python benchmarks/stage_operators.py evaluate DATASET --answers PRED --models DIR -o OUT [--caps none,1,2,3,4]
    python benchmarks/stage_operators.py summarize OUT [OUT ...] -o RESULT.json

``evaluate`` runs, once per cap, `teller evaluate DATASET --split mechanism --view
vertical,horizontal --seed 0` of the rows that name the stage's operators (`teller_numeric_deploy`,
`teller_diagnose_family`, `teller_sustained_family`, beside the model rows they read) with the
model's answers ``PRED`` and its config.json under ``DIR`` (``--reuse PRED --models DIR``: no
weights), the stage naming at most that many operators (``none``: every candidate and the
evidence's family); results in ``OUT/cap_N/``. A cap moves no flag and no fault type, only the
operators. ``summarize`` reads those OUTs (one per fold) and writes, per cap, each row's operator
Macro₊ F1 per fold and view, its mean over the blocks and its mean per fold. docs/results.md
("The operators a stage flag names") says which cap was taken and why.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROWS = ("teller_numeric_deploy", "teller_diagnose_family", "teller_sustained_family")
METHODS = ("teller_mot_family", "teller_mot_family_sustained", *ROWS)


def parse_caps(text: str) -> list[int | None]:
    return [None if c.strip() == "none" else int(c) for c in text.split(",") if c.strip()]


def cap_name(cap: int | None) -> str:
    return "cap_none" if cap is None else f"cap_{cap}"


def evaluate(a: argparse.Namespace) -> None:
    from teller.baselines import numeric
    from teller.cli import main

    for cap in parse_caps(a.caps):
        numeric.TellerNumeric.max_operators = cap
        out = Path(a.out) / cap_name(cap)
        rc = main(["evaluate", a.dataset, "--split", "mechanism", "--view", "vertical,horizontal", "--seed", "0",
                   "--methods", ",".join(METHODS), "--reuse", a.answers, "--models", a.models, "-o", str(out)])
        if rc:
            raise SystemExit(f"teller evaluate failed for {cap_name(cap)} (exit {rc})")


def macro_plus(results: Path) -> dict[str, dict[str, float]]:
    """Per row, its operator Macro₊ F1 per view of one results.json."""
    r = json.loads(results.read_text())
    out: dict[str, dict[str, float]] = {}
    for b in r["results"]:
        for m in b["methods"]:
            if m["method"] in ROWS:
                out.setdefault(m["method"], {})[b["view"]] = float(m["operator"]["macro_plus_f1"])
    return out


def summarize(outs: list[str]) -> dict[str, Any]:
    caps = sorted({p.name for o in outs for p in Path(o).glob("cap_*") if (p / "results.json").is_file()})
    rows = []
    for c in caps:
        per = {}
        for o in outs:
            f = Path(o) / c / "results.json"
            if not f.is_file():
                raise SystemExit(f"{f}: missing (run `evaluate` for {c} on every fold)")
            per[Path(o).name] = macro_plus(f)
        row: dict[str, Any] = {"cap": c.removeprefix("cap_"), "blocks": per}
        for name in ROWS:
            vals = {fold: list(v[name].values()) for fold, v in per.items() if name in v}
            flat = [x for xs in vals.values() for x in xs]
            if flat:
                row[name] = {"mean": sum(flat) / len(flat), "per_fold": {f: sum(x) / len(x) for f, x in vals.items()}}
        rows.append(row)
    return {"folds": [Path(o).name for o in outs], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("evaluate")
    e.add_argument("dataset")
    e.add_argument("--answers", required=True, help="the model rows' answers (predictions.parquet of a `teller evaluate` run)")
    e.add_argument("--models", required=True, help="the folder of the models' config.json (their floors and novelty cut)")
    e.add_argument("--caps", default="none,1,2,3,4")
    e.add_argument("-o", "--out", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("outs", nargs="+")
    s.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    if a.what == "evaluate":
        evaluate(a)
        return
    res = summarize(a.outs)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for r in res["rows"]:
        print(r["cap"], {n: round(r[n]["mean"], 4) for n in ROWS if n in r},
              {f: round(v, 4) for f, v in r.get("teller_sustained_family", {}).get("per_fold", {}).items()}, file=sys.stderr)


if __name__ == "__main__":
    main()
