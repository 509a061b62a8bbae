"""Run a campaign: record each run with ``teller record``, then reconstruct and label it.

For every run × repetition, in ``RUNS/<run>-r<k>/``:

1. mechanisms that cannot run here are dropped from the plan and listed under ``skipped`` with
   the reason (no GPU, not root, wrong workload); a faulty run whose faults were all skipped is
   not recorded (``status: skipped``);
2. the workload command is recorded with :func:`teller.record.launcher.record`, the fault plan
   passed in ``TELLER_FAULTS`` (the in-engine agent applies it and writes ``inject/<pid>.json``);
3. the run is reconstructed and its logs aligned; a run whose command failed keeps its partial
   trace and is marked ``status: crashed`` with the exit code (reconstruction is still tried);
4. :mod:`teller.inject.labels` labels every step; ``labels.json`` gets the windows, the plan,
   the skipped faults, the status and a label summary, ``step_labels.parquet`` the per-step labels.

A planned window that did not happen as planned (never opened in a process that ran engine
steps, or cut short by the end of the run) is listed under ``unapplied`` in ``labels.json``
with what was planned and what the run did (:func:`window_problems`), counted in the campaign
summary and printed by ``teller inject run``. The serve workload keeps admitting requests until
every window has closed (:func:`teller.workload.serve.keep_serving`), so this happens only with
engines that cannot be kept serving, with a step-anchored window past the end of a run whose
length is fixed in steps (``serve-tp``), or when the extension's bounds are hit.

Normal runs come first, so faulty runs can use the first normal run of the same workload as
their reference when they have too few fault-free steps of their own.

``parallel = N`` records N runs at a time, each in a lane: a ``python -m teller.inject.lane``
process pinned to its own share of the CPU cores (the engine, its collectors and any host-CPU
contention it gets inherit the pinning). The normal runs go first, in lanes, and become the
references; then the faulty runs, in lanes; last, one at a time, the runs with a machine-wide
mechanism (a co-located GPU hog, a shaped network link), which would disturb their neighbours.
Recording N at a time suits engines that are host-bound (the GPU is shared by the lanes).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from teller.errors import TellerError
from teller.inject import AGENT_EXTENSION, ENV_FAULTS
from teller.inject.labels import label_run
from teller.inject.mechanisms import registry
from teller.inject.spec import Campaign, RunSpec, load_spec
from teller.logs import align_run
from teller.reconstruct import reconstruct
from teller.record.launcher import gpu_present, record
from teller.rundir import RunDir


def workload_command(w: dict[str, Any], extra: list[str], seed_offset: int) -> list[str]:
    """The ``python -m teller.workload ...`` command of a workload table."""
    kind = w.get("kind", "serve")
    cmd = [sys.executable, "-m", "teller.workload", kind]
    for k, v in w.items():
        if k in ("kind", "args"):
            continue
        if k == "seed":
            v = int(v) + seed_offset
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    if "seed" not in w and seed_offset:
        cmd += ["--seed", str(seed_offset)]
    return cmd + list(w.get("args", [])) + extra


def _cpus() -> list[int]:
    """The CPU cores this process may run on (empty where the platform does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def machine_context(w: dict[str, Any]) -> dict[str, Any]:
    """What the mechanisms' availability checks need to know about this machine and workload."""
    gpu = gpu_present()
    device = str(w.get("device", "auto"))
    return {"gpu": gpu, "gpu_device": gpu and device in ("auto", "cuda"), "device": device, "cpus": _cpus(),
            "tp": int(w.get("tp", 2)) if w.get("kind") == "serve-tp" else 1,
            "workload": w.get("kind", "serve"), "root": os.geteuid() == 0}


def tp_hooks_file() -> str:
    return str(Path(__file__).resolve().parents[2] / "campaigns" / "hooks_tp.toml")


def run_campaign(spec: str | Path | Campaign, out: str | Path, only: list[str] | None = None,
                 force: bool = False, quiet: bool = True, parallel: int = 1,
                 refs: dict[str, str] | None = None, lane: bool = False,
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Record, reconstruct and label every run of ``spec`` under ``out``; returns a summary.

    ``parallel`` > 1 records that many runs at a time (module docstring). ``refs`` (workload key
    → run path) and ``lane`` are for lane processes: known references, and no campaign files.
    ``on_result(result)`` is called as each run is done (a progress bar's hook; with
    ``parallel`` > 1, as each group of lanes is collected)."""
    camp = spec if isinstance(spec, Campaign) else load_spec(spec)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reg = registry()
    order = sorted(camp.runs, key=lambda r: bool(r.faults))  # normal runs first (references)
    if only:
        unknown = sorted(set(only) - {r.name for r in camp.runs})
        if unknown:
            raise TellerError(f"--only {unknown[0]!r}: no run of that name in {camp.path}")
        order = [r for r in order if r.name in only]
    if parallel < 1:
        raise TellerError(f"--parallel {parallel}: expected 1 or more runs at a time")
    results: list[dict[str, Any]] = []
    refs = dict(refs or {})
    if not lane:
        (out / "campaign.json").write_text(json.dumps({"name": camp.name, "spec": camp.path, "seed": camp.seed,
                                                       "mechanisms": {k: m.describe() for k, m in reg.items()}},
                                                      indent=2))
    if parallel > 1:
        results = _run_lanes(camp, order, out, parallel, force, quiet, on_result)
    else:
        for run in order:
            for rep in range(run.repetitions):
                res = run_one(camp, run, rep, out, refs, force=force, quiet=quiet)
                results.append(res)
                if on_result is not None:
                    on_result(res)
                if not run.faults and res["status"] == "finished":
                    refs.setdefault(_wl_key(run.workload), res["path"])
    summary = {"campaign": camp.name, "runs": len(results),
               "finished": sum(r["status"] == "finished" for r in results),
               "crashed": sum(r["status"] == "crashed" for r in results),
               "skipped": sum(r["status"] == "skipped" for r in results),
               "abnormal_steps": sum(r.get("abnormal_steps", 0) for r in results),
               "unapplied_windows": sum(len(r.get("unapplied", [])) for r in results),
               "steps": sum(r.get("steps", 0) for r in results), "results": results}
    if not lane:
        (out / "campaign_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


#: a run's workload stops admitting at its timeout; the recording is ended (process tree killed,
#: what was recorded kept) this many seconds later, so a hung engine cannot stall the campaign
HARD_DEADLINE_EXTRA_S = 120.0


def _lane_cpus(lanes: int) -> list[list[int]]:
    """The CPU cores of each lane: this process's cores cut into ``lanes`` contiguous shares."""
    cpus = _cpus() or list(range(os.cpu_count() or 1))
    per = max(1, len(cpus) // lanes)
    return [cpus[k * per:(k + 1) * per] or cpus[-per:] for k in range(lanes)]


def run_lanes(runs: list[RunSpec], lanes: int, command: Callable[[int, list[str], list[int]], list[str]]) -> list[int]:
    """Start up to ``lanes`` processes at once and wait for them all; returns their exit codes.

    Lane ``k`` records ``runs[k::lanes]`` (their names, in that order) on the ``k``-th share of this
    process's CPU cores (:func:`_lane_cpus`); ``command(k, names, cpus)`` is its command line, and
    the lane pins itself to ``cpus`` (the engine, its collectors and any host-CPU contention it
    starts inherit the pinning). Which runs go to the lanes, and what a lane does with each, is the
    caller's (:func:`run_campaign`: ``python -m teller.inject.lane``; ``scripts/gpu/campaign.py``)."""
    import subprocess

    cpus = _lane_cpus(lanes)
    procs = [subprocess.Popen(command(k, [r.name for r in runs[k::lanes]], cpus[k]))
             for k in range(min(lanes, len(runs)))]
    return [p.wait() for p in procs]


def _run_lanes(camp: Campaign, order: list[RunSpec], out: Path, lanes: int, force: bool,
               quiet: bool, on_result: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Record ``order`` ``lanes`` runs at a time (module docstring); returns the run results."""
    if not camp.path:
        raise TellerError("--parallel needs the campaign spec as a file (lanes load it by path)")
    reg = registry()
    alone = [r for r in order if r.faults and any(reg[f.mechanism].machine_wide for f in r.faults)]
    normal = [r for r in order if not r.faults]
    rest = [r for r in order if r.faults and r not in alone]
    refs: dict[str, str] = {}
    results: list[dict[str, Any]] = []

    def lane_command(k: int, names: list[str], cpus: list[int]) -> list[str]:
        cmd = [sys.executable, "-m", "teller.inject.lane", str(camp.path), str(out), "--cpus",
               ",".join(map(str, cpus)), "--refs", json.dumps(refs), "--only", *names]
        return cmd + (["--force"] if force else []) + ([] if quiet else ["--verbose"])

    def in_lanes(runs: list[RunSpec]) -> None:
        codes = run_lanes(runs, lanes, lane_command)
        if any(codes):
            print(f"[teller] {sum(1 for c in codes if c)} lane(s) of the campaign exited with an error; "
                  "their runs are reported from what they wrote", file=sys.stderr)

    def collect(runs: list[RunSpec]) -> None:
        for run in runs:
            for rep in range(run.repetitions):
                results.append(_result_from_disk(out / f"{run.name}-r{rep}"))
                if on_result is not None:
                    on_result(results[-1])

    in_lanes(normal)
    collect(normal)
    for run, res in zip([r for r in normal for _ in range(r.repetitions)], results, strict=True):
        if res["status"] == "finished":
            refs.setdefault(_wl_key(run.workload), res["path"])
    in_lanes(rest)
    collect(rest)
    for run in alone:
        for rep in range(run.repetitions):
            results.append(run_one(camp, run, rep, out, refs, force=force, quiet=quiet))
            if on_result is not None:
                on_result(results[-1])
    return results


def _result_from_disk(path: Path) -> dict[str, Any]:
    """A run's result as :func:`run_one` returns it, read back from its ``labels.json``."""
    try:
        lab = json.loads((path / "labels.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {"run_id": path.name, "path": str(path), "status": "crashed", "exit_code": None,
                "skipped": [], "note": "the lane wrote no labels.json"}
    res = {"run_id": lab.get("run_id", path.name), "path": str(path), "status": lab.get("status", "crashed"),
           "exit_code": lab.get("exit_code"), "skipped": lab.get("skipped", []), "unapplied": lab.get("unapplied", [])}
    ls = lab.get("label_summary")
    if ls:
        res.update(steps=ls["steps"], abnormal_steps=ls["abnormal"])
    return res


def _wl_key(w: dict[str, Any]) -> str:
    keep = {k: v for k, v in w.items() if k not in ("num_blocks", "seed")}
    return json.dumps(keep, sort_keys=True)


def run_one(camp: Campaign, run: RunSpec, rep: int, out: Path, refs: dict[str, str],
            force: bool = False, quiet: bool = True) -> dict[str, Any]:
    """Record and label one repetition of one run."""
    reg = registry()
    run_id = f"{run.name}-r{rep}"
    path = out / run_id
    ctx = machine_context(run.workload)
    plan, skipped, extra, prefix = [], [], [], []
    for j, f in enumerate(run.faults):
        m = reg[f.mechanism]
        reason = m.unavailable(ctx)
        if reason:
            skipped.append({"mechanism": f.mechanism, "category": f.category, "reason": reason})
            continue
        entry = f.to_plan(f"f{j}")
        entry["implementation"] = m.implementation(ctx)
        entry["where"], entry["evidence"] = m.where, m.evidence
        plan.append(entry)
        extra += m.workload_args(entry)
        if not prefix:  # the workload's launcher (the same for every link fault)
            prefix = m.launch_prefix(entry)
    labels: dict[str, Any] = {"run_id": run_id, "campaign": camp.name, "run": run.name, "repetition": rep,
                              "workload": run.workload, "plan": plan, "skipped": skipped, "windows": [],
                              "machine": {k: v for k, v in ctx.items()}}
    rd = RunDir(path)
    if run.faults and not plan:
        labels["status"] = "skipped"
        path.mkdir(parents=True, exist_ok=True)
        rd.write_labels(labels)
        return {"run_id": run_id, "path": str(path), "status": "skipped", "skipped": skipped}
    cmd = workload_command(run.workload, extra, seed_offset=camp.seed + rep)
    if "timeout" not in run.workload:
        cmd += ["--timeout", str(camp.timeout_s)]
    cmd = prefix + cmd

    env_before = os.environ.get(ENV_FAULTS)
    os.environ[ENV_FAULTS] = json.dumps({"run_id": run_id, "faults": plan, "gpu_device": ctx["gpu_device"]})
    hooks = tp_hooks_file() if run.workload.get("kind") == "serve-tp" else None
    t0 = time.time()
    sink = io.BytesIO() if quiet else None
    try:
        # every step in detail: the labeller and the dataset read every step's operators
        summary = record(path, cmd, collector=camp.collector, be_depth=camp.be_depth, force=force,
                         hooks=hooks, detail_every=1, stdout=sink, stderr=sink, extensions=[AGENT_EXTENSION],
                         deadline_s=float(run.workload.get("timeout", camp.timeout_s)) + HARD_DEADLINE_EXTRA_S)
    finally:
        if env_before is None:
            os.environ.pop(ENV_FAULTS, None)
        else:
            os.environ[ENV_FAULTS] = env_before
    status = "finished" if summary["exit_code"] == 0 else "crashed"
    labels.update(status=status, exit_code=summary["exit_code"], command=cmd, record_s=round(time.time() - t0, 3))
    labels["windows"] = gather_windows(path)
    labels["unapplied"] = window_problems(plan, labels["windows"])
    rec_err = None
    try:
        reconstruct(path)
        align_run(path)
    except Exception as e:  # a crashed run may not reconstruct; keep it, marked
        rec_err = f"{type(e).__name__}: {e}"
        labels["reconstruct_error"] = rec_err
    res = {"run_id": run_id, "path": str(path), "status": status, "exit_code": summary["exit_code"],
           "skipped": skipped, "unapplied": labels["unapplied"]}
    if rec_err is None:
        ref = refs.get(_wl_key(run.workload)) if run.faults else None
        lsum = label_run(path, labels, reference=ref)
        labels["label_summary"] = lsum
        res.update(steps=lsum["steps"], abnormal_steps=lsum["abnormal"])
    rd.write_labels(labels)
    return res


def gather_windows(path: Path) -> list[dict[str, Any]]:
    """The windows the agents applied (``RUN/inject/<pid>.json``), one list for the run."""
    out = []
    for f in sorted((Path(path) / "inject").glob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for w in doc.get("windows", []):
            w["first_step_tau_ns"] = doc.get("first_step_tau_ns")
            w["steps_seen"] = doc.get("steps_seen")
            out.append(w)
    return out


def window_problems(plan: list[dict[str, Any]], windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The planned windows that did not happen as planned, one entry per fault and process.

    Only processes that ran engine steps count (a launcher that only starts the ranks gets the
    plan too and never steps). A fault is reported when no such process opened it (``never
    opened``) or when the run ended before its planned length (``cut short``: fewer steps than
    ``steps``, less time than ``duration_s``). Each entry says what was planned and what the run
    did, and how to fix the spec."""
    out: list[dict[str, Any]] = []
    for p in plan:
        if p.get("start_step") is not None:
            planned = f"to open at step {p['start_step']}" + (f" for {p['steps']} steps" if p.get("steps") else "")
        else:
            planned = f"to open {p.get('start_s') or 0:g} s after the first step" + (
                f" for {p['duration_s']:g} s" if p.get("duration_s") is not None else "")
        base = {"id": p["id"], "mechanism": p["mechanism"], "planned": planned}
        ws = [w for w in windows if w.get("id") == p["id"] and w.get("steps_seen")]
        if not ws:
            why = ("no process that received the plan ran an engine step"
                   if any(w.get("id") == p["id"] for w in windows) else "no process applied the plan")
            out.append({**base, "problem": "never opened", "pid": None, "rank": p.get("rank"),
                        "detail": f"planned {planned}; {why}",
                        "fix": "check that the engine's steps are recorded (teller stats RUN) and the fault agent loaded"})
            continue
        for w in ws:
            where = {"pid": w.get("pid"), "rank": w.get("rank")}
            if w.get("state") == "pending":
                out.append({**base, **where, "problem": "never opened",
                            "detail": f"planned {planned}; the process ran {w['steps_seen']} steps",
                            "fix": "anchor the window earlier, or give the workload more requests"})
                continue
            if w.get("state") != "closed-at-exit" or w.get("start_tau_ns") is None or w.get("end_tau_ns") is None:
                continue
            if p.get("steps") is not None and w.get("steps_at_start") is not None and w.get("steps_at_end") is not None:
                ran = int(w["steps_at_end"]) - int(w["steps_at_start"])
                if ran < int(p["steps"]):
                    out.append({**base, **where, "problem": "cut short",
                                "detail": f"planned {planned}; the run ended after {ran} of them",
                                "fix": "anchor the window earlier, or give the workload more requests"})
            elif p.get("duration_s") is not None:
                ran_s = (int(w["end_tau_ns"]) - int(w["start_tau_ns"])) / 1e9
                if ran_s < float(p["duration_s"]):
                    out.append({**base, **where, "problem": "cut short",
                                "detail": f"planned {planned}; the run ended {ran_s:.3g} s into it",
                                "fix": "anchor the window earlier, or give the workload more requests"})
    return out
