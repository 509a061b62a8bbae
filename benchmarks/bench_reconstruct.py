"""Throughput and peak memory of ``teller reconstruct`` on synthetic engine runs.

    python benchmarks/bench_reconstruct.py                 # 1M and 10M events, 3 runs each
    python benchmarks/bench_reconstruct.py --sizes 2e6 --repeat 5

For each size a run directory is generated once (not timed). Each measurement is a fresh
subprocess pinned to one core (OMP/OPENBLAS/MKL threads = 1, Arrow CPU and IO pools = 1 thread):
wall and CPU time of ``reconstruct(run)`` (reading events, writing all tables), and peak RSS per
event = (ru_maxrss after − ru_maxrss after imports) / events. The best of the repeats is reported
(the machine may be shared; CPU seconds are reported too because they suffer less from that).
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

CHILD = r"""
import json, os, resource, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import pyarrow as pa
pa.set_cpu_count(1)
pa.set_io_thread_count(1)
from teller.reconstruct import reconstruct
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
w0, c0 = time.perf_counter(), time.process_time()
s = reconstruct(sys.argv[1])
wall, cpu = time.perf_counter() - w0, time.process_time() - c0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
hwm = [int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM")][0]
print(json.dumps({"events": s["events_in"], "nodes": s["nodes"], "wall": wall, "cpu": cpu,
                  "base_rss": base, "peak_rss": peak, "hwm": hwm, "timings": s["timings"],
                  "coverage": s["binding_coverage"], "reconciled": s["reconciled"]}))
"""

SINGLE = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}


def measure(run: Path) -> dict:
    env = {**os.environ, **SINGLE}
    out = subprocess.run([sys.executable, "-c", CHILD, str(run)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the runs (default: a temp dir)")
    args = ap.parse_args(argv)

    try:
        from rich.console import Console

        console = Console(stderr=True)
    except ImportError:  # a bare machine: plain progress lines
        import contextlib

        class _Plain:
            def status(self, msg):
                print(msg, file=sys.stderr, flush=True)
                return contextlib.nullcontext()

            def print(self, msg):
                print(msg, file=sys.stderr, flush=True)

        console = _Plain()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for size in args.sizes:
            n = int(size)
            run = Path(tmp) / f"synth_{n}"
            t0 = time.perf_counter()
            with console.status(f"generating {n:,} events"):
                # in a child process, so this process stays small: ru_maxrss of a forked child
                # starts from its parent's high-water mark
                gen_cmd = f"from teller.testing.synth import write_synth_run; write_synth_run({str(run)!r}, {n}, ranks={args.ranks})"
                subprocess.run([sys.executable, "-c", gen_cmd], check=True)
            gen = time.perf_counter() - t0
            results = []
            for i in range(args.repeat):
                with console.status(f"reconstruct {n:,} events, run {i + 1}/{args.repeat}"):
                    results.append(measure(run))
            best = min(results, key=lambda r: r["wall"])
            cpu_best = min(r["cpu"] for r in results)
            mem = min((r["peak_rss"] - r["base_rss"]) / r["events"] for r in results)
            row = {
                "events": best["events"],
                "nodes": best["nodes"],
                "generate_s": round(gen, 2),
                "wall_s": round(best["wall"], 3),
                "events_per_s": round(best["events"] / best["wall"]),
                "cpu_s": round(cpu_best, 3),
                "events_per_cpu_s": round(best["events"] / cpu_best),
                "bytes_per_event": round(mem, 1),
                "peak_rss_mb": round(max(r["peak_rss"] for r in results) / 2**20),
                "base_rss_mb": round(min(r["base_rss"] for r in results) / 2**20),
                "walls": [round(r["wall"], 2) for r in results],
                "phases_cpu_s": best["timings"],
                "binding_coverage": best["coverage"],
                "reconciled": best["reconciled"],
            }
            rows.append(row)
            console.print(json.dumps(row))
    print("| events | nodes | wall s (best) | events/s | CPU s | events/CPU-s | peak RSS B/event |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['events']:,} | {r['nodes']:,} | {r['wall_s']} | {r['events_per_s']:,} | {r['cpu_s']} | {r['events_per_cpu_s']:,} | {r['bytes_per_event']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
