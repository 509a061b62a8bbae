"""Cross-layer reconstruction (DESIGN.md §4–5): events → call forest, steps, requests, comm edges.

``reconstruct(RUN)`` reads ``RUN/events/*.parquet`` and writes

- ``forest.parquet``: one row per node, in depth-first preorder (a parent before its children,
  every subtree a contiguous block ``[node_id, node_id + size)``; see :mod:`.forest` for the
  order of roots and siblings). Columns: node_id, parent_id (-1 root), layer, name, start_ns,
  end_ns, node, rank, pid, tid, device, stream, corr_id, step_id (innermost enclosing STEP, -1
  none; GPU nodes take their launching call's), flags, depth, size, kind, graph_id, bytes, args.
- ``steps.parquet``, ``requests.parquet`` (:mod:`.steps`), ``comm_edges.parquet`` (:mod:`.comm`),
- ``reconstruct.json``: the returned summary: ``events_in``, ``nodes``, ``pops_consumed``,
  ``repaired_pops_without_push`` and ``reconciled`` (events in = nodes + pops consumed + pops
  without a push); flag counts (``truncated``, ``repaired`` with its causes, ``unbound``,
  ``duplicate``); ``gpu_activity``/``gpu_bound``/``binding_coverage`` (share of kernel, memcpy and
  memset nodes bound to a host call); ``steps``, ``requests``, ``comm_edges``; per-layer counts;
  CPU seconds per phase.

Events in = nodes + pops consumed by pairing + pops without a push (dropped and counted).
Every step is a vectorized numpy/Arrow pass; Python loops run over threads, files and row groups,
pointer-jumping rounds and output chunks only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.errors import TellerError
from teller.forest import FOREST_SCHEMA
from teller.reconstruct import layers as L
from teller.reconstruct._np import factorize, index_dtype, pack, segment_starts, sort_with_ties
from teller.reconstruct.comm import comm_edges, describe
from teller.reconstruct.forest import extent, join, nest, preorder
from teller.reconstruct.ranges import pair
from teller.reconstruct.steps import steps_tables
from teller.rundir import (
    FLAG_DUPLICATE,
    FLAG_NAMES,
    FLAG_REPAIRED,
    FLAG_TRUNCATED,
    FLAG_UNBOUND,
    KIND_CODE,
    KINDS,
    LAYERS,
    RunDir,
    kind_codes,
)

__all__ = ["reconstruct"]

LANE_COLS = ("node", "rank", "pid", "tid", "device", "stream")
CHUNK_ROWS = 1 << 19
#: Parquet encodings of the forest: dictionary pages for the few-valued columns, delta encoding for
#: the near-monotone ones (node ids, times); measured 2x faster to write and smaller than defaults.
DICT_COLS = ["layer", "name", "kind", "node", "rank", "pid", "tid", "device", "stream", "flags", "depth"]
DELTA_COLS = ["node_id", "parent_id", "start_ns", "end_ns", "corr_id", "step_id", "size"]
#: Row-group min/max only where readers filter (string statistics alone cost a third of the write).
STATS_COLS = ["node_id", "parent_id", "step_id", "start_ns", "end_ns", "rank", "depth"]

_PUSH, _POP, _SYNC = KIND_CODE["NVTX_PUSH"], KIND_CODE["NVTX_POP"], KIND_CODE["SYNC"]
_RANGE_LIKE = L.kind_table({"NVTX_PUSH": True, "RANGE": True, "MARKER": True}, False, bool)


def _release() -> None:
    """Hand Arrow's freed read buffers back to the OS: a Parquet read needs 2-4x the column's size
    while decoding, and the allocator would otherwise keep that high-water mark for the run."""
    pa.default_memory_pool().release_unused()


def _column(rd: RunDir, name: str) -> pa.Array:
    col = rd.read_events(columns=[name]).column(0)
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    _release()
    return col


class _Numeric:
    """Numeric event columns decoded row group by row group into one preallocated numpy array,
    so reading a column costs the column plus one row group (not 2-4x the column)."""

    def __init__(self, rd: RunDir):
        self.files = []
        for f in rd.event_files():
            try:
                self.files.append((f, pq.ParquetFile(f)))
            except (pa.ArrowInvalid, OSError) as e:
                raise TellerError(f"{f}: unreadable Parquet ({e}); delete the file or re-run the recording/ingest that wrote it") from e
        self.n = sum(pf.metadata.num_rows for _, pf in self.files)

    def _fits_int32(self, name: str) -> bool:
        """Row-group statistics say every value fits int32 (no statistics: assume not)."""
        for _, pf in self.files:
            idx = pf.schema_arrow.get_field_index(name)
            for g in range(pf.metadata.num_row_groups):
                st = pf.metadata.row_group(g).column(idx).statistics
                if st is None or not st.has_min_max or st.min < -(2**31) or st.max >= 2**31:
                    return False
        return True

    def constant(self, name: str) -> int | None:
        """The single value of a column without nulls, when row-group statistics prove it."""
        vals = set()
        for _, pf in self.files:
            idx = pf.schema_arrow.get_field_index(name)
            for g in range(pf.metadata.num_row_groups):
                st = pf.metadata.row_group(g).column(idx).statistics
                if st is None or not st.has_min_max or st.null_count or st.min != st.max:
                    return None
                vals.add(st.min)
        return vals.pop() if len(vals) == 1 else None

    def all_null(self, name: str) -> bool:
        """Row-group statistics say the column holds only nulls (e.g. ``args`` of NVTX events)."""
        for _, pf in self.files:
            idx = pf.schema_arrow.get_field_index(name)
            for g in range(pf.metadata.num_row_groups):
                col = pf.metadata.row_group(g).column(idx)
                st = col.statistics
                if st is None or st.null_count is None or st.null_count != col.num_values:
                    return False
        return True

    def strings(self, name: str) -> tuple[np.ndarray, pa.Array]:
        """A string column as (int32 codes, dictionary), nulls as "".

        Writers usually repeat one file's whole dictionary in every row group; chunks whose
        dictionary equals the previous one reuse its mapping, so only distinct dictionaries are
        hashed (unifying every row group's copy cost a second on runs with unique step messages).
        """
        out = np.empty(self.n, dtype=np.int32)
        dicts: list[pa.Array] = []
        spans: list[tuple[int, int, int]] = []  # (row offset, rows, index into dicts)
        pos = 0
        for f, pf in self.files:
            if name not in pf.schema_arrow.names:
                raise TellerError(f"{f}: not a canonical events file (missing column {name!r}); write it with teller.rundir.RunDir.write_events")
            for g in range(pf.metadata.num_row_groups):
                for ch in pf.read_row_group(g, columns=[name]).column(0).chunks:
                    if not pa.types.is_dictionary(ch.type):
                        ch = ch.dictionary_encode()
                    d = ch.dictionary
                    if not dicts or not (len(d) == len(dicts[-1]) and d.equals(dicts[-1])):
                        dicts.append(d)
                    idx = ch.indices.fill_null(len(d)) if ch.indices.null_count else ch.indices
                    out[pos : pos + len(ch)] = idx.to_numpy(zero_copy_only=False)
                    spans.append((pos, len(ch), len(dicts) - 1))
                    pos += len(ch)
        _release()
        if not dicts:
            return out, pa.array([""], pa.string())
        # one global dictionary; each distinct dictionary (plus a "" for nulls) maps into it
        parts = [pc.fill_null(d.cast(pa.string()), "") for d in dicts]
        enc = pa.concat_arrays([x for p in parts for x in (p, pa.array([""], pa.string()))]).dictionary_encode()
        codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        offs = np.cumsum([0] + [len(p) + 1 for p in parts])
        for start, rows, k in spans:
            seg = out[start : start + rows]
            seg[:] = codes[offs[k] : offs[k + 1]][seg]
        return out, enc.dictionary

    def __call__(self, name: str, narrow: bool = False) -> np.ndarray:
        """Column ``name`` as numpy (nulls → -1): int64, or int32 when ``narrow`` and the values
        fit (or the column is int32 already)."""
        for f, pf in self.files:
            if name not in pf.schema_arrow.names:
                raise TellerError(f"{f}: not a canonical events file (missing column {name!r}); write it with teller.rundir.RunDir.write_events")
        typ = self.files[0][1].schema_arrow.field(name).type if self.files else pa.int64()
        small = pa.types.is_integer(typ) and typ.bit_width <= 32
        out = np.empty(self.n, dtype=np.int32 if small or (narrow and self._fits_int32(name)) else np.int64)
        pos = 0
        for _, pf in self.files:
            for g in range(pf.metadata.num_row_groups):
                for ch in pf.read_row_group(g, columns=[name]).column(0).chunks:
                    if ch.null_count:
                        ch = ch.fill_null(-1)
                    out[pos : pos + len(ch)] = ch.to_numpy(zero_copy_only=False)
                    pos += len(ch)
        _release()
        return out


def _write_chunks(rd: RunDir, name: str, schema: pa.Schema, n: int, make) -> Path:
    """Write ``name.parquet`` atomically, ``CHUNK_ROWS`` rows at a time (bounded memory).

    The same file layout as :meth:`RunDir.write_table` (zstd), so ``read_table`` reads it."""
    out = rd.path / f"{name}.parquet"
    tmp = out.with_suffix(".parquet.tmp")
    opts = dict(compression="zstd", use_dictionary=DICT_COLS, write_statistics=STATS_COLS)
    opts["column_encoding"] = {c: "DELTA_BINARY_PACKED" for c in DELTA_COLS}
    with pq.ParquetWriter(tmp, schema, **opts) as w:
        for a in range(0, n, CHUNK_ROWS):
            w.write_table(pa.Table.from_arrays(make(a, min(n, a + CHUNK_ROWS)), schema=schema), row_group_size=CHUNK_ROWS)
        if n == 0:
            w.write_table(schema.empty_table())
    tmp.replace(out)
    return out


def _bind(hs: np.ndarray, gpu_ev: np.ndarray, kind: np.ndarray, lane: np.ndarray, corr: np.ndarray, proc_of_lane: np.ndarray, nr_of_lane: np.ndarray) -> np.ndarray:
    """Position (in ``hs``) of the host call that launched each GPU row, -1 if none.

    Keys are (process, corr_id); GPU rows whose process made no host calls at all (a reader
    put the device number in ``pid``) get a second chance by (node, rank, corr_id).
    """
    it = hs.dtype
    call_pos = np.flatnonzero((L.LAUNCH_PRIORITY[kind[hs]] >= 0) & (corr[hs] >= 0)).astype(it)
    calls = hs[call_pos]
    gcorr = corr[gpu_ev]
    bound_pos = np.full(len(gpu_ev), -1, dtype=it)
    if not calls.size:
        return bound_pos
    prio = L.LAUNCH_PRIORITY[kind[calls]]
    has_corr = gcorr >= 0
    procs_with_calls = np.zeros(int(proc_of_lane.max(initial=-1)) + 1, dtype=bool)
    procs_with_calls[proc_of_lane[lane[calls]]] = True
    for code_of_lane, fallback in ((proc_of_lane, False), (nr_of_lane, True)):
        todo = np.flatnonzero(has_corr & (bound_pos < 0))
        if fallback:
            todo = todo[~procs_with_calls[proc_of_lane[lane[gpu_ev[todo]]]]]
        if not todo.size:
            continue
        keys = [np.concatenate([code_of_lane[lane[calls]], code_of_lane[lane[gpu_ev[todo]]]]), np.concatenate([corr[calls], gcorr[todo]])]
        both = pack(keys)
        if both is None:
            both, _ = factorize(keys)
        m = join(both[: len(calls)], prio, both[len(calls) :])
        ok = m >= 0
        bound_pos[todo[ok]] = call_pos[m[ok]]
    return bound_pos


def reconstruct(run: str | os.PathLike, step_patterns: list[str] | None = None) -> dict[str, Any]:
    """Rebuild the call forest of ``run`` and write its tables; returns the summary dict."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    timings: dict[str, float] = {}
    last = [c0]

    def lap(phase: str) -> None:  # CPU seconds per phase (wall time is noisy on shared machines)
        now = time.process_time()
        timings[phase] = round(now - last[0], 3)
        last[0] = now

    rd = RunDir(run).require()
    _ints = _Numeric(rd)

    # ---- load: thread lanes first (six wide columns → one int32 code), then the rest ----------
    lane, lanes = factorize([_ints(c) for c in LANE_COLS])
    lane_node, lane_rank, lane_pid, lane_tid, lane_dev, lane_stream = lanes
    n_lanes = len(lane_tid)
    proc_of_lane, _ = factorize([lane_node, lane_rank, lane_pid])
    nr_of_lane, _ = factorize([lane_node, lane_rank])
    kind = kind_codes(rd.read_events(columns=["kind"]))
    n = len(kind)
    it = index_dtype(n)
    if len(kind) != _ints.n:
        raise TellerError(f"{rd.events_dir}: the event files changed while being read; run again")
    start = _ints("start_ns")
    end = _ints("end_ns")
    flags = _ints("flags")

    lap("load")
    # ---- 1. push/pop pairing ------------------------------------------------------------------
    push = np.flatnonzero(kind == _PUSH).astype(it)
    pop = np.flatnonzero(kind == _POP).astype(it)
    is_pop = np.zeros(n, dtype=bool)
    is_pop[pop] = True
    rid = None if _ints.constant("range_id") == -1 else _ints("range_id")
    proc = proc_of_lane[lane]
    pr = pair(push, pop, lane, proc, start, rid)
    del rid, proc
    n_pops = len(pop)
    popped = pr.pop_of_push >= 0
    end[push[popped]] = start[pr.pop_of_push[popped]]
    open_push = push[~popped]
    if open_push.size:
        last = np.full(n_lanes, np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(last, lane, np.maximum(start, end))
        end[open_push] = np.maximum(last[lane[open_push]], start[open_push])
        flags[open_push] |= FLAG_TRUNCATED
    flags[push[pr.duplicate]] |= FLAG_DUPLICATE
    del push, pop, popped, open_push

    # negative durations (instants: markers are points, not repairs)
    bad = np.flatnonzero((end < start) & ~is_pop)
    is_marker = kind[bad] == KIND_CODE["MARKER"]
    flags[bad[~is_marker]] |= FLAG_REPAIRED
    end[bad] = start[bad]
    neg_repaired = int((~is_marker).sum())

    lap("pair")
    # ---- 4. layers and names (on the dictionary) ----------------------------------------------
    name_in, name_dict = _ints.strings("name")
    rules = L.name_rules(name_dict, step_patterns)
    lcodes, ldict = _ints.strings("layer")
    layer_in = L.layer_codes(ldict)[lcodes]
    del lcodes
    layer, name = L.assign(kind, layer_in, name_in, rules)
    del layer_in
    step_ev = np.flatnonzero((layer == L.STEP) & ~is_pop)
    step_name_in = name_in[step_ev]
    del name_in

    lap("layers")
    # ---- 2./3. nesting of host events per thread ------------------------------------------------
    gpu = L.IS_GPU_KIND[kind] | ((kind == _SYNC) & (lane_tid[lane] < 0))
    host = np.flatnonzero(~gpu & ~is_pop).astype(it)
    del is_pop
    gpu_ev = np.flatnonzero(gpu).astype(it)
    del gpu
    def tie_keys(rows: np.ndarray, host: np.ndarray = host) -> list[np.ndarray]:
        ev = host[rows]
        return [-end[ev], L.TIE_RANK[kind[ev]], ev]

    order = sort_with_ties([lane[host], start[host]], tie_keys)
    hs = host[order]
    del order, host, tie_keys
    hlane = lane[hs]
    first = segment_starts(hlane)
    del hlane
    hstart = start[hs]
    hleaf = L.IS_LEAF_KIND[kind[hs]]
    parent_h, e_eff, clipped, rounds = nest(first, hstart, end[hs], hleaf)
    pop_h = extent(first, hstart, e_eff, hleaf)
    del first, hleaf, hstart
    end[hs] = e_eff
    del e_eff
    flags[hs[clipped]] |= FLAG_REPAIRED
    n_clipped = int(clipped.sum())
    del clipped
    h = len(hs)

    lap("nest")
    # ---- 3. GPU activity → launching host call by (process, corr_id) -----------------------------
    corr = _ints("corr_id", narrow=True)
    bound_pos = _bind(hs, gpu_ev, kind, lane, corr, proc_of_lane, nr_of_lane)
    bound = bound_pos >= 0
    flags[gpu_ev[~bound]] |= FLAG_UNBOUND
    kinds_g = kind[gpu_ev]
    km = L.IS_GPU_KIND[kinds_g]
    n_km, n_km_bound = int(km.sum()), int((km & bound).sum())
    del kinds_g, km
    del bound

    lap("bind")
    # ---- layout: depth-first preorder ---------------------------------------------------------
    lay = preorder(pop_h, parent_h, layer[hs] == L.STEP, bound_pos, lane[gpu_ev], start[gpu_ev])
    del pop_h, parent_h, bound_pos
    gpu_ev = gpu_ev[lay["order"]]
    m = h + len(gpu_ev)
    fin_in = np.empty(m, dtype=it)
    par_fin = np.empty(m, dtype=it)
    depth = np.empty(m, dtype=np.int32)
    size = np.ones(m, dtype=it)
    step = np.empty(m, dtype=it)
    hpos, gpos = lay["hpos"], lay["gpos"]
    fin_in[hpos], fin_in[gpos] = hs, gpu_ev
    par_fin[hpos], par_fin[gpos] = lay["hparent"], lay["gparent"]
    depth[hpos], depth[gpos] = lay["hdepth"], lay["gdepth"]
    size[hpos] = lay["hsize"]
    step[hpos], step[gpos] = lay["hstep"], lay["gstep"]
    del lay, hpos, gpos, hs, gpu_ev

    lap("layout")
    # ---- remaining payload columns ------------------------------------------------------------
    graph = _ints("graph_id", narrow=True)
    nbytes = _ints("bytes", narrow=True)
    args = None if _ints.all_null("args") else _column(rd, "args")
    if args is not None and not pa.types.is_string(args.type):
        args = args.cast(pa.string())

    # ---- COMM: describe nodes (fills bytes), match across ranks -----------------------------------
    layer_fin = layer[fin_in]
    comm_ids = np.flatnonzero(layer_fin == L.COMM)
    comm_ev = fin_in[comm_ids]
    desc = describe(
        rules.names.take(pa.array(name[comm_ev])) if comm_ev.size else pa.array([], pa.string()),
        args.take(pa.array(comm_ev)) if comm_ev.size and args is not None else pa.nulls(len(comm_ev), pa.string()),
        _RANGE_LIKE[kind[comm_ev]],
        nbytes[comm_ev].astype(np.int64),
    )
    if nbytes.dtype != np.int64 and len(comm_ev) and desc["bytes"].max() >= 2**31:
        nbytes = nbytes.astype(np.int64)
    nbytes[comm_ev] = desc["bytes"]
    source = np.where(_RANGE_LIKE[kind[comm_ev]], 0, np.where(L.IS_GPU_KIND[kind[comm_ev]], 1, 2))
    edges = comm_edges(comm_ids, lane_rank[lane[comm_ev]], start[comm_ev], source, desc)

    lap("comm")
    # ---- steps and requests -------------------------------------------------------------------
    step_ids = np.flatnonzero(layer_fin == L.STEP)
    sev = fin_in[step_ids]
    # step_ev (ascending input indices) → position of each STEP event's input name
    pos_in = np.searchsorted(step_ev, sev)
    sname_in = step_name_in[pos_in]
    sl = lane[sev]
    steps, requests = steps_tables(
        {
            "step_id": step_ids,
            "step_num": rules.step_num[sname_in],
            "node": lane_node[sl],
            "rank": lane_rank[sl],
            "pid": lane_pid[sl],
            "tid": lane_tid[sl],
            "start_ns": start[sev],
            "end_ns": end[sev],
            "name": rules.names.take(pa.array(name[sev])) if sev.size else pa.array([], pa.string()),
            "size": size[step_ids],
            "reqs": rules.reqs.take(pa.array(sname_in)) if sev.size else pa.array([], pa.string()),
        }
    )

    lap("steps")
    # ---- write the forest in row chunks --------------------------------------------------------
    lane_node, lane_rank, lane_dev = (x.astype(np.int32) for x in (lane_node, lane_rank, lane_dev))
    lane_pid, lane_tid, lane_stream = (x.astype(np.int64) for x in (lane_pid, lane_tid, lane_stream))
    layer_dict = pa.array(LAYERS)
    kind_dict = pa.array(KINDS)
    names = rules.names

    def used_names(codes: np.ndarray) -> pa.DictionaryArray:
        """The chunk's names with a dictionary of the entries it uses: Parquet stores the
        dictionary once per row group, and unique STEP/COMM messages make the full one large."""
        used = np.zeros(len(names), dtype=bool)
        used[codes] = True
        sub = np.flatnonzero(used)
        remap = np.zeros(len(names), dtype=np.int32)
        remap[sub] = np.arange(len(sub), dtype=np.int32)
        return pa.DictionaryArray.from_arrays(pa.array(remap[codes]), names.take(pa.array(sub)))

    def chunk(a: int, b: int) -> list[pa.Array]:
        ii = fin_in[a:b]
        ln = lane[ii]
        return [
            pa.array(np.arange(a, b, dtype=np.int64)),
            pa.array(par_fin[a:b].astype(np.int64)),
            pa.DictionaryArray.from_arrays(pa.array(layer_fin[a:b]), layer_dict),
            used_names(name[ii]),
            pa.array(start[ii]),
            pa.array(end[ii]),
            pa.array(lane_node[ln]),
            pa.array(lane_rank[ln]),
            pa.array(lane_pid[ln]),
            pa.array(lane_tid[ln]),
            pa.array(lane_dev[ln]),
            pa.array(lane_stream[ln]),
            pa.array(corr[ii].astype(np.int64)),
            pa.array(step[a:b].astype(np.int64)),
            pa.array(flags[ii]),
            pa.array(depth[a:b].astype(np.int32)),
            pa.array(size[a:b].astype(np.int64)),
            pa.DictionaryArray.from_arrays(pa.array(kind[ii]), kind_dict),
            pa.array(graph[ii].astype(np.int64)),
            pa.array(nbytes[ii].astype(np.int64)),
            args.take(pa.array(ii)) if args is not None else pa.nulls(b - a, pa.string()),
        ]

    _write_chunks(rd, "forest", FOREST_SCHEMA, m, chunk)
    rd.write_table(steps, "steps")
    rd.write_table(requests, "requests")
    rd.write_table(edges, "comm_edges")

    lap("write")
    # ---- summary ------------------------------------------------------------------------------
    node_flags = flags[fin_in]
    layer_counts = np.bincount(layer_fin, minlength=len(LAYERS))
    n_dropped = len(pr.pops_unmatched)
    summary: dict[str, Any] = {
        "events_in": int(n),
        "nodes": int(m),
        "pops_consumed": int(pr.pops_consumed),
        "repaired_pops_without_push": int(n_dropped),
        "reconciled": bool(n == m + pr.pops_consumed + n_dropped and n_pops == pr.pops_consumed + n_dropped),
        "truncated": int(((node_flags & FLAG_TRUNCATED) != 0).sum()),
        "repaired": int(((node_flags & FLAG_REPAIRED) != 0).sum()),
        "repaired_negative_duration": neg_repaired,
        "repaired_partial_overlap": n_clipped,
        "unbound": int(((node_flags & FLAG_UNBOUND) != 0).sum()),
        "duplicate": int(((node_flags & FLAG_DUPLICATE) != 0).sum()),
        "gpu_activity": n_km,
        "gpu_bound": n_km_bound,
        "binding_coverage": round(n_km_bound / n_km, 6) if n_km else None,
        "steps": int(steps.num_rows),
        "requests": len(pc.unique(requests.column("request_id"))),
        "request_step_pairs": int(requests.num_rows),
        "comm_nodes": int(len(comm_ids)),
        "comm_edges": int(edges.num_rows),
        "threads": int(n_lanes),
        "nesting_rounds": int(rounds),
        "max_depth": int(depth.max(initial=-1)) if m else 0,
        "layers": {lay: int(c) for lay, c in zip(LAYERS, layer_counts, strict=True)},
        "flags": {FLAG_NAMES[b]: int(((node_flags & b) != 0).sum()) for b in FLAG_NAMES},
        "seconds": round(time.perf_counter() - t0, 3),
        "cpu_seconds": round(time.process_time() - c0, 3),
        "timings": timings,
    }
    (rd.path / "reconstruct.json").write_text(json.dumps(summary, indent=2))
    return summary
