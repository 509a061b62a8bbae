"""A tensor-parallel serving workload: a Llama-style decoder on N ranks with real collectives.

``teller workload serve-tp`` starts ``tp`` worker processes (``python -m teller.workload.tp``,
each with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in its environment, so
``teller record`` records every rank: children inherit its settings). Each rank holds 1/tp of
the attention heads (column-parallel q/k/v, row-parallel o) and of the MLP (column-parallel
gate/up, row-parallel down) and sums partial outputs with ``torch.distributed.all_reduce``:
two all_reduces per layer per forward, gloo on the CPU and when ranks share a GPU, NCCL with
one GPU per rank (:func:`placement`).

The engine is a small continuous-batching loop, the same on every rank (lockstep, no control
messages): requests arrive as a Poisson process counted in steps (``arrivals_per_step``,
seeded), at most ``max_batch`` run per step; a new request is prefilled, then decodes one
token per step. ``TPEngine.step(batch)`` is one step; ``campaigns/hooks_tp.toml`` maps it to
STEP (request ids from ``args[0][*]``) and the layers to FE for ``teller record --hooks``.
Rank 0 logs one line per request added and finished, naming the request id, and the service
logs of :mod:`teller.workload.stats` (``Added request``/``Finished request`` with latencies,
``Engine 000: ...`` statistics every ``--stats-interval`` s or ``--stats-every-steps`` steps).
Before each step the loop sets ``TPEngine.batch`` to the batch context (``prefill`` prompt
tokens, ``decode`` tokens, ``waiting`` requests that arrived but are beyond ``max_batch``; there is
no paged KV cache and no preemption, so no ``kv_*``/``preempted``), which ``hooks_tp.toml``'s
``[batch]`` entry puts on the STEP message.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import subprocess
import sys
import time
from typing import Any

from teller.workload.serve import parse_length
from teller.workload.stats import EngineStats, log_added, log_finished

log = logging.getLogger("teller.workload.tp")


def _nn() -> Any:
    import torch

    nn = torch.nn

    class RMSNorm(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x: Any) -> Any:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class TPAttention(nn.Module):
        """Column-parallel q/k/v (local heads), row-parallel o, one all_reduce."""

        def __init__(self, hidden: int, heads: int, tp: int):
            super().__init__()
            self.local_heads, self.head_dim = heads // tp, hidden // heads
            d = self.local_heads * self.head_dim
            self.q_proj = nn.Linear(hidden, d, bias=False)
            self.k_proj = nn.Linear(hidden, d, bias=False)
            self.v_proj = nn.Linear(hidden, d, bias=False)
            self.o_proj = nn.Linear(d, hidden, bias=False)

        def forward(self, x: Any, cache: list) -> Any:
            import torch.distributed as dist
            import torch.nn.functional as F

            t = x.shape[0]
            q = self.q_proj(x).view(t, self.local_heads, self.head_dim).transpose(0, 1)
            k = self.k_proj(x).view(t, self.local_heads, self.head_dim).transpose(0, 1)
            v = self.v_proj(x).view(t, self.local_heads, self.head_dim).transpose(0, 1)
            if cache:
                k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
            cache[:] = [k, v]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
            out = self.o_proj(o.transpose(0, 1).reshape(t, -1))
            dist.all_reduce(out)
            return out

    class TPMLP(nn.Module):
        """Column-parallel gate/up, row-parallel down, one all_reduce."""

        def __init__(self, hidden: int, inter: int, tp: int):
            super().__init__()
            self.gate_proj = nn.Linear(hidden, inter // tp, bias=False)
            self.up_proj = nn.Linear(hidden, inter // tp, bias=False)
            self.down_proj = nn.Linear(inter // tp, hidden, bias=False)

        def forward(self, x: Any) -> Any:
            import torch.distributed as dist
            import torch.nn.functional as F

            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            dist.all_reduce(out)
            return out

    class TPDecoderLayer(nn.Module):
        def __init__(self, hidden: int, heads: int, inter: int, tp: int):
            super().__init__()
            self.input_layernorm = RMSNorm(hidden)
            self.self_attn = TPAttention(hidden, heads, tp)
            self.post_attention_layernorm = RMSNorm(hidden)
            self.mlp = TPMLP(hidden, inter, tp)

        def forward(self, x: Any, cache: list) -> Any:
            x = x + self.self_attn(self.input_layernorm(x), cache)
            return x + self.mlp(self.post_attention_layernorm(x))

    class TPModel(nn.Module):
        def __init__(self, layers: int, hidden: int, heads: int, inter: int, vocab: int, tp: int):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList(TPDecoderLayer(hidden, heads, inter, tp) for _ in range(layers))
            self.norm = RMSNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids: Any, caches: list) -> Any:
            x = self.embed_tokens(ids)
            for layer, cache in zip(self.layers, caches, strict=False):
                x = layer(x, cache)
            return self.lm_head(self.norm(x[-1:]))

    return TPModel


class TPEngine:
    """Per-rank engine state; :meth:`step` runs one batch (the STEP hook point)."""

    def __init__(self, model: Any, n_layers: int, device: Any = "cpu"):
        self.model, self.n_layers, self.device = model, n_layers, device
        self.state: dict[str, dict[str, Any]] = {}
        self.batch: dict[str, int] = {}  # batch context of the next step (set by the loop)

    def add(self, rid: str, prompt: list[int], max_new: int) -> None:
        self.state[rid] = {"prompt": prompt, "out": [], "max_new": max_new,
                           "caches": [[] for _ in range(self.n_layers)]}

    def step(self, batch: list[str]) -> list[str]:
        """One engine step over ``batch``; returns the requests that finished."""
        import torch

        done = []
        with torch.no_grad():
            for rid in batch:
                st = self.state[rid]
                ids = st["prompt"] if not st["out"] else st["out"][-1:]
                logits = self.model(torch.tensor(ids, device=self.device), st["caches"])
                st["out"].append(int(logits.argmax(-1)[0]))
                if len(st["out"]) >= st["max_new"]:
                    done.append(rid)
        return done


def placement(device: str, backend: str, rank: int, world: int) -> tuple[Any, str]:
    """This rank's device and the process-group backend.

    ``cpu``: gloo. ``cuda``: rank r on GPU ``r mod n``; with ``backend auto`` NCCL when every
    rank has a GPU of its own, else gloo (NCCL refuses two ranks on one GPU; gloo reduces CUDA
    tensors through host copies, so the collectives stay real on a one-GPU machine).
    """
    import torch

    if device == "cpu":
        if backend == "nccl":
            raise SystemExit("serve-tp: --backend nccl needs --device cuda")
        return torch.device("cpu"), "gloo"
    if device != "cuda":
        raise SystemExit(f"serve-tp: --device {device!r}: expected cpu or cuda")
    n = torch.cuda.device_count()
    if n == 0:
        raise SystemExit("serve-tp: --device cuda but no GPU is visible; use --device cpu")
    if backend == "auto":
        backend = "nccl" if n >= world else "gloo"
    elif backend == "nccl" and n < world:
        raise SystemExit(f"serve-tp: --backend nccl needs one GPU per rank ({world} ranks, {n} GPU(s)); use gloo")
    return torch.device("cuda", rank % n), backend


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[rank{rank}]: %(message)s")
    torch.set_num_threads(a.threads)
    dev, backend = placement(a.device, a.backend, rank, world)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    if rank == 0:
        log.info("tp=%d backend=%s device=%s", world, backend, dev)
    torch.manual_seed(a.seed)
    model = _nn()(a.layers, a.hidden, a.heads, a.intermediate, a.vocab, world).eval().to(dev)
    torch.manual_seed(a.seed + 1 + rank)  # each rank's shard differs; replicated parts stay equal
    for name, p in model.named_parameters():
        if "proj" in name:
            with torch.no_grad():
                p.normal_(0, 0.02)
    eng = TPEngine(model, a.layers, dev)
    rng = random.Random(a.seed)
    plen, olen = parse_length(a.prompt_len, "prompt-len"), parse_length(a.output_len, "output-len")
    arrivals, t = [], 0.0
    for i in range(a.requests):
        if i:
            t += rng.expovariate(a.arrivals_per_step)
        arrivals.append((int(t), f"req_{i}", [rng.randrange(1, a.vocab) for _ in range(plen(rng))], olen(rng)))
    waiting, running, finished, step = list(arrivals), [], 0, 0
    t0 = time.perf_counter()
    step_times = []
    stats = EngineStats(log, interval_s=a.stats_interval, every_steps=a.stats_every_steps)
    added_at: dict[str, float] = {}
    first_at: dict[str, float] = {}
    while finished < a.requests and time.perf_counter() - t0 < a.timeout:
        while waiting and waiting[0][0] <= step:
            _, rid, prompt, n = waiting.pop(0)
            eng.add(rid, prompt, n)
            running.append(rid)
            added_at[rid] = time.perf_counter()
            if rank == 0:
                log.info("request %s added prompt_len=%d max_new_tokens=%d", rid, len(prompt), n)
                log_added(log, rid, len(prompt), n)
        batch = running[:a.max_batch]
        if batch:
            prefill = sum(len(eng.state[r]["prompt"]) for r in batch if not eng.state[r]["out"])
            decode = sum(1 for r in batch if eng.state[r]["out"])
            eng.batch = {"prefill": prefill, "decode": decode, "waiting": len(running) - len(batch)}
            ts = time.perf_counter()
            for rid in eng.step(batch):
                running.remove(rid)
                finished += 1
                if rank == 0:
                    st = eng.state[rid]
                    log.info("request %s finished generated=%d", rid, len(st["out"]))
                    now = time.perf_counter()
                    log_finished(log, rid, len(st["prompt"]), len(st["out"]), now - added_at[rid],
                                 first_at.get(rid, now) - added_at[rid])
            for rid in batch:
                first_at.setdefault(rid, time.perf_counter())
            step_times.append(time.perf_counter() - ts)
            if rank == 0:
                stats.step(prefill, decode, len(batch), len(running) - len(batch),
                           generated=len(batch))
        step += 1
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        s = sorted(step_times)
        p = (lambda q: 1e3 * s[min(len(s) - 1, int(q * (len(s) - 1)))]) if s else (lambda q: float("nan"))
        print(f"tp={world} requests {finished}/{a.requests}; steps {len(s)} p50 {p(0.5):.1f} ms p99 {p(0.99):.1f} ms",
              flush=True)
    return 0 if finished == a.requests else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], tp: int) -> int:
    """Start ``tp`` worker processes and wait for all of them; returns the worst exit code."""
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(tp))
    procs = []
    for r in range(tp):
        # imported by name (not run as __main__) so hooks on teller.workload.tp apply
        code = "import sys; from teller.workload.tp import worker, parser; sys.exit(worker(parser().parse_args(sys.argv[1:])))"
        procs.append(subprocess.Popen([sys.executable, "-c", code, *argv],
                                      env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
    codes = [p.wait() for p in procs]
    return max(abs(c) for c in codes)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m teller.workload.tp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--arrivals-per-step", type=float, default=0.5)
    ap.add_argument("--prompt-len", default="uniform:8:24")
    ap.add_argument("--output-len", default="8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--stats-interval", type=float, default=1.0)
    ap.add_argument("--stats-every-steps", type=int, default=None)
    return ap


if __name__ == "__main__":
    sys.exit(worker(parser().parse_args()))
