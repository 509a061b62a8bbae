"""What reading a dataset for the root-cause model costs (`teller.rca.data.load_dataset`: the
subtrees decoded and every unit serialized once): wall time and peak memory, with the subtree
columns the serialization reads (:data:`teller.rca.data.STEP_COLUMNS`, the default) and with
every column, each in a fresh process, and a digest of the serialized steps that must be the
same for both.

    python benchmarks/rca_dataset_load.py runs/h200_v2_all [--unit iteration] [-o RESULT.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import hashlib, json, resource, sys, time
import numpy as np
import teller.rca.data as D
path, unit, columns = sys.argv[1], sys.argv[2], sys.argv[3]
if columns == "all":
    D.STEP_COLUMNS = None  # read_steps keeps every column
t = time.perf_counter()
ds = D.load_dataset(path, unit=unit)
secs = time.perf_counter() - t
sf, h = ds.forest, hashlib.sha256()
for name in ("key", "node_family", "node_priority", "node_id", "node_in_step", "node_span"):
    h.update(np.ascontiguousarray(getattr(sf, name)).tobytes())
h.update("|".join(sf.families).encode() + b"\0" + "|".join(sf.runs).encode())
for name in ("codes", "parent", "depth", "duration", "offsets", "node_id", "key"):
    h.update(np.ascontiguousarray(getattr(sf.seqs, name)).tobytes())
h.update("|".join(map(str, sf.seqs.symbols)).encode())
cur = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
print(json.dumps({"columns": columns, "seconds": round(secs, 1), "units": len(ds.units), "nodes": int(len(sf.node_id)),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                  "rss_after_mib": round(cur / 1024), "digest": h.hexdigest()}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--unit", default="iteration")
    ap.add_argument("-o", "--out", default=None)
    a = ap.parse_args()
    rows = []
    for columns in ("step", "all"):
        r = subprocess.run([sys.executable, "-c", CHILD, a.dataset, a.unit, columns], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    res = {"dataset": a.dataset, "unit": a.unit, "runs": rows, "same_steps": rows[0]["digest"] == rows[1]["digest"]}
    if not res["same_steps"]:
        print("the two readings serialize different steps", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0 if res["same_steps"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
