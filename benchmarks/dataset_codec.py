"""Subtree storage formats on a committed dataset: bytes per step and read speed, v1 against v2.

Reads every part of ``DS/subtrees`` (stored in ``teller-subtrees/1``), writes the same rows in the
current format (``teller-subtrees/2``) to ``--out`` with :func:`teller.dataset.codec.write_subtree_parts`
(parts cut at step boundaries), checks that both read back to the same values, and reports:

- subtree bytes, bytes per step (a step: one ``(run_id, step_id)``) and per row, of each format;
- the stored bytes of each column of the v2 parts (Parquet's compressed column chunks), summed;
- read speed: wall seconds of :func:`teller.dataset.codec.read_subtrees` on the whole folder
  (median of ``--repeat`` runs) and rows per second; and the write time of v2;
- the floor left by the times' jitter: the empirical entropy of the stored ``start_ns`` and
  ``end_ns`` values of the first part given their op's name, in bits per row (an estimate from
  below for a coder that models each name's distribution; low ``--floor-bits`` bits counted as
  uniform, as they measure to be).

    git checkout 644acca -- data/h200_v1   # dataset v1, in git history
    python benchmarks/dataset_codec.py data/h200_v1 --out /tmp/h200_v1_v2 --json benchmarks/results/dataset_codec_h200_v1.json

The figures in benchmarks/README.md and ``benchmarks/results/dataset_codec_h200_v1.json`` were
measured on dataset v1 (``data/h200_v1``, no longer in the working tree); ``data/h200_v2`` is
already in ``teller-subtrees/2``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from teller.dataset.codec import (
    CODEC,
    codec_of,
    differing_columns,
    read_subtrees,
    write_subtree_parts,
)


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("part-*.parquet"))


def _columns(folder: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in sorted(folder.glob("part-*.parquet")):
        md = pq.ParquetFile(f).metadata
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            for i in range(rg.num_columns):
                c = rg.column(i)
                out[c.path_in_schema] = out.get(c.path_in_schema, 0) + c.total_compressed_size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _read_time(folder: Path, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        read_subtrees(folder)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _cond_entropy(x: np.ndarray, cond: np.ndarray, low: int) -> float:
    """H(x >> low | cond) + low bits per row."""
    q = (x >> low).astype(np.int64)
    _, jc = np.unique(np.stack([q, cond.astype(np.int64)]), axis=1, return_counts=True)
    _, cc = np.unique(cond, return_counts=True)
    pj, pcnd = jc / jc.sum(), cc / cc.sum()
    return float(-(pj * np.log2(pj)).sum() + (pcnd * np.log2(pcnd)).sum() + low)


def _floor(v2_part: Path, low: int) -> dict:
    t = pq.read_table(v2_part, columns=["name", "start_ns", "end_ns"])
    name = t.column("name").to_numpy()
    o = np.argsort(name, kind="stable")  # the time columns are stored in this order
    return {c + "_bits_per_row": round(_cond_entropy(t.column(c).to_numpy(), name[o], low), 2)
            for c in ("start_ns", "end_ns")} | {"rows": t.num_rows, "low_bits_uniform": low}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ds", type=Path, help="dataset folder whose subtrees are in teller-subtrees/1")
    ap.add_argument("--out", type=Path, default=Path("/tmp/teller_bench_codec"), help="where the v2 parts go")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--floor-bits", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    src = a.ds / "subtrees"
    formats = sorted({codec_of(f) for f in src.glob("part-*.parquet")})
    old = read_subtrees(a.ds)
    steps = pa.table({"r": old.column("run_id").cast(pa.string()), "s": old.column("step_id")}).group_by(["r", "s"]).aggregate([]).num_rows
    dst = a.out / "subtrees"
    t0 = time.perf_counter()
    write_subtree_parts(old, dst)
    t_write = time.perf_counter() - t0
    new = read_subtrees(dst)
    bad = differing_columns(old, new)
    if bad:
        raise SystemExit(f"{dst}: columns {bad} differ from {src}")
    del new
    res = {"dataset": str(a.ds), "rows": old.num_rows, "steps": steps,
           "machine": f"{platform.machine()}, {platform.python_version()}, pyarrow {pa.__version__}"}
    for label, folder, fmt in (("v1", src, ",".join(formats)), ("v2", dst, CODEC)):
        b = _bytes(folder)
        sec = _read_time(folder, a.repeat)
        res[label] = {"format": fmt, "parts": len(list(folder.glob("part-*.parquet"))), "bytes": b,
                      "bytes_per_step": round(b / steps, 1), "bytes_per_row": round(b / old.num_rows, 3),
                      "read_s": round(sec, 2), "rows_per_s": round(old.num_rows / sec)}
    res["v2"]["write_s"] = round(t_write, 1)
    res["ratio"] = round(res["v1"]["bytes"] / res["v2"]["bytes"], 3)
    res["v2_columns"] = _columns(dst)
    res["v1_columns"] = _columns(src)
    res["times_floor"] = _floor(sorted(dst.glob("part-*.parquet"))[0], a.floor_bits)
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
