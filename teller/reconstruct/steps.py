"""Steps (docs/design.md §5.5): STEP rows, the request → step index, and
the rule that decides which rows form a step.

A STEP node's message names its step number and request set Q(s) (``STEP id=12 reqs=req_0,req_3``).
The per-request tree C_q(s) is not copied: ``requests.parquet`` maps (request, step) to the
step's node id, and because the forest is a depth-first preorder the step's whole subtree is the
contiguous block of forest rows ``[step_id, step_id + size)`` (``size`` is in ``steps.parquet``).

Runs without STEP ranges still have steps: :func:`decide_steps` takes the first rule that applies
(STEP ranges, profiler steps, fixed windows), writes it into ``steps.parquet`` (``rule``) and gives
every forest row its step (``step_idx``), so every later stage reads the same steps.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.forest import gpu_rows
from teller.reconstruct.forest import innermost
from teller.rundir import IS_GPU_KIND, KIND_CODE, LAYER_CODE

STEPS_SCHEMA = pa.schema(
    [
        ("step_id", pa.int64()),
        ("step_num", pa.int64()),
        ("node", pa.int32()),
        ("rank", pa.int32()),
        ("pid", pa.int64()),
        ("tid", pa.int64()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("name", pa.string()),
        ("n_requests", pa.int32()),
        ("size", pa.int64()),
    ]
)

REQUESTS_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("step_id", pa.int64()),
        ("rank", pa.int32()),
        ("step_num", pa.int64()),
    ]
)


def split_requests(reqs: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Explode comma-separated request lists: (row index, request id), empty ids and repeats dropped."""
    lists = pc.split_pattern(pc.fill_null(reqs.cast(pa.string()), ""), ",")
    values = pc.utf8_trim_whitespace(pc.list_flatten(lists))
    rows = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    keep = pc.not_equal(values, "").to_numpy(zero_copy_only=False)
    rows, values = rows[keep], values.filter(pa.array(keep))
    if len(rows):
        t = pa.table({"row": rows, "req": values}).group_by(["row", "req"], use_threads=False).aggregate([])
        t = t.sort_by([("row", "ascending"), ("req", "ascending")])
        rows, values = t.column("row").to_numpy(), t.column("req").combine_chunks()
    return rows, values


def steps_tables(cols: dict[str, object]) -> tuple[pa.Table, pa.Table]:
    """Build ``steps`` and ``requests`` tables from per-STEP arrays (``cols`` keyed like STEPS_SCHEMA
    plus ``reqs``: the request-list text of each step, null when the message names none)."""
    rows, req_ids = split_requests(cols.pop("reqs"))
    n_req = np.bincount(rows, minlength=len(cols["step_id"])).astype(np.int32)
    steps = pa.table({**cols, "n_requests": n_req}).select(STEPS_SCHEMA.names).cast(STEPS_SCHEMA)
    requests = pa.table(
        {
            "request_id": req_ids,
            "step_id": np.asarray(cols["step_id"])[rows],
            "rank": np.asarray(cols["rank"])[rows],
            "step_num": np.asarray(cols["step_num"])[rows],
        }
    ).cast(REQUESTS_SCHEMA)
    return steps, requests


# ------------------------------------------------------------------------------------------------
# which rows form a step: the rule (docs/design.md §5.5)

#: Layers whose nodes are operator instances (a rule under which none falls in a step gives way).
INSTANCE_LAYERS = ("FE", "BE", "COMM")
#: Used instead when a run has no FE/BE/COMM node at all (e.g. a CUDA-only trace).
FALLBACK_LAYERS = ("RT", "DRV")
#: Host ranges that mark profiler steps in foreign traces (rule 2).
PROFILER_STEP_RE = r"(?i)^\s*(?:profilerstep\s*#\s*|step\s*[:#_=\s]\s*)(\d+)\s*$"
#: Default length of a fixed window (rule 3); runs shorter than ten windows get a tenth of their span.
DEFAULT_WINDOW_NS = 100_000_000
#: The rules, in the order they are tried (``steps.parquet``'s ``rule`` column).
RULES = ("STEP ranges", "profiler steps", "fixed windows")
#: the word a STEP message ends with when its step was recorded without detail (no BE ranges, no
#: GPU activity: ``teller record --detail-every``, teller.record.runtime.DetailGate)
NOT_DETAILED_RE = r"(?:^|\s)detail=0(?:\s|$)"
#: the family of the range the recording runtime puts around a switch of its collector between
#: detail windows (TELLER's own time: the iteration holding it is left out of time features)
SWITCH_FAMILY = "OTHER detail_switch"


def without_detail(names: pa.Array | pa.ChunkedArray | list[str]) -> np.ndarray:
    """Per step name: recorded without detail (its STEP message carries ``detail=0``)."""
    arr = names if isinstance(names, (pa.Array, pa.ChunkedArray)) else pa.array(list(names), pa.string())
    if not len(arr):
        return np.zeros(0, bool)
    hit = pc.match_substring_regex(pc.fill_null(arr.cast(pa.string()), ""), NOT_DETAILED_RE)
    return np.asarray(hit.to_numpy(zero_copy_only=False), bool)

STEP_RULE_COLUMNS = [("step_idx", pa.int64()), ("rule", pa.string())]
#: ``steps.parquet``: the STEP-range columns, then the step's index and the rule that made it.
STEPS_FILE_SCHEMA = pa.schema(list(STEPS_SCHEMA) + [pa.field(n, t) for n, t in STEP_RULE_COLUMNS])


@dataclass
class ForestRows:
    """The forest as reconstruct holds it before writing: per row (preorder) its parent row,
    subtree size, layer and innermost STEP (``step_id``), and the input event (``event``) whose
    columns (``kind``, ``name``, ``start``, ``end``, ``lane``: one entry per input event) and
    thread lane (per-lane ``lane_*`` arrays, ``proc_of_lane``) describe it."""

    parent: np.ndarray
    size: np.ndarray
    layer: np.ndarray
    step_id: np.ndarray
    event: np.ndarray
    kind: np.ndarray
    name: np.ndarray
    names: pa.Array
    start: np.ndarray
    end: np.ndarray
    lane: np.ndarray
    lane_node: np.ndarray
    lane_rank: np.ndarray
    lane_pid: np.ndarray
    lane_tid: np.ndarray
    lane_dev: np.ndarray
    proc_of_lane: np.ndarray

    @property
    def n(self) -> int:
        return len(self.parent)

    def lanes_of(self, rows: np.ndarray) -> np.ndarray:
        return self.lane[self.event[rows]]

    def is_gpu(self, rows: np.ndarray) -> np.ndarray:
        """GPU rows among ``rows`` (:func:`teller.forest.gpu_rows`: the forest's rule)."""
        ln, k = self.lanes_of(rows), self.kind[self.event[rows]]
        return gpu_rows(IS_GPU_KIND[k], self.lane_tid[ln], self.lane_dev[ln], k == KIND_CODE["SYNC"])

    def names_of(self, rows: np.ndarray) -> pa.Array:
        return self.names.take(pa.array(self.name[self.event[rows]])) if len(rows) else pa.array([], pa.string())


@dataclass
class Steps:
    """The steps of a run: ``table`` (``steps.parquet``), the rule that made them and what it
    found, and the step index of every forest row (:meth:`step_idx`, -1 in no step).

    Under rule 1 a row's step follows from its ``step_id`` (the innermost STEP node), so no
    per-row array is kept: ``row_idx`` is None and the index is looked up per written chunk;
    ``joined`` lists the root blocks ``[first, stop)`` that joined a step by time, with the step."""

    table: pa.Table
    rule: str
    detail: str
    row_idx: np.ndarray | None = None
    joined: tuple[np.ndarray, np.ndarray, np.ndarray] = field(default_factory=lambda: (_EMPTY, _EMPTY, _EMPTY))

    @property
    def n(self) -> int:
        return self.table.num_rows

    def step_idx(self, step_id: np.ndarray, a: int = 0) -> np.ndarray:
        """Step index of the forest rows ``a, a + 1, ...`` whose ``step_id`` column is given."""
        if self.row_idx is not None:
            return self.row_idx[a : a + len(step_id)].astype(np.int64)
        return _paint(_index_of_steps(self.table.column("step_id").to_numpy(), step_id), self.joined, a)


_EMPTY = np.zeros(0, np.int64)


def _index_of_steps(srows: np.ndarray, step_id: np.ndarray) -> np.ndarray:
    """Index into ``srows`` (ascending node ids) of each ``step_id`` (-1 stays -1)."""
    out = np.searchsorted(srows, step_id).astype(np.int64)
    out[step_id < 0] = -1
    return out


def decide_steps(f: ForestRows, step_ranges: pa.Table, window_ns: int | None = None) -> Steps:
    """Group forest rows into steps by the first rule that applies:

    1. ``STEP ranges``: each STEP node with its subtree (``step_ranges``: the STEP-range table of
       :func:`steps_tables`, in row order);
    2. ``profiler steps``: host ranges named like a profiler step (:data:`PROFILER_STEP_RE`:
       ``ProfilerStep#N``, ``step:N``, ``step N``, ``step_N``), each with its subtree;
    3. ``fixed windows``: per rank, windows of ``window_ns`` (default :data:`DEFAULT_WINDOW_NS`, a
       tenth of runs shorter than a second) over the start times of root nodes; a root and its
       subtree go to the window its start falls in.

    Under rules 1 and 2 a root node of the same process that is in no step (another thread's work:
    a backward pass, a batching loop) joins the step running at its start, with its subtree. A
    rule under which no operator instance (an FE/BE/COMM node, else a host RT/DRV call) falls in a
    step gives way to the next. GPU rows are in their launching call's subtree, so they take its
    step.
    """
    inst = _InstanceRule(f)
    for rule in (lambda: _step_ranges(f, step_ranges), lambda: _profiler_steps(f)):  # tried lazily
        st = rule()
        if st is None:
            continue
        attached = _attach_by_time(f, st)
        if not inst.any or any(inst.in_blocks(a, b) for a, b in _blocks(f, st)):
            if attached:
                st.detail += f"; {attached} root node(s) of other threads joined the step running at their start"
            return st
    return _fixed_windows(f, window_ns)


_INSTANCE_CODES = [LAYER_CODE[x] for x in INSTANCE_LAYERS]
_FALLBACK_CODES = [LAYER_CODE[x] for x in FALLBACK_LAYERS]


def _in_layers(layer: np.ndarray, codes: list[int]) -> np.ndarray:
    m = layer == codes[0]
    for c in codes[1:]:
        m |= layer == c
    return m


class _InstanceRule:
    """Which rows are operator instances: FE/BE/COMM nodes, else (a run without any) host RT/DRV
    calls. Asked per block of rows, so a step that holds one is found without a pass over all."""

    def __init__(self, f: ForestRows):
        self.f = f
        self.fallback = not _in_layers(f.layer, _INSTANCE_CODES).any()
        self.codes = _FALLBACK_CODES if self.fallback else _INSTANCE_CODES
        self.any = bool(self.mask(0, f.n).any()) if self.fallback else True

    def mask(self, a: int, b: int) -> np.ndarray:
        m = _in_layers(self.f.layer[a:b], self.codes)
        if self.fallback and m.any():
            rows = np.flatnonzero(m) + a
            m[rows[self.f.is_gpu(rows)] - a] = False
        return m

    def in_blocks(self, first: np.ndarray, stop: np.ndarray, probe: int = 64) -> bool:
        """Whether an instance lies in any block ``[first, stop)``."""
        for a, b in zip(first[:probe].tolist(), stop[:probe].tolist(), strict=True):  # usually the first
            if self.mask(a, b).any():
                return True
        if len(first) <= probe:
            return False
        count = np.concatenate([[0], np.cumsum(self.mask(0, self.f.n), dtype=np.int64)])
        return bool((count[stop[probe:]] > count[first[probe:]]).any())


def _blocks(f: ForestRows, st: Steps) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The row blocks of the steps' nodes, then of the roots that joined them by time."""
    srows = st.table.column("step_id").combine_chunks().to_numpy().astype(np.int64)
    yield srows, srows + f.size[srows]
    yield st.joined[0], st.joined[1]


def _with_rule(cols: dict[str, Any], rule: str) -> pa.Table:
    n = len(cols["step_id"])
    cols = {**cols, "step_idx": np.arange(n, dtype=np.int64), "rule": pa.array([rule] * n, pa.string())}
    return pa.table(cols).select(STEPS_FILE_SCHEMA.names).cast(STEPS_FILE_SCHEMA)


def _step_ranges(f: ForestRows, step_ranges: pa.Table) -> Steps | None:
    """Rule 1: STEP nodes; a row's step is its innermost enclosing STEP (the ``step_id`` column)."""
    if not step_ranges.num_rows:
        return None
    cols = {c: step_ranges.column(c) for c in STEPS_SCHEMA.names}
    return Steps(_with_rule(cols, RULES[0]), RULES[0], f"{step_ranges.num_rows} STEP ranges")


def _profiler_steps(f: ForestRows) -> Steps | None:
    """Rule 2: host ranges named like profiler steps (the name dictionary is matched once)."""
    rx = re.compile(PROFILER_STEP_RE)
    nums = np.array([int(m.group(1)) if (m := rx.match(s or "")) else -1 for s in f.names.to_pylist()] or [-1], dtype=np.int64)
    if not (nums >= 0).any() or not f.n:
        return None
    rows = np.flatnonzero(nums[f.name[f.event]] >= 0)
    rows = rows[~f.is_gpu(rows)]
    if not rows.size:
        return None
    ev, ln = f.event[rows], f.lanes_of(rows)
    table = _with_rule({
        "step_id": rows.astype(np.int64), "step_num": nums[f.name[ev]], "node": f.lane_node[ln], "rank": f.lane_rank[ln],
        "pid": f.lane_pid[ln], "tid": f.lane_tid[ln], "start_ns": f.start[ev], "end_ns": f.end[ev], "name": f.names_of(rows),
        "n_requests": np.zeros(len(rows), np.int32), "size": f.size[rows].astype(np.int64),
    }, RULES[1])
    row_idx = innermost(rows, rows + f.size[rows], f.n)
    return Steps(table, RULES[1], f"{len(rows)} host ranges named like profiler steps (no STEP ranges)", row_idx)


def _attach_by_time(f: ForestRows, st: Steps) -> int:
    """Roots of a step's process that are in no step join the step running at their start (the
    last step of the process to start at or before it, if still open), with their subtrees: the
    blocks go into ``st.joined`` (and ``st.row_idx`` when there is one). Returns how many joined."""
    roots = np.flatnonzero(f.parent < 0)
    in_step = f.step_id[roots] >= 0 if st.row_idx is None else st.row_idx[roots] >= 0
    roots = roots[~in_step]
    roots = roots[~f.is_gpu(roots)]
    if not roots.size or not st.n:
        return 0
    srows = st.table.column("step_id").to_numpy()
    s_start, s_end = f.start[f.event[srows]], f.end[f.event[srows]]
    proc_s = f.proc_of_lane[f.lanes_of(srows)]
    proc_r = f.proc_of_lane[f.lanes_of(roots)]
    t = f.start[f.event[roots]]
    got = np.full(len(roots), -1, np.int64)
    for p in np.unique(proc_r).tolist():  # processes: a handful
        sidx = np.flatnonzero(proc_s == p)
        if not sidx.size:
            continue
        sidx = sidx[np.argsort(s_start[sidx], kind="stable")]
        ridx = np.flatnonzero(proc_r == p)
        j = np.searchsorted(s_start[sidx], t[ridx], side="right") - 1
        ok = (j >= 0) & (t[ridx] < s_end[sidx[np.maximum(j, 0)]])
        got[ridx[ok]] = sidx[j[ok]]
    sel = got >= 0
    if not sel.any():
        return 0
    # roots' subtrees are disjoint blocks [root, root + size), in row order
    first = roots[sel].astype(np.int64)
    st.joined = (first, first + f.size[first].astype(np.int64), got[sel])
    if st.row_idx is not None:
        st.row_idx = _paint(st.row_idx, st.joined)
    return int(sel.sum())


def _paint(row_idx: np.ndarray, joined: tuple[np.ndarray, np.ndarray, np.ndarray], a: int = 0) -> np.ndarray:
    """``row_idx`` (the step index of forest rows ``a, a + 1, ...``) where a row is in no step:
    the step of the joined block ``[first, stop)`` holding it (blocks disjoint, in row order)."""
    first, stop, idx = joined
    b = a + len(row_idx)
    lo, hi = np.searchsorted(stop, a, side="right"), np.searchsorted(first, b)
    if lo >= hi:
        return row_idx
    paint = np.zeros(len(row_idx) + 1, np.int64)
    g = idx[lo:hi] + 1
    np.add.at(paint, np.maximum(first[lo:hi], a) - a, g)
    np.subtract.at(paint, np.minimum(stop[lo:hi], b) - a, g)
    paint = np.cumsum(paint[:-1])
    fill = (row_idx < 0) & (paint > 0)
    row_idx[fill] = paint[fill] - 1
    return row_idx


def _fixed_windows(f: ForestRows, window_ns: int | None) -> Steps:
    """Rule 3: per rank, fixed time windows over root start times."""
    n = f.n
    roots = np.flatnonzero(f.parent < 0)
    if not roots.size:
        return Steps(_with_rule({c: [] for c in STEPS_SCHEMA.names}, RULES[2]), RULES[2], "empty forest", np.full(n, -1, np.int64))
    r_start = f.start[f.event[roots]]
    t0 = int(r_start.min())
    span = int(f.end[f.event].max()) - t0
    if window_ns is None:
        window_ns = DEFAULT_WINDOW_NS if span >= 10 * DEFAULT_WINDOW_NS else max(span // 10, 1)
    window_ns = max(int(window_ns), 1)
    w = (r_start - t0) // window_ns
    r_lane = f.lanes_of(roots)
    keys = np.stack([f.lane_rank[r_lane].astype(np.int64), w])
    uniq, first, inv = np.unique(keys, axis=1, return_index=True, return_inverse=True)
    k = uniq.shape[1]
    # every row lies in exactly one root's block: the root of row i is the last root at or before i
    root_k = np.cumsum(np.bincount(roots, minlength=n)[:n]) - 1
    step_idx = inv.reshape(-1)[root_k]
    starts = t0 + uniq[1] * window_ns
    table = _with_rule({
        "step_id": np.full(k, -1, np.int64), "step_num": uniq[1], "node": f.lane_node[r_lane[first]],
        "rank": uniq[0], "pid": np.full(k, -1, np.int64), "tid": np.full(k, -1, np.int64),
        "start_ns": starts, "end_ns": starts + window_ns, "name": [f"window {int(x)}" for x in uniq[1]],
        "n_requests": np.zeros(k, np.int32), "size": np.bincount(step_idx, minlength=k).astype(np.int64),
    }, RULES[2])
    return Steps(table, RULES[2], f"no step holds an operator: windows of {window_ns / 1e6:g} ms by root start time", step_idx)


