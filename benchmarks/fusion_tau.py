"""How the numeric stage's and the root-cause model's answers combine, from `teller evaluate`'s
per-step answers (``predictions.parquet`` holding the ``teller_numeric`` and ``teller_mot`` rows):
step precision / recall / F1 of the model alone, the stage alone, either (``teller``), both at the
model's own 0.5, and for a grid of tau the stage's flags the model gives at least tau
(``teller_confirm`` and `teller diagnose` at tau 0.1) and the screen rule (``teller_screened``: the
model's flags, and the stage's where the model gives the step at least tau), per split and view.

    python benchmarks/fusion_tau.py PRED.parquet [PRED2.parquet ...] [--taus 0.001,0.003,0.01,0.03,0.1] [--json OUT]

Several files are joined (e.g. the model's answers from the GPU machine and the stage's from the
CPU). The rules are :func:`teller.baselines.rca.fuse`'s, applied to the rows as stored.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import pyarrow as pa
import pyarrow.parquet as pq

from teller.baselines.base import Prediction
from teller.baselines.rca import fuse
from teller.evaluate.scores import step_scores


def blocks(paths: list[str]) -> dict[tuple[str, str], dict[str, pa.Table]]:
    """(split, view) -> {method: its rows sorted by (run_id, step_id)} for the two rows fused."""
    t = pa.concat_tables([pq.read_table(p) for p in paths], promote_options="permissive")
    out: dict[tuple[str, str], dict[str, pa.Table]] = defaultdict(dict)
    for split in sorted(set(t.column("split").to_pylist())):
        for view in sorted(set(t.column("view").to_pylist())):
            for m in ("teller_mot", "teller_numeric"):
                mask = [s == split and v == view and x == m for s, v, x in
                        zip(t.column("split").to_pylist(), t.column("view").to_pylist(), t.column("method").to_pylist(), strict=True)]
                rows = t.filter(pa.array(mask)).sort_by([("run_id", "ascending"), ("step_id", "ascending")])
                if rows.num_rows:
                    out[(split, view)][m] = rows
    return {k: v for k, v in out.items() if len(v) == 2}


def _pred(rows: pa.Table) -> Prediction:
    return Prediction(score=rows.column("score").to_numpy(zero_copy_only=False).astype(float),
                      flag=rows.column("flag").to_numpy(zero_copy_only=False).astype(bool),
                      fault_type=rows.column("fault_type").to_pylist(), operators=rows.column("operators").to_pylist())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pred", nargs="+")
    ap.add_argument("--taus", default="0.001,0.003,0.01,0.03,0.1")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    taus = [float(x) for x in a.taus.split(",")]
    res = {}
    for (split, view), rows in sorted(blocks(a.pred).items()):
        mot, num = rows["teller_mot"], rows["teller_numeric"]
        if mot.select(["run_id", "step_id"]) != num.select(["run_id", "step_id"]):
            raise SystemExit(f"{split}/{view}: the two rows hold different steps")
        truth = mot.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
        pm, pn = _pred(mot), _pred(num)
        r = {"steps": len(truth), "abnormal": int(truth.sum()), "model": step_scores(truth, pm.flag), "stage": step_scores(truth, pn.flag),
             "either": step_scores(truth, fuse(pn, pm, "or").flag), "both": step_scores(truth, fuse(pn, pm, "and").flag)}
        r.update({f"screen tau={t:g}": step_scores(truth, fuse(pn, pm, "screen", t).flag) for t in taus})
        r.update({f"stage and model>={t:g}": step_scores(truth, fuse(pn, pm, "and", t).flag) for t in taus})
        res[f"{split}/{view}"] = r
        cells = "  ".join(f"{k} {v['f1']:.3f}" for k, v in r.items() if isinstance(v, dict))
        print(f"{split:9s} {view:10s} ({r['steps']}, {r['abnormal']}): {cells}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"inputs": a.pred, "taus": taus, "blocks": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
