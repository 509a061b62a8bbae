"""Run a fault campaign on the GPU machine within a time budget and reduce what comes back.

    python3 scripts/gpu/campaign.py SPEC RUNS OUT --deadline-s 480 [--lanes 4] [--keep-raw NAME ...] [--only NAME ...]

With --lanes N, runs whose faults act beside the engine (co-located contention: they would
disturb other runs) are recorded one at a time after the others, which are recorded N at a time
by ``teller.inject.campaign.run_lanes``: each lane is this script, on its share of the runs,
pinned to its own CPU cores (the workloads are host-bound; their GPU work is small), until the
deadline.

Runs are recorded in spec order (``teller.inject.campaign.run_one``); runs already labelled in
RUNS are skipped, so a second call on the same machine resumes. No run starts after the deadline.
If one of the first two runs (the small ``ex-*`` runs) crashes, the campaign stops there.
Every finished run is copied to OUT/reduced/<run> without its raw ``events/`` (the forest,
steps, logs and labels are what ``teller dataset build`` reads), except the runs named by
--keep-raw, which keep everything (committed examples). The reduced runs are packed into
OUT/runs.tar.NN parts of at most 15 MiB (four per call; the rest wait in /tmp/parts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _record(a, camp, todo, runs, red, refs, done, until, t0) -> None:
    from teller.inject.campaign import _wl_key, run_one

    for i, run in enumerate(todo):
        run_id = f"{run.name}-r0"
        if (runs / run_id / "labels.json").is_file():
            print(f"{run_id}: already recorded", flush=True)
            continue
        if time.time() > until:
            print(f"deadline: {run_id} and later runs not started ({time.time() - t0:.0f} s)", flush=True)
            return
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
            done.append({"run_id": run_id, "status": "smoke run failed"})
            for f in sorted((src / "logs").glob("*"))[:4]:
                print(f"--- {f.name}\n{f.read_bytes()[-3000:].decode('utf-8', 'replace')}", flush=True)
            print("a smoke run failed: stopping", flush=True)
            return


def _relabel_short_references(camp, runs: Path, todo) -> None:
    """Relabel fault runs that had fewer than MIN_REF fault-free steps of their own (a KV-pressure
    run is all window) against a finished fault-free run of the same workload under RUNS: lane
    processes do not share their references (``teller inject run`` in one process does this)."""
    from teller.inject.campaign import _wl_key
    from teller.inject.labels import MIN_REF, label_run
    from teller.rundir import RunDir

    normal = {}
    for r in camp.runs:
        d = runs / f"{r.name}-r0"
        if not r.faults and (d / "steps.parquet").is_file():
            normal.setdefault(_wl_key(r.workload), d)
    for r in todo:
        d = runs / f"{r.name}-r0"
        if not r.faults or not (d / "labels.json").is_file():
            continue
        rd = RunDir(d)
        labels = rd.read_labels() or {}
        lsum = labels.get("label_summary") or {}
        ref = normal.get(_wl_key(r.workload))
        if ref is None or lsum.get("reference") != "own fault-free steps" or lsum.get("reference_steps", MIN_REF) >= MIN_REF:
            continue
        labels["label_summary"] = label_run(d, labels, reference=ref)
        rd.write_labels(labels)
        print(json.dumps({"relabelled": d.name, "reference": ref.name, "abnormal_steps": labels["label_summary"]["abnormal"]}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("runs")
    ap.add_argument("out")
    ap.add_argument("--deadline-s", type=float, default=540)
    ap.add_argument("--keep-raw", nargs="*", default=[])
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--lanes-deadline-s", type=float, default=None, help="no lane run starts after this (default: --deadline-s)")
    ap.add_argument("--until", type=float, default=None, help="absolute deadline (epoch s; lanes)")
    ap.add_argument("--cpus", default=None, help="pin this process and its children, e.g. 0-3 or 0,1,2,3")
    ap.add_argument("--no-pack", action="store_true")
    ap.add_argument("--co-located-in-lanes", action="store_true",
                    help="record co-located runs in the lanes too (their contention is pinned to the lane's cores)")
    ap.add_argument("--lane", type=int, default=None)
    a = ap.parse_args()
    t0 = time.time()
    until = a.until if a.until is not None else t0 + a.deadline_s
    if a.cpus:
        os.sched_setaffinity(0, [c for part in a.cpus.split(",") for lo, _, hi in [part.partition("-")]
                                 for c in range(int(lo), int(hi or lo) + 1)])
    from teller.inject.spec import load_spec

    camp = load_spec(a.spec)
    runs, out = Path(a.runs), Path(a.out)
    runs.mkdir(parents=True, exist_ok=True)
    red = out / "reduced"
    red.mkdir(parents=True, exist_ok=True)
    refs: dict[str, str] = {}
    done = []
    todo = [r for r in camp.runs if not a.only or r.name in a.only]
    if a.lanes > 1:
        from teller.inject.mechanisms import registry

        reg = registry()
        beside = [] if a.co_located_in_lanes else [r for r in todo if any(reg[f.mechanism].where == "co_located" and f.mechanism != "netem_link" for f in r.faults)]
        rest = [r for r in todo if r not in beside]
        smoke, rest = (rest[:2], rest[2:]) if any(r.name.startswith("ex-") for r in rest[:2]) else ([], rest)
        todo = smoke  # here; then the lanes; then the co-located runs one at a time
    else:
        rest, beside = [], []
    _record(a, camp, todo, runs, red, refs, done, until, t0)
    if a.lanes > 1 and not any("smoke run failed" in str(d) for d in done):
        from teller.inject.campaign import run_lanes

        lane_until = until if a.lanes_deadline_s is None else min(until, t0 + a.lanes_deadline_s)

        def lane_command(k: int, names: list[str], cpus: list[int]) -> list[str]:
            return [sys.executable, __file__, a.spec, a.runs, a.out, "--until", str(lane_until), "--no-pack",
                    "--cpus", ",".join(map(str, cpus)), "--only", *names, "--keep-raw", *a.keep_raw, "--lane", str(k)]

        failed = sum(1 for c in run_lanes(rest, a.lanes, lane_command) if c)
        if failed:
            print(f"{failed} lane(s) exited with an error", flush=True)
        _record(a, camp, beside, runs, red, refs, done, until, t0)
        _relabel_short_references(camp, runs, camp.runs)
    lane = f"-{a.lane}" if a.lane is not None else ""
    (red / f"campaign_progress{lane}.json").write_text(json.dumps(done, indent=1, default=str))
    if a.no_pack:
        return 0
    # about 64 MiB come back from a call (4 parts of 15 MiB): the other parts wait in /tmp/parts for the next call
    subprocess.run(f"mkdir -p /tmp/parts && cd {out} && tar cf - reduced | split -b 15m -d - /tmp/parts/runs.tar. "
                   f"&& rm -rf reduced && ls /tmp/parts | head -4 | xargs -I{{}} mv /tmp/parts/{{}} {out}/", shell=True, check=False)
    print(f"packed after {time.time() - t0:.0f} s:", sorted(p.name for p in out.glob("runs.tar.*")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
