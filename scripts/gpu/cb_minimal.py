"""Minimal transformers continuous-batching run with one collector around it (no launcher).

    python scripts/gpu/cb_minimal.py OUT_DIR --collector none|cupti|kineto [--layers 8 --hidden 1024
        --requests 32 --new-tokens 32]

Builds a randomly initialised Llama from a config (no download), generates a batch through
``model.generate_batch`` and prints one JSON line: tokens/s, wall time, collector info. Used to
size recordings and to see the collector's cost before the launcher exists.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--collector", default="none")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    import numpy as np
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from teller.record.sink import EventSink
    from teller.rundir import RunDir, RunInfo

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 256), vocab_size=32000,
                      max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.config._attn_implementation = "paged|sdpa"
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 32000, size=int(rng.integers(args.prompt // 2, args.prompt))).tolist()
              for _ in range(args.requests)]
    gen = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=-1, do_sample=False)
    # warm-up outside the recording
    model.generate_batch(inputs=inputs[:4], generation_config=GenerationConfig(max_new_tokens=4, eos_token_id=-1, do_sample=False))
    torch.cuda.synchronize()

    run = Path(args.out) / f"cb_{args.collector}"
    sink = EventSink(run)
    col = None
    if args.collector == "cupti":
        from teller.record.collectors.cupti import CuptiCollector

        col = CuptiCollector()
    elif args.collector == "kineto":
        from teller.record.collectors.kineto import KinetoCollector

        col = KinetoCollector()
    if col:
        col.start(sink)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=inputs, generation_config=gen)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    if col:
        col.stop()
    sink.close()
    stop_s = time.perf_counter() - t1
    toks = sum(len(o.generated_tokens) for o in out.values())
    info = col.info() if col else {}
    RunDir(run).write_info(RunInfo(source="cb_minimal", collector=info))
    res = {"collector": args.collector, "requests": len(out), "tokens": toks, "wall_s": wall,
           "tokens_per_s": toks / wall, "stop_s": stop_s, "events": sink.rows_written,
           "info": {k: info.get(k) for k in ("records", "buffers", "decode_s", "decode_us_per_record",
                                             "dropped_records", "events_out", "errors", "time_base",
                                             "events")}}
    print("RESULT", json.dumps(res, default=str), flush=True)


if __name__ == "__main__":
    main()
