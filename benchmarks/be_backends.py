"""Per-op cost of the two BE backends (aten-op ranges), measured on one thread without a model.

    python benchmarks/be_backends.py [--block ops|llama] [--steps 400] [--reps 7] [--out results.json]

A "step" is a block of aten ops run between ``runtime.push_step``/``pop_step`` on a background
thread, the way an engine's batching thread runs its steps: ``ops`` is a small decoder-like
block (linear, softmax, silu, add, view, cat), ``llama`` one forward pass of the workload's tiny
Llama (2 layers, hidden 128) on 4×16 tokens. Step time is the thread's CPU time
(``time.thread_time``), which a busy shared machine disturbs less than wall time.
Configurations, interleaved ``reps`` times:

- ``off``: BE depth 0 (STEP ranges only);
- ``dispatch``: the TorchDispatchMode backend, depth 1 (its op count: the BE ranges it records);
- ``profiler``: the torch.profiler backend, depth 1 (one session for the whole run).

Reports the median step time and, per aten op (counted by the profiler backend's conversion:
``kept`` top-level ops, ``aten_rows`` ops at every depth), the inline cost over ``off``; for the
profiler backend also what ending its session costs (stop + export) and what converting the
exported trace costs, per recorded op, and a stop/start cycle of an empty session.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", choices=("ops", "llama"), default="ops")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch

    from teller.record import ranges, runtime
    from teller.record.instrument import torch_profiler_ops as tpo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    x = torch.randn(4, 64)

    def ops_block() -> None:
        with torch.inference_mode():
            h = lin1(x)
            h = torch.softmax(h.view(4, 4, 16), -1).reshape(4, 64)
            h = torch.nn.functional.silu(lin2(h)) + x
            torch.cat([h, x], 0).sum()

    block = ops_block
    if args.block == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1024)
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, 1024, (4, 16))

        def llama_block() -> None:
            with torch.inference_mode():
                model(ids)

        block = llama_block

    be_counts: dict[str, int] = {}

    def run(n: int, cfg: str = "") -> float:
        out: list[float] = []

        def body() -> None:
            t0 = time.thread_time()
            for i in range(n):
                runtime.push_step(f"STEP id={i} reqs=r")
                block()
                runtime.pop_step()
            out.append((time.thread_time() - t0) / n)

        th = threading.Thread(target=body)
        th.start()
        th.join()
        cols = ranges.RECORDER.drain(final=True)
        if cols is not None and cfg:
            be_counts[cfg] = sum(1 for x in cols["name"].to_pylist() if x.startswith("BE "))
        return out[0]

    tmp = Path(tempfile.mkdtemp(prefix="teller-be-bench-"))
    res: dict[str, list[float]] = {"off": [], "dispatch": [], "profiler": []}
    prof_costs: list[dict[str, float]] = []
    run(50)  # warm-up
    for rep in range(args.reps):
        for cfg in res:
            if cfg == "off":
                runtime._default_be_depth = lambda: 0
                runtime.set_be_backend(None)
                res[cfg].append(run(args.steps))
            elif cfg == "dispatch":
                runtime._default_be_depth = lambda: 1
                runtime.set_be_backend(None)
                res[cfg].append(run(args.steps, cfg))
            else:
                runtime._default_be_depth = lambda: 1
                be = tpo.ProfilerBE(tmp / f"r{rep}", period_s=0, defer=True, pid=rep, runtime=runtime)
                runtime.set_be_backend(be.enter, be.exit)
                res[cfg].append(run(args.steps))
                runtime.set_be_backend(None)
                be.stop()
                t0 = time.perf_counter()
                summ: dict = {}
                for seg in be.segments:
                    _, s = tpo.convert_segment(seg)
                    tpo.merge_counts(summ, s)
                conv = time.perf_counter() - t0
                prof_costs.append({"stop_s": be.stop_s, "export_s": be.export_s, "convert_s": conv,
                                   "start_s": be.start_s, **{k: summ.get(k, 0) for k in
                                                             ("kept", "aten_rows", "rows_in", "windows_matched")}})
    # an empty stop/start cycle
    from torch.profiler import ProfilerActivity, profile

    cycle = []
    for _ in range(5):
        cfg, _opts = tpo.experimental_config()
        p = profile(activities=[ProfilerActivity.CPU], experimental_config=cfg)
        t0 = time.perf_counter()
        p.start()
        p.stop()
        cycle.append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in res.items()}
    pc = prof_costs[-1]
    top_ops = pc["kept"] / args.steps
    all_ops = pc["aten_rows"] / args.steps
    dispatch_ops = be_counts.get("dispatch", 0) / args.steps
    stop_export = statistics.median((c["stop_s"] + c["export_s"]) / max(1, c["aten_rows"]) for c in prof_costs)
    convert = statistics.median(c["convert_s"] / max(1, c["rows_in"]) for c in prof_costs)
    summary = {
        "torch": torch.__version__,
        "block": args.block,
        "steps": args.steps, "reps": args.reps,
        "step_us_median": {k: v * 1e6 for k, v in med.items()},
        "dispatch_ops_per_step": dispatch_ops,
        "top_level_aten_ops_per_step": top_ops,
        "aten_ops_all_depths_per_step": all_ops,
        "dispatch_inline_us_per_op": (med["dispatch"] - med["off"]) * 1e6 / max(dispatch_ops, 1),
        "profiler_inline_us_per_top_op": (med["profiler"] - med["off"]) * 1e6 / top_ops,
        "profiler_inline_us_per_recorded_op": (med["profiler"] - med["off"]) * 1e6 / all_ops,
        "profiler_stop_export_us_per_recorded_op": stop_export * 1e6,
        "profiler_convert_us_per_trace_event": convert * 1e6,
        "profiler_empty_cycle_ms_median": statistics.median(cycle) * 1e3,
        "runs": res,
        "profiler_costs": prof_costs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k not in ("runs", "profiler_costs")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
