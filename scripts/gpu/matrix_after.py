"""What follows the trainings of rca_matrix.py on the GPU machine, in device calls of their own:
the experts of models trained without them, side by side, and `teller evaluate` of the model rows
once per training seed, side by side; what comes back is left in OUT.

    python3 scripts/gpu/matrix_after.py experts --work runs/rca_work --data runs/h200_v2_all --out $OUT
    python3 scripts/gpu/matrix_after.py evaluate --work runs/rca_work --data runs/h200_v2_all --out $OUT \\
        --methods teller_mot_family,teller_mot_family_sustained

``experts`` runs `teller rca experts MODEL DATA` for every model directory under ``--work`` (or
those ``--jobs`` names), ``--workers`` at a time, each with its share of the cores (the trees use
every core they are given); a model's log is ``experts_NAME.log``. ``evaluate`` groups the models
by their training seed and runs one `teller evaluate --split SPLITS --seed SEED --models DIR` per
seed on the splits its models were trained on (a folder of links per seed, so that each row finds
the model of its split and seed); ``evaluate.tar`` holds, per seed, results.json, results.md and
predictions.parquet (what `teller evaluate --reuse` reads), and each model's config.json under
``models/NAME/`` (what the rows read for the model's floor with ``--reuse PRED --models DIR``, no
weights needed). Files in OUT stay few (at most 8 come back).

An A/B of an expert setting on the same trained weights: ``experts --suffix _w4 --expert-args
"--in-window-weight 4"`` first copies each model directory to NAME_w4 (the originals untouched)
and fits the copies' experts with those arguments; ``evaluate --jobs wl0_w4,... --tag _w4`` then
scores the copies apart (``_eval_models_sSEED_w4``, ``evaluate_w4.tar``), ``--jobs wl0,...`` the
originals."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def models_under(work: Path, jobs: str) -> list[Path]:
    names = [x for x in jobs.split(",") if x]
    found = sorted(p for p in work.iterdir() if (p / "config.json").is_file() and (not names or p.name in names))
    missing = sorted(set(names) - {p.name for p in found})
    if missing:
        raise SystemExit(f"no trained model {', '.join(missing)} under {work}")
    if not found:
        raise SystemExit(f"no model directory (with config.json) under {work}")
    return found


def run_side_by_side(cmds: list[tuple[str, list[str], Path]], workers: int, threads: int, deadline: float) -> dict[str, int]:
    """Run each (name, argv, log) ``workers`` at a time with ``threads`` cores each; a command still
    running at ``deadline`` is stopped (its return code: None)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    todo, running, rc = list(cmds), {}, {}
    while todo or running:
        while todo and len(running) < workers:
            name, argv, log = todo.pop(0)
            fh = open(log, "w")
            running[name] = (subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env), time.time(), fh)
            print(f"[{name}] started", flush=True)
        for name, (p, t, fh) in list(running.items()):
            if p.poll() is not None:
                rc[name] = p.returncode
                print(f"[{name}] rc {p.returncode} after {time.time() - t:.0f} s", flush=True)
            elif time.time() > deadline:
                p.kill()
                p.wait()
                rc[name] = None
                print(f"[{name}] stopped at the deadline after {time.time() - t:.0f} s", flush=True)
            else:
                continue
            fh.close()
            del running[name]
        time.sleep(2)
    return rc


def copies(models: list[Path], suffix: str) -> list[Path]:
    """Each model directory copied to NAME+``suffix`` beside it (a copy already there is replaced)."""
    out = []
    for m in models:
        dst = m.with_name(m.name + suffix)
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(m, dst, symlinks=True)
        out.append(dst)
    return out


def experts(a) -> dict:
    models = models_under(Path(a.work), a.jobs)
    if a.suffix:
        models = copies([m for m in models if not m.name.endswith(a.suffix)], a.suffix)
    out = Path(a.out)
    extra = shlex.split(a.expert_args)
    cmds = [(m.name, [sys.executable, "-m", "teller", "rca", "experts", str(m), a.data, "--device", a.device, *extra],
             out / f"experts_{m.name}.log") for m in models]
    workers = min(a.workers, len(cmds))
    return {"experts": run_side_by_side(cmds, workers, max(1, a.cores // workers), a.t0 + a.deadline_s)}


def evaluate(a) -> dict:
    models = models_under(Path(a.work), a.jobs)
    out, work = Path(a.out), Path(a.work)
    by_seed: dict[int, list[tuple[Path, str]]] = {}
    for m in models:
        tr = json.loads((m / "config.json").read_text()).get("training", {})
        by_seed.setdefault(int(tr.get("seed", 0)), []).append((m, tr.get("split", "request")))
    cmds = []
    for seed, ms in sorted(by_seed.items()):
        links = work / f"_eval_models_s{seed}{a.tag}"
        links.mkdir(exist_ok=True)
        for m, _ in ms:
            if not (links / m.name).exists():
                (links / m.name).symlink_to(m.resolve())
        splits = ",".join(sorted({sp for _, sp in ms}))
        cmds.append((f"seed{seed}", [sys.executable, "-m", "teller", "evaluate", a.data, "--split", splits,
                                     "--view", a.view, "--methods", a.methods, "--seed", str(seed),
                                     "--models", str(links), "--device", a.device, "-o", str(work / f"_evaluate_s{seed}{a.tag}")]
                     + (["--limit-steps", str(a.limit_steps)] if a.limit_steps else []),
                     out / f"evaluate_s{seed}{a.tag}.log"))
    workers = min(a.workers, len(cmds))
    rc = run_side_by_side(cmds, workers, max(1, a.cores // workers), a.t0 + a.deadline_s)
    with tarfile.open(out / f"evaluate{a.tag}.tar", "w") as tar:
        for seed in sorted(by_seed):
            for f in ("results.json", "results.md", "predictions.parquet"):
                src = work / f"_evaluate_s{seed}{a.tag}" / f
                if src.is_file():
                    tar.add(src, f"evaluate_s{seed}/{f}")
        for m in models:
            tar.add(m / "config.json", f"models/{m.name}/config.json")
    return {"evaluate": rc, "seeds": {s: [m.name for m, _ in ms] for s, ms in by_seed.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("experts", "evaluate"))
    ap.add_argument("--work", required=True, help="the folder of model directories (rca_matrix.py --work)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--jobs", default="", help="model directories to take (comma-separated; default every one)")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default="teller_mot_family,teller_mot_family_sustained")
    ap.add_argument("--view", default="vertical,horizontal")
    ap.add_argument("--limit-steps", type=int, default=None, help="evaluate a sample of this many steps per view (CPU dry runs)")
    ap.add_argument("--suffix", default="", help="experts: fit copies NAME+SUFFIX of the models, not the models")
    ap.add_argument("--expert-args", default="", help="experts: more arguments of `teller rca experts` (one string)")
    ap.add_argument("--tag", default="", help="evaluate: suffix of its folders and tar (scores copies apart)")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="a command still running then is stopped")
    a = ap.parse_args()
    a.t0 = time.time()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    res = experts(a) if a.what == "experts" else evaluate(a)
    res["seconds"] = round(time.time() - a.t0, 1)
    (Path(a.out) / f"{a.what}{a.suffix if a.what == 'experts' else a.tag}.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, default=str), flush=True)
    return 0 if all(v == 0 for v in res[a.what].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
