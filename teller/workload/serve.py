"""A real serving workload: transformers continuous batching with Poisson request arrivals.

The engine is transformers' continuous-batching manager (``model.init_continuous_batching()``,
then ``start()``, ``add_request(..., request_id=...)`` at each arrival and ``get_result()``;
the same API in transformers 5.17 and 5.24) serving a randomly initialised Llama built from a
``LlamaConfig`` (seeded; nothing is downloaded). Requests arrive as a Poisson process of rate
``rate`` (req/s); prompt and output lengths follow the given distributions; decoding is greedy
with EOS disabled, so every request generates exactly its output length.

For full per-op traces CUDA graphs and async batching are off (docs/design.md §13). The attention
implementation is picked per version: 5.24 takes ``sdpa`` (and refuses ``paged|sdpa``), 5.17
takes ``paged|sdpa``; ``eager`` is ``paged|eager`` on both.

It logs one line per request added and finished, naming the request id (so log lines align
with the STEP ranges that carry the same ids), and service logs like a production server's
(:mod:`teller.workload.stats`: ``Added request``/``Finished request`` lines with latencies,
periodic ``Engine 000: ... Running: N reqs, Waiting: M reqs, GPU KV cache usage: Z%`` statistics
written from the engine thread at the end of a step, ``Offloaded N requests`` and KV-usage
warnings); it prints throughput, request latency and step
latency (p50/p99; the step time is measured around the manager's ``_generation_step``) and
writes them as JSON.

With ``rate=0`` every request is queued before the generation loop starts: batching, and hence
the greedy tokens, are then deterministic, which is what the "same output with and without
recording" check relies on.

A run recorded with a fault plan serves until every fault window has closed: once the
``requests`` planned arrivals are in, the arrival process goes on (same seed, same
distributions; the extra requests are marked ``extension`` in the results) for as long as
:func:`keep_serving` says so, an extra request admitted at its arrival time or, when the engine
has fallen behind, once fewer requests are in flight than when the planned arrivals ended; while
a window whose mechanism acts on arrivals is open (:func:`wants_arrivals`: delayed admission,
which injects nothing in a window without admissions) one is admitted at the workload's rate
even where the engine is behind.
:func:`keep_serving` says no by itself; the fault agent in the process
(:mod:`teller.inject.agent`) hooks it to say yes while one of its windows has not reached its
planned end, so a window anchored at step 60 opens even when a loaded machine batches the planned
requests into 45 steps. ``max_extra_requests`` (default 4 × ``requests``, at least 100),
``duration`` and half of ``timeout_s`` bound the extension, so the run drains before its deadline.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from teller.errors import TellerError
from teller.workload.stats import EngineStats, log_added, log_finished

log = logging.getLogger("teller.workload")

#: model presets: layers, hidden, heads, kv_heads, intermediate, vocab
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024),
    "small": dict(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1376, vocab=8192),
    "gpu": dict(layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=32000),
}


@dataclass
class ServeConfig:
    """Settings of one workload run (see ``teller workload serve --help``)."""

    device: str = "auto"  # auto | cpu | cuda
    preset: str = "auto"  # auto (tiny on cpu, gpu on cuda) | tiny | small | gpu
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    intermediate: int | None = None
    vocab: int | None = None
    dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | bf16 | fp16 | fp32
    requests: int = 16
    rate: float = 20.0  # req/s, Poisson; 0 = all queued before the loop starts
    prompt_len: str = "uniform:8:32"
    output_len: str = "16"
    seed: int = 0
    attn: str = "sdpa"  # sdpa | eager | paged | a raw implementation name
    duration: float | None = None  # stop admitting new requests after this many seconds
    warmup: int = 1  # requests served (and not measured) before the arrivals start; not with rate 0
    max_batch_tokens: int | None = None
    num_blocks: int | None = None
    block_size: int = 32
    timeout_s: float = 600.0
    save_tokens: bool = False
    threads: int | None = None  # torch intra-op threads; default 1 on the CPU (see serve())
    max_extra_requests: int | None = None  # arrivals past `requests` while keep_serving() (default max(100, 4 × requests))
    stats_interval_s: float = 1.0  # seconds between the engine statistics log lines
    stats_every_steps: int | None = None  # or every N steps
    model: dict[str, int] = field(default_factory=dict)  # resolved model shape (filled by serve)


def _length_spec(spec: str, what: str) -> tuple[str, tuple]:
    """(kind, parameters) of a length spec: ``N``, ``uniform:A:B``, ``normal:MEAN:STD`` or
    ``choice:A,B,C``."""
    s = str(spec).strip().lower()
    try:
        if s.isdigit():
            n = int(s)
            if n < 1:
                raise ValueError
            return "fixed", (n,)
        kind, _, rest = s.partition(":")
        if kind == "uniform":
            a, b = (int(x) for x in rest.split(":"))
            if not 1 <= a <= b:
                raise ValueError
            return "uniform", (a, b)
        if kind == "normal":
            mu, sd = (float(x) for x in rest.split(":"))
            return "normal", (mu, sd)
        if kind == "choice":
            vals = [int(x) for x in rest.split(",")]
            if not vals or min(vals) < 1:
                raise ValueError
            return "choice", tuple(vals)
    except ValueError:
        pass
    raise TellerError(f"--{what} {spec!r}: expected N, uniform:A:B, normal:MEAN:STD or choice:A,B,C (lengths ≥ 1)")


def parse_length(spec: str, what: str) -> Callable[[random.Random], int]:
    """A length distribution: ``N``, ``uniform:A:B``, ``normal:MEAN:STD`` or ``choice:A,B,C``."""
    kind, p = _length_spec(spec, what)
    if kind == "fixed":
        return lambda rng: p[0]
    if kind == "uniform":
        return lambda rng: rng.randint(*p)
    if kind == "normal":
        return lambda rng: max(1, int(round(rng.gauss(*p))))
    return lambda rng: rng.choice(p)


def mean_length(spec: str, what: str) -> float:
    """The mean of a length spec's distribution (a normal's mean before its clip at 1)."""
    kind, p = _length_spec(spec, what)
    if kind == "uniform":
        return (p[0] + p[1]) / 2
    return float(p[0]) if kind in ("fixed", "normal") else sum(p) / len(p)


def make_requests(cfg: ServeConfig, vocab: int, extra: int = 0) -> list[dict[str, Any]]:
    """Request ids, prompts, output lengths and arrival times (seconds from the first arrival):
    the ``requests`` planned ones, then ``extra`` more of the same arrival process (the first
    ``requests`` do not depend on ``extra``)."""
    rng = random.Random(cfg.seed)
    plen, olen = parse_length(cfg.prompt_len, "prompt-len"), parse_length(cfg.output_len, "output-len")
    t, out = 0.0, []
    for i in range(cfg.requests + extra):
        if i and cfg.rate > 0:
            t += rng.expovariate(cfg.rate)
        n = plen(rng)
        out.append({"id": f"req_{i}", "prompt": [rng.randrange(1, vocab) for _ in range(n)],
                    "max_new_tokens": olen(rng), "arrival_s": t})
    return out


def keep_serving() -> bool:
    """Whether the run should admit more requests once the planned ones are in: False here; a
    fault plan recorded into this process hooks it while one of its windows is still to close."""
    return False


def wants_arrivals() -> bool:
    """Whether the extra requests should arrive on time even where the engine fell behind (the
    in-flight bound of :func:`keep_serving`'s extension lifted): False here; a fault plan hooks
    it while a window whose mechanism acts on arrivals is open (delayed admission: a window
    without admissions injects nothing)."""
    return False


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _cb_config(cb_cls: Any, **wanted: Any) -> Any:
    """A ContinuousBatchingConfig with the wanted fields this transformers version has."""
    names = {f.name for f in dataclasses.fields(cb_cls)} if dataclasses.is_dataclass(cb_cls) else set()
    if "block_size" in wanted and "page_size" in names:  # 5.24 renamed block_size → page_size
        wanted["page_size"] = wanted.pop("block_size")
    return cb_cls(**{k: v for k, v in wanted.items() if k in names and v is not None})


def attn_implementation(attn: str, cb_cls: Any) -> str:
    """The attention implementation string this transformers version accepts for ``attn``."""
    new_api = dataclasses.is_dataclass(cb_cls) and "auto_switch_to_flash" in {f.name for f in dataclasses.fields(cb_cls)}
    a = attn.lower()
    if a == "sdpa":
        return "sdpa" if new_api else "paged|sdpa"
    if a in ("eager", "paged"):
        return "paged|eager"
    return attn


def serve(cfg: ServeConfig) -> dict[str, Any]:
    """Run the workload; returns the results (config, per-request rows, summary)."""
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TellerError("--device cuda: no CUDA device is available to torch; use --device cpu or auto")
    preset = cfg.preset if cfg.preset != "auto" else ("gpu" if device == "cuda" else "tiny")
    if preset not in PRESETS:
        raise TellerError(f"--preset {preset!r}: expected auto or one of {', '.join(PRESETS)}")
    shape = dict(PRESETS[preset])
    for k in shape:
        if getattr(cfg, k) is not None:
            shape[k] = int(getattr(cfg, k))
    if shape["hidden"] % shape["heads"] or shape["heads"] % shape["kv_heads"]:
        raise TellerError(f"--hidden {shape['hidden']} / --heads {shape['heads']} / --kv-heads {shape['kv_heads']}: "
                          "hidden must be a multiple of heads and heads a multiple of kv-heads")
    cfg.model = shape
    if cfg.threads or device == "cpu":
        # On small CPU machines the intra-op pool fights the manager's and the client's threads
        # for the cores (steps 10x slower and erratic with 2 threads on 2 cores); one is steadier.
        torch.set_num_threads(cfg.threads or 1)
    dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype_name not in dtypes:
        raise TellerError(f"--dtype {cfg.dtype!r}: expected auto, bf16, fp16 or fp32")

    n_extra = 0 if cfg.rate <= 0 else (max(100, 4 * cfg.requests) if cfg.max_extra_requests is None
                                        else cfg.max_extra_requests)
    if n_extra < 0:
        raise TellerError(f"--max-extra-requests {n_extra}: expected 0 or more")
    pool = make_requests(cfg, shape["vocab"], extra=n_extra)
    reqs, extension = pool[:cfg.requests], pool[cfg.requests:]
    max_prompt = max((len(r["prompt"]) for r in pool), default=1)
    max_out = max((r["max_new_tokens"] for r in pool), default=1)
    max_pos = max(256, 2 ** math.ceil(math.log2(max_prompt + max_out + 1)))

    torch.manual_seed(cfg.seed)
    mcfg = LlamaConfig(num_hidden_layers=shape["layers"], hidden_size=shape["hidden"],
                       num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                       intermediate_size=shape["intermediate"], vocab_size=shape["vocab"],
                       max_position_embeddings=max_pos, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    impl = attn_implementation(cfg.attn, ContinuousBatchingConfig)
    mcfg._attn_implementation = impl
    model = LlamaForCausalLM(mcfg).to(device=device, dtype=dtypes[dtype_name]).eval()
    model.config._attn_implementation = impl

    # KV-cache size: every planned request resident at once (tiny on the CPU; bounded on the GPU)
    pages = sum(math.ceil((len(r["prompt"]) + r["max_new_tokens"]) / cfg.block_size) for r in reqs)
    num_blocks = cfg.num_blocks or max(16, pages + 4 * cfg.warmup + 4)
    max_batch_tokens = cfg.max_batch_tokens or max(256, min(4096, max_prompt * 4))
    cb_cfg = _cb_config(ContinuousBatchingConfig, use_cuda_graph=False, use_async_batching=False,
                        auto_switch_to_flash=False, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                        block_size=cfg.block_size)
    gen_cfg = GenerationConfig(max_new_tokens=max_out, eos_token_id=-1, do_sample=False, pad_token_id=0)
    log.info("model: llama %s on %s/%s, attention %s, transformers %s, torch %s", shape, device,
             dtype_name, impl, transformers.__version__, torch.__version__)

    mgr = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    step_times: list[float] = []
    original_step = mgr._generation_step
    stats = EngineStats(log, interval_s=cfg.stats_interval_s, every_steps=cfg.stats_every_steps)
    offloaded: list[str] = []
    hooked: list[Any] = []

    def timed_step() -> None:
        bp = getattr(mgr, "batch_processor", None)
        if bp is not None and not hooked:
            hooked.append(bp)
            _watch_offloads(bp, offloaded)
        t = time.perf_counter()
        try:
            original_step()
        finally:
            step_times.append(time.perf_counter() - t)
            if bp is not None:
                try:
                    b = _batch(bp)
                    gone, offloaded[:] = list(offloaded), []
                    stats.step(b["prefill"], b["decode"], b["running"], b["waiting"], b.get("kv_used"),
                               b.get("kv_total"), gone, b["generated"])
                except Exception as e:  # the statistics never stop the engine
                    log.debug("engine statistics unavailable: %s", e)

    mgr._generation_step = timed_step  # per-instance: the workload's own step timer

    rows = {r["id"]: {"id": r["id"], "prompt_len": len(r["prompt"]), "max_new_tokens": r["max_new_tokens"],
                      "arrival_s": round(r["arrival_s"], 6)} for r in reqs}
    results: dict[str, Any] = {}
    finished = [0]  # requests of `rows` finished, counted as they come (not summed over every admitted
    # request at each result, which is quadratic in the requests)

    def submit(r: dict[str, Any], t0: float) -> None:
        mgr.add_request(r["prompt"], request_id=r["id"], max_new_tokens=r["max_new_tokens"],
                        record_timestamps=True)
        rows[r["id"]]["submit_s"] = time.perf_counter() - t0
        log.info("request %s added prompt_len=%d max_new_tokens=%d", r["id"], len(r["prompt"]), r["max_new_tokens"])
        log_added(log, r["id"], len(r["prompt"]), r["max_new_tokens"])

    def collect(res: Any, t0: float) -> None:
        if res is None or not res.is_finished():
            return
        rid = res.request_id
        if rid in rows and rid not in results:
            finished[0] += 1
        results[rid] = res
        if rid not in rows:
            log.info("request %s finished (warm-up) generated=%d", rid, len(res.generated_tokens))
            return
        row = rows[rid]
        row["finish_s"] = time.perf_counter() - t0
        row["latency_s"] = row["finish_s"] - row.get("submit_s", row["finish_s"])
        row["generated"] = len(res.generated_tokens)
        ts = getattr(res, "timestamps", None)
        if ts and getattr(res, "created_time", None) is not None:
            row["ttft_s"] = ts[0] - res.created_time
        if getattr(res, "error", None):
            row["error"] = str(res.error)
        if cfg.save_tokens:
            row["tokens"] = list(res.generated_tokens)
        log.info("request %s finished generated=%d latency_ms=%.1f%s", rid, row["generated"],
                 1e3 * row["latency_s"], f" error={row['error']}" if "error" in row else "")
        log_finished(log, rid, row["prompt_len"], row["generated"], row["latency_s"], row.get("ttft_s"))

    t_wall0 = time.time()
    deadline = time.perf_counter() + cfg.timeout_s
    ok = True
    try:
        if cfg.rate <= 0:
            t0 = time.perf_counter()
            for r in reqs:
                submit(r, t0)
            mgr.start()
        else:
            mgr.start()
            if cfg.warmup:
                warm = [{"id": f"warmup_{i}", "prompt": reqs[0]["prompt"] if reqs else [1], "max_new_tokens": 4}
                        for i in range(cfg.warmup)]
                for w in warm:
                    mgr.add_request(w["prompt"], request_id=w["id"], max_new_tokens=w["max_new_tokens"])
                    log.info("request %s added (warm-up)", w["id"])
                while not all(w["id"] in results for w in warm) and time.perf_counter() < deadline:
                    collect(mgr.get_result(timeout=0.1), 0.0)
                    if not mgr.is_running():
                        break
                step_times.clear()
        t0 = time.perf_counter() if cfg.rate > 0 else t0
        i = 0 if cfg.rate > 0 else len(reqs)
        admitted = len(reqs) if cfg.rate <= 0 else 0
        extended, inflight_cap, last_paced = 0, 0, -math.inf
        while True:
            now = time.perf_counter() - t0
            if (i == len(reqs) and extended < len(extension) and now < cfg.timeout_s / 2
                    and (cfg.duration is None or extension[extended]["arrival_s"] <= cfg.duration)
                    and keep_serving()):
                inflight = admitted - finished[0]
                if not extended and not inflight_cap:
                    # as many in flight as when the planned arrivals ended: an engine that fell behind
                    # them gets the extra requests as it frees a slot, not all at once
                    inflight_cap = max(1, inflight)
                    log.info("serving past --requests %d: a fault window of this process has not closed yet "
                             "(at most %d requests in flight)", cfg.requests, inflight_cap)
                # a window acting on arrivals (wants_arrivals) gets one at the workload's rate
                # even where the engine is behind, never a burst of the overdue ones
                paced = cfg.rate > 0 and now - last_paced >= 1.0 / cfg.rate and wants_arrivals()
                if inflight < inflight_cap or paced:
                    if paced:
                        last_paced = now
                    r = extension[extended]
                    extended += 1
                    reqs.append(r)
                    rows[r["id"]] = {"id": r["id"], "prompt_len": len(r["prompt"]),
                                     "max_new_tokens": r["max_new_tokens"], "arrival_s": round(r["arrival_s"], 6),
                                     "extension": True}
            if i < len(reqs) and (cfg.duration is None or reqs[i]["arrival_s"] <= cfg.duration):
                if reqs[i]["arrival_s"] <= now:
                    submit(reqs[i], t0)
                    i += 1
                    admitted += 1
                    continue
                wait = reqs[i]["arrival_s"] - now
            else:
                if finished[0] >= admitted:
                    break
                wait = 0.1
            collect(mgr.get_result(timeout=max(0.001, min(wait, 0.1))), t0)
            if time.perf_counter() > deadline:
                log.error("timeout after %.0f s: %d of %d admitted requests unfinished", cfg.timeout_s,
                          admitted - finished[0], admitted)
                ok = False
                break
            if not mgr.is_running():
                while (res := mgr.get_result(timeout=0.01)) is not None:
                    collect(res, t0)
                if finished[0] < admitted:
                    log.error("generation thread stopped with requests unfinished")
                    ok = False
                break
    finally:
        try:
            mgr.stop(block=True, timeout=30)
        finally:
            destroy = getattr(mgr, "destroy", None)
            if callable(destroy):
                try:
                    destroy()
                except Exception as e:  # cleanup only
                    log.warning("manager destroy failed: %s", e)

    done = [rows[r["id"]] for r in reqs if "finish_s" in rows[r["id"]]]
    gen_tokens = sum(r.get("generated", 0) for r in done)
    span = (max(r["finish_s"] for r in done) - min(r["submit_s"] for r in done)) if done else 0.0
    lat = [r["latency_s"] for r in done]
    ttft = [r["ttft_s"] for r in done if "ttft_s" in r]
    summary = {
        "ok": ok and len(done) == len([r for r in reqs if "submit_s" in rows[r["id"]]]),
        "requests_submitted": sum(1 for r in rows.values() if "submit_s" in r),
        "requests_finished": len(done),
        "requests_extended": sum(1 for r in rows.values() if r.get("extension")),
        "generated_tokens": gen_tokens,
        "throughput_tok_s": gen_tokens / span if span > 0 else None,
        "latency_p50_s": _percentile(lat, 50),
        "latency_p99_s": _percentile(lat, 99),
        "latency_mean_s": sum(lat) / len(lat) if lat else None,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "steps": len(step_times),
        "step_p50_s": _percentile(step_times, 50),
        "step_p99_s": _percentile(step_times, 99),
        "wall_s": time.time() - t_wall0,
    }
    conf = dataclasses.asdict(cfg)
    conf.update(device=device, preset=preset, dtype=dtype_name, attn_implementation=impl,
                torch_threads=torch.get_num_threads(),
                num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    return {"config": conf, "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                                         "python": sys.version.split()[0]},
            "summary": summary, "requests": [rows[r["id"]] for r in reqs]}


def _batch(bp: Any) -> dict[str, int]:
    """The batch the engine just ran and its queue and KV cache (read from the batch processor)."""
    prefill = decode = generated = 0
    for fs in bp.inputs_and_outputs.requests_in_batch:  # before update_batch: no token of this step yet
        q = getattr(fs, "query_length", None)
        q = len(fs.state.tokens_to_process) if q is None else int(q)
        if fs.state.generated_tokens:
            decode += q
        else:
            prefill += q
        generated += bool(getattr(fs, "has_new_token", True))
    sch = bp.scheduler
    qsize = bp.input_queue.qsize() if getattr(bp, "input_queue", None) is not None else 0
    out = {"prefill": prefill, "decode": decode, "generated": generated, "running": len(sch.active_requests),
           "waiting": len(sch.waiting_requests) + qsize}
    cache = bp.cache
    try:
        total = int(cache.num_blocks)
        free = (int(cache.get_num_free_blocks()) if hasattr(cache, "get_num_free_blocks")
                else int(round(total * float(cache.compute_free_capacity(relative=True)))))
        out["kv_used"], out["kv_total"] = max(0, min(total, total - free)), total
    except Exception:
        pass
    return out


def _watch_offloads(bp: Any, into: list[str]) -> None:
    """Collect into ``into`` the ids of the requests each offload takes out of the running set
    (this batch processor's offloading manager, where the version has one)."""
    om = getattr(bp, "offloading_manager", None)
    fn = getattr(om, "offload_requests", None)
    if fn is None:
        return

    def offload_requests(*args: Any, **kwargs: Any) -> Any:
        before = set(bp.scheduler.active_requests)
        out = fn(*args, **kwargs)
        into.extend(sorted(before - set(bp.scheduler.active_requests)))
        return out

    om.offload_requests = offload_requests


def format_summary(res: dict[str, Any]) -> str:
    s = res["summary"]

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{1e3 * x:.1f} ms"

    tput = "n/a" if s["throughput_tok_s"] is None else f"{s['throughput_tok_s']:.1f} tok/s"
    return (f"throughput {tput}; requests {s['requests_finished']}/{s['requests_submitted']}; "
            f"latency p50 {ms(s['latency_p50_s'])} p99 {ms(s['latency_p99_s'])}; "
            f"ttft p50 {ms(s['ttft_p50_s'])}; steps {s['steps']} p50 {ms(s['step_p50_s'])} p99 {ms(s['step_p99_s'])}")


def write_json(res: dict[str, Any], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(res, indent=2))
