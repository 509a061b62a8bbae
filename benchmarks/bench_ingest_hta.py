"""Ingest speed and memory: `teller ingest` vs HolisticTraceAnalysis' TraceAnalysis.

Both sides load the same Kineto trace into a table: TELLER writes the canonical events
(Parquet) and run.json; HTA builds its per-rank DataFrames (`TraceAnalysis(trace_dir=...)`).
Each measurement runs in a fresh subprocess; wall time is the call itself (imports excluded),
memory is the process's peak resident set (VmHWM; children's ru_maxrss if larger) and the growth
over the peak after imports.

Inputs: the larger external Kineto file of the test data, and a trace 10x (``--scale``) larger
made from it by repeating its events shifted in time (correlation, External and flow ids shifted
too, so they stay unique), written under ``--workdir``.

HolisticTraceAnalysis is not a TELLER dependency: install it beside TELLER first
(``pip install HolisticTraceAnalysis``), or pass ``--python`` for an interpreter that has both.

    python benchmarks/bench_ingest_hta.py [--python PY] [--repeat 3] [--scale 10] [--workdir /tmp/teller_bench_ingest]
"""

from __future__ import annotations

import argparse
import gzip
import json
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
    t = time.perf_counter()
    s = ingest(path, out)
    wall = time.perf_counter() - t
    rows = s["events_out"]
else:
    from hta.trace_analysis import TraceAnalysis
    base = peak_mb()
    devnull = open(os.devnull, "w")
    so, se = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = devnull
    t = time.perf_counter()
    a = TraceAnalysis(trace_dir=path)
    wall = time.perf_counter() - t
    sys.stdout, sys.stderr = so, se
    rows = sum(len(df) for df in a.t.traces.values())
print("RESULT " + json.dumps({"wall_s": wall, "peak_mb": peak_mb(), "base_mb": base, "rows": rows}))
"""


def source_file() -> Path:
    files = [DATA / c for c in CANDIDATES if (DATA / c).is_file()]
    if not files:
        sys.exit(f"no Kineto sample under {DATA}")
    return max(files, key=lambda p: p.stat().st_size)


def make_scaled(src: Path, dst: Path, scale: int) -> Path:
    """Write ``src`` with its non-metadata events repeated ``scale`` times, shifted in time."""
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    doc = json.loads(gzip.open(src).read())
    events = doc["traceEvents"]
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
    out = list(meta)
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
            out.append(c)
    doc["traceEvents"] = out
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    with gzip.open(tmp, "wt", compresslevel=1) as f:
        json.dump(doc, f)
    tmp.replace(dst)
    return dst


def measure(python: str, tool: str, path: Path, repeat: int) -> dict | str:
    runs = []
    for _ in range(repeat):
        p = subprocess.run(
            [python, "-c", _MEASURE, tool, str(path)], capture_output=True, text=True
        )
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            return (p.stderr.strip().splitlines() or ["no output"])[-1]
        runs.append(json.loads(line[7:]))
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "peak_mb": max(r["peak_mb"] for r in runs),
        "growth_mb": max(r["peak_mb"] - r["base_mb"] for r in runs),
        "rows": runs[0]["rows"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--python", default=sys.executable, help="interpreter with teller and HolisticTraceAnalysis"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/teller_bench_ingest"))
    args = ap.parse_args()

    src = source_file()
    big = make_scaled(src, args.workdir / f"x{args.scale}" / src.name, args.scale)
    one = args.workdir / "x1" / src.name
    one.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, one)

    rows = []
    for label, f in (("1x", one), (f"{args.scale}x", big)):
        mb = len(gzip.open(f).read()) / 2**20
        t = measure(args.python, "teller", f, args.repeat)
        h = measure(args.python, "hta", f.parent, args.repeat)
        rows.append((label, f, mb, t, h))

    print(f"source: {src.name}; python: {args.python}; median of {args.repeat} runs\n")
    print(
        "| input | JSON MiB | teller s | HTA s | HTA/teller time | teller peak MiB (growth) | HTA peak MiB (growth) | HTA/teller growth |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, _f, mb, t, h in rows:
        if isinstance(t, str):
            print(f"| {label} | {mb:.0f} | failed: {t} | | | | | |")
            continue
        if isinstance(h, str):
            print(
                f"| {label} | {mb:.0f} | {t['wall_s']:.2f} | not run: {h} | | {t['peak_mb']:.0f} ({t['growth_mb']:.0f}) | | |"
            )
            continue
        print(
            f"| {label} | {mb:.0f} | {t['wall_s']:.2f} | {h['wall_s']:.2f} | {h['wall_s'] / t['wall_s']:.1f}x "
            f"| {t['peak_mb']:.0f} ({t['growth_mb']:.0f}) | {h['peak_mb']:.0f} ({h['growth_mb']:.0f}) "
            f"| {h['growth_mb'] / max(t['growth_mb'], 1e-9):.1f}x |"
        )
    print(
        "\nrows: "
        + "; ".join(
            f"{lb}: teller {t['rows'] if isinstance(t, dict) else '-'}, HTA {h['rows'] if isinstance(h, dict) else '-'}"
            for lb, _, _, t, h in rows
        )
    )


if __name__ == "__main__":
    main()
