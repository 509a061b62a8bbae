"""Ingest speed and memory: `teller ingest` vs HolisticTraceAnalysis' TraceAnalysis.

Both sides load the same Kineto trace into a table: TELLER writes the canonical events
(Parquet) and run.json; HTA builds its per-rank DataFrames (`TraceAnalysis(trace_dir=...)`).
Each measurement runs in a fresh subprocess; wall time is the call itself (imports excluded),
CPU time the process's user + system time over the call (``time.process_time``, every thread),
memory is the process's peak resident set (VmHWM; children's ru_maxrss if larger) and the growth
over the peak after imports. events/s and B/event count the Kineto events of the file (every
element of ``traceEvents``, as ``teller ingest`` reports them in ``events_in``).

Inputs: the larger external Kineto file of the test data (1x), and traces ``--scales`` times
larger made from it by repeating its events shifted in time (correlation, External and flow ids
shifted too, so they stay unique), written under ``--workdir``.

HolisticTraceAnalysis is not a TELLER dependency: install it beside TELLER first
(``pip install HolisticTraceAnalysis``), or pass ``--python`` for an interpreter that has both.
Perfetto's ``trace_processor`` is not compared: its Python package downloads the
``trace_processor_shell`` binary on first use, which an offline machine cannot do.

    python benchmarks/bench_ingest_hta.py [--python PY] [--repeat 3] [--scales 1,10,50]
        [--repeat-big 1] [--lock /tmp/teller-big.lock] [--tools teller,hta]
        [--workdir /tmp/teller_bench_ingest]

``--lock``: measurements at 50x and more run under ``flock LOCK`` (HTA needs ~12 GiB there),
so that big jobs on a shared machine do not overlap.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "tests" / "data" / "external" / "kineto"
CANDIDATES = ("hta_ns_resolution_rank0.json.gz", "hta_nccl_data_rank0.json.gz")

_MEASURE = r"""
import json, logging, os, resource, sys, tempfile, time
logging.disable(logging.CRITICAL)
tool, path = sys.argv[1], sys.argv[2]
def peak_mb():
    # VmHWM: this process's peak RSS. (ru_maxrss would carry the parent's peak across exec.)
    with open("/proc/self/status") as f:
        hwm = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(hwm, kids) / 1024.0
if tool == "teller":
    from teller.ingest import ingest
    import teller.ingest.kineto  # noqa: F401  (ingest imports its reader lazily; load it up front, as HTA's)
    import pyarrow.parquet  # noqa: F401
    base = peak_mb()
    out = tempfile.mkdtemp(prefix="teller_bench_")
    t, c = time.perf_counter(), time.process_time()
    s = ingest(path, out)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    rows = s["events_out"]
    events = s["events_in"]
else:
    from hta.trace_analysis import TraceAnalysis
    base = peak_mb()
    devnull = open(os.devnull, "w")
    so, se = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = devnull
    t, c = time.perf_counter(), time.process_time()
    a = TraceAnalysis(trace_dir=path)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    sys.stdout, sys.stderr = so, se
    rows = sum(len(df) for df in a.t.traces.values())
    events = None
print("RESULT " + json.dumps(
    {"wall_s": wall, "cpu_s": cpu, "peak_mb": peak_mb(), "base_mb": base, "rows": rows, "events": events}
))
"""


def source_file() -> Path:
    files = [DATA / c for c in CANDIDATES if (DATA / c).is_file()]
    if not files:
        sys.exit(f"no Kineto sample under {DATA}")
    return max(files, key=lambda p: p.stat().st_size)


def make_scaled(src: Path, dst: Path, scale: int) -> Path:
    """Write ``src`` with its non-metadata events repeated ``scale`` times, shifted in time.

    Written event by event (only the source's events are held), gzip level 1."""
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    doc = json.loads(gzip.open(src).read())
    events = doc.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    timed = [e for e in events if e.get("ph") != "M"]
    ts = [e["ts"] for e in timed if isinstance(e.get("ts"), (int, float))]
    ends = [e["ts"] + e.get("dur", 0) for e in timed if isinstance(e.get("ts"), (int, float))]
    span = max(ends) - min(ts) + 1000.0
    ids = [e.get("id", 0) for e in timed] + [
        v
        for e in timed
        for k, v in (e.get("args") or {}).items()
        if k in ("correlation", "External id") and isinstance(v, int)
    ]
    id_step = max(i for i in ids if isinstance(i, int)) + 1
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    with gzip.open(tmp, "wt", compresslevel=1) as f:
        f.write('{"traceEvents": [')
        first = True
        for e in meta:
            f.write(("" if first else ", ") + json.dumps(e))
            first = False
        for k in range(scale):
            for e in timed:
                c = dict(e)
                if isinstance(c.get("ts"), (int, float)):
                    c["ts"] = c["ts"] + k * span
                if isinstance(c.get("id"), int):
                    c["id"] = c["id"] + k * id_step
                a = c.get("args")
                if isinstance(a, dict) and ("correlation" in a or "External id" in a):
                    a = dict(a)
                    for key in ("correlation", "External id"):
                        if isinstance(a.get(key), int):
                            a[key] += k * id_step
                    c["args"] = a
                f.write(("" if first else ", ") + json.dumps(c))
                first = False
        f.write("]")
        rest = json.dumps(doc)
        f.write((", " + rest[1:]) if doc else "}")
    tmp.replace(dst)
    return dst


def measure(python: str, tool: str, path: Path, repeat: int, lock: str | None) -> dict | str:
    runs = []
    cmd = [python, "-c", _MEASURE, tool, str(path)]
    if lock:
        cmd = ["flock", lock, *cmd]
    for _ in range(repeat):
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            return (p.stderr.strip().splitlines() or ["no output"])[-1]
        runs.append(json.loads(line[7:]))
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "walls": [r["wall_s"] for r in runs],
        "cpu_s": statistics.median(r["cpu_s"] for r in runs),
        "cpus": [r["cpu_s"] for r in runs],
        "peak_mb": max(r["peak_mb"] for r in runs),
        "growth_mb": max(r["peak_mb"] - r["base_mb"] for r in runs),
        "rows": runs[0]["rows"],
        "events": runs[0]["events"],
        "runs": len(runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--python", default=sys.executable, help="interpreter with teller and HolisticTraceAnalysis"
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool below 50x (median)")
    ap.add_argument("--repeat-big", type=int, default=1, help="runs per tool at 50x and more")
    ap.add_argument("--scales", default="1,10,50")
    ap.add_argument("--tools", default="teller,hta")
    ap.add_argument("--lock", default=None, help="flock file for the runs at 50x and more")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/teller_bench_ingest"))
    args = ap.parse_args()
    tools = args.tools.split(",")

    src = source_file()
    rows = []
    for scale in (int(x) for x in args.scales.split(",")):
        if scale == 1:
            f = args.workdir / "x1" / src.name
            f.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, f)
        else:
            f = make_scaled(src, args.workdir / f"x{scale}" / src.name, scale)
        with gzip.open(f) as g:
            mb = sum(len(b) for b in iter(lambda: g.read(1 << 24), b"")) / 2**20
        big = scale >= 50
        rep = args.repeat_big if big else args.repeat
        lock = args.lock if big else None
        t = measure(args.python, "teller", f, rep, lock) if "teller" in tools else "not run"
        h = measure(args.python, "hta", f.parent, rep, lock) if "hta" in tools else "not run"
        rows.append((f"{scale}x", mb, t, h))
        print(f"{scale}x: teller {t}\n{scale}x: hta {h}", file=sys.stderr, flush=True)

    la = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"source: {src.name}; python: {args.python}; median of {args.repeat} runs "
        f"({args.repeat_big} at 50x and more); load average after the runs: {la}\n"
    )
    print(
        "| input | Kineto events | JSON MiB | teller s | teller CPU s | HTA s | HTA CPU s "
        "| HTA/teller time | teller events/s (CPU) | teller peak MiB (growth) "
        "| HTA peak MiB (growth) "
        "| HTA/teller peak | teller peak B/event | HTA peak B/event |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, mb, t, h in rows:
        ev = t["events"] if isinstance(t, dict) else None
        cells = [label, f"{ev:,}" if ev else "-", f"{mb:.0f}"]
        cells.append(f"{t['wall_s']:.2f}" if isinstance(t, dict) else f"failed: {t}")
        cells.append(f"{t['cpu_s']:.2f}" if isinstance(t, dict) else "")
        cells.append(f"{h['wall_s']:.2f}" if isinstance(h, dict) else f"not run: {h}")
        cells.append(f"{h['cpu_s']:.2f}" if isinstance(h, dict) else "")
        both = isinstance(t, dict) and isinstance(h, dict)
        cells.append(f"{h['wall_s'] / t['wall_s']:.1f}x" if both else "")
        cells.append(f"{ev / t['wall_s'] / 1e6:.2f}M ({ev / t['cpu_s'] / 1e6:.2f}M)" if ev else "")
        cells.append(
            f"{t['peak_mb']:.0f} ({t['growth_mb']:.0f})" if isinstance(t, dict) else ""
        )
        cells.append(
            f"{h['peak_mb']:.0f} ({h['growth_mb']:.0f})" if isinstance(h, dict) else ""
        )
        cells.append(f"{h['peak_mb'] / t['peak_mb']:.1f}x" if both else "")
        cells.append(f"{t['peak_mb'] * 2**20 / ev:.0f}" if ev else "")
        cells.append(f"{h['peak_mb'] * 2**20 / ev:.0f}" if ev and isinstance(h, dict) else "")
        print("| " + " | ".join(cells) + " |")
    print(
        "\nrows kept: "
        + "; ".join(
            f"{lb}: teller {t['rows'] if isinstance(t, dict) else '-'}, "
            f"HTA {h['rows'] if isinstance(h, dict) else '-'}"
            for lb, _, t, h in rows
        )
    )
    print(
        "CPU times of each run (s): "
        + "; ".join(
            f"{lb}: teller {[round(x, 2) for x in t['cpus']] if isinstance(t, dict) else '-'}, "
            f"HTA {[round(x, 2) for x in h['cpus']] if isinstance(h, dict) else '-'}"
            for lb, _, t, h in rows
        )
    )
    print(
        "wall times of each run (s): "
        + "; ".join(
            f"{lb}: teller {[round(x, 2) for x in t['walls']] if isinstance(t, dict) else '-'}, "
            f"HTA {[round(x, 2) for x in h['walls']] if isinstance(h, dict) else '-'}"
            for lb, _, t, h in rows
        )
    )


if __name__ == "__main__":
    main()
