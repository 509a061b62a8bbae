"""The highest operator Macro₊ F1 a model reading what ``teller rca`` reads could score: per truly
abnormal test unit with labelled operators, the F1 of naming exactly the labelled families that
are present among the unit's trace tokens (families outside them cannot be named), averaged as
Macro₊; per fault type, with the labelled families no token carries. ``--unit iteration``: the
units are whole engine iterations (the STEP subtree with the iteration's schedule/update ranges
and GAP rows, ``RCAConfig.unit``), encoded with the same tokenizers and token limit.

    python benchmarks/rca_operator_ceiling.py [--ds data/h200_v2] [--split request] [--model DIR] [--unit step|iteration]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ds", default=str(ROOT / "data" / "h200_v2"))
    ap.add_argument("--split", default="request")
    ap.add_argument("--model", default=None, help="model whose tokenizers encode the units (default: the shipped one)")
    ap.add_argument("--unit", default=None, choices=["step", "iteration"],
                    help="what a unit's trace holds (default: the model's unit)")
    a = ap.parse_args()
    import dataclasses

    import torch

    torch.set_num_threads(1)
    from teller.rca import DEFAULT_MODEL, load
    from teller.rca.data import FAULT_TYPES, load_dataset
    from teller.rca.train import prepare_units

    m = load(a.model or DEFAULT_MODEL)
    cfg = dataclasses.replace(m.cfg, unit=a.unit or m.cfg.unit)
    ds = load_dataset(a.ds, unit=cfg.unit)
    idx = ds.units.part(a.split, "test")
    u = ds.units.select(idx)
    prep, _ = prepare_units(ds, idx, cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
    rows = []
    for i in np.flatnonzero(u.is_anomaly).tolist():
        lab = set(u.operator_labels[i])
        if not lab:
            continue
        hit = lab & set(prep.inputs.candidates(i))
        rows.append((FAULT_TYPES[int(u.fault[i])], str(u.view[i]), 2 * len(hit) / (len(hit) + len(lab)), sorted(lab - hit)))
    n_cand = [len(prep.inputs.candidates(i)) for i in range(len(idx))]
    print(f"{a.split} test, unit {cfg.unit}, at most {cfg.max_trace_tokens} trace tokens: {len(rows)} abnormal units "
          f"with labelled operators ({int(prep.inputs.truncated.sum())} of {len(idx)} test units truncated; "
          f"candidate families per unit: mean {np.mean(n_cand):.1f}, median {np.median(n_cand):.0f})")
    for view in ("all", "vertical", "horizontal"):
        sel = [r for r in rows if view in ("all", r[1])]
        if sel:
            print(f"  Macro+ F1 ceiling, {view}: {np.mean([r[2] for r in sel]):.3f} ({len(sel)} units)")
    for t in FAULT_TYPES[1:]:
        sel = [r for r in rows if r[0] == t]
        if not sel:
            continue
        miss: dict[str, int] = {}
        for r in sel:
            for f in r[3]:
                miss[f] = miss.get(f, 0) + 1
        print(f"  {t}: {len(sel)} units, ceiling {np.mean([r[2] for r in sel]):.3f}; labelled families no token carries: "
              + (", ".join(f"{k} ({v})" for k, v in sorted(miss.items(), key=lambda x: -x[1])) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
