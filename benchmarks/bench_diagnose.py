"""Speed and accuracy of the numeric stage (`teller diagnose`: features → localizer → slices → JSON).

    python benchmarks/bench_diagnose.py speed                 # 1M-event run, 3 repeats
    python benchmarks/bench_diagnose.py speed --events 2e6
    python benchmarks/bench_diagnose.py speed --events 16e6 --repeat 1 --pair /tmp/pair16m   # generate once, reuse
    python benchmarks/bench_diagnose.py accuracy              # planted anomalies in synthetic runs
    python benchmarks/bench_diagnose.py accuracy --cpu        # + a CPU fault-injection campaign

speed: a reference run and a run with planted anomalies (about 1M canonical events each, from
:mod:`teller.testing.synth` via :mod:`teller.testing.planted`) are generated and reconstructed
once (not timed). Each measurement is a fresh subprocess pinned to one core (OMP/OPENBLAS/MKL threads 1,
Arrow pools 1 thread): ``diagnose(RUN, localizer=ARTEFACT, html=True)`` from reading the forest to
writing diagnosis.json and report.html; then the same with ``reference=[REF]`` (fitting
included), with no reference (the run read against its own steps: a fit on each half, then on the reference,
``teller.localize.fit_self_reference``), and ``teller localize fit`` alone. CPU time is the process's own (user and system:
the system part is mostly page faults of fresh memory, and varies with the machine's state). Peak
memory is the process's VmHWM (absolute) and its growth over the resident size after the imports.
Reading and featurizing the reference inside the fit is timed apart (``reference_features_s``;
the rest of the fit phase is the fit itself). Best of the repeats.

accuracy: step-level P/R/F1 and operator-set Macro₊ F1 (docs/design.md §11) of the numeric stage on
planted anomalies, never on the labelled dataset: synthetic runs with each mechanism of
:mod:`teller.testing.planted` at several magnitudes (reference: a fault-free synthetic run of
another seed), and with ``--cpu`` real recordings of the CPU workload with faults injected by
``teller inject`` (reference: the campaign's fault-free runs; labels: its step_labels.parquet).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SINGLE = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}

CHILD = r"""
import json, os, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import pyarrow as pa
pa.set_cpu_count(1)
pa.set_io_thread_count(1)
from teller.localize import fit_localizer, GMMLocalizer
from teller.report.diagnose import diagnose
import sklearn.mixture, scipy.stats  # imports before the baseline
import teller.localize as L
mode, run, ref, art, out = sys.argv[1:6]
ref_feat = [0.0]  # seconds fit_localizer spends reading and featurizing the reference (the rest is the fit)
_run_features = L.run_features
def _timed(*a, **k):
    t = time.perf_counter()
    try:
        return _run_features(*a, **k)
    finally:
        ref_feat[0] += time.perf_counter() - t
L.run_features = _timed
def status(key):
    return [int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key)][0]
base = status("VmRSS:")  # after imports (ru_maxrss would include the parent's peak before exec)
w0, c0, o0 = time.perf_counter(), time.process_time(), os.times()
info = {}
if mode == "fit":
    est = fit_localizer([ref])
    est.save(art)
    info = {"families": int(len(est.families_)), **est.extra_}
else:
    kw = {"localizer": art} if mode in ("load", "model") else {} if mode == "own" else {"reference": [ref]}
    if mode == "model":  # the shipped root-cause model on the flagged steps, on one thread
        import torch
        torch.set_num_threads(1)
    d = diagnose(run, out=out, html=True, model=None if mode == "model" else False, **kw)
    s = d["summary"]
    info = {k: s[k] for k in ("steps", "steps_flagged", "instances", "slice_nodes")}
    info["phases"] = s["seconds"]
    info["json_bytes"] = os.path.getsize(d["paths"]["json"])
    info["html_bytes"] = os.path.getsize(d["paths"]["html"])
wall, cpu, o1 = time.perf_counter() - w0, time.process_time() - c0, os.times()
hwm = status("VmHWM:")
print(json.dumps({"wall": wall, "cpu": cpu, "user": o1.user - o0.user, "sys": o1.system - o0.system,
                  "base_rss": base, "hwm": hwm, "reference_features_s": ref_feat[0], **info}))
"""


def _child(mode: str, run: Path, ref: Path, art: Path, out: Path) -> dict:
    env = {**os.environ, **SINGLE}
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(run), str(ref), str(art), str(out)],
                       env=env, check=True, capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _console():
    from rich.console import Console

    return Console(stderr=True)


def make_pair(tmp: Path, n_events: int, ranks: int = 1) -> tuple[Path, Path, int, int]:
    """A fault-free reference and a run with ~1% of its steps planted (three mechanisms)."""
    from teller.reconstruct import reconstruct
    from teller.testing.planted import Plant, write_planted_run

    ref, bad = tmp / "ref", tmp / "bad"
    # pushpop="none" writes one row per range: ask for more so the run has n_events rows
    scale = 1.31
    write_planted_run(ref, int(n_events * scale), [], seed=1, ranks=ranks)
    s = reconstruct(ref)
    steps = list(range(50, max(s["steps"] // ranks - 50, 60), 97))
    plants = [Plant("BE aten::mul", steps[0::3], "host", 4.0), Plant("BE aten::linear", steps[1::3], "kernel", 4.0),
              Plant("BE aten::silu", steps[2::3], "churn", 4.0)]
    write_planted_run(bad, int(n_events * scale), plants, seed=2, ranks=ranks)
    s2 = reconstruct(bad)
    return ref, bad, s2["events_in"], s2["nodes"]


def _pair(tmp: Path, args: argparse.Namespace, con) -> tuple[Path, Path, int, int]:
    """The run pair: generated in ``tmp``, or kept in (and reused from) ``--pair DIR``."""
    if args.pair is not None and (args.pair / "bad" / "reconstruct.json").is_file() and (args.pair / "ref" / "reconstruct.json").is_file():
        s = json.loads((args.pair / "bad" / "reconstruct.json").read_text())
        return args.pair / "ref", args.pair / "bad", int(s["events_in"]), int(s["nodes"])
    where = args.pair if args.pair is not None else tmp
    where.mkdir(parents=True, exist_ok=True)
    with con.status(f"generating and reconstructing two runs of {args.events:g} events"):
        return make_pair(where, int(args.events), args.ranks)


def speed(args: argparse.Namespace) -> int:
    con = _console()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmpd:
        tmp = Path(tmpd)
        ref, bad, events, nodes = _pair(tmp, args, con)
        load = os.getloadavg()
        art = tmp / "loc.npz"
        results = {}
        for mode in ("fit", "load", "reference", "own") + (("model",) if args.model else ()):
            best = None
            for i in range(args.repeat):
                with con.status(f"{mode}: run {i + 1}/{args.repeat}"):
                    r = _child(mode, bad, ref, art, tmp / f"out_{mode}")
                if best is None or r["wall"] < best["wall"]:
                    best = r
            results[mode] = best
        from teller.evaluate.metrics import evaluate_run

        acc = {m: evaluate_run(bad, json.loads((tmp / f"out_{m}" / "diagnosis.json").read_text())) for m in ("reference", "own")}
    row = {"events": events, "nodes": nodes, "results": results, "loadavg": {"start": load, "end": os.getloadavg()},
           "accuracy": {"step": acc["reference"]["step"], "operator": acc["reference"]["operator"]},
           "accuracy_own_steps": {"step": acc["own"]["step"], "operator": acc["own"]["operator"]}}
    print(json.dumps(row, indent=2))
    g = 2**30
    print("\n| measurement | wall s | CPU s (user + sys) | peak RSS GiB | growth GiB |\n|---|---:|---:|---:|---:|")
    names = {"load": "diagnose --localizer (target)", "reference": "diagnose --reference (fit included)",
             "fit": "localize fit", "model": "diagnose --localizer with the shipped root-cause model",
             "own": "diagnose, no reference (the run's own steps: a fit on each half, then the reference)"}
    for mode in ("load", "reference", "own", "fit") + (("model",) if args.model else ()):
        r = results[mode]
        print(f"| {names[mode]} | {r['wall']:.2f} | {r['cpu']:.2f} ({r['user']:.2f} + {r['sys']:.2f}) | {r['hwm'] / g:.2f} | "
              f"{(r['hwm'] - r['base_rss']) / g:.2f} |")
    print(f"\nrun: {events:,} events, {nodes:,} forest nodes, {results['load']['steps']} steps, "
          f"{results['load']['instances']:,} instances, {results['load']['steps_flagged']} flagged, "
          f"{results['load']['slice_nodes']} slice nodes; phases {results['load']['phases']}; with --reference "
          f"{results['reference']['phases']} (of fit_or_load, reading and featurizing the reference: "
          f"{results['reference']['reference_features_s']:.3f}; localize fit: {results['fit']['reference_features_s']:.3f} "
          f"of {results['fit']['wall']:.3f}); load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    return 0


# ------------------------------------------------------------------------------------------------
# accuracy


def _pool(rows: list[dict]) -> dict:
    """Metrics over the union of the steps of several evaluations."""
    import numpy as np

    from teller.evaluate.metrics import operator_metrics, step_metrics

    truth = np.concatenate([np.asarray(r["truth"], bool) for r in rows])
    pred = np.concatenate([np.asarray(r["pred"], bool) for r in rows])
    t_ops = [set(x) for r in rows for x in r["true_ops"]]
    p_ops = [set(x) for r in rows for x in r["pred_ops"]]
    return {"step": step_metrics(truth, pred), "operator": operator_metrics(t_ops, p_ops)}


def synthetic_accuracy(tmp: Path, n_events: int, con) -> list[dict]:
    from teller.evaluate.metrics import evaluate_run
    from teller.localize import fit_localizer
    from teller.reconstruct import reconstruct
    from teller.report.diagnose import diagnose
    from teller.testing.planted import Plant, write_planted_run

    write_planted_run(tmp / "ref", n_events, [], seed=1)
    s = reconstruct(tmp / "ref")
    est = fit_localizer([tmp / "ref"])
    art = tmp / "loc.npz"
    est.save(art)
    n_steps = s["steps"]
    targets = {"host": "BE aten::mul", "kernel": "BE aten::linear", "churn": "BE aten::silu"}
    rows = []
    seed = 10
    for mech, target in targets.items():
        for mag in (1.5, 2.0, 4.0, 8.0):
            seed += 1
            steps = list(range(7, n_steps - 5, 17))  # ~6% of the steps
            run = tmp / f"{mech}_{mag}"
            with con.status(f"synthetic {mech} x{mag}"):
                write_planted_run(run, n_events, [Plant(target, steps, mech, mag)], seed=seed)
                reconstruct(run)
                d = diagnose(run, localizer=art, out=run / "diag", model=False)
                m = evaluate_run(run, d)
            rows.append({"source": "synthetic", "mechanism": mech, "target": target, "magnitude": mag, **m})
    return rows


CPU_SPEC = """
[campaign]
name = "diagnose_eval_cpu"
seed = 0
repetitions = {reps}
collector = "cpu"
be_depth = 1
timeout_s = 240

[workload]
kind = "serve"
device = "cpu"
preset = "tiny"
requests = 24
rate = 40.0
prompt_len = "uniform:8:32"
output_len = "16"

[[runs]]
name = "normal"
[[runs]]
name = "normal-b"
workload = {{ seed = 101 }}
[[runs]]
name = "normal-c"
workload = {{ seed = 202 }}
[[runs]]
name = "op-delay-mlp"
[[runs.faults]]
mechanism = "targeted_op_delay"
magnitude = 1000
start_s = 0.1
duration_s = 0.3
targets = ["MLP"]
[[runs]]
name = "op-delay-attn"
[[runs.faults]]
mechanism = "targeted_op_delay"
magnitude = 300
start_s = 0.1
duration_s = 0.3
targets = ["Attention"]
[[runs]]
name = "hidden-sync"
[[runs.faults]]
mechanism = "hidden_host_sync"
magnitude = 4
start_s = 0.1
duration_s = 0.3
[[runs]]
name = "alloc-churn"
[[runs.faults]]
mechanism = "allocator_churn"
magnitude = 64
start_s = 0.1
duration_s = 0.3
[[runs]]
name = "cpu-contention"
[[runs.faults]]
mechanism = "host_cpu_contention"
magnitude = 2
start_s = 0.1
duration_s = 0.3
[[runs]]
name = "gil"
[[runs.faults]]
mechanism = "gil_contention"
magnitude = 1
start_s = 0.1
duration_s = 0.3
[[runs]]
name = "scheduler-stall"
[[runs.faults]]
mechanism = "scheduler_stall"
magnitude = 2
start_s = 0.1
duration_s = 0.3
"""


def cpu_accuracy(tmp: Path, reps: int, con) -> list[dict]:
    from teller.evaluate.metrics import evaluate_run
    from teller.inject.campaign import run_campaign
    from teller.localize import fit_localizer
    from teller.report.diagnose import diagnose

    spec = tmp / "cpu.toml"
    spec.write_text(CPU_SPEC.format(reps=reps))
    out = tmp / "campaign"
    with con.status("recording the CPU campaign (teller inject run)"):
        summary = run_campaign(spec, out)
    runs = sorted(p for p in out.iterdir() if (p / "labels.json").is_file())
    refs = [p for p in runs if p.name.startswith(("normal-r", "normal-b-r"))]
    art = tmp / "cpu_loc.npz"
    fit_localizer(refs).save(art)
    rows = []
    for run in runs:
        if run in refs:
            continue
        lab = json.loads((run / "labels.json").read_text())
        if lab.get("status") != "finished":
            continue
        d = diagnose(run, localizer=art, out=run / "diag", model=False)
        m = evaluate_run(run, d)
        mech = ",".join(sorted({w["mechanism"] for w in lab.get("windows", [])})) or "none (held-out normal)"
        # where the flags fall: inside a fault window (labelled abnormal or not) or outside all
        import pyarrow.parquet as pq

        sl = pq.read_table(run / "step_labels.parquet", columns=["step_id", "in_window"])
        inw = dict(zip(sl.column("step_id").to_pylist(), sl.column("in_window").to_pylist(), strict=True))
        win = [bool(inw.get(x["node_id"], False)) for x in d["steps"]]
        flag = m["pred"]
        m["in_window"] = {"steps": sum(win), "flagged": sum(f and w for f, w in zip(flag, win, strict=True)),
                          "outside": len(win) - sum(win),
                          "flagged_outside": sum(f and not w for f, w in zip(flag, win, strict=True))}
        m["unseen_instances"] = d["summary"]["unseen_instances_in_steps"]  # a recorder mismatch shows here
        rows.append({"source": "cpu-inject", "run": run.name, "mechanism": mech, **m})
    con.print(f"campaign: {summary.get('runs', '?')} runs; references {', '.join(p.name for p in refs)}")
    return rows


def accuracy(args: argparse.Namespace) -> int:
    con = _console()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmpd:
        tmp = Path(tmpd)
        rows = synthetic_accuracy(tmp, int(args.events), con)
        if args.cpu:
            rows += cpu_accuracy(tmp, args.reps, con)
    print("| source | run / mechanism | magnitude | steps | abnormal | step P | step R | step F1 | op Macro₊ F1 "
          "| in-window steps flagged | other steps flagged |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s, o = r["step"], r["operator"]
        w = r.get("in_window")
        wtxt = f"{w['flagged']}/{w['steps']} | {w['flagged_outside']}/{w['outside']}" if w else " | "
        name = f"{r['run']} ({r['mechanism']})" if "run" in r else r["mechanism"]
        print(f"| {r['source']} | {name} | {r.get('magnitude', '')} | {s['steps']} | {s['abnormal']} | "
              f"{s['precision']:.2f} | {s['recall']:.2f} | {s['f1']:.2f} | {o['macro_plus_f1']:.2f} | {wtxt} |")
    summary = {}
    for src in sorted({r["source"] for r in rows}):
        pooled = _pool([r for r in rows if r["source"] == src])
        summary[src] = pooled
        s, o = pooled["step"], pooled["operator"]
        print(f"| **{src}, pooled** | all | | {s['steps']} | {s['abnormal']} | {s['precision']:.2f} | "
              f"{s['recall']:.2f} | {s['f1']:.2f} | {o['macro_plus_f1']:.2f} | | |")
    if args.out:
        slim = [{k: v for k, v in r.items() if k not in ("truth", "pred", "true_ops", "pred_ops")} for r in rows]
        Path(args.out).write_text(json.dumps({"rows": slim, "pooled": summary}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("speed", help="time and peak memory on a 1M-event run")
    sp.add_argument("--events", type=float, default=1e6)
    sp.add_argument("--ranks", type=int, default=1)
    sp.add_argument("--repeat", type=int, default=3)
    sp.add_argument("--dir", type=Path, default=None)
    sp.add_argument("--pair", type=Path, default=None,
                    help="keep the generated run pair in this folder and reuse it when it is there (same --events)")
    sp.add_argument("--model", action="store_true", help="also time diagnose with the shipped root-cause model")
    ap_acc = sub.add_parser("accuracy", help="step P/R/F1 and operator Macro+ F1 on planted anomalies")
    ap_acc.add_argument("--events", type=float, default=1.5e5, help="events per synthetic run")
    ap_acc.add_argument("--cpu", action="store_true", help="also record and score a CPU fault-injection campaign")
    ap_acc.add_argument("--reps", type=int, default=2, help="repetitions of each CPU campaign run")
    ap_acc.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap_acc.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rc = speed(args) if args.cmd == "speed" else accuracy(args)
    print(f"\n({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
