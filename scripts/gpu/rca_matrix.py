"""Train several RCA models side by side on one GPU, one protocol for all, score each on its
split's test part, and optionally run `teller evaluate` on the model rows; what comes back is
left in OUT.

    python3 scripts/gpu/rca_matrix.py --out $OUT --workers 6 --epochs 6 --batch-size 128 \\
        --job mot_run=mot:run --job tpe0=mot:request:trace_vocab=0 --evaluate run,mechanism

A job is ``NAME=VARIANT:SPLIT[:KEY=VALUE,...]``; the keys are :class:`teller.rca.model.RCAConfig`
fields (``inputs=log``, ``trace_vocab=0``, ``max_log_tokens=224``, ``unit=iteration``: the
dataset is then also read as engine iterations), and ``seed=N`` trains that job with its own seed. The dataset is read once and
the workers are forked from the reading process (before CUDA starts), each training one job at a
time with the same epochs, batch size and seed, so rows differ only in what the job names. Each
job runs its epochs; the deadline is only a hard stop (``stopped_by`` says which ended it). Written to OUT (at most 8
files): ``matrix.json`` (per job: the training summary, the test metrics, and the TPE length of
the test steps: nodes and tokens per step before truncation, the share truncated), the
``teller evaluate`` results of ``--evaluate`` (``evaluate.json``, ``evaluate.md``, and the rows'
per-step answers, ``predictions.parquet``, which ``teller evaluate --reuse`` reads), and a tar of
each model named by ``--keep`` (without ``checkpoint/``): ``rca_NAME.tar``, or ``rca_NAME.tar.gz``
where the tar is over ``--return-limit-mib`` (what a device call may return in one file; a model
with its experts is about 18 MB, 14.6 MB compressed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

DS: dict = {}  # the dataset per unit (step, iteration), read once in the parent and shared with the forked workers


def parse_job(spec: str) -> dict:
    name, _, rest = spec.partition("=")
    parts = rest.split(":")
    if not name or len(parts) < 2:
        raise SystemExit(f"--job {spec!r}: expected NAME=VARIANT:SPLIT[:KEY=VALUE,...]")
    over = {}
    for kv in (parts[2].split(",") if len(parts) > 2 and parts[2] else []):
        k, _, v = kv.partition("=")
        over[k] = int(v) if v.lstrip("-").isdigit() else (float(v) if v.replace(".", "", 1).isdigit() else v)
    return {"name": name, "variant": parts[0], "split": parts[1], "overrides": over}


def tpe_lengths(inp) -> dict:
    import numpy as np

    nodes = np.diff(inp.node_offsets).astype(float)
    full = inp.full_tokens.astype(float)
    keep = nodes > 0
    return {"units": int(len(nodes)), "nodes_per_step": float(nodes.mean()), "tokens_per_step": float(full.mean()),
            "length_reduction": float(1.0 - (full[keep] / nodes[keep]).mean()),
            "length_reduction_pooled": float(1.0 - full.sum() / max(nodes.sum(), 1)),
            "truncated_share": float(inp.truncated.mean()), "read_tokens_per_step": float(np.diff(inp.offsets).mean())}


def run_job(job: dict, a: dict, deadline: float) -> dict:
    import torch

    from teller.rca import load
    from teller.rca.train import evaluate, prepare_units, train

    torch.set_num_threads(a["threads"])
    torch.backends.cuda.matmul.allow_tf32 = True
    work = Path(a["work"]) / job["name"]
    if work.exists():
        shutil.rmtree(work)
    logf = open(Path(a["work"]) / f"{job['name']}.log", "w")

    def log(m: str) -> None:
        logf.write(m + "\n")
        logf.flush()

    t0 = time.time()
    res: dict = {"job": job}
    try:
        minutes = max(0.2, (deadline - time.time() - a["eval_reserve_s"]) / 60)
        over = dict(job["overrides"])
        seed = int(over.pop("seed", a["seed"]))
        ds = DS[over.get("unit", "step")]
        s = train(ds, work, variant=job["variant"], split=job["split"], device=a["device"], epochs=a["epochs"],
                  seed=seed, config=a["config"], max_minutes=minutes, batch_size=a["batch_size"], progress=False,
                  log=log, replan=False, **over)
        summary = {k: v for k, v in s.items() if k != "curve"}
        summary["curve"] = s["curve"][:: max(1, len(s["curve"]) // 40)]
        summary["stopped_by"] = json.loads((work / "config.json").read_text())["training"]["stopped_by"]
        res["training"] = summary
        te = time.time()
        model = load(work, device=a["device"])
        _, metrics, idx = evaluate(model, ds, job["split"], "test", batch_size=256, explain=job["name"] in a["explain"])
        prep, _ = prepare_units(ds, idx, model.cfg, model.text_tok, model.trace_tok, model.ref, labels=False)
        res["tpe"] = {"trace_vocab": len(model.trace_tok), **tpe_lengths(prep.inputs)}
        res["test"] = metrics
        res["eval_seconds"] = round(time.time() - te, 1)
        log(f"done: step F1 {metrics['all']['step']['f1']:.3f}")
    except Exception as e:  # one job's failure is a row of the result, not the end of the call
        res["error"] = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
    res["seconds"] = round(time.time() - t0, 1)
    logf.close()
    return res


def send_back(mdir: Path, out: Path, name: str, limit: int) -> Path:
    """The model directory ``mdir`` packed into ``out`` as ``rca_NAME.tar``, compressed where over
    ``limit`` bytes (:func:`teller.rca.api.pack`); one still over it is named on stderr with the
    command that splits it. Returns the file written."""
    from teller.rca.api import pack

    got = pack(mdir, out / f"rca_{name}.tar", f"rca_{name}", max_bytes=limit)
    if got.stat().st_size > limit:
        print(f"{got}: {got.stat().st_size} bytes, over the {limit} a returned file may have; split it "
              f"(split -b {limit} {got.name} {got.name}.part_) in a further call", file=sys.stderr, flush=True)
    return got


def _worker(args):
    job, a, deadline = args
    return run_job(job, a, deadline)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(REPO / "data" / "h200_v2"))
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--work", default="/tmp/rca_matrix")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", default="small")
    ap.add_argument("--job", action="append", default=[], help="NAME=VARIANT:SPLIT[:KEY=VALUE,...] (repeat)")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads per worker")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=520.0, help="wall-clock budget of the whole script")
    ap.add_argument("--eval-reserve-s", type=float, default=40.0, help="time a job keeps for its test scoring")
    ap.add_argument("--evaluate", default="", help="splits for `teller evaluate` of the model rows (comma-separated)")
    ap.add_argument("--evaluate-reserve-s", type=float, default=150.0, help="time kept at the end for --evaluate")
    ap.add_argument("--methods", default="teller_mot,teller_single")
    ap.add_argument("--evaluate-jobs", default="", help="the jobs --evaluate may pick from (default: every job)")
    ap.add_argument("--keep", default="", help="jobs whose model directory comes back as a tar (comma-separated)")
    ap.add_argument("--return-limit-mib", type=float, default=16.0,
                    help="a kept tar over this is sent compressed (.tar.gz)")
    ap.add_argument("--explain", default="", help="jobs whose test scoring decodes explanations (BLEU)")
    ap.add_argument("--max-units", type=int, default=None, help="a sample of units (CPU dry runs)")
    a = ap.parse_args()
    t0 = time.time()
    jobs = [parse_job(j) for j in a.job]
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    from teller.rca.api import weight_files
    from teller.rca.data import load_dataset

    for unit in sorted({j["overrides"].get("unit", "step") for j in jobs} or {"step"}):
        DS[unit] = load_dataset(a.data, max_units=a.max_units, seed=a.seed, unit=unit)
        print(f"dataset ({unit} units): {len(DS[unit].units)} units, read in {time.time() - t0:.0f} s", flush=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    opts = {"work": str(work), "device": a.device, "config": a.config, "epochs": a.epochs, "batch_size": a.batch_size,
            "seed": a.seed, "threads": a.threads, "eval_reserve_s": a.eval_reserve_s,
            "explain": [x for x in a.explain.split(",") if x]}
    train_deadline = t0 + a.deadline_s - (a.evaluate_reserve_s if a.evaluate else 0.0)
    result = {"protocol": {k: opts[k] for k in ("device", "config", "epochs", "batch_size", "seed")},
              "dataset": a.data, "torch": torch.__version__, "transformers": transformers.__version__,
              "workers": a.workers, "jobs": {}}
    ctx = mp.get_context("fork")
    with ctx.Pool(min(a.workers, max(1, len(jobs))), maxtasksperchild=1) as pool:
        for r in pool.imap_unordered(_worker, [(j, opts, train_deadline) for j in jobs]):
            name = r["job"]["name"]
            result["jobs"][name] = r
            m = r.get("test", {}).get("all")
            line = (f"step F1 {m['step']['f1']:.3f}, fault macro-F1 {m['fault_type']['macro_f1']:.3f}, "
                    f"op Macro+ {m['operator']['macro_plus_f1']:.3f}" if m else r.get("error", "?"))
            tr = r.get("training", {})
            print(f"[{name}] {tr.get('steps', '?')} steps ({tr.get('stopped_by', '?')}) in {r['seconds']} s: {line}; "
                  f"{time.time() - t0:.0f} s so far", flush=True)
            result["total_seconds"] = round(time.time() - t0, 1)
            (out / "matrix.json").write_text(json.dumps(result, indent=1))
    for name in [x for x in a.keep.split(",") if x]:
        mdir = work / name
        if (mdir / "config.json").is_file():
            send_back(mdir, out, name, int(a.return_limit_mib * 2**20))
    if a.evaluate:
        models = work / "models"
        models.mkdir(exist_ok=True)
        pick = [x for x in a.evaluate_jobs.split(",") if x] or list(result["jobs"])
        for name in pick:
            if name in result["jobs"] and weight_files(work / name / "model.safetensors"):
                link = models / name
                if not link.exists():
                    link.symlink_to(work / name)
        cmd = [sys.executable, "-m", "teller", "evaluate", a.data, "--split", a.evaluate, "--view", "vertical,horizontal",
               "--methods", a.methods, "--seed", str(a.seed), "--models", str(models), "--device", a.device,
               "-o", str(work / "evaluate")]
        print("\n" + " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})
        for src, dst in (("results.json", "evaluate.json"), ("results.md", "evaluate.md"),
                         ("predictions.parquet", "predictions.parquet")):
            if (work / "evaluate" / src).is_file():
                shutil.copy(work / "evaluate" / src, out / dst)
        result["evaluate"] = {"command": " ".join(cmd), "rc": rc}
    result["total_seconds"] = round(time.time() - t0, 1)
    (out / "matrix.json").write_text(json.dumps(result, indent=1))
    print(f"\ndone in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
