"""Synthetic canonical runs that look like an instrumented LLM engine, for tests and benchmarks.

``synth_run(n_events)`` returns about ``n_events`` canonical events (:data:`teller.rundir.EVENT_SCHEMA`):

- an engine thread per rank: ``STEP id=N reqs=req_a,req_b`` ranges → decoder layers (``FE
  LlamaDecoderLayer``) → ``FE LlamaRMSNorm``/``FE LlamaAttention``/``FE LlamaMLP`` → ``BE aten::*``
  ops (and, in attention and MLP, ``COMM all_reduce bytes=.. group=tp seq=..`` ranges) → 1–3
  CUDA runtime calls per op (some ``cuLaunchKernel`` driver calls, some ``cudaGraphLaunch``) →
  kernels / memcpys bound by correlation id, serialized per CUDA stream; one MARKER per step;
- worker threads with their own ranges (``prepare_inputs``), copies, ``cudaStreamSynchronize``
  calls with a host SYNC record, and GPU work on their own stream;
- the same step structure on every rank (so collectives match by group and seq), with each
  rank's own timing, pid and device.

Even-numbered threads record ranges as NVTX push/pop pairs, odd ones as paired RANGE events, so
both reconstruction paths run. Everything is generated with numpy array operations: 10M events
take seconds. ``write_synth_run`` writes one events file per rank plus ``run.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from teller.rundir import KIND_CODE, KINDS, RunDir, RunInfo, events_table

FE_MODULES = ("LlamaRMSNorm", "LlamaAttention", "LlamaRMSNorm", "LlamaMLP")
BE_OPS = {
    "LlamaRMSNorm": ("aten::pow", "aten::mean", "aten::rsqrt", "aten::mul"),
    "LlamaAttention": ("aten::linear", "aten::view", "aten::_scaled_dot_product_flash_attention", "aten::add", "aten::cat"),
    "LlamaMLP": ("aten::linear", "aten::silu", "aten::mul"),
    "prepare_inputs": ("aten::to", "aten::copy_", "aten::index_select"),
}
KERNELS = {
    "aten::pow": "vectorized_elementwise_kernel<pow>",
    "aten::mean": "reduce_kernel<mean>",
    "aten::rsqrt": "vectorized_elementwise_kernel<rsqrt>",
    "aten::mul": "vectorized_elementwise_kernel<mul>",
    "aten::linear": "sm90_xmma_gemm_bf16bf16_bf16f32",
    "aten::view": "",
    "aten::_scaled_dot_product_flash_attention": "flash_fwd_kernel",
    "aten::add": "vectorized_elementwise_kernel<add>",
    "aten::cat": "CatArrayBatchedCopy",
    "aten::silu": "vectorized_elementwise_kernel<silu>",
    "aten::to": "",
    "aten::copy_": "",
    "aten::index_select": "indexSelectLargeIndex",
}
NCCL_KERNEL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
# runtime calls after the first of an op: (name, kind, GPU rows it issues)
EXTRA_CALLS = (("cudaStreamIsCapturing", "RUNTIME", 0), ("cudaGetDevice", "RUNTIME", 0), ("cudaLaunchKernel", "RUNTIME", 1))


@dataclass
class _Names:
    """String table shared by all generated rows (codes → strings)."""

    strings: list[str] = field(default_factory=lambda: [""])
    index: dict[str, int] = field(default_factory=lambda: {"": 0})

    def code(self, s: str) -> int:
        if s not in self.index:
            self.index[s] = len(self.strings)
            self.strings.append(s)
        return self.index[s]

    def codes(self, items) -> np.ndarray:
        return np.array([self.code(s) for s in items], dtype=np.int32)


@dataclass
class _Thread:
    """Structure of one host thread: host nodes (ranges and calls) and GPU rows, rank-independent."""

    parent: np.ndarray  # host node → parent host node (-1 root), parents before children
    name: np.ndarray  # name codes
    kind: np.ndarray  # kind codes (RANGE for ranges; emitted as push/pop or RANGE later)
    gpu_of: np.ndarray  # GPU row → launching host node
    gpu_name: np.ndarray
    gpu_kind: np.ndarray
    gpu_graph: np.ndarray
    gpu_stream: np.ndarray  # stream index (0..streams-1, or the worker stream)
    bytes_: np.ndarray  # per host node (COMM / memcpy size), -1 otherwise
    gpu_bytes: np.ndarray
    sync: np.ndarray  # host nodes that also emit a host SYNC record
    n_roots: int


def _repeat_parent(counts: np.ndarray, first: int) -> np.ndarray:
    return np.repeat(np.arange(first, first + len(counts)), counts)


def _engine(rng: np.random.Generator, nm: _Names, steps: int, layers: int, streams: int, comm: bool, reqs_per_step: int, graph_frac: float, step0: int) -> _Thread:
    """Engine thread: STEP → decoder layer → module → op (BE or COMM) → calls → GPU rows."""
    rng_names = rng
    # level 0: steps
    step_ids = np.arange(step0, step0 + steps)
    step_names = nm.codes(
        f"STEP id={s} reqs=" + ",".join(f"req_{r}" for r in range(s // 4, s // 4 + reqs_per_step)) for s in step_ids
    )
    par = [np.full(steps, -1)]
    names = [step_names]
    # level 1: decoder layers, plus one marker per step (a leaf)
    lay_par = np.repeat(np.arange(steps), layers)
    par.append(lay_par)
    names.append(np.full(len(lay_par), nm.code("FE LlamaDecoderLayer"), np.int32))
    off1 = steps
    # level 2: modules
    mod_par = off1 + np.repeat(np.arange(len(lay_par)), len(FE_MODULES))
    mod_kind = np.tile(np.arange(len(FE_MODULES)), len(lay_par))
    par.append(mod_par)
    names.append(nm.codes(f"FE {m}" for m in FE_MODULES)[mod_kind])
    off2 = off1 + len(lay_par)
    # level 3: ops — 1..3 BE ops per module, plus a COMM op closing attention and MLP
    n_ops = rng.integers(1, 4, len(mod_par))
    op_mod = np.repeat(np.arange(len(mod_par)), n_ops)
    op_fe = mod_kind[op_mod]
    op_name = np.empty(len(op_mod), np.int32)
    op_kernel = np.empty(len(op_mod), np.int32)
    for fe_i, fe in enumerate(FE_MODULES):
        sel = np.flatnonzero(op_fe == fe_i)
        choice = rng_names.integers(0, len(BE_OPS[fe]), len(sel))
        op_name[sel] = nm.codes(f"BE {o}" for o in BE_OPS[fe])[choice]
        op_kernel[sel] = nm.codes(KERNELS[o] for o in BE_OPS[fe])[choice]
    op_is_comm = np.zeros(len(op_mod), bool)
    op_bytes = np.full(len(op_mod), -1, np.int64)
    if comm:
        cm = np.flatnonzero(np.isin(mod_kind, [1, 3]))
        seq = np.arange(len(cm))
        nbytes = 8192 * (1 + (seq % 4))
        cnames = nm.codes(f"COMM all_reduce bytes={b} group=tp seq={q}" for b, q in zip(nbytes, seq, strict=True))
        op_mod = np.concatenate([op_mod, cm])
        op_name = np.concatenate([op_name, cnames])
        op_kernel = np.concatenate([op_kernel, np.full(len(cm), nm.code(NCCL_KERNEL), np.int32)])
        op_is_comm = np.concatenate([op_is_comm, np.ones(len(cm), bool)])
        op_bytes = np.concatenate([op_bytes, nbytes])
        o = np.lexsort((op_is_comm, op_mod))
        op_mod, op_name, op_kernel, op_is_comm, op_bytes = op_mod[o], op_name[o], op_kernel[o], op_is_comm[o], op_bytes[o]
    par.append(off2 + op_mod)
    names.append(op_name)
    off3 = off2 + len(mod_par)
    op_stream = rng.integers(0, streams, len(op_mod))
    op_stream[op_is_comm] = streams - 1
    # level 4: calls — the launch first, then 0..2 more
    n_calls = np.where(op_is_comm, 1, rng.integers(1, 4, len(op_mod)))
    call_op = np.repeat(np.arange(len(op_mod)), n_calls)
    first_call = np.r_[True, call_op[1:] != call_op[:-1]]
    extra = rng.integers(0, len(EXTRA_CALLS), len(call_op))
    r = rng.random(len(call_op))
    call_name = nm.codes(c[0] for c in EXTRA_CALLS)[extra]
    call_kind = np.array([KIND_CODE[c[1]] for c in EXTRA_CALLS], np.int8)[extra]
    call_gpu = np.array([c[2] for c in EXTRA_CALLS], np.int64)[extra]
    has_kernel = op_kernel[call_op] != 0
    launch = first_call & has_kernel
    graph = launch & (r < graph_frac) & ~op_is_comm[call_op]
    drv = launch & ~graph & (r > 0.95)
    plain = launch & ~graph & ~drv
    call_name[plain] = nm.code("cudaLaunchKernel")
    call_kind[plain] = KIND_CODE["RUNTIME"]
    call_gpu[plain] = 1
    call_name[drv] = nm.code("cuLaunchKernelEx")
    call_kind[drv] = KIND_CODE["DRIVER"]
    call_gpu[drv] = 1
    call_name[graph] = nm.code("cudaGraphLaunch")
    call_kind[graph] = KIND_CODE["RUNTIME"]
    call_gpu[graph] = rng.integers(2, 5, int(graph.sum()))
    nolaunch = first_call & ~has_kernel  # view-like ops: a cheap runtime call only
    call_name[nolaunch] = nm.code("cudaStreamIsCapturing")
    call_kind[nolaunch] = KIND_CODE["RUNTIME"]
    call_gpu[nolaunch] = 0
    call_gpu[(call_gpu > 0) & ~has_kernel] = 0
    par.append(off3 + call_op)
    names.append(call_name)
    off4 = off3 + len(op_mod)
    # markers: one per step, a leaf under the STEP
    par.append(np.arange(steps))
    names.append(np.full(steps, nm.code("scheduler.schedule"), np.int32))
    parent = np.concatenate(par).astype(np.int64)
    name = np.concatenate(names).astype(np.int32)
    n_host = len(parent)
    kind = np.full(n_host, KIND_CODE["RANGE"], np.int8)
    kind[off4 : off4 + len(call_op)] = call_kind
    kind[off4 + len(call_op) :] = KIND_CODE["MARKER"]
    bytes_ = np.full(n_host, -1, np.int64)
    bytes_[off3 : off3 + len(op_mod)] = op_bytes
    # GPU rows
    gpu_of_call = np.repeat(np.arange(len(call_op)), call_gpu)
    g_graph = np.where(graph[gpu_of_call], 1 + gpu_of_call % 7, -1)
    return _Thread(
        parent=parent,
        name=name,
        kind=kind,
        gpu_of=off4 + gpu_of_call,
        gpu_name=op_kernel[call_op[gpu_of_call]],
        gpu_kind=np.full(len(gpu_of_call), KIND_CODE["KERNEL"], np.int8),
        gpu_graph=g_graph,
        gpu_stream=op_stream[call_op[gpu_of_call]],
        bytes_=bytes_,
        gpu_bytes=np.full(len(gpu_of_call), -1, np.int64),
        sync=np.zeros(0, np.int64),
        n_roots=steps,
    )


def _worker(rng: np.random.Generator, nm: _Names, iters: int, stream: int) -> _Thread:
    """Worker thread: prepare_inputs → copy ops → memcpy / sync / launch calls."""
    root_name = np.full(iters, nm.code("prepare_inputs"), np.int32)
    n_ops = rng.integers(1, 4, iters)
    op_par = np.repeat(np.arange(iters), n_ops)
    ops = BE_OPS["prepare_inputs"]
    choice = rng.integers(0, len(ops), len(op_par))
    op_name = nm.codes(f"BE {o}" for o in ops)[choice]
    calls = (("cudaMemcpyAsync", "MEMCPY"), ("cudaStreamSynchronize", "SYNC"), ("cudaLaunchKernel", "KERNEL"))
    n_calls = rng.integers(1, 3, len(op_par))
    call_op = np.repeat(np.arange(len(op_par)), n_calls)
    c = rng.integers(0, len(calls), len(call_op))
    call_name = nm.codes(x[0] for x in calls)[c]
    off_op = iters
    off_call = off_op + len(op_par)
    parent = np.concatenate([np.full(iters, -1), op_par, off_op + call_op]).astype(np.int64)
    name = np.concatenate([root_name, op_name, call_name]).astype(np.int32)
    kind = np.full(len(parent), KIND_CODE["RANGE"], np.int8)
    kind[off_call:] = KIND_CODE["RUNTIME"]
    gcall = np.flatnonzero(c != 1)
    gkind = np.where(c[gcall] == 0, KIND_CODE["MEMCPY"], KIND_CODE["KERNEL"]).astype(np.int8)
    gname = np.where(c[gcall] == 0, nm.code("Memcpy HtoD (Pinned -> Device)"), nm.code("indexSelectLargeIndex")).astype(np.int32)
    gbytes = np.where(c[gcall] == 0, 4096 * (1 + gcall % 8), -1).astype(np.int64)
    return _Thread(
        parent=parent,
        name=name,
        kind=kind,
        gpu_of=off_call + gcall,
        gpu_name=gname,
        gpu_kind=gkind,
        gpu_graph=np.full(len(gcall), -1),
        gpu_stream=np.full(len(gcall), stream),
        bytes_=np.full(len(parent), -1, np.int64),
        gpu_bytes=gbytes,
        sync=off_call + np.flatnonzero(c == 1),
        n_roots=iters,
    )


def _times(rng: np.random.Generator, th: _Thread, span: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Start/end (ns) of host nodes: leaves 1–8 µs, ranges wrap their children with slack.

    Roots run back to back (spread over ``span`` ns when given). Every child lies strictly inside
    its parent and siblings do not overlap, so the true tree is known.
    """
    n = len(th.parent)
    has_par = th.parent >= 0
    leaf_dur = rng.integers(1000, 8000, n)
    pad = rng.integers(100, 2000, n)  # before the first child
    gap = rng.integers(50, 1500, n)  # after a node, before its next sibling
    tail = rng.integers(100, 2000, n)
    # depth of nodes (parents come first, so a few passes over levels suffice)
    depth = np.zeros(n, np.int64)
    for _ in range(16):
        d = np.where(has_par, depth[np.maximum(th.parent, 0)] + 1, 0)
        if np.array_equal(d, depth):
            break
        depth = d
    nchild = np.bincount(th.parent[has_par], minlength=n)
    dur = np.where(nchild > 0, 0, leaf_dur).astype(np.int64)
    for lv in range(int(depth.max()), 0, -1):
        sel = np.flatnonzero(depth == lv)
        np.add.at(dur, th.parent[sel], dur[sel] + gap[sel])
        ps = np.unique(th.parent[sel])
        # parents at lv-1 with children: pad + children + tail (their own dur was 0)
        dur[ps] += pad[ps] + tail[ps]
    start = np.zeros(n, np.int64)
    roots = np.flatnonzero(~has_par)
    step = dur[roots] + gap[roots]
    if span is not None and span > step.sum():
        step = step + (span - step.sum()) // max(len(roots), 1)
    start[roots] = np.cumsum(step) - step
    for lv in range(1, int(depth.max()) + 1):
        sel = np.flatnonzero(depth == lv)
        sel = sel[np.argsort(th.parent[sel], kind="stable")]  # siblings together, in index order
        p = th.parent[sel]
        w = dur[sel] + gap[sel]
        cs = np.cumsum(w) - w
        first = np.r_[True, p[1:] != p[:-1]]
        base = cs[np.maximum.accumulate(np.where(first, np.arange(len(sel)), 0))]
        start[sel] = start[p] + pad[p] + (cs - base)
    return start, start + dur


def _gpu_times(rng: np.random.Generator, ready: np.ndarray, stream: np.ndarray, is_nccl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kernels run in launch order per stream: start = max(ready, end of the previous one)."""
    dur = rng.integers(2000, 12000, len(ready)).astype(np.int64)
    dur[is_nccl] = rng.integers(8000, 30000, int(is_nccl.sum()))
    start = np.empty(len(ready), np.int64)
    for s in np.unique(stream):
        sel = np.flatnonzero(stream == s)
        sel = sel[np.argsort(ready[sel], kind="stable")]
        d = np.cumsum(dur[sel]) - dur[sel]
        start[sel] = d + np.maximum.accumulate(ready[sel] - d)
    return start, start + dur


def synth_run(n_events: int, seed: int = 0, threads: int = 3, streams: int = 2, ranks: int = 1, **kwargs: Any) -> pa.Table:
    """About ``n_events`` canonical events of a synthetic engine (see the module docstring and
    :func:`synth_tables` for the options)."""
    tables = list(synth_tables(n_events, seed=seed, threads=threads, streams=streams, ranks=ranks, **kwargs))
    return pa.concat_tables(tables).combine_chunks() if tables else events_table({})


def synth_tables(
    n_events: int,
    seed: int = 0,
    threads: int = 3,
    streams: int = 2,
    ranks: int = 1,
    layers: int = 4,
    requests_per_step: int = 3,
    comm: bool | None = None,
    graph_frac: float = 0.03,
    unbound_frac: float = 0.0,
    pushpop: str = "even",
) -> Iterator[pa.Table]:
    """One canonical events table per rank, about ``n_events`` rows in all.

    ``comm`` defaults to ``ranks > 1``; ``unbound_frac`` gives that share of GPU rows a
    correlation id no host call has (to exercise FLAG_UNBOUND). ``pushpop`` says which threads
    record ranges as NVTX push/pop pairs: ``"even"`` (thread 0, 2, ...), ``"all"`` or ``"none"``
    (paired RANGE events only).
    """
    if pushpop not in ("even", "all", "none"):
        raise ValueError("pushpop must be 'even', 'all' or 'none'")
    if n_events < 0 or threads < 1 or streams < 1 or ranks < 1:
        raise ValueError("n_events >= 0, threads >= 1, streams >= 1, ranks >= 1 required")
    comm = ranks > 1 if comm is None else comm
    rng = np.random.default_rng(seed)
    nm = _Names()
    per_rank = max(n_events // ranks, 1)
    engine_share = 0.85 if threads > 1 else 1.0

    def rows_per_root(th: _Thread, ti: int) -> float:
        """Rows one root emits on thread ``ti`` when even threads write push/pop pairs (two rows
        per range). Sized this way whatever ``pushpop`` says, so the structure (steps, ops,
        kernels) is the same in every mode and only the way ranges are written changes."""
        twice = ti % 2 == 0
        ranges = int((th.kind == KIND_CODE["RANGE"]).sum())
        return (len(th.parent) + (ranges if twice else 0) + len(th.gpu_of) + len(th.sync)) / th.n_roots

    probe = _engine(np.random.default_rng(seed), _Names(), 32, layers, streams, comm, requests_per_step, graph_frac, 0)
    steps = max(1, int(round(per_rank * engine_share / rows_per_root(probe, 0))))
    eng = _engine(rng, nm, steps, layers, streams, comm, requests_per_step, graph_frac, 0)
    workers = []
    if threads > 1:
        wprobe = _worker(np.random.default_rng(seed), _Names(), 256, streams)
        per_iter = np.mean([rows_per_root(wprobe, ti) for ti in range(1, threads)])
        iters = max(1, int(round(per_rank * (1 - engine_share) / (threads - 1) / per_iter)))
        workers = [_worker(rng, nm, iters, streams + i) for i in range(threads - 1)]
    for rank in range(ranks):
        rrng = np.random.default_rng([seed, rank + 1])
        yield _emit(rrng, nm, rank, [eng, *workers], unbound_frac, pushpop)


def _emit(rng: np.random.Generator, nm: _Names, rank: int, threads: list[_Thread], unbound_frac: float, pushpop: str) -> pa.Table:
    """Time one rank's threads and lay out its rows: ranges, calls, syncs, GPU rows."""
    pid = 4000 + rank
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("kind", "name", "tid", "start_ns", "end_ns", "corr_id", "graph_id", "bytes", "device", "stream")}
    order_key: list[np.ndarray] = []
    host_calls = []  # (thread idx, host node idx, start) for corr numbering
    span = None
    timed = []
    for ti, th in enumerate(threads):
        s, e = _times(rng, th, span)
        if ti == 0:
            span = int(e.max()) if len(e) else 0
        timed.append((s, e))
        host_calls.append(np.flatnonzero((th.kind == KIND_CODE["RUNTIME"]) | (th.kind == KIND_CODE["DRIVER"])))
    # correlation ids: one counter per process, in start order over all threads
    all_starts = np.concatenate([timed[i][0][hc] for i, hc in enumerate(host_calls)])
    corr_all = np.empty(len(all_starts), np.int64)
    corr_all[np.argsort(all_starts, kind="stable")] = np.arange(1, len(all_starts) + 1)
    corr_of = []
    o = 0
    for i, hc in enumerate(host_calls):
        c = np.full(len(threads[i].parent), -1, np.int64)
        c[hc] = corr_all[o : o + len(hc)]
        o += len(hc)
        corr_of.append(c)
    block = 0
    for ti, th in enumerate(threads):
        s, e = timed[ti]
        tid = pid * 10 + ti
        as_pushpop = pushpop == "all" or (pushpop == "even" and ti % 2 == 0)
        is_range = th.kind == KIND_CODE["RANGE"]
        rg = np.flatnonzero(is_range)
        other = np.flatnonzero(~is_range)
        n_h = len(th.parent)
        if as_pushpop:
            # pushes at start, pops at end; a pop sorts before a push at the same instant
            t = np.concatenate([s[rg], e[rg]])
            key = np.concatenate([s[rg] * 2 + 1, e[rg] * 2])
            kinds = np.concatenate([np.full(len(rg), KIND_CODE["NVTX_PUSH"], np.int8), np.full(len(rg), KIND_CODE["NVTX_POP"], np.int8)])
            nm_ = np.concatenate([th.name[rg], np.zeros(len(rg), np.int32)])
            o_ = np.argsort(key, kind="stable")
            _put(cols, kind=kinds[o_], name=nm_[o_], tid=tid, start_ns=t[o_], end_ns=-1, corr_id=-1, graph_id=-1, bytes=np.concatenate([th.bytes_[rg], np.full(len(rg), -1)])[o_], device=-1, stream=-1)
            order_key.append(block * (1 << 56) + t[o_])
        else:
            _put(cols, kind=th.kind[rg], name=th.name[rg], tid=tid, start_ns=s[rg], end_ns=e[rg], corr_id=-1, graph_id=-1, bytes=th.bytes_[rg], device=-1, stream=-1)
            order_key.append(block * (1 << 56) + s[rg])
        block += 1
        # calls and markers
        ends = np.where(th.kind[other] == KIND_CODE["MARKER"], -1, e[other])
        _put(cols, kind=th.kind[other], name=th.name[other], tid=tid, start_ns=s[other], end_ns=ends, corr_id=corr_of[ti][other], graph_id=-1, bytes=th.bytes_[other], device=-1, stream=-1)
        order_key.append(block * (1 << 56) + s[other])
        if len(th.sync):
            sy = th.sync
            _put(cols, kind=np.full(len(sy), KIND_CODE["SYNC"], np.int8), name=np.full(len(sy), nm.code("cudaStreamSynchronize"), np.int32), tid=tid, start_ns=s[sy] + 1, end_ns=np.maximum(e[sy] - 1, s[sy] + 1), corr_id=corr_of[ti][sy], graph_id=-1, bytes=-1, device=-1, stream=-1)
            order_key.append(block * (1 << 56) + s[sy])
        block += 1
        del n_h
    # GPU rows of all threads, timed per stream
    g_ready, g_stream, g_parts = [], [], []
    for ti, th in enumerate(threads):
        s, e = timed[ti]
        g_ready.append(e[th.gpu_of] + rng.integers(1000, 5000, len(th.gpu_of)))
        g_stream.append(th.gpu_stream)
        g_parts.append((ti, th))
    ready = np.concatenate(g_ready) if g_ready else np.zeros(0, np.int64)
    stream = np.concatenate(g_stream) if g_stream else np.zeros(0, np.int64)
    gname = np.concatenate([th.gpu_name for th in threads])
    is_nccl = gname == nm.code(NCCL_KERNEL)
    gs, ge = _gpu_times(rng, ready, stream, is_nccl)
    gcorr = np.concatenate([corr_of[ti][th.gpu_of] for ti, th in enumerate(threads)])
    if unbound_frac > 0 and len(gcorr):
        lost = rng.random(len(gcorr)) < unbound_frac
        gcorr[lost] += 1 << 40
    _put(
        cols,
        kind=np.concatenate([th.gpu_kind for th in threads]),
        name=gname,
        tid=-1,
        start_ns=gs,
        end_ns=ge,
        corr_id=gcorr,
        graph_id=np.concatenate([th.gpu_graph for th in threads]),
        bytes=np.concatenate([th.gpu_bytes for th in threads]),
        device=rank,
        stream=7 + stream,
    )
    order_key.append(block * (1 << 56) + gs)
    out = {k: np.concatenate(v) for k, v in cols.items()}
    o = np.argsort(np.concatenate(order_key), kind="stable")  # blocks as collectors flush them, time order inside
    out = {k: v[o] for k, v in out.items()}
    n = len(o)
    names = pa.array(nm.strings, pa.string())
    out["name"] = pa.DictionaryArray.from_arrays(pa.array(out["name"], pa.int32()), names)
    out["kind"] = pa.DictionaryArray.from_arrays(pa.array(out["kind"], pa.int8()), pa.array(KINDS))
    out["pid"] = np.full(n, pid, np.int64)
    out["node"] = np.zeros(n, np.int32)
    out["rank"] = np.full(n, rank, np.int32)
    return events_table(out, n)


def _put(cols: dict[str, list[np.ndarray]], **values: Any) -> None:
    n = next(len(v) for v in values.values() if isinstance(v, np.ndarray))
    for k, v in values.items():
        cols[k].append(v if isinstance(v, np.ndarray) else np.full(n, v, np.int64))


def write_synth_run(path: str | os.PathLike, n_events: int, **kwargs: Any) -> RunDir:
    """Write ``synth_run(n_events, **kwargs)`` as a run directory (one events file per rank)."""
    rd = RunDir(path)
    rows = 0
    ranks = []
    for r, table in enumerate(synth_tables(n_events, **kwargs)):
        rd.write_events(table, name=f"rank{r}")
        rows += table.num_rows
        ranks.append(r)
    rd.write_info(
        RunInfo(
            source="synth",
            command=["teller.testing.synth.synth_run", str(n_events)],
            ranks=[{"node": 0, "rank": r, "pid": 4000 + r} for r in ranks],
            counts={"events": rows},
            extra={"synth": {k: v for k, v in kwargs.items()}},
        )
    )
    return rd
