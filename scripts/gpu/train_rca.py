"""Train one RCA variant on the request-, run- and mechanism-disjoint splits of a dataset within
a time budget, evaluate each split's test part, and leave what comes back in OUT.

    python3 scripts/gpu/train_rca.py --variant mot --out $OUT --device cuda --deadline-s 480

The dataset is read and its steps serialized once; each split then fits its own tokenizers and
duration reference on its training part, trains with ``--max-minutes`` set from the time left
(shares ``--shares``, request first: it is the model that ships), and is evaluated on its test
part with the saved (float16) files. Written to OUT, at most 8 files:

- ``metrics_VARIANT.json``: per split the training summary (steps, seconds, loss curve) and the
  test metrics (all units, vertical, horizontal), rewritten after every split;
- ``rca_VARIANT.tar`` (``.tar.gz`` where over ``--return-limit-mib``, 16 by default): the request split's model directory without ``checkpoint/`` (the shipped
  candidate; about 13 MB for the small config);
- the log is the command's own output (``scripts/gpu/train_rca.sh`` tees it to OUT).

Checkpoints (float32 weights and optimizer state) stay under ``--work`` on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("mot", "single"), required=True)
    ap.add_argument("--data", default=str(REPO / "data" / "h200_v2"))
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--work", default="/tmp/rca_work")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", default="small")
    ap.add_argument("--splits", nargs="+", default=["request", "run", "mechanism"], help="request run mechanism workload")
    ap.add_argument("--shares", nargs="+", type=float, default=[0.4, 0.3, 0.3],
                    help="share of the training time left for each split")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="wall-clock budget of the whole script")
    ap.add_argument("--eval-reserve-s", type=float, default=35.0, help="time kept per split for preparing and evaluating")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--max-units", type=int, default=None, help="a sample of units (CPU dry runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--return-limit-mib", type=float, default=16.0,
                    help="what a device call may return in one file: the model's tar is compressed above it")
    a = ap.parse_args()
    t0 = time.time()
    import torch
    from rca_matrix import send_back

    from teller.rca import load
    from teller.rca.data import load_dataset
    from teller.rca.train import evaluate, train

    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    import transformers

    print(f"transformers {transformers.__version__}", flush=True)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    ds = load_dataset(a.data, max_units=a.max_units, seed=a.seed)
    print(f"dataset: {len(ds.units)} units, {ds.forest.seqs.n_nodes} nodes, read in {time.time() - t0:.0f} s", flush=True)
    result = {"variant": a.variant, "config": a.config, "dataset": a.data, "device": a.device, "seed": a.seed,
              "torch": torch.__version__, "transformers": transformers.__version__, "splits": {}}
    mpath = out / f"metrics_{a.variant}.json"
    shares = dict(zip(a.splits, a.shares + [a.shares[-1]] * len(a.splits), strict=False))
    for k, split in enumerate(a.splits):
        left = a.deadline_s - (time.time() - t0)
        reserve = a.eval_reserve_s * (len(a.splits) - k)
        share = shares[split] / sum(shares[s] for s in a.splits[k:])
        minutes = max(0.2, (left - reserve) * share / 60)
        print(f"\n[{split}] {left:.0f} s left; training budget {minutes:.2f} min", flush=True)
        mdir = work / f"{a.variant}_{split}"
        if mdir.exists():
            shutil.rmtree(mdir)
        s = train(ds, mdir, variant=a.variant, split=split, device=a.device, epochs=a.epochs, seed=a.seed,
                  config=a.config, max_minutes=minutes, batch_size=a.batch_size, progress=False)
        te = time.time()
        model = load(mdir, device=a.device)
        _, res, _ = evaluate(model, ds, split, "test", batch_size=256)
        res["seconds"] = round(time.time() - te, 1)
        summary = {k2: v for k2, v in s.items() if k2 != "curve"}
        summary["curve"] = s["curve"][:: max(1, len(s["curve"]) // 60)]
        result["splits"][split] = {"training": summary, "test": res}
        for view in ("all", "vertical", "horizontal"):
            m = res.get(view)
            if m:
                print(f"[{split}] test {view}: units {m['units']}, step F1 {m['step']['f1']:.3f}, fault-type macro-F1 "
                      f"{m['fault_type']['macro_f1']:.3f}, operator Macro+ F1 {m['operator']['macro_plus_f1']:.3f}", flush=True)
        print(f"[{split}] evaluated in {res['seconds']} s; {time.time() - t0:.0f} s so far", flush=True)
        result["total_seconds"] = round(time.time() - t0, 1)
        mpath.write_text(json.dumps(result, indent=1))
        if split == "request":
            send_back(mdir, out, a.variant, int(a.return_limit_mib * 2**20))
    print(f"\ndone in {time.time() - t0:.0f} s; wrote {mpath}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
