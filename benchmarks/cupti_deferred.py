"""CPU cost of CUPTI's buffer-completed callback: inline decoding against the deferred copy.

    python benchmarks/cupti_deferred.py [--steps 30] [--kernel-bytes 96] [--reps 9] [--out results.json]

Builds one raw activity buffer the way CUPTI packs records (8-byte aligned structs), ``steps``
steps of the bundled H200 workload's record mix (per step 1,285 records with the query-API
filter: 559 RUNTIME, 100 DRIVER, 540 CONCURRENT_KERNEL among 30 distinct kernel names, 40
MEMCPY, 20 MEMSET, 26 SYNCHRONIZATION; docs/overhead.md), and times, on one thread with
``time.thread_time_ns`` (CPU time: a busy shared machine disturbs it less than wall time):

- ``inline``: :meth:`RecordDecoder.decode_raw` of the buffer, what the callback does by default
  (plus handing the columns to an :class:`EventSink`, as the collector does);
- ``walk``: :func:`walk_records` alone, the per-record Python loop inside the decode;
- ``deferred``: :meth:`PendingBuffers.add`, the deferred callback's copy of ``buf[:valid]``;
- ``stop``: decoding the held copy later (what :meth:`CuptiCollector.stop` does per buffer).

The record layouts are the synthetic ones of ``tests/test_collectors.py`` (API 40 bytes, MEMCPY
48, MEMSET 56, SYNC 40); the real kernel record (CUpti_ActivityKernel10) is larger than the
synthetic 96 bytes, so ``--kernel-bytes`` pads it (the copy cost follows the bytes, the decode
cost the records). Medians of ``reps`` interleaved repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from teller.record.clock import ClockMap
from teller.record.collectors.cupti import DEFAULT_KIND_VALUES as K
from teller.record.collectors.cupti import PendingBuffers, RecordDecoder, walk_records
from teller.record.sink import EventSink
from teller.testing import cupti_layouts

T0 = 1_790_000_000_000_000_000


#: per step: (kind, count)
MIX = (("RUNTIME", 559), ("DRIVER", 100), ("CONCURRENT_KERNEL", 540), ("MEMCPY", 40), ("MEMSET", 20),
       ("SYNCHRONIZATION", 26))
GROUP = {"RUNTIME": "API", "DRIVER": "API", "CONCURRENT_KERNEL": "KERNEL", "MEMCPY": "MEMCPY",
         "MEMSET": "MEMSET", "SYNCHRONIZATION": "SYNC"}


def build_buffer(steps: int, lay: dict[str, np.dtype], seed: int = 0) -> tuple[np.ndarray, int]:
    """``steps`` steps of :data:`MIX`, kinds interleaved as launches are (packed, 8-aligned)."""
    rng = np.random.default_rng(seed)
    names = [cupti_layouts.c_string(f"_ZN2at6native18elementwise_kernelILi{i}ELi4EEEviT1_") for i in range(30)]
    order = np.concatenate([np.full(n, j) for j, (_, n) in enumerate(MIX)] * steps)
    rng.shuffle(order)
    parts = []
    t = T0
    for corr, j in enumerate(order.tolist()):
        kind = MIX[j][0]
        dt = lay[GROUP[kind]]
        row = np.zeros(1, dt)
        row["kind"] = K[kind]
        t += 1000
        for f in ("start", "end"):
            row[f] = t + (500 if f == "end" else 0)
        if "correlation_id" in dt.names:
            row["correlation_id"] = corr
        if GROUP[kind] == "API":
            row["cbid"] = 211 if kind == "RUNTIME" else 307
            row["process_id"], row["thread_id"] = 1234, 77
        if GROUP[kind] == "KERNEL":
            row["name"] = names[corr % 30]
            row["grid_x"], row["block_x"] = 1 + corr % 8, 128
        b = row.tobytes()
        parts.append(b + b"\0" * (-len(b) % 8))
    raw = b"".join(parts)
    buf = np.zeros(len(raw) + 4096, np.uint8)  # CUPTI's buffer is larger than what it filled
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    return buf, len(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="steps per buffer (30 × ~140 kB ≈ a 4 MiB buffer)")
    ap.add_argument("--kernel-bytes", type=int, default=96)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out")
    args = ap.parse_args()
    lay = cupti_layouts.layouts(args.kernel_bytes)
    buf, valid = build_buffer(args.steps, lay)
    n_rec = args.steps * sum(n for _, n in MIX)
    names = {211: "cudaLaunchKernel_v7000", 307: "cuLaunchKernel"}
    cm = ClockMap()
    cm.add(T0, 0)
    cm.add(T0 + 10**12, 10**12 + 20)
    sizes = {int(K[k]): ((lay[GROUP[k]].itemsize + 7) & ~7) for k, _ in MIX}
    times: dict[str, list[float]] = {"inline": [], "walk": [], "deferred": [], "stop": []}
    with tempfile.TemporaryDirectory() as tmp:
        sink = EventSink(tmp, pid=1, flush_rows=10**9)
        dec = RecordDecoder(K, lambda kind, cbid: names.get(cbid, "x"), cm, lay)
        for g in dec.decode_raw(buf, valid):  # warm the caches (API names, demangling), as in a run
            sink.append(g)
        for _ in range(args.reps):
            c0 = time.thread_time_ns()
            for g in dec.decode_raw(buf, valid):
                sink.append(g)
            times["inline"].append(time.thread_time_ns() - c0)
            c0 = time.thread_time_ns()
            walk_records(buf, valid, sizes)
            times["walk"].append(time.thread_time_ns() - c0)
            pb = PendingBuffers(1 << 40)
            c0 = time.thread_time_ns()
            pb.add(buf, valid)
            times["deferred"].append(time.thread_time_ns() - c0)
            (held,) = pb.take()
            c0 = time.thread_time_ns()
            for g in dec.decode_raw(held, len(held)):
                sink.append(g)
            times["stop"].append(time.thread_time_ns() - c0)
            sink._pending.clear()  # keep memory flat; not written
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"steps_per_buffer": args.steps, "records": n_rec, "buffer_bytes": valid,
           "kernel_record_bytes": lay["KERNEL"].itemsize, "reps": args.reps,
           "python": sys.version.split()[0], "numpy": np.__version__,
           "per_buffer_ms": {k: v / 1e6 for k, v in med.items()},
           "per_record_us": {k: v / 1e3 / n_rec for k, v in med.items()},
           "per_step_ms": {k: v / 1e6 / args.steps for k, v in med.items()},
           "deferred_copy_gb_s": valid / med["deferred"] if med["deferred"] else None,
           "raw_ns": times}
    print(json.dumps({k: v for k, v in res.items() if k != "raw_ns"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
