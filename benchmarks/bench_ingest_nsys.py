"""Nsight Systems SQLite reader speed on the real exports of the test data.

Each export is ingested ``--repeat`` times in one process after one warm-up run (imports and
first-use pages excluded); the table gives the median wall and CPU time of ``ingest_nsys`` (SQL
queries, columns, Parquet write, run.json), the rows read from the export's tables and the
canonical events written, and events per second.

The real exports are small (tens of events), so a per-file fixed cost is all they show;
``--scale N`` also measures each export enlarged about N times: its CUPTI activity rows copied
(by doubling) with start/end shifted past the previous copy and correlation ids offset, so the
copies stay distinct (written under ``--workdir``).

    python benchmarks/bench_ingest_nsys.py [--repeat 5] [--scale 32768] [DIR_OR_FILE ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from teller.ingest.nsys import ingest_nsys

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "tests" / "data" / "external" / "nsys"


_TABLES = ("RUNTIME", "KERNEL", "MEMCPY", "MEMSET", "SYNCHRONIZATION")


def enlarge(src: Path, dst: Path, scale: int) -> Path:
    """``src`` with its CUPTI activity rows doubled until there are ``scale`` copies of each."""
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    db = sqlite3.connect(dst)
    names = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
    tables = [f"CUPTI_ACTIVITY_KIND_{t}" for t in _TABLES if f"CUPTI_ACTIVITY_KIND_{t}" in names]
    lo = min(db.execute(f"select min(start) from {t}").fetchone()[0] or 0 for t in tables)
    hi = max(db.execute(f"select max(end) from {t}").fetchone()[0] or 0 for t in tables)
    step = 1 + max(db.execute(f"select max(correlationId) from {t}").fetchone()[0] or 0 for t in tables)
    span = hi - lo + 1000
    copies = 1
    while copies * 2 <= scale:
        for t in tables:
            cols = [r[1] for r in db.execute(f"pragma table_info({t})")]
            expr = [
                f"{c} + {copies * span}" if c in ("start", "end")
                else f"{c} + {copies * step}" if c == "correlationId"
                else c
                for c in cols
            ]
            db.execute(f"insert into {t} ({', '.join(cols)}) select {', '.join(expr)} from {t}")
        copies *= 2
    db.commit()
    db.close()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path, default=[DATA])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--scale", type=int, default=0, help="also each export enlarged ~N times")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/teller_bench_nsys"))
    args = ap.parse_args()
    files = sorted(
        f for p in args.paths for f in ([p] if p.is_file() else p.glob("*.sqlite"))
    )
    if args.scale > 1:
        files += [enlarge(f, args.workdir / f"x{args.scale}_{f.name}", args.scale) for f in files]
    print(f"median of {args.repeat} runs after one warm-up; load average before: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + "\n")
    print("| export | MiB | rows in | events out | wall s | CPU s | events/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for f in files:
        walls, cpus = [], []
        for k in range(args.repeat + 1):
            with tempfile.TemporaryDirectory() as tmp:
                t, c = time.perf_counter(), time.process_time()
                s = ingest_nsys(f, Path(tmp) / "run")
                if k:
                    walls.append(time.perf_counter() - t)
                    cpus.append(time.process_time() - c)
        rows_in = sum(s["tables"].values())
        events = sum(s["kinds"].values())
        w, c = statistics.median(walls), statistics.median(cpus)
        print(
            f"| {f.name} | {f.stat().st_size / 2**20:.1f} | {rows_in:,} | {events:,} "
            f"| {w:.3f} | {c:.3f} | {events / w / 1e3:.0f}k |"
        )


if __name__ == "__main__":
    main()
