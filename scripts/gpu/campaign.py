"""Run a fault campaign on the GPU machine within a time budget and reduce what comes back.

    python3 scripts/gpu/campaign.py SPEC RUNS OUT --deadline-s 540 [--keep-raw NAME ...] [--only NAME ...]

Runs are recorded in spec order (``teller.inject.campaign.run_one``); runs already labelled in
RUNS are skipped, so a second call on the same machine resumes. No run starts after the deadline.
If one of the first two runs (the small ``ex-*`` runs) crashes, the campaign stops there.
Every finished run is copied to OUT/reduced/<run> without its raw ``events/`` (the forest,
steps, logs and labels are what ``teller dataset build`` reads), except the runs named by
--keep-raw, which keep everything (committed examples). The reduced runs are packed into
OUT/runs.tar.NN parts of at most 15 MiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("runs")
    ap.add_argument("out")
    ap.add_argument("--deadline-s", type=float, default=540)
    ap.add_argument("--keep-raw", nargs="*", default=[])
    ap.add_argument("--only", nargs="*", default=[])
    a = ap.parse_args()
    t0 = time.time()
    from teller.inject.campaign import _wl_key, run_one
    from teller.inject.spec import load_spec

    camp = load_spec(a.spec)
    runs, out = Path(a.runs), Path(a.out)
    runs.mkdir(parents=True, exist_ok=True)
    red = out / "reduced"
    red.mkdir(parents=True, exist_ok=True)
    refs: dict[str, str] = {}
    done = []
    for i, run in enumerate(camp.runs):
        if a.only and run.name not in a.only:
            continue
        run_id = f"{run.name}-r0"
        if (runs / run_id / "labels.json").is_file():
            print(f"{run_id}: already recorded", flush=True)
            continue
        el = time.time() - t0
        if el > a.deadline_s:
            print(f"deadline: {run_id} and later runs not started ({el:.0f} s)", flush=True)
            break
        ts = time.time()
        try:
            res = run_one(camp, run, 0, runs, refs, force=True)
        except Exception as e:  # keep going: the run folder holds what was recorded
            res = {"run_id": run_id, "status": f"error {type(e).__name__}: {e}"}
        res["wall_s"] = round(time.time() - ts, 1)
        done.append(res)
        print(json.dumps({k: res.get(k) for k in ("run_id", "status", "exit_code", "steps", "abnormal_steps", "wall_s", "skipped")}),
              flush=True)
        if not run.faults and res.get("status") == "finished":
            refs.setdefault(_wl_key(run.workload), res["path"])
        src = runs / run_id
        if src.is_dir():
            dst = red / run_id
            shutil.rmtree(dst, ignore_errors=True)
            keep = run.name in a.keep_raw
            shutil.copytree(src, dst, ignore=None if keep else shutil.ignore_patterns("events"))
        if i < 2 and res.get("status") != "finished" and run.name.startswith("ex-"):
            for f in sorted((src / "logs").glob("*"))[:4]:
                print(f"--- {f.name}\n{f.read_bytes()[-3000:].decode('utf-8', 'replace')}", flush=True)
            print("a smoke run failed: stopping", flush=True)
            break
    (out / "campaign_progress.json").write_text(json.dumps(done, indent=1, default=str))
    subprocess.run(f"cd {out} && tar cf - reduced | split -b 15m -d - runs.tar. && rm -rf reduced", shell=True, check=False)
    print(f"packed after {time.time() - t0:.0f} s:", sorted(p.name for p in out.glob("runs.tar.*")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
