"""``teller workload serve``: command-line front of :mod:`teller.workload.serve`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from teller.cliutil import new_app, run_app

workload_app = new_app("Workloads to record: a real serving engine with a request arrival process.")


@workload_app.callback()
def _group() -> None:
    """Workloads to record: a real serving engine with a request arrival process."""


@workload_app.command()
def serve(
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    preset: str = typer.Option("auto", "--preset", help="Model shape: auto (tiny on cpu, gpu on cuda) | tiny | small | gpu; the flags below override it."),
    layers: Optional[int] = typer.Option(None, "--layers"),
    hidden: Optional[int] = typer.Option(None, "--hidden"),
    heads: Optional[int] = typer.Option(None, "--heads"),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads"),
    intermediate: Optional[int] = typer.Option(None, "--intermediate"),
    vocab: Optional[int] = typer.Option(None, "--vocab"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on cuda, fp32 on cpu) | bf16 | fp16 | fp32"),
    requests: int = typer.Option(16, "--requests", help="Number of requests."),
    rate: float = typer.Option(20.0, "--rate", help="Arrival rate in requests/s (Poisson); 0 queues all before the loop starts (deterministic batching)."),
    prompt_len: str = typer.Option("uniform:8:32", "--prompt-len", help="N | uniform:A:B | normal:MEAN:STD | choice:A,B,C"),
    output_len: str = typer.Option("16", "--output-len", help="Same forms as --prompt-len."),
    seed: int = typer.Option(0, "--seed"),
    attn: str = typer.Option("sdpa", "--attn", help="sdpa | eager | paged (= paged|eager); mapped to what the installed transformers accepts."),
    duration: Optional[float] = typer.Option(None, "--duration", help="Stop admitting requests after this many seconds."),
    warmup: int = typer.Option(1, "--warmup", help="Warm-up requests before the arrivals start (ignored with --rate 0)."),
    max_batch_tokens: Optional[int] = typer.Option(None, "--max-batch-tokens"),
    num_blocks: Optional[int] = typer.Option(None, "--num-blocks"),
    timeout: float = typer.Option(600.0, "--timeout", help="Give up after this many seconds."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op threads (default: 1 on the CPU, torch's default on CUDA)."),
    max_extra_requests: Optional[int] = typer.Option(None, "--max-extra-requests", help="Most arrivals past --requests while a fault window of the recorded run has not closed yet (default 4 × --requests, at least 100; 0: none)."),
    stats_interval: float = typer.Option(1.0, "--stats-interval", help="Seconds between the engine statistics log lines (Running/Waiting/KV cache usage/throughput)."),
    stats_every_steps: Optional[int] = typer.Option(None, "--stats-every-steps", help="Log the engine statistics every N steps instead of every --stats-interval seconds."),
    save_tokens: bool = typer.Option(False, "--save-tokens", help="Put every request's generated tokens in --out-json."),
    out_json: Optional[Path] = typer.Option(None, "--out-json", help="Write config, per-request rows and summary here."),
) -> None:
    """Serve random-Llama requests with transformers continuous batching; print throughput and latency."""
    from teller.workload.serve import ServeConfig, format_summary, write_json
    from teller.workload.serve import serve as do_serve

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ServeConfig(device=device, preset=preset, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                      intermediate=intermediate, vocab=vocab, dtype=dtype, requests=requests, rate=rate,
                      prompt_len=prompt_len, output_len=output_len, seed=seed, attn=attn, duration=duration,
                      warmup=warmup, max_batch_tokens=max_batch_tokens, num_blocks=num_blocks, timeout_s=timeout, threads=threads,
                      save_tokens=save_tokens, max_extra_requests=max_extra_requests,
                      stats_interval_s=stats_interval, stats_every_steps=stats_every_steps)
    res = do_serve(cfg)
    print(format_summary(res), flush=True)
    if out_json is not None:
        write_json(res, out_json)
    if not res["summary"]["ok"]:
        raise typer.Exit(1)


@workload_app.command("serve-tp", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve_tp(ctx: typer.Context, tp: int = typer.Option(2, "--tp", min=1, help="Ranks (processes): gloo on the CPU or on a shared GPU, NCCL with a GPU per rank.")) -> None:
    """Tensor-parallel random-Llama serving on --tp ranks with torch.distributed collectives (see teller.workload.tp)."""
    from teller.workload.tp import launch, parser

    parser().parse_args(list(ctx.args))  # bad options fail here, before ranks start
    rc = launch(list(ctx.args), tp)
    if rc:
        raise typer.Exit(rc)


def register(app: typer.Typer) -> None:
    """Add the ``workload`` group to the ``teller`` app."""
    app.add_typer(workload_app, name="workload")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m teller.workload``."""
    return run_app(workload_app, argv)
