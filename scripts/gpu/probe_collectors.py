"""Probe the CUPTI and Kineto collectors on a GPU machine, standalone (no launcher needed).

    python scripts/gpu/probe_collectors.py OUT_DIR

Runs, each in a fresh process (CUPTI allows one activity client per process):

- ``cupti``: the CUPTI collector around matmuls, copies, a memset and syncs on two threads, with
  ``torch.cuda.nvtx`` ranges (``NVTX_INJECTION64_PATH`` set to libcupti so they arrive as MARKER
  records) and perf_counter-timed brackets around each launch, the way TELLER's CPU range
  recorder times hook ranges. It checks that every cudaLaunchKernel mapped onto τ lies inside its
  bracket (clock anchors correct) and inside its NVTX range, and reports which host clock CUPTI
  follows.
- ``kineto``: the Kineto collector around the same program.

Writes ``OUT_DIR/<mode>/`` run directories and prints one JSON summary per mode.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path


def libcupti_path() -> str:
    import nvidia  # type: ignore[import-not-found]

    for base in list(getattr(nvidia, "__path__", [])):
        hits = sorted(glob.glob(os.path.join(base, "**", "libcupti.so*"), recursive=True))
        if hits:
            return hits[0]
    return ""


def program(brackets: list, n_iter: int = 200) -> None:
    """Matmul + softmax loop on the main thread and a helper thread, with ranges and brackets."""
    import torch

    from teller.record import clock

    dev = torch.device("cuda")
    x = torch.randn(1024, 1024, device=dev)

    def loop(tag: str, n: int) -> None:
        y = x.clone()
        tid = threading.get_native_id()
        for i in range(n):
            torch.cuda.nvtx.range_push(f"STEP id={i} reqs={tag}")
            a = clock.tau_now()
            y = torch.mm(y, x)
            b = clock.tau_now()
            brackets.append((tid, a, b))
            y = torch.softmax(y, dim=-1)
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()

    th = threading.Thread(target=loop, args=("bg", n_iter // 2))
    th.start()
    loop("main", n_iter)
    th.join()
    h = torch.empty(1 << 20, pin_memory=True)
    d = h.to(dev, non_blocking=True)
    z = torch.zeros(1 << 20, device=dev)
    (d + z).cpu()
    torch.cuda.synchronize()


def run_mode(mode: str, out: Path) -> dict:
    import numpy as np
    import pyarrow.compute as pc
    import torch

    from teller.record import clock
    from teller.record.sink import EventSink
    from teller.rundir import RunDir, RunInfo

    run = out / mode
    sink = EventSink(run)
    torch.cuda.init()
    if mode.startswith("cupti"):
        from teller.record.collectors.cupti import CuptiCollector

        col = CuptiCollector(decode="objects" if mode == "cupti_objects" else "raw")
    else:
        from teller.record.collectors.kineto import KinetoCollector

        col = KinetoCollector()
    clocks = {}
    if mode.startswith("cupti"):
        try:
            from cupti import cupti

            c = cupti.get_timestamp()
            clocks = {"cupti": c, "realtime": time.time_ns(), "monotonic": time.monotonic_ns(),
                      "monotonic_raw": time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)}
        except Exception as e:
            clocks = {"error": repr(e)}
    brackets: list = []
    t_start = time.perf_counter()
    col.start(sink)
    program(brackets, n_iter=20)  # warm-up inside the recording
    col.flush()
    t0 = time.perf_counter()
    program(brackets, n_iter=200)
    t_prog = time.perf_counter() - t0
    col.flush()
    col.stop()
    sink.close()
    t_total = time.perf_counter() - t_start
    info = col.info()
    RunDir(run).write_info(RunInfo(source="probe", command=sys.argv, collector=info,
                                   clock={"t0_unix_ns": clock.T0_UNIX_NS}))
    t = RunDir(run).read_events()
    kinds = t.column("kind").cast("string").to_numpy(zero_copy_only=False)
    names = t.column("name").cast("string").to_numpy(zero_copy_only=False)
    res = {"mode": mode, "events": t.num_rows, "program_s": t_prog, "total_s": t_total,
           "by_kind": {k: int((kinds == k).sum()) for k in np.unique(kinds)}, "clocks": clocks,
           "info": {k: v for k, v in info.items() if k not in ("clock_anchors",)},
           "anchors": info.get("clock_anchors")}
    # every cudaLaunchKernel inside its perf_counter bracket, on the right thread
    launch = pc.match_substring(t.column("name").cast("string"), "LaunchKernel")
    lk = t.filter(pc.and_(launch, pc.equal(t.column("kind").cast("string"), "RUNTIME")))
    ls, le = lk.column("start_ns").to_numpy(), lk.column("end_ns").to_numpy()
    ltid = lk.column("tid").to_numpy()
    inside = 0
    margins = []
    for tid, a, b in brackets:
        m = (ltid == tid) & (ls >= a) & (le <= b)
        if m.any():
            inside += 1
        else:
            near = np.flatnonzero(ltid == tid)
            if len(near):
                j = near[np.argmin(np.abs(ls[near] - a))]
                margins.append(int(min(ls[j] - a, b - le[j])))
    res["brackets"] = {"total": len(brackets), "with_launch_inside": inside,
                       "worst_miss_ns": sorted(margins)[:5]}
    rng = t.filter(pc.equal(t.column("kind").cast("string"), "RANGE"))
    res["ranges"] = {"n": rng.num_rows, "tids": sorted(set(rng.column("tid").to_pylist()))[:5],
                     "sample": rng.slice(0, 2).select(["name", "tid", "start_ns", "end_ns"]).to_pylist()}
    if mode == "kineto" and info.get("raw_trace"):
        d = json.loads(Path(info["raw_trace"]).read_text())
        ts = [e["ts"] for e in d["traceEvents"] if e.get("ph") == "X"]
        base = d.get("baseTimeNanoseconds", 0)
        res["kineto_time"] = {"base": base, "min_ts_us": min(ts), "max_ts_us": max(ts),
                              "abs_min_minus_wall0_ms": (min(ts) * 1000 + base - col._wall0) / 1e6,
                              "abs_max_minus_wall1_ms": (max(ts) * 1000 + base - col._wall1) / 1e6,
                              "cats": sorted({e.get("cat", "") for e in d["traceEvents"]})}
    res["sample_names"] = sorted(set(names[kinds == "RUNTIME"]))[:20]
    res["kind_name_counts"] = dict(Counter(f"{k}|{n}" for k, n in zip(kinds.tolist(), names.tolist(), strict=True)))
    if mode.startswith("cupti"):
        from cupti import cupti

        res["layouts"] = {n: [getattr(cupti, n).itemsize, list(getattr(cupti, n).names)[:40]]
                          for n in ("activity_api_dtype", "activity_kernel10_dtype", "activity_marker2_dtype")}
    res["kernel_names"] = sorted(set(names[kinds == "KERNEL"]))[:8]
    return res


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 2:  # child
        res = run_mode(sys.argv[2], out)
        (out / f"probe_{sys.argv[2]}.json").write_text(json.dumps(res, indent=1, default=str))
        short = {k: v for k, v in res.items() if k not in ("kind_name_counts", "layouts")}
        print(json.dumps(short, default=str)[:2500])
        return
    env = dict(os.environ)
    lib = libcupti_path()
    env["NVTX_INJECTION64_PATH"] = lib
    print("libcupti:", lib, flush=True)
    modes = os.environ.get("PROBE_MODES", "cupti,cupti_objects,kineto").split(",")
    for mode in modes:
        r = subprocess.run([sys.executable, __file__, str(out), mode],
                           env=env if mode.startswith("cupti") else os.environ, timeout=240)
        print(mode, "exit", r.returncode, flush=True)
    done = [json.loads((out / f"probe_{m}.json").read_text()) for m in ("cupti", "cupti_objects")
            if (out / f"probe_{m}.json").is_file()]
    if len(done) == 2:
        a, b = (d["kind_name_counts"] for d in done)
        diff = {k: (a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)}
        print("raw vs objects: same (kind, name) counts" if not diff else f"raw vs objects differ: {diff}")


if __name__ == "__main__":
    main()
