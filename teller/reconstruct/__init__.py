"""Cross-layer reconstruction (docs/design.md §5): events → call forest, steps,
requests, comm edges.

``reconstruct(RUN)`` reads ``RUN/events/*.parquet`` and writes

- ``forest.parquet``: one row per node, in depth-first preorder (a parent before its children,
  every subtree a contiguous block ``[node_id, node_id + size)``; see :mod:`.forest` for the
  order of roots and siblings). Columns: node_id, parent_id (-1 root), layer, name, start_ns,
  end_ns, node, rank, pid, tid, device, stream, corr_id, step_id (innermost enclosing STEP, -1
  none; GPU nodes take their launching call's), step_idx (the row's step in ``steps.parquet``,
  -1 none), flags, depth, size, kind, graph_id, bytes, args.
- ``steps.parquet`` (the steps of the first rule that applies: STEP ranges, profiler steps or
  fixed windows; :func:`.steps.decide_steps`), ``requests.parquet`` (:mod:`.steps`),
  ``comm_edges.parquet`` (:mod:`.comm`),
- ``reconstruct.json``: the returned summary: ``events_in``, ``nodes``, ``pops_consumed``,
  ``repaired_pops_without_push`` and ``reconciled`` (events in = nodes + pops consumed + pops
  without a push); flag counts (``truncated``, ``repaired`` with its causes, ``unbound``,
  ``duplicate``); ``gpu_activity``/``gpu_bound``/``binding_coverage`` (share of kernel, memcpy and
  memset nodes bound to a host call); ``steps``, ``steps_rule``, ``steps_detail``, ``requests``,
  ``comm_edges``; per-layer counts; CPU seconds per phase (``timings``).

The phases (load, pair, layers, nest, bind, preorder, comm, steps, write) are the functions below,
in that order, each documented as a paragraph of docs/design.md. Every step is a vectorized
numpy/Arrow pass; Python loops run over threads, files and row groups, pointer-jumping rounds and
output chunks only.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.errors import TellerError
from teller.forest import FOREST_SCHEMA, warmup_steps
from teller.reconstruct import layers as L
from teller.reconstruct._np import factorize, index_dtype, pack, segment_starts, sort_with_ties
from teller.reconstruct.clocks import Clocks, check_clocks
from teller.reconstruct.comm import comm_edges, describe
from teller.reconstruct.forest import extent, join, nest, preorder
from teller.reconstruct.iterations import (
    GAP_MIN_NS,
    GAP_NAME,
    IDLE_NAME,
    ITERATION_RULES,
    ITERATIONS_SCHEMA,
    Roots,
    batch_fields,
    engine_iterations,
    gpu_busy,
)
from teller.reconstruct.ranges import pair
from teller.reconstruct.steps import (
    RULES,
    ForestRows,
    Steps,
    decide_steps,
    steps_tables,
    without_detail,
)
from teller.rundir import (
    EVENT_SCHEMA,
    FLAG_CLOCK_REPAIRED,
    FLAG_DUPLICATE,
    FLAG_NAMES,
    FLAG_REPAIRED,
    FLAG_TRUNCATED,
    FLAG_UNBOUND,
    KIND_CODE,
    KINDS,
    LAYER_CODE,
    LAYERS,
    OPTIONAL_EVENT_COLUMNS,
    RunDir,
    kind_codes,
    recording_state,
    unreadable_parquet,
)

__all__ = ["reconstruct"]

LANE_COLS = ("node", "rank", "pid", "tid", "device", "stream")
CHUNK_ROWS = 1 << 19
#: Parquet encodings of the forest: dictionary pages for the few-valued columns, delta encoding for
#: the near-monotone ones (node ids, times); measured 2x faster to write and smaller than defaults.
DICT_COLS = ["layer", "name", "kind", "node", "rank", "pid", "tid", "device", "stream", "flags", "depth"]
DELTA_COLS = ["node_id", "parent_id", "start_ns", "end_ns", "corr_id", "step_id", "step_idx", "size"]
#: Row-group min/max only where readers filter (string statistics alone cost a third of the write).
STATS_COLS = ["node_id", "parent_id", "step_id", "step_idx", "start_ns", "end_ns", "rank", "depth"]

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
        self.copies = rd.copied_event_files()
        for f in rd.event_files(skip_copies=True):
            try:
                self.files.append((f, pq.ParquetFile(f)))
            except (pa.ArrowInvalid, OSError) as e:
                raise TellerError(unreadable_parquet(f, e)) from e
        self.n = sum(pf.metadata.num_rows for _, pf in self.files)
        self.copied_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in self.copies)

    def _has(self, pf: pq.ParquetFile, f: Path, name: str) -> bool:
        """Whether file ``f`` has column ``name``; an optional one (layer, flags, args) may be
        absent and reads as its default, a required one is an error naming the file."""
        if name in pf.schema_arrow.names:
            return True
        if name in OPTIONAL_EVENT_COLUMNS:
            return False
        raise TellerError(f"{f}: not a canonical events file (missing column {name!r}); write it with teller.rundir.RunDir.write_events")

    def _row_group(self, f: Path, pf: pq.ParquetFile, g: int, name: str) -> pa.ChunkedArray:
        try:
            return pf.read_row_group(g, columns=[name]).column(0)
        except (pa.ArrowInvalid, OSError) as e:  # a corrupt page behind an intact footer
            raise TellerError(unreadable_parquet(f, e)) from e

    def _fits_int32(self, name: str) -> bool:
        """Row-group statistics say every value fits int32 (no statistics: assume not)."""
        for f, pf in self.files:
            if not self._has(pf, f, name):
                continue
            idx = pf.schema_arrow.get_field_index(name)
            for g in range(pf.metadata.num_row_groups):
                st = pf.metadata.row_group(g).column(idx).statistics
                if st is None or not st.has_min_max or st.min < -(2**31) or st.max >= 2**31:
                    return False
        return True

    def constant(self, name: str) -> int | None:
        """The single value of a column without nulls, when row-group statistics prove it."""
        vals = set()
        for f, pf in self.files:
            if not self._has(pf, f, name):
                vals.add(0 if name == "flags" else -1)
                continue
            idx = pf.schema_arrow.get_field_index(name)
            for g in range(pf.metadata.num_row_groups):
                st = pf.metadata.row_group(g).column(idx).statistics
                if st is None or not st.has_min_max or st.null_count or st.min != st.max:
                    return None
                vals.add(st.min)
        return vals.pop() if len(vals) == 1 else None

    def all_null(self, name: str) -> bool:
        """Row-group statistics say the column holds only nulls (e.g. ``args`` of NVTX events)."""
        for f, pf in self.files:
            if not self._has(pf, f, name):
                continue
            idx = pf.schema_arrow.get_field_index(name)
            for g in range(pf.metadata.num_row_groups):
                col = pf.metadata.row_group(g).column(idx)
                st = col.statistics
                if st is None or st.null_count is None or st.null_count != col.num_values:
                    return False
        return True

    def _string_chunks(self, f: Path, pf: pq.ParquetFile, name: str):
        """The chunks of a string column, row group by row group; an absent ``layer`` column
        reads as "" (decided by reconstruction)."""
        if not self._has(pf, f, name):
            yield pa.DictionaryArray.from_arrays(pa.array(np.zeros(pf.metadata.num_rows, np.int32)), pa.array([""]))
            return
        for g in range(pf.metadata.num_row_groups):
            yield from self._row_group(f, pf, g, name).chunks

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
            for ch in self._string_chunks(f, pf, name):
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
        present = [self._has(pf, f, name) for f, pf in self.files]
        typ = next((pf.schema_arrow.field(name).type for (_, pf), p in zip(self.files, present, strict=True) if p), EVENT_SCHEMA.field(name).type)
        small = pa.types.is_integer(typ) and typ.bit_width <= 32
        out = np.empty(self.n, dtype=np.int32 if small or (narrow and self._fits_int32(name)) else np.int64)
        pos = 0
        for (f, pf), p in zip(self.files, present, strict=True):
            if not p:  # an absent optional column: its default (flags 0)
                out[pos : pos + pf.metadata.num_rows] = 0 if name == "flags" else -1
                pos += pf.metadata.num_rows
                continue
            for g in range(pf.metadata.num_row_groups):
                for ch in self._row_group(f, pf, g, name).chunks:
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


class _PhaseClock:
    """CPU seconds per phase (wall time is noisy on shared machines)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.c0 = self._mark = time.process_time()
        self.timings: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.process_time()
        self.timings[phase] = round(now - self._mark, 3)
        self._mark = now


# ------------------------------------------------------------------------------------------------
# the phases, in order (docs/design.md §5). Each takes what earlier phases left and
# returns what later ones need; a field a later phase is the last to read is set to None there
# ("consumed"), so the big arrays are freed at the same points as in one long function.


@dataclass
class Events:
    """Input columns, one entry per event, and the thread lanes.

    The six wide thread columns (node, rank, pid, tid, device, stream) are coded once as an int32
    ``lane`` per event, with the lane's values in ``lane_*`` and its process (node, rank, pid) and
    (node, rank) codes. ``end`` and ``flags`` are repaired in place by :func:`pair_ranges` and
    :func:`nest_threads`; ``is_pop`` (set by pairing: pops make no node) is consumed by nesting."""

    rd: RunDir
    cols: _Numeric
    lane: np.ndarray
    lane_node: np.ndarray
    lane_rank: np.ndarray
    lane_pid: np.ndarray
    lane_tid: np.ndarray
    lane_dev: np.ndarray
    lane_stream: np.ndarray
    proc_of_lane: np.ndarray
    nr_of_lane: np.ndarray
    kind: np.ndarray
    start: np.ndarray
    end: np.ndarray
    flags: np.ndarray
    is_pop: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.kind)

    @property
    def it(self) -> type:
        return index_dtype(self.n)


def load_events(rd: RunDir) -> Events:
    """Read the event columns every phase needs (the rest are read where they are used).

    A run without ``events/`` is refused (it would reconstruct to nothing and say nothing),
    except a recording made with ``--collector none`` (logs only, by choice)."""
    if not rd.events_dir.is_dir():
        info = rd.read_info()
        if (info.collector or {}).get("resolved") != "none":
            what = ("the recording ended before its first flush" if info.source == "teller record"
                    else "the folder was moved or deleted")
            raise TellerError(f"{rd.events_dir}: missing, so the run holds no events ({what}?); restore the "
                              f"folder, or re-run `teller record -o {rd.path} -- CMD` / `teller ingest SRC -o {rd.path}`")
    cols = _Numeric(rd)
    lane, lanes = factorize([cols(c) for c in LANE_COLS])
    proc_of_lane, _ = factorize([lanes[0], lanes[1], lanes[2]])
    nr_of_lane, _ = factorize([lanes[0], lanes[1]])
    kind = kind_codes(rd.read_events(columns=["kind"]))
    if len(kind) != cols.n:
        raise TellerError(f"{rd.events_dir}: the event files changed while being read; run again")
    return Events(rd, cols, lane, *lanes, proc_of_lane, nr_of_lane, kind, cols("start_ns"), cols("end_ns"), cols("flags"))


@dataclass
class Paired:
    """Counts of the pairing phase (the pairs themselves are written into ``Events.end``)."""

    pops: int
    pops_consumed: int
    pops_without_push: int
    negative_repaired: int


def pair_ranges(ev: Events) -> Paired:
    """Pushes meet their pops (:func:`.ranges.pair`): a push's end becomes its pop's time; a push
    still open when its thread ends is closed at the thread's last event (FLAG_TRUNCATED); a push
    whose range id was pushed again is flagged FLAG_DUPLICATE; pops without a push are counted
    and dropped. Negative durations become instants (FLAG_REPAIRED, except markers)."""
    it, start, end, flags, lane = ev.it, ev.start, ev.end, ev.flags, ev.lane
    push = np.flatnonzero(ev.kind == _PUSH).astype(it)
    pop = np.flatnonzero(ev.kind == _POP).astype(it)
    ev.is_pop = np.zeros(ev.n, dtype=bool)
    ev.is_pop[pop] = True
    pr = pair(push, pop, lane, ev.proc_of_lane[lane], start, _range_ids(ev.cols))
    popped = pr.pop_of_push >= 0
    end[push[popped]] = start[pr.pop_of_push[popped]]
    open_push = push[~popped]
    if open_push.size:
        thread_end = np.full(len(ev.lane_tid), np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(thread_end, lane, np.maximum(start, end))
        end[open_push] = np.maximum(thread_end[lane[open_push]], start[open_push])
        flags[open_push] |= FLAG_TRUNCATED
    flags[push[pr.duplicate]] |= FLAG_DUPLICATE
    # negative durations (instants: markers are points, not repairs)
    bad = np.flatnonzero((end < start) & ~ev.is_pop)
    is_marker = ev.kind[bad] == KIND_CODE["MARKER"]
    flags[bad[~is_marker]] |= FLAG_REPAIRED
    end[bad] = start[bad]
    return Paired(len(pop), int(pr.pops_consumed), len(pr.pops_unmatched), int((~is_marker).sum()))


def _range_ids(cols: _Numeric) -> np.ndarray | None:
    return None if cols.constant("range_id") == -1 else cols("range_id")


@dataclass
class Named:
    """Layer and output name of every event, decided on the name dictionary (:mod:`.layers`)."""

    rules: L.NameRules
    layer: np.ndarray | None  # int8 code into LAYERS, per event (consumed by the preorder phase)
    name: np.ndarray  # int32 code into rules.names, per event
    step_ev: np.ndarray  # STEP events, ascending
    step_name_in: np.ndarray  # their input name codes (for step numbers and request lists)


def name_layers(ev: Events, step_patterns: list[str] | None) -> Named:
    """Tag words, step patterns and the reader's layer column give each event its layer and name
    (:func:`.layers.assign`); the STEP events are remembered for the step table."""
    name_in, name_dict = ev.cols.strings("name")
    rules = L.name_rules(name_dict, step_patterns)
    layer, name = L.assign(ev.kind, _input_layers(ev.cols), name_in, rules)
    step_ev = np.flatnonzero((layer == L.STEP) & ~ev.is_pop)
    return Named(rules, layer, name, step_ev, name_in[step_ev])


def _input_layers(cols: _Numeric) -> np.ndarray:
    codes, dictionary = cols.strings("layer")
    return L.layer_codes(dictionary)[codes]


@dataclass
class Nested:
    """Host events in thread order (``hs``; position i is host node i) with each one's parent
    position (-1 root) and ``stop`` (the position right after its subtree), and the GPU events."""

    hs: np.ndarray | None
    gpu_ev: np.ndarray | None
    parent: np.ndarray | None
    stop: np.ndarray | None
    clipped: int
    rounds: int


def nest_threads(ev: Events) -> Nested:
    """Host events (everything but GPU activity and pops) are sorted per thread by (start, end
    descending, kind rank, input order) and nested by :func:`.forest.nest`: the parent is the
    innermost open event; children sticking out of their parent are clipped to it (FLAG_REPAIRED)."""
    host, gpu_ev = _host_and_gpu(ev)
    hs = _thread_order(ev, host)
    del host  # before the nesting's own arrays
    first = segment_starts(ev.lane[hs])
    hstart = ev.start[hs]
    hleaf = L.IS_LEAF_KIND[ev.kind[hs]]
    parent, e_eff, clipped, rounds = nest(first, hstart, ev.end[hs], hleaf)
    stop = extent(first, hstart, e_eff, hleaf)
    ev.end[hs] = e_eff
    ev.flags[hs[clipped]] |= FLAG_REPAIRED
    return Nested(hs, gpu_ev, parent, stop, int(clipped.sum()), rounds)


def _host_and_gpu(ev: Events) -> tuple[np.ndarray, np.ndarray]:
    """Host events (neither GPU activity nor pops) and GPU events; consumes ``ev.is_pop``."""
    gpu = L.IS_GPU_KIND[ev.kind] | ((ev.kind == _SYNC) & (ev.lane_tid[ev.lane] < 0))
    host = np.flatnonzero(~gpu & ~ev.is_pop).astype(ev.it)
    ev.is_pop = None  # consumed
    return host, np.flatnonzero(gpu).astype(ev.it)


def _thread_order(ev: Events, host: np.ndarray) -> np.ndarray:
    end, kind = ev.end, ev.kind

    def tie_keys(rows: np.ndarray) -> list[np.ndarray]:
        e = host[rows]
        return [-end[e], L.TIE_RANK[kind[e]], e]

    return host[sort_with_ties([ev.lane[host], ev.start[host]], tie_keys)]


@dataclass
class Bound:
    """The launching host call of each GPU event (``launch``: a position in ``Nested.hs``, -1
    unbound), the correlation ids, and the binding counts of kernels, copies and sets."""

    corr: np.ndarray
    launch: np.ndarray | None
    gpu_activity: int
    gpu_bound: int


def bind_gpu(ev: Events, nested: Nested) -> Bound:
    """Kernels, copies, sets and GPU-side syncs bind to the runtime or driver call that launched
    them, by (process, corr_id), a runtime call before the driver call it issued; GPU rows whose
    process made no host call at all (a reader put the device number in ``pid``) get a second
    chance by (node, rank, corr_id). The rest are unbound roots (FLAG_UNBOUND). This is the only
    place where GPU activity meets its launch."""
    corr = ev.cols("corr_id", narrow=True)
    launch = _bind(nested.hs, nested.gpu_ev, ev.kind, ev.lane, corr, ev.proc_of_lane, ev.nr_of_lane)
    bound = launch >= 0
    ev.flags[nested.gpu_ev[~bound]] |= FLAG_UNBOUND
    km = L.IS_GPU_KIND[ev.kind[nested.gpu_ev]]
    return Bound(corr, launch, int(km.sum()), int((km & bound).sum()))


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


def check_thread_clocks(ev: Events, nested: Nested, bound: Bound) -> Clocks:
    """GPU work that starts before its launch call, and threads whose events lie outside the
    run (:mod:`.clocks`); a thread whose clock is clearly off (most of its pairs before launch)
    has its host events moved by the estimated offset, flagged FLAG_CLOCK_REPAIRED. A uniform
    shift per thread leaves its nesting and the binding (by correlation id) as they were."""
    hs, gpu_ev, launch = nested.hs, nested.gpu_ev, bound.launch
    nl = len(ev.lane_tid)
    ok = launch >= 0
    call = hs[launch[ok]]
    first = np.flatnonzero(segment_starts(ev.lane[hs])) if len(hs) else np.zeros(0, np.int64)
    lanes = ev.lane[hs[first]] if len(hs) else np.zeros(0, np.int64)
    lane_first = np.zeros(nl, np.int64)
    lane_last = np.zeros(nl, np.int64)
    is_host = np.zeros(nl, bool)
    if len(hs):
        lane_first[lanes] = ev.start[hs[first]]
        lane_last[lanes] = np.maximum.reduceat(ev.end[hs].astype(np.int64), first)
        is_host[lanes] = True
    info = ev.rd.read_info()
    span = None
    if isinstance(info.start_wall, (int, float)) and isinstance(info.end_wall, (int, float)) and info.source == "teller record":
        w = (info.end_wall - info.start_wall) * 1e9
        span = int(w) if np.isfinite(w) and 0 < w < 2**62 else None

    def lane_name(ln: int) -> str:
        rank = int(ev.lane_rank[ln])
        return f"pid {int(ev.lane_pid[ln])} thread {int(ev.lane_tid[ln])}" + (f" (rank {rank})" if rank > 0 else "")

    clk = check_clocks(ev.lane[call], ev.start[call], ev.start[gpu_ev[ok]], nl, lane_first, lane_last, is_host, span, lane_name)
    if clk.offset.any():
        moved = hs[clk.offset[ev.lane[hs]] != 0]
        shift = clk.offset[ev.lane[moved]]
        ev.start[moved] += shift.astype(ev.start.dtype)
        ev.end[moved] += shift.astype(ev.end.dtype)
        ev.flags[moved] |= FLAG_CLOCK_REPAIRED
        clk.report["repaired_rows"] = int(len(moved))
    else:
        clk.report["repaired_rows"] = 0
    return clk


@dataclass
class Layout:
    """The forest's rows in depth-first preorder: the input event of each row and, per row, its
    parent row, depth, subtree size, layer and innermost enclosing STEP (``step``, -1 none)."""

    event: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    size: np.ndarray
    step: np.ndarray
    layer: np.ndarray

    @property
    def m(self) -> int:
        return len(self.event)


def preorder_rows(ev: Events, named: Named, nested: Nested, bound: Bound) -> Layout:
    """Rows in depth-first preorder (:func:`.forest.preorder`): roots by thread, then start; a
    node's host children in start order, then the GPU activity it launched. Every subtree is the
    block ``[row, row + size)``; depth, size and the innermost STEP come from counting."""
    event, parent, depth, size, step = _place_rows(ev, named, nested, bound)
    layer, named.layer = named.layer[event], None  # consumed: rows carry their layer from here on
    return Layout(event, parent, depth, size, step, layer)


def _place_rows(ev: Events, named: Named, nested: Nested, bound: Bound) -> tuple[np.ndarray, ...]:
    """Per row: input event, parent row, depth, size, innermost STEP; consumes the nesting and
    binding arrays."""
    hs, gpu_ev = nested.hs, nested.gpu_ev
    lay = preorder(nested.stop, nested.parent, named.layer[hs] == L.STEP, bound.launch, ev.lane[gpu_ev], ev.start[gpu_ev])
    nested.hs = nested.gpu_ev = nested.parent = nested.stop = bound.launch = None  # consumed
    gpu_ev = gpu_ev[lay["order"]]
    m, it = len(hs) + len(gpu_ev), ev.it
    event = np.empty(m, dtype=it)
    parent = np.empty(m, dtype=it)
    depth = np.empty(m, dtype=np.int32)
    size = np.ones(m, dtype=it)
    step = np.empty(m, dtype=it)
    hpos, gpos = lay["hpos"], lay["gpos"]
    event[hpos], event[gpos] = hs, gpu_ev
    parent[hpos], parent[gpos] = lay["hparent"], lay["gparent"]
    depth[hpos], depth[gpos] = lay["hdepth"], lay["gdepth"]
    size[hpos] = lay["hsize"]
    step[hpos], step[gpos] = lay["hstep"], lay["gstep"]
    return event, parent, depth, size, step


@dataclass
class Payload:
    """The remaining per-event columns the forest carries (``bytes`` completed for COMM nodes),
    and the communication edges."""

    graph: np.ndarray
    nbytes: np.ndarray
    args: pa.Array | None
    comm_nodes: int
    edges: pa.Table


def match_comm(ev: Events, named: Named, lay: Layout) -> Payload:
    """COMM nodes are described from their names and args (collective, group, sequence number,
    bytes: :func:`.comm.describe`) and the same collective is matched across ranks
    (:func:`.comm.comm_edges`)."""
    cols, kind = ev.cols, ev.kind
    extra = ev.n - cols.n  # GAP rows (:func:`make_iterations`): no input event behind them
    graph = _pad(cols("graph_id", narrow=True), extra)
    nbytes = _pad(cols("bytes", narrow=True), extra)
    args = None if cols.all_null("args") else _column(ev.rd, "args")
    if args is not None and not pa.types.is_string(args.type):
        args = args.cast(pa.string())
    if args is not None and extra:
        args = pa.concat_arrays([args, pa.nulls(extra, pa.string())])
    comm_ids = np.flatnonzero(lay.layer == L.COMM)
    comm_ev = lay.event[comm_ids]
    desc = describe(
        named.rules.names.take(pa.array(named.name[comm_ev])) if comm_ev.size else pa.array([], pa.string()),
        args.take(pa.array(comm_ev)) if comm_ev.size and args is not None else pa.nulls(len(comm_ev), pa.string()),
        _RANGE_LIKE[kind[comm_ev]],
        nbytes[comm_ev].astype(np.int64),
    )
    if nbytes.dtype != np.int64 and len(comm_ev) and desc["bytes"].max() >= 2**31:
        nbytes = nbytes.astype(np.int64)
    nbytes[comm_ev] = desc["bytes"]
    source = np.where(_RANGE_LIKE[kind[comm_ev]], 0, np.where(L.IS_GPU_KIND[kind[comm_ev]], 1, 2))
    edges = comm_edges(comm_ids, ev.lane_rank[ev.lane[comm_ev]], ev.start[comm_ev], source, desc)
    return Payload(graph, nbytes, args, len(comm_ids), edges)


def _pad(x: np.ndarray, extra: int, fill: int = -1) -> np.ndarray:
    return np.concatenate([x, np.full(extra, fill, x.dtype)]) if extra else x


def make_steps(ev: Events, named: Named, lay: Layout, window_ns: int | None) -> tuple[Steps, pa.Table]:
    """The STEP ranges with their step numbers and request lists (:func:`.steps.steps_tables`:
    the request → step index), then the run's steps by the first rule that applies
    (:func:`.steps.decide_steps`: STEP ranges, profiler steps, fixed windows)."""
    rules = named.rules
    step_ids = np.flatnonzero(lay.layer == L.STEP)
    sev = lay.event[step_ids]
    # step_ev (ascending input indices) → position of each STEP event's input name
    sname_in = named.step_name_in[np.searchsorted(named.step_ev, sev)]
    sl = ev.lane[sev]
    step_ranges, requests = steps_tables(
        {
            "step_id": step_ids,
            "step_num": rules.step_num[sname_in],
            "node": ev.lane_node[sl],
            "rank": ev.lane_rank[sl],
            "pid": ev.lane_pid[sl],
            "tid": ev.lane_tid[sl],
            "start_ns": ev.start[sev],
            "end_ns": ev.end[sev],
            "name": rules.names.take(pa.array(named.name[sev])) if sev.size else pa.array([], pa.string()),
            "size": lay.size[step_ids],
            "reqs": rules.reqs.take(pa.array(sname_in)) if sev.size else pa.array([], pa.string()),
        }
    )
    rows = ForestRows(lay.parent, lay.size, lay.layer, lay.step, lay.event, ev.kind, named.name, rules.names, ev.start,
                      ev.end, ev.lane, ev.lane_node, ev.lane_rank, ev.lane_pid, ev.lane_tid, ev.lane_dev, ev.proc_of_lane)
    return decide_steps(rows, step_ranges, window_ns), requests


@dataclass
class Iters:
    """The iterations table (``iterations.parquet``) and its summary; ``gap_rows``: GAP rows added."""

    table: pa.Table
    gap_rows: int
    summary: dict[str, Any]


def make_iterations(ev: Events, named: Named, lay: Layout, bound: Bound, steps: Steps, requests: pa.Table) -> tuple[Iters, pa.Table]:
    """Engine iterations (:mod:`.iterations`): under the STEP-range rule each engine STEP's
    iteration is measured on its thread's root ranges, its untraced stretches of at least
    ``GAP_MIN_NS`` become GAP rows inserted into the preorder (after the root they follow, so
    every subtree stays a block), and the iteration's roots and GAP rows join its step. Other
    rules: the iteration is the step. Returns the table and ``requests`` with node ids moved."""
    st = steps.table
    n = st.num_rows
    srow = st.column("step_id").to_numpy().astype(np.int64)
    sstart, send = st.column("start_ns").to_numpy().astype(np.int64), st.column("end_ns").to_numpy().astype(np.int64)
    names = st.column("name").combine_chunks() if n else pa.array([], pa.string())
    engine = np.zeros(n, bool)
    if steps.rule == RULES[0] and n:
        engine = np.asarray(pc.starts_with(names.cast(pa.string()), "STEP ").fill_null(False).to_numpy(zero_copy_only=False), bool)
        engine &= lay.parent[srow] < 0
    roots = _host_roots(ev, named, lay) if engine.any() else Roots(*(np.zeros(0, np.int64) for _ in range(5)), np.zeros(0, bool))
    it = engine_iterations(roots, srow, engine, sstart, send)
    gap_rows = len(it.gap_after)
    if gap_rows or len(it.join_first):
        srow, requests = _insert_gaps(ev, named, lay, bound, steps, requests, it)
    cols = it.cols
    row_step = steps.step_idx(lay.step, 0)
    gpu = np.flatnonzero(L.IS_GPU_KIND[ev.kind[lay.event]])
    gev = lay.event[gpu]
    batch = batch_fields(names)
    table = pa.table({
        "step_id": srow, "step_idx": np.arange(n, dtype=np.int64),
        "pid": st.column("pid"), "tid": st.column("tid"), "rank": st.column("rank"),
        "start_ns": cols["start_ns"], "end_ns": cols["end_ns"], "dur_ns": cols["dur_ns"], "step_ns": send - sstart,
        "schedule_ns": cols["schedule_ns"], "post_ns": cols["post_ns"], "gap_ns": cols["gap_ns"],
        "host_busy_ns": cols["host_busy_ns"], "gpu_busy_ns": gpu_busy(row_step[gpu], ev.start[gev], ev.end[gev], n),
        "n_requests": st.column("n_requests"), **batch, "warmup": warmup_steps(st),
        "rule": pa.array(np.where(engine, ITERATION_RULES[0], ITERATION_RULES[1]).tolist(), pa.string()),
    }).select(ITERATIONS_SCHEMA.names).cast(ITERATIONS_SCHEMA)
    gap = cols["gap_ns"][engine]
    summary = {
        "count": n,
        "rules": {r: int(c) for r, c in zip(ITERATION_RULES, [int(engine.sum()), int(n - engine.sum())], strict=True) if c},
        "gap_ns_total": int(gap.sum()),
        "gap_ns_median": float(np.median(gap)) if gap.size else None,
        "gap_rows": gap_rows,
        "gap_min_ns": GAP_MIN_NS,
        "batch_fields": sorted(k for k, v in batch.items() if (v >= 0).any()),
    }
    return Iters(table, gap_rows, summary), requests


def _host_roots(ev: Events, named: Named, lay: Layout) -> Roots:
    """Host roots of the forest by thread lane, then start (GPU rows left out)."""
    rows = np.flatnonzero(lay.parent < 0)
    e = lay.event[rows]
    k = ev.kind[e]
    host = ~(L.IS_GPU_KIND[k] | ((k == _SYNC) & (ev.lane_tid[ev.lane[e]] < 0)))
    rows, e = rows[host], e[host]
    lane = ev.lane[e]
    order = np.lexsort((ev.start[e], lane))
    rows, e, lane = rows[order].astype(np.int64), e[order], lane[order]
    idle_codes = np.flatnonzero(pc.equal(named.rules.names, IDLE_NAME).fill_null(False).to_numpy(zero_copy_only=False))
    layer = lay.layer[rows]
    idle = (layer == L.OTHER) & np.isin(named.name[e], idle_codes)
    return Roots(rows, lane.astype(np.int64), ev.start[e].astype(np.int64), ev.end[e].astype(np.int64), layer, idle)


def _insert_gaps(ev: Events, named: Named, lay: Layout, bound: Bound, steps: Steps, requests: pa.Table, it) -> tuple[np.ndarray, pa.Table]:
    """Insert the GAP rows of ``it`` into the layout (each right after the block of the root it
    follows), give them input events of their own (appended to ``ev``), move every node id
    that later rows or tables hold, and join the iteration's roots and GAP rows to its step."""
    k = len(it.gap_after)
    q = (it.gap_after + lay.size[it.gap_after]).astype(np.int64)  # insert before old row q
    order = np.argsort(q, kind="stable")
    q = q[order]
    m = lay.m

    def moved(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.int64)
        return np.where(x >= 0, x + np.searchsorted(q, x, side="right"), x)

    # GAP rows' input events, appended after the real ones
    n0 = ev.n
    gev = np.arange(n0, n0 + k)
    ev.kind = _pad(ev.kind, k, KIND_CODE["RANGE"])
    ev.start = np.concatenate([ev.start, it.gap_start[order].astype(ev.start.dtype)])
    ev.end = np.concatenate([ev.end, it.gap_end[order].astype(ev.end.dtype)])
    ev.flags = _pad(ev.flags, k, 0)
    ev.lane = np.concatenate([ev.lane, it.gap_lane[order].astype(ev.lane.dtype)])
    if k:
        have = np.flatnonzero(pc.equal(named.rules.names, GAP_NAME).fill_null(False).to_numpy(zero_copy_only=False))
        if have.size:
            code = int(have[0])
        else:
            code = len(named.rules.names)
            named.rules.names = pa.concat_arrays([named.rules.names, pa.array([GAP_NAME], pa.string())])
        named.name = _pad(named.name, k, code)
    bound.corr = _pad(bound.corr, k)
    # the layout with the GAP rows in place
    old_pos = np.arange(m, dtype=np.int64) + np.searchsorted(q, np.arange(m), side="right")
    gpos = q + np.arange(k)
    itype = index_dtype(m + k + n0 + k)

    def spread(x: np.ndarray, fill, dtype=None) -> np.ndarray:
        out = np.empty(m + k, dtype=dtype or x.dtype)
        out[old_pos] = x
        out[gpos] = fill
        return out

    lay.event = spread(lay.event.astype(itype), gev)
    lay.parent = spread(moved(lay.parent).astype(itype), -1)
    lay.depth = spread(lay.depth, 0)
    lay.size = spread(lay.size, 1)
    lay.step = spread(moved(lay.step).astype(itype), -1)
    lay.layer = spread(lay.layer, LAYER_CODE["GAP"])
    srow = moved(steps.table.column("step_id").to_numpy())
    steps.table = steps.table.set_column(steps.table.schema.get_field_index("step_id"), "step_id", pa.array(srow, pa.int64()))
    if requests.num_rows:
        rq = moved(requests.column("step_id").to_numpy())
        requests = requests.set_column(requests.schema.get_field_index("step_id"), "step_id", pa.array(rq, pa.int64()))
    # joined blocks: the old ones (moved) except roots the iterations claim, then the iterations'
    first, stop, idx = steps.joined
    first_m, stop_m = moved(first), moved(np.asarray(stop) - 1) + 1
    jf = moved(it.join_first)
    keep = ~np.isin(first_m, jf)
    first = np.concatenate([first_m[keep], jf, gpos])
    stop = np.concatenate([stop_m[keep], jf + lay.size[jf].astype(np.int64), gpos + 1])
    idx = np.concatenate([np.asarray(idx, np.int64)[keep], it.join_step, it.gap_step[order]])
    o = np.argsort(first, kind="stable")
    steps.joined = (first[o], stop[o], idx[o])
    return srow, requests


def write_forest(ev: Events, named: Named, lay: Layout, bound: Bound, pay: Payload, steps: Steps) -> Path:
    """``forest.parquet`` in row chunks of ``CHUNK_ROWS`` (bounded memory), each chunk's names with
    a dictionary of only the entries it uses."""
    lane, kind, start, end, flags, name, corr = ev.lane, ev.kind, ev.start, ev.end, ev.flags, named.name, bound.corr
    lane_node, lane_rank, lane_dev = (x.astype(np.int32) for x in (ev.lane_node, ev.lane_rank, ev.lane_dev))
    lane_pid, lane_tid, lane_stream = (x.astype(np.int64) for x in (ev.lane_pid, ev.lane_tid, ev.lane_stream))
    layer_dict = pa.array(LAYERS)
    kind_dict = pa.array(KINDS)
    names = named.rules.names
    fin_in, layer_fin, par_fin, depth, size, step = lay.event, lay.layer, lay.parent, lay.depth, lay.size, lay.step
    graph, nbytes, args = pay.graph, pay.nbytes, pay.args

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
        cols = {
            "node_id": pa.array(np.arange(a, b, dtype=np.int64)),
            "parent_id": pa.array(par_fin[a:b].astype(np.int64)),
            "layer": pa.DictionaryArray.from_arrays(pa.array(layer_fin[a:b]), layer_dict),
            "name": used_names(name[ii]),
            "start_ns": pa.array(start[ii]),
            "end_ns": pa.array(end[ii]),
            "node": pa.array(lane_node[ln]),
            "rank": pa.array(lane_rank[ln]),
            "pid": pa.array(lane_pid[ln]),
            "tid": pa.array(lane_tid[ln]),
            "device": pa.array(lane_dev[ln]),
            "stream": pa.array(lane_stream[ln]),
            "corr_id": pa.array(corr[ii].astype(np.int64)),
            "step_id": pa.array(step[a:b].astype(np.int64)),
            "step_idx": pa.array(steps.step_idx(step[a:b], a)),
            "flags": pa.array(flags[ii]),
            "depth": pa.array(depth[a:b].astype(np.int32)),
            "size": pa.array(size[a:b].astype(np.int64)),
            "kind": pa.DictionaryArray.from_arrays(pa.array(kind[ii]), kind_dict),
            "graph_id": pa.array(graph[ii].astype(np.int64)),
            "bytes": pa.array(nbytes[ii].astype(np.int64)),
            "args": args.take(pa.array(ii)) if args is not None else pa.nulls(b - a, pa.string()),
        }
        return [cols[c] for c in FOREST_SCHEMA.names]

    return _write_chunks(ev.rd, "forest", FOREST_SCHEMA, lay.m, chunk)


def reconstruct(run: str | os.PathLike, step_patterns: list[str] | None = None, window_ns: int | None = None) -> dict[str, Any]:
    """Rebuild the call forest of ``run`` and write its tables; returns the summary dict.

    ``step_patterns``: extra regexes naming STEP ranges (:func:`.layers.name_rules`);
    ``window_ns``: the window of the fixed-window step rule (:func:`.steps.decide_steps`)."""
    clock = _PhaseClock()
    rd = RunDir(run).require()
    ev = load_events(rd)
    clock.lap("load")
    paired = pair_ranges(ev)
    clock.lap("pair")
    named = name_layers(ev, step_patterns)
    clock.lap("layers")
    nested = nest_threads(ev)
    clock.lap("nest")
    bound = bind_gpu(ev, nested)
    clock.lap("bind")
    clocks = check_thread_clocks(ev, nested, bound)
    clock.lap("clocks")
    lay = preorder_rows(ev, named, nested, bound)
    clock.lap("preorder")
    steps, requests = make_steps(ev, named, lay, window_ns)
    clock.lap("steps")
    iters, requests = make_iterations(ev, named, lay, bound, steps, requests)
    clock.lap("iterations")
    pay = match_comm(ev, named, lay)
    clock.lap("comm")
    write_forest(ev, named, lay, bound, pay, steps)
    rd.write_table(steps.table, "steps")
    rd.write_table(iters.table, "iterations")
    rd.write_table(requests, "requests")
    rd.write_table(pay.edges, "comm_edges")
    clock.lap("write")
    summary = _summary(ev, paired, nested, bound, lay, pay, steps, requests, iters, clocks, clock)
    (rd.path / "reconstruct.json").write_text(json.dumps(summary, indent=2))
    return summary


def _summary(ev: Events, paired: Paired, nested: Nested, bound: Bound, lay: Layout, pay: Payload, steps: Steps,
             requests: pa.Table, iters: Iters, clocks: Clocks, clock: _PhaseClock) -> dict[str, Any]:
    """``reconstruct.json``: counts that reconcile, repairs, binding coverage, steps, iterations,
    timings. ``nodes`` counts the GAP rows (``gap_nodes``), ``events_in`` only the input."""
    n, m = ev.n - iters.gap_rows, lay.m
    node_flags = ev.flags[lay.event]
    layer_counts = np.bincount(lay.layer, minlength=len(LAYERS))
    n_km, n_bound = bound.gpu_activity, bound.gpu_bound
    return {
        "events_in": int(n),
        "nodes": int(m),
        "copied_event_files": {f.name: o.name for f, o in ev.cols.copies.items()},
        "dropped_copied_events": int(ev.cols.copied_rows),
        "pops_consumed": paired.pops_consumed,
        "repaired_pops_without_push": paired.pops_without_push,
        "gap_nodes": iters.gap_rows,
        "reconciled": bool(n == m - iters.gap_rows + paired.pops_consumed + paired.pops_without_push
                           and paired.pops == paired.pops_consumed + paired.pops_without_push),
        "truncated": int(((node_flags & FLAG_TRUNCATED) != 0).sum()),
        "repaired": int(((node_flags & FLAG_REPAIRED) != 0).sum()),
        "repaired_negative_duration": paired.negative_repaired,
        "repaired_partial_overlap": nested.clipped,
        "unbound": int(((node_flags & FLAG_UNBOUND) != 0).sum()),
        "duplicate": int(((node_flags & FLAG_DUPLICATE) != 0).sum()),
        "gpu_activity": n_km,
        "gpu_bound": n_bound,
        "binding_coverage": round(n_bound / n_km, 6) if n_km else None,
        "steps": int(steps.table.num_rows),
        "steps_rule": steps.rule,
        "steps_detail": steps.detail,
        "steps_without_detail": int(without_detail(steps.table.column("name")).sum()) if steps.table.num_rows else 0,
        "requests": len(pc.unique(requests.column("request_id"))),
        "request_step_pairs": int(requests.num_rows),
        "iterations": iters.summary,
        "comm_nodes": pay.comm_nodes,
        "comm_edges": int(pay.edges.num_rows),
        "threads": int(len(ev.lane_tid)),
        "nesting_rounds": int(nested.rounds),
        "max_depth": int(lay.depth.max(initial=-1)) if m else 0,
        "layers": {name: int(c) for name, c in zip(LAYERS, layer_counts, strict=True)},
        "flags": {FLAG_NAMES[b]: int(((node_flags & b) != 0).sum()) for b in FLAG_NAMES},
        "clocks": clocks.report,
        "recording": (rec := recording_state(ev.rd)),
        "warnings": rec["words"] + _warnings(ev, clocks),
        "seconds": round(time.perf_counter() - clock.t0, 3),
        "cpu_seconds": round(time.process_time() - clock.c0, 3),
        "timings": clock.timings,
    }


def _warnings(ev: Events, clocks: Clocks) -> list[str]:
    """What reconstruction found wrong with the input, in words (reconstruct.json ``warnings``)."""
    out = []
    for f, o in ev.cols.copies.items():
        out.append(f"{f.name} holds exactly the events of {o.name} (a copied chunk): left out, "
                   f"{pq.ParquetFile(f).metadata.num_rows:,} events not counted twice")
    return out + clocks.words
