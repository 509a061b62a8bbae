"""The MoT's two operator heads side by side (``RCAConfig.op_unit`` token and family): the same
small configuration, data, split and seed, one process per head (one CPU thread each), trained
and scored on the split's test part. What differs between two rows is the head alone.

    python benchmarks/rca_op_head.py data/h200_v2_tp --split request,run --seeds 0 -o OUT.json

The configuration is small enough for a 2-core CPU (hidden 64, 2 layers, 256 trace tokens, 8 epochs
of batches of 32; about 8 minutes a model on the tensor-parallel part), so the figures say what
the head changes, not what the shipped size reaches.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: the small configuration (RCAConfig fields over the "tiny" preset)
CONFIG = dict(hidden=64, intermediate=128, layers=2, heads=2, kv_heads=2, max_trace_tokens=256, trace_vocab=512,
              max_log_tokens=48, max_expl_tokens=24)


def run_one(args: tuple) -> dict:
    data, split, seed, op_unit, work, epochs, batch_size, lr = args
    import torch

    torch.set_num_threads(1)
    from teller.rca import load
    from teller.rca.data import load_dataset
    from teller.rca.train import evaluate, train

    ds = load_dataset(data, unit="iteration")
    out = Path(work) / f"{split}_s{seed}_{op_unit}"
    t0 = time.perf_counter()
    s = train(ds, out, variant="mot", split=split, config="tiny", epochs=epochs, seed=seed, progress=False,
              log=lambda m: None, unit="iteration", op_unit=op_unit, batch_size=batch_size, lr=lr, **CONFIG)
    m = load(out)
    _, res, _ = evaluate(m, ds, split, "test", explain=False)
    row = {"split": split, "seed": seed, "op_unit": op_unit, "train_s": round(time.perf_counter() - t0, 1),
           "steps": s["steps"], "op_threshold": m.op_threshold}
    for v in ("vertical", "horizontal"):
        if v in res:
            r = res[v]
            row[v] = {"units": r["units"], "abnormal": int(r["step"]["abnormal"]), "step_f1": r["step"]["f1"], "macro_plus_f1": r["operator"]["macro_plus_f1"],
                      "operator_f1": r["operator"]["f1"], "fault_macro_f1": r["fault_type"]["macro_f1"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--split", default="request")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--heads", default="token,family", help="the operator heads to train (RCAConfig.op_unit values)")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", default="/tmp/rca_op_head")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    jobs = [(a.data, sp, int(s), op, a.work, a.epochs, a.batch_size, a.lr)
            for sp in a.split.split(",") for s in a.seeds.split(",") for op in a.heads.split(",")]
    t0 = time.perf_counter()
    # a worker that dies (killed for memory) breaks the pool with an error instead of a hang
    with ProcessPoolExecutor(a.workers, mp_context=mp.get_context("spawn"), max_tasks_per_child=1) as pool:
        rows = list(pool.map(run_one, jobs))
    res = {"command": "python benchmarks/rca_op_head.py " + " ".join(sys.argv[1:]), "config": CONFIG,
           "epochs": a.epochs, "batch_size": a.batch_size, "lr": a.lr, "rows": rows,
           "seconds": round(time.perf_counter() - t0, 1)}
    Path(a.out).write_text(json.dumps(res, indent=1))
    for r in rows:
        cells = [f"{v}: step F1 {r[v]['step_f1']:.3f}, Macro+ {r[v]['macro_plus_f1']:.3f}, fault {r[v]['fault_macro_f1']:.3f}"
                 for v in ("vertical", "horizontal") if v in r]
        print(f"{r['split']} seed {r['seed']} {r['op_unit']:6s} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
