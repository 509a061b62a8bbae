"""Add the ``workload`` column and ``split_workload`` to a dataset built before they existed, from
the runs' run.json and labels.json (the same rule as ``teller dataset build``:
:func:`teller.dataset.build.workload_shape`), and rewrite its datasheet. The other split columns
are recomputed and must come out unchanged (checked).

    python scripts/dataset_add_workload.py DATASET RUNS_META

RUNS_META holds one folder per run (``<run_id>/run.json``, ``labels.json``), as the GPU campaign's
``runs_meta_pN.tar`` bring back (data/h200_v2 was patched this way).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.dataset.build import workload_shape
from teller.dataset.datasheet import write_datasheet
from teller.dataset.splits import SPLIT_COLUMNS, split_table
from teller.rundir import RunDir


def main() -> int:
    ds, meta = Path(sys.argv[1]), Path(sys.argv[2])
    rec = pq.read_table(ds / "records.parquet")
    sheet = json.loads((ds / "datasheet.json").read_text())
    shape = {}
    for r in sorted(set(rec.column("run_id").to_pylist())):
        rd = RunDir(meta / r)
        if not (meta / r / "labels.json").is_file():
            raise SystemExit(f"{meta / r}: no labels.json; give the runs' metadata folders")
        shape[r] = workload_shape(rd, rd.read_labels())
    wl = pa.array([shape[r] for r in rec.column("run_id").to_pylist()], pa.string())
    old = {c: rec.column(c) for c in SPLIT_COLUMNS if c in rec.column_names}
    base = rec.drop_columns([c for c in ("workload", *SPLIT_COLUMNS) if c in rec.column_names])
    base = base.add_column(base.column_names.index("provenance"), "workload", wl)
    new, held = split_table(base, sheet.get("seed", 0))
    for c, col in old.items():
        if c != "split_workload" and not pc.all(pc.equal(col.cast(pa.string()), new.column(c).cast(pa.string()))).as_py():
            raise SystemExit(f"{c} changed: the dataset does not match its runs")
    pq.write_table(new, ds / "records.parquet", compression="zstd")
    out = write_datasheet(new, sheet["runs"], ds, seed=sheet.get("seed", 0), held_out=held, sampling=sheet.get("sampling"))
    print(json.dumps({"by_workload": out.get("by_workload"), "held_out_workloads": out.get("held_out_workloads"),
                      "split_workload": out["by_split"].get("split_workload")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
