"""Programmatic checks of explanations (docs/design.md §11): the shipped root-cause model's own
sentences and the dataset's reference sentences, on the truly abnormal test steps of a split.

    python benchmarks/explain_checks.py [--model DIR] [--ds data/h200_v2] [--split request] [--out FILE]

For every truly abnormal unit of the split's test part (the model's units,
``teller.dataset.splits.step_representatives``) the model predicts with explanations (greedy,
CPU); ``teller.evaluate.scores.explanation_checks`` scores the model's sentence as written, the
same sentence grounded as ``teller diagnose`` shows it (vertical units; no numeric-stage
numbers, as the dataset has no reference run here) and the reference sentence, against the unit's
labelled category and operators and the operator families of its own tree. Prints the rates and
writes them (with the per-step booleans' counts) as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the shipped one)")
    ap.add_argument("--ds", default=str(ROOT / "data" / "h200_v2"))
    ap.add_argument("--split", default=None, help="default: the split the model was trained on")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from teller.evaluate.scores import EXPLANATION_CHECKS, explanation_checks
    from teller.rca import DEFAULT_MODEL, load
    from teller.rca.data import FAULT_TYPES, load_dataset
    from teller.rca.train import prepare_units

    t0 = time.perf_counter()
    m = load(a.model or DEFAULT_MODEL)
    split = a.split or m.meta.get("training", {}).get("split", "request")
    ds = load_dataset(a.ds, unit=m.cfg.unit)  # serialized as the model reads its units
    idx = ds.units.part(split, "test")
    idx = idx[ds.units.is_anomaly[idx]]
    prep, _ = prepare_units(ds, idx, m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
    pred = m.predict(prep, explain=True)
    inp = prep.inputs
    fams = [set(np.asarray(inp.families, dtype=object)[inp.node_family[inp.node_offsets[i]:inp.node_offsets[i + 1]]].tolist())
            for i in range(len(idx))]
    u = ds.units.select(idx)
    types = [FAULT_TYPES[int(f)] for f in u.fault]
    res = {"dataset": a.ds, "split": split, "part": "test (truly abnormal units)", "units": int(len(idx)),
           "model": str(a.model or "teller/rca/default"), "definitions": EXPLANATION_CHECKS}
    # what `teller diagnose` shows: the model's sentence grounded (teller.report.diagnose._ground) on
    # the step's number and rank and the model's type and evidence; per-rank (vertical) steps only,
    # the ones diagnose explains, and without the numeric stage's "measured" clause (no reference here)
    import pyarrow.parquet as pq

    from teller.report.diagnose import _ground

    rec = pq.read_table(Path(a.ds) / "records.parquet", columns=["record_id", "rank"])
    rank_of = dict(zip(rec.column("record_id").to_pylist(), rec.column("rank").to_pylist(), strict=True))
    grounded = [_ground(p["explanation"] or "", {"fault_type": p["fault_type"] or None, "step_num": int(u.step_num[i]),
                                                 "rank": int(rank_of.get(int(u.record_id[i]), 0)),
                                                 "evidence_families": p["evidence_operators"], "suspects": []})
                if u.view[i] == "vertical" else "" for i, p in enumerate(pred)]
    vert = np.flatnonzero(u.view == "vertical")
    gc = explanation_checks([grounded[i] for i in vert], [types[i] for i in vert], [u.operator_labels[i] for i in vert],
                            [fams[i] for i in vert])
    res["grounded_vertical"] = {"units": int(len(vert)), "rates": gc["rates"],
                                "passing": {k: int(sum(v)) for k, v in gc["per_step"].items()},
                                "empty": int(sum(1 for i in vert if not grounded[i]))}
    for name, texts in (("generated", [p["explanation"] or "" for p in pred]), ("reference", list(u.explanation))):
        c = explanation_checks(texts, types, u.operator_labels, fams)
        res[name] = {"rates": c["rates"], "passing": {k: int(sum(v)) for k, v in c["per_step"].items()},
                     "empty": int(sum(1 for t in texts if not t))}
        for v in ("vertical", "horizontal"):
            sel = np.flatnonzero(u.view == v)
            if len(sel):
                cv = explanation_checks([texts[i] for i in sel], [types[i] for i in sel],
                                        [u.operator_labels[i] for i in sel], [fams[i] for i in sel])
                res[name][v] = {"units": int(len(sel)), "rates": cv["rates"]}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{res['units']} truly abnormal test units of split {split} ({res['seconds']} s)")
    print(f"{'check':20s} {'generated':>10s} {'grounded (vertical)':>20s} {'reference':>10s}")
    for k in EXPLANATION_CHECKS:
        print(f"{k:20s} {res['generated']['rates'][k]:10.3f} {res['grounded_vertical']['rates'][k]:20.3f} "
              f"{res['reference']['rates'][k]:10.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
