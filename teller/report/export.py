"""`teller export`: a reconstructed run as a trace the viewers users already have can open.

Two formats, both written column by column (no Python object per event):

- ``perfetto``: Perfetto's native protobuf trace (``Trace { repeated TracePacket packet = 1 }``,
  track events on one packet sequence with interned names), opened by the Perfetto UI and
  ``trace_processor``. Host slices nest along each thread's call tree; GPU work has one track per
  (GPU, stream); a flow joins every launch to the GPU work it started.
- ``chrome``: the JSON Trace Event Format (``{"traceEvents": [...]}`` with complete ``X`` events,
  ``s``/``f`` flow pairs and ``M`` metadata), opened by ``chrome://tracing`` and the Perfetto UI.

Both carry the same content:

- one process per (node, host process), one thread track per host thread, named with the rank;
- one process per (node, GPU) with a thread track per stream;
- a ``steps`` track per process holding the run's steps (from ``steps.parquet``, whatever rule
  decided them), so fixed-window steps are visible too;
- with a ``diagnosis.json`` (``teller diagnose``): a ``diagnosis`` track per process holding the
  flagged steps as slices (score, top family, fault type and explanation where present) and an
  instant event at each suspect operator on its own thread.

Timestamps are the run's time base τ (ns since run start). Slices keep the forest's node id as an
argument (``node_id``), so what a viewer shows can be looked up with ``teller show``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.errors import TellerError
from teller.forest import Forest
from teller.rundir import RunDir, dict_codes, np_col

__all__ = ["export_trace", "FORMATS"]

FORMATS = ("perfetto", "chrome")

_COLUMNS = ["node_id", "parent_id", "layer", "name", "start_ns", "end_ns", "node", "rank", "pid",
            "tid", "device", "stream", "size", "depth"]
_STEPS_TID, _DIAG_TID = 2**31 - 2, 2**31 - 3  # thread ids of the synthetic tracks in the JSON format


# ------------------------------------------------------------------------------------------------
# the run as tracks and slices


@dataclass
class _Slices:
    """Slices of the export, one row each, in the order they are emitted per track."""

    track: np.ndarray  # track index
    start: np.ndarray  # ns
    end: np.ndarray  # ns (>= start)
    name: np.ndarray  # index into names
    cat: np.ndarray  # index into cats
    node_id: np.ndarray  # forest node id, -1 for synthetic slices
    nested: np.ndarray  # bool: the track's slices nest as an Euler tour (host call trees)
    euler: np.ndarray  # int64 keys ordering BEGIN/END events of nested tracks (see _events)


@dataclass
class _Track:
    name: str
    pid: int  # exported process id (dense, 1-based)
    tid: int  # exported thread id
    process_name: str
    thread: bool = False  # a real host thread (Perfetto: a thread track), else a named track


class _Model:
    """What both writers need: tracks, slices, flows, instants, names."""

    def __init__(self) -> None:
        self.tracks: list[_Track] = []
        self.names: list[str] = []
        self.cats: list[str] = []
        self._name_ix: dict[str, int] = {}
        self._cat_ix: dict[str, int] = {}
        self.parts: list[dict[str, np.ndarray]] = []
        self.flows = np.zeros((0, 3), np.int64)  # (source slice row, target slice row, flow id)
        self.instants: list[dict[str, Any]] = []  # few: one per suspect of a flagged step
        self.annotations: dict[int, dict[str, Any]] = {}  # slice row -> args (flagged steps)
        self.clipped = 0

    def name_codes(self, values: list[str]) -> np.ndarray:
        out = np.empty(len(values), np.int64)
        for i, v in enumerate(values):
            j = self._name_ix.get(v)
            if j is None:
                j = self._name_ix[v] = len(self.names)
                self.names.append(v)
            out[i] = j
        return out

    def cat_code(self, value: str) -> int:
        j = self._cat_ix.get(value)
        if j is None:
            j = self._cat_ix[value] = len(self.cats)
            self.cats.append(value)
        return j

    def track(self, name: str, pid: int, tid: int, process_name: str, thread: bool = False) -> int:
        self.tracks.append(_Track(name, pid, tid, process_name, thread))
        return len(self.tracks) - 1


def _display_names(layer: list[str], names: list[str], layer_code: np.ndarray, name_code: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """``LAYER name`` for tagged host ranges whose name does not already start with the tag."""
    pair = layer_code * (len(names) + 1) + name_code
    uniq, inv = np.unique(pair, return_inverse=True)
    out = []
    for p in uniq.tolist():
        lc, nc = divmod(p, len(names) + 1)
        lay = layer[lc] if 0 <= lc < len(layer) else ""
        nm = names[nc] if 0 <= nc < len(names) else ""
        tagged = lay in ("STEP", "FE", "BE", "COMM", "OTHER") and not nm.startswith(lay + " ")
        out.append(f"{lay} {nm}" if tagged and lay else (nm or lay or "?"))
    return inv.reshape(-1), out


def _build(run: Path, diagnosis: dict[str, Any] | None) -> _Model:
    rd = RunDir(run).require()
    p = rd.artefact("forest.parquet")
    f = Forest.read(rd.path, columns=[*_COLUMNS, "kind"])
    t = f.table
    missing = [c for c in _COLUMNS if c not in t.column_names]
    if missing:
        raise TellerError(f"{p}: no column(s) {', '.join(missing)}; re-run `teller reconstruct {rd.path}`")
    m = _Model()
    n = t.num_rows
    node_id, parent_id = np_col(t, "node_id").astype(np.int64), np_col(t, "parent_id").astype(np.int64)
    start, end = np_col(t, "start_ns").astype(np.int64), np_col(t, "end_ns").astype(np.int64)
    end = np.maximum(end, start)
    host_node, rank = np_col(t, "node").astype(np.int64), np_col(t, "rank").astype(np.int64)
    pid, tid = np_col(t, "pid").astype(np.int64), np_col(t, "tid").astype(np.int64)
    device, stream = np_col(t, "device").astype(np.int64), np_col(t, "stream").astype(np.int64)
    size = np_col(t, "size").astype(np.int64)
    gpu = f.is_gpu  # GPU rows: no host call (teller.forest)
    lcode, lnames = dict_codes(t, "layer")
    ncode, nnames = dict_codes(t, "name")
    disp_code, disp_names = _display_names(lnames, nnames, lcode, ncode)
    name_of_disp = m.name_codes(disp_names)
    cat_of_layer = np.array([m.cat_code(x or "?") for x in lnames] + [m.cat_code("?")], np.int64)

    # processes and threads: host (node, pid) -> process; GPU (node, device) -> process, stream -> thread
    host = ~gpu
    keys_h = np.stack([host_node[host], pid[host], tid[host]], axis=1) if host.any() else np.zeros((0, 3), np.int64)
    keys_g = np.stack([host_node[gpu], device[gpu], stream[gpu]], axis=1) if gpu.any() else np.zeros((0, 3), np.int64)
    track_of_row = np.full(n, -1, np.int64)
    proc_pid: dict[tuple[int, int, int], int] = {}  # (is_gpu, node, pid|device) -> exported pid
    proc_name: dict[int, str] = {}
    step_track: dict[int, int] = {}
    ranks_of_proc: dict[tuple[int, int], int] = {}
    if host.any():
        r_h = rank[host]
        for (nd, p_, _), rk in zip(keys_h.tolist(), r_h.tolist(), strict=True):
            ranks_of_proc.setdefault((nd, p_), rk)
    multi_node = len(np.unique(host_node)) > 1 if n else False

    def proc(is_gpu: int, nd: int, ident: int) -> int:
        k = (is_gpu, nd, ident)
        if k not in proc_pid:
            proc_pid[k] = len(proc_pid) + 1
            where = f" on node {nd}" if multi_node else ""
            if is_gpu:
                proc_name[proc_pid[k]] = (f"GPU {ident}" if ident >= 0 else "GPU synchronization (no device)") + where
            else:
                rk = ranks_of_proc.get((nd, ident), 0)
                proc_name[proc_pid[k]] = f"rank {rk} (pid {ident}){where}"
        return proc_pid[k]

    for is_gpu, keys, mask in ((0, keys_h, host), (1, keys_g, gpu)):
        if not len(keys):
            continue
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        tr = np.empty(len(uniq), np.int64)
        for i, (nd, ident, th) in enumerate(uniq.tolist()):
            xp = proc(is_gpu, nd, ident)
            label = (f"stream {th}" if th >= 0 else "no stream") if is_gpu else f"thread {th}"
            tr[i] = m.track(label, xp, int(th) if th >= 0 else 0, proc_name[xp], thread=not is_gpu)
        track_of_row[mask] = tr[inv.reshape(-1)]

    # parent rows (the forest is a preorder, node_id == row, but do not rely on it)
    par_row = np.full(n, -1, np.int64)
    if n:
        order = np.argsort(node_id, kind="stable")
        pos = np.minimum(np.searchsorted(node_id, parent_id, sorter=order), n - 1)
        ok = (parent_id >= 0) & (node_id[order[pos]] == parent_id)
        par_row[ok] = order[pos[ok]]
    depth = np_col(t, "depth").astype(np.int64)
    # a host child never outlives its parent in the export (viewers drop or mis-nest such slices):
    # clip level by level, parents first
    hp = host & (par_row >= 0)
    hp[hp] = host[par_row[hp]]
    for d in np.unique(depth[hp]).tolist():
        lv = np.flatnonzero(hp & (depth == d))
        pr = par_row[lv]
        s2 = np.clip(start[lv], start[pr], end[pr])
        e2 = np.clip(end[lv], s2, end[pr])
        m.clipped += int(((s2 != start[lv]) | (e2 != end[lv])).sum())
        start[lv], end[lv] = s2, e2
    # host slices nest along each thread's call tree: BEGIN of row i sorts at (i, 0), END at
    # (i + size - 1, 1, -i) — the Euler tour of the preorder. GPU slices are flat per stream.
    rows = np.arange(n, dtype=np.int64)
    m.parts.append({"track": track_of_row, "start": start, "end": end, "name": name_of_disp[disp_code],
                    "cat": cat_of_layer[lcode], "node_id": node_id, "nested": host,
                    "euler": rows, "euler_end": rows + np.maximum(size, 1) - 1})
    # flows: every GPU row bound to a host launch; one flow per launch (id = launch node id + 1)
    g = gpu & (par_row >= 0)
    g[g] = host[par_row[g]]
    dst = np.flatnonzero(g)
    src = par_row[dst]
    m.flows = np.stack([src, dst, node_id[src] + 1], axis=1) if len(dst) else np.zeros((0, 3), np.int64)

    _steps(m, rd, host_node, rank, pid, tid, start, track_of_row, host, proc_name, proc_pid, step_track, n)
    if diagnosis:
        _diagnosis(m, diagnosis, node_id, host_node, rank, pid, start, end, track_of_row, host, proc_pid,
                   proc_name, disp_names, disp_code, n)
    return m


def _process_of_rank(host: np.ndarray, host_node: np.ndarray, rank: np.ndarray, pid: np.ndarray,
                     proc_pid: dict) -> dict[int, int]:
    """Exported pid of the first host process of each rank."""
    out: dict[int, int] = {}
    for nd, rk, p_ in zip(host_node[host].tolist(), rank[host].tolist(), pid[host].tolist(), strict=True):
        if rk not in out and (0, nd, p_) in proc_pid:
            out[rk] = proc_pid[(0, nd, p_)]
    return out


def _steps(m: _Model, rd: RunDir, host_node, rank, pid, tid, start, track_of_row, host, proc_name,
           proc_pid, step_track, n) -> None:
    if not rd.has_table("steps"):
        return
    st = rd.read_table("steps")
    if not st.num_rows:
        return
    by_rank = _process_of_rank(host, host_node, rank, pid, proc_pid)
    s_rank = np_col(st, "rank").astype(np.int64)
    s_pid = np_col(st, "pid").astype(np.int64) if "pid" in st.column_names else np.full(st.num_rows, -1)
    s_node = np_col(st, "node").astype(np.int64) if "node" in st.column_names else np.zeros(st.num_rows, np.int64)
    xp = np.array([proc_pid.get((0, int(a), int(b)), by_rank.get(int(r), 0))
                   for a, b, r in zip(s_node.tolist(), s_pid.tolist(), s_rank.tolist(), strict=True)], np.int64)
    tr = np.empty(st.num_rows, np.int64)
    for p_ in np.unique(xp).tolist():
        if p_ not in step_track:
            step_track[p_] = m.track("steps", int(p_), _STEPS_TID, proc_name.get(p_, f"process {p_}"))
        tr[xp == p_] = step_track[p_]
    nums = np_col(st, "step_num").astype(np.int64)
    nreq = np_col(st, "n_requests").astype(np.int64) if "n_requests" in st.column_names else np.zeros(st.num_rows, np.int64)
    labels = [f"step {k} ({q} req)" if q else f"step {k}" for k, q in zip(nums.tolist(), nreq.tolist(), strict=True)]
    s0, s1 = np_col(st, "start_ns").astype(np.int64), np_col(st, "end_ns").astype(np.int64)
    o = np.lexsort((s0, tr))
    # steps of one track do not overlap; clip a step that would end after the next one starts
    s1 = np.maximum(s1, s0)
    same = tr[o][1:] == tr[o][:-1]
    nxt = np.where(same, s0[o][1:], np.iinfo(np.int64).max)
    e2 = s1.copy()
    e2[o[:-1]] = np.minimum(s1[o[:-1]], np.maximum(nxt, s0[o[:-1]]))
    m.clipped += int((e2 != s1).sum())
    sid = np_col(st, "step_id").astype(np.int64) if "step_id" in st.column_names else np.full(st.num_rows, -1)
    m.parts.append({"track": tr[o], "start": s0[o], "end": e2[o], "name": m.name_codes([labels[i] for i in o.tolist()]),
                    "cat": np.full(len(o), m.cat_code("steps"), np.int64), "node_id": sid[o],
                    "nested": np.zeros(len(o), bool), "euler": np.zeros(len(o), np.int64),
                    "euler_end": np.zeros(len(o), np.int64)})


def _diagnosis(m: _Model, diag: dict[str, Any], node_id, host_node, rank, pid, start, end, track_of_row,
               host, proc_pid, proc_name, disp_names, disp_code, n) -> None:
    flagged = [s for s in diag.get("steps", []) if s.get("flag")]
    if not flagged:
        return
    order = np.argsort(node_id, kind="stable")

    def row_of(nid: int) -> int:
        if nid is None or nid < 0 or not n:
            return -1
        i = int(np.searchsorted(node_id, nid, sorter=order))
        return int(order[i]) if i < n and node_id[order[i]] == nid else -1

    by_rank = _process_of_rank(host, host_node, rank, pid, proc_pid)
    diag_track: dict[int, int] = {}
    rows: list[tuple[int, int, int, str, dict[str, Any]]] = []
    for s in flagged:
        r = row_of(int(s.get("node_id", -1) if s.get("node_id") is not None else -1))
        xp = proc_pid.get((0, int(host_node[r]), int(pid[r]))) if r >= 0 else by_rank.get(int(s.get("rank", 0)))
        if xp is None:
            continue
        if xp not in diag_track:
            diag_track[xp] = m.track("diagnosis", int(xp), _DIAG_TID, proc_name.get(xp, f"process {xp}"))
        verdict = s.get("fault_type") or s.get("top_family") or "abnormal"
        label = f"abnormal step {s.get('step_num')}: {verdict}"
        args = {k: s[k] for k in ("step_num", "score", "top_family", "fault_type", "fault_probability",
                                  "abnormal_probability", "explanation") if s.get(k) is not None}
        sus = s.get("suspects") or []
        if sus:
            args["suspects"] = ", ".join(f"{x.get('family')} (node {x.get('node_id')})" for x in sus[:5])
        rows.append((diag_track[xp], int(s["start_ns"]), max(int(s["end_ns"]), int(s["start_ns"])), label, args))
        for x in sus[:5]:
            rr = row_of(int(x.get("node_id", -1)))
            if rr < 0 or track_of_row[rr] < 0:
                continue
            m.instants.append({"track": int(track_of_row[rr]), "ts": int(start[rr]),
                               "name": f"suspect: {x.get('family', disp_names[disp_code[rr]])}",
                               "args": {"node_id": int(node_id[rr]), "a": x.get("a"), "step_num": s.get("step_num"),
                                        "dur_ns": int(end[rr] - start[rr])}})
    if not rows:
        return
    rows.sort(key=lambda x: (x[0], x[1]))
    base = sum(len(p["track"]) for p in m.parts)
    tr = np.array([x[0] for x in rows], np.int64)
    s0 = np.array([x[1] for x in rows], np.int64)
    s1 = np.array([x[2] for x in rows], np.int64)
    same = tr[1:] == tr[:-1]
    s1[:-1] = np.where(same, np.minimum(s1[:-1], np.maximum(s0[1:], s0[:-1])), s1[:-1])
    m.parts.append({"track": tr, "start": s0, "end": s1, "name": m.name_codes([x[3] for x in rows]),
                    "cat": np.full(len(rows), m.cat_code("diagnosis"), np.int64), "node_id": np.full(len(rows), -1),
                    "nested": np.zeros(len(rows), bool), "euler": np.zeros(len(rows), np.int64),
                    "euler_end": np.zeros(len(rows), np.int64)})
    for i, x in enumerate(rows):
        m.annotations[base + i] = x[4]


def _concat_parts(m: _Model) -> dict[str, np.ndarray]:
    """All slices in one set of columns; flat tracks (GPU streams, steps, diagnosis) in time order,
    each slice clipped to end where the next one of its track starts (``flat_pos``: the order)."""
    keys = ("track", "start", "end", "name", "cat", "node_id", "nested", "euler", "euler_end")
    s = {k: np.concatenate([p[k] for p in m.parts]) if m.parts else np.zeros(0, np.int64) for k in keys}
    s["nested"] = s["nested"].astype(bool)
    flat = np.flatnonzero(~s["nested"] & (s["track"] >= 0))
    s["flat_pos"] = np.zeros(len(s["track"]), np.int64)
    if len(flat):
        o = flat[np.lexsort((s["end"][flat], s["start"][flat], s["track"][flat]))]
        s["flat_pos"][o] = np.arange(len(o))
        same = s["track"][o][1:] == s["track"][o][:-1]
        nxt = np.where(same, s["start"][o][1:], np.iinfo(np.int64).max)
        e2 = np.minimum(s["end"][o][:-1], np.maximum(nxt, s["start"][o][:-1]))
        m.clipped += int((e2 != s["end"][o][:-1]).sum())
        s["end"][o[:-1]] = e2
    return s


# ------------------------------------------------------------------------------------------------
# protobuf wire format, column by column


def _varint(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Varint bytes of non-negative int64s: a (N, 10) uint8 matrix and the length of each row."""
    u = np.asarray(v, np.int64).astype(np.uint64)
    n = len(u)
    out = np.zeros((n, 10), np.uint8)
    length = np.ones(n, np.int64)
    rest = u.copy()
    for j in range(10):
        out[:, j] = (rest & np.uint64(0x7F)).astype(np.uint8)
        rest = rest >> np.uint64(7)
        more = rest > 0
        out[more, j] |= 0x80
        length += more
        if not more.any():
            return out[:, : j + 1], length
    return out, length


def _const(b: bytes, n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.tile(np.frombuffer(b, np.uint8), (n, 1)), np.full(n, len(b), np.int64)


def _varint_bytes(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint_bytes((field << 3) | wire)


def _cat(*fields: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-row byte fields: (matrix, lengths) pairs → one (matrix, lengths)."""
    mats = [f[0] for f in fields]
    lens = [f[1] for f in fields]
    n = len(lens[0])
    width = sum(x.shape[1] for x in mats)
    out = np.zeros((n, width), np.uint8)
    total = np.zeros(n, np.int64)
    # pack left: each field lands right after the previous ones of its row
    pos = 0
    tmp = np.zeros((n, width), np.uint8)
    valid = np.zeros((n, width), bool)
    for mat, ln in zip(mats, lens, strict=True):
        w = mat.shape[1]
        tmp[:, pos:pos + w] = mat
        valid[:, pos:pos + w] = np.arange(w)[None, :] < ln[:, None]
        pos += w
        total += ln
    flat = tmp[valid]
    rows = np.repeat(np.arange(n), total)
    starts = np.concatenate([[0], np.cumsum(total)[:-1]]) if n else np.zeros(0, np.int64)
    cols = np.arange(len(flat)) - np.repeat(starts, total)
    out[rows, cols] = flat
    return out, total


def _when(mask: np.ndarray, f: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return f[0], np.where(mask, f[1], 0)


def _field_varint(field: int, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _cat(_const(_tag(field, 0), len(v)), _varint(v))


def _field_fixed64(field: int, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(v, np.int64).astype("<u8").view(np.uint8).reshape(-1, 8)
    return _cat(_const(_tag(field, 1), len(v)), (b, np.full(len(v), 8, np.int64)))


def _field_message(field: int, body: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    n = len(body[1])
    return _cat(_const(_tag(field, 2), n), _varint(body[1]), body)


def _flat(f: tuple[np.ndarray, np.ndarray]) -> bytes:
    mat, ln = f
    return mat[np.arange(mat.shape[1])[None, :] < ln[:, None]].tobytes()


def _msg(*parts: bytes) -> bytes:
    return b"".join(parts)


def _pb_varint(field: int, v: int) -> bytes:
    return _tag(field, 0) + _varint_bytes(int(v) & 0xFFFFFFFFFFFFFFFF)


def _pb_len(field: int, payload: bytes) -> bytes:
    return _tag(field, 2) + _pb_varint(0, len(payload))[1:] + payload


def _pb_str(field: int, s: str) -> bytes:
    return _pb_len(field, s.encode("utf-8", "replace"))


def _annotation(name: str, v: Any) -> bytes:
    """A DebugAnnotation with a plain name and one value."""
    body = _pb_str(10, name)
    if isinstance(v, bool):
        body += _pb_varint(2, int(v))
    elif isinstance(v, int):
        body += _pb_varint(4, v)
    elif isinstance(v, float):
        body += _tag(5, 1) + np.float64(v).tobytes()
    else:
        body += _pb_str(6, str(v))
    return body


# TracePacket / TrackEvent field numbers (perfetto/protos/perfetto/trace/...)
_PKT_TIMESTAMP, _PKT_SEQ_ID, _PKT_TRACK_EVENT, _PKT_INTERNED, _PKT_SEQ_FLAGS, _PKT_TRACK_DESC = 8, 10, 11, 12, 13, 60
_TE_TYPE, _TE_NAME_IID, _TE_TRACK_UUID, _TE_CAT_IIDS, _TE_ANNOT, _TE_NAME, _TE_FLOW_IDS = 9, 10, 11, 3, 4, 23, 47
_SLICE_BEGIN, _SLICE_END, _INSTANT = 1, 2, 3
_SEQ_CLEARED, _SEQ_NEEDS_STATE = 1, 2
_SEQ = 1
_UUID_BASE = 1 << 20


def _events(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """BEGIN/END events of every slice (rows without a track left out), in an order valid per
    track: the Euler tour for nested (host) tracks, BEGIN/END pairs in time order for flat ones."""
    sel = np.flatnonzero(s["track"] >= 0)
    k = len(sel)
    row = np.concatenate([sel, sel])
    begin = np.concatenate([np.ones(k, bool), np.zeros(k, bool)])
    ts = np.concatenate([s["start"][sel], s["end"][sel]])
    nested = np.concatenate([s["nested"][sel]] * 2)
    key1 = np.where(nested, np.concatenate([s["euler"][sel], s["euler_end"][sel]]),
                    np.concatenate([s["flat_pos"][sel]] * 2))
    key2 = np.concatenate([np.zeros(k, np.int64), np.ones(k, np.int64)])
    key3 = np.where(nested, np.concatenate([np.zeros(k, np.int64), -s["euler"][sel]]), 0)
    track = np.concatenate([s["track"][sel]] * 2)
    o = np.lexsort((key3, key2, key1, track))
    row, ts, begin, track = row[o], ts[o], begin[o], track[o]
    # timestamps never go back along a track (they could only where input nesting was damaged)
    if len(ts):
        seg = np.flatnonzero(np.r_[True, track[1:] != track[:-1]])
        for a_, b_ in zip(seg.tolist(), np.r_[seg[1:], len(ts)].tolist(), strict=True):  # tracks: a few dozen
            ts[a_:b_] = np.maximum.accumulate(ts[a_:b_])
    return {"row": row, "ts": ts, "begin": begin, "track": track}


def _write_perfetto(m: _Model, s: dict[str, np.ndarray], out: Path) -> int:
    ev = _events(s)
    parts: list[bytes] = []
    # interned names and categories, clearing the sequence's state
    interned = b"".join(_pb_len(1, _pb_varint(1, i + 1) + _pb_str(2, c)) for i, c in enumerate(m.cats))
    interned += b"".join(_pb_len(2, _pb_varint(1, i + 1) + _pb_str(2, nm)) for i, nm in enumerate(m.names))
    parts.append(_pb_len(1, _pb_varint(_PKT_SEQ_ID, _SEQ) + _pb_varint(_PKT_SEQ_FLAGS, _SEQ_CLEARED)
                         + _pb_len(_PKT_INTERNED, interned)))
    # track descriptors: a process track per exported pid, a child track per thread/stream/steps track
    seen: set[int] = set()
    for i, tr in enumerate(m.tracks):
        if tr.pid not in seen:
            seen.add(tr.pid)
            pd = _pb_varint(1, tr.pid) + _pb_str(6, tr.process_name)
            parts.append(_pb_len(1, _pb_len(_PKT_TRACK_DESC, _pb_varint(1, tr.pid) + _pb_len(3, pd))))
        body = _pb_varint(1, _UUID_BASE + i) + _pb_str(2, tr.name) + _pb_varint(5, tr.pid)
        if tr.thread:  # ThreadDescriptor {pid, tid, thread_name}
            body += _pb_len(4, _pb_varint(1, tr.pid) + _pb_varint(2, tr.tid) + _pb_str(5, tr.name))
        parts.append(_pb_len(1, _pb_len(_PKT_TRACK_DESC, body)))
    head = b"".join(parts)
    # one sequence in time order: a stable sort by timestamp keeps each track's valid order
    o = np.argsort(ev["ts"], kind="stable")
    ev = {k: v[o] for k, v in ev.items()}
    n_ev = len(ev["row"])
    r, b = ev["row"], ev["begin"]
    uuid = _UUID_BASE + s["track"][r]
    # flows: a launch's BEGIN and the BEGINs of the GPU work it started carry one id
    flow = np.zeros(len(s["track"]), np.int64)
    if len(m.flows):
        flow[m.flows[:, 0]] = m.flows[:, 2]
        flow[m.flows[:, 1]] = m.flows[:, 2]
    has_flow = b & (flow[r] > 0)
    node = s["node_id"][r]
    te = _cat(
        _field_varint(_TE_TYPE, np.where(b, _SLICE_BEGIN, _SLICE_END)),
        _field_varint(_TE_TRACK_UUID, uuid),
        _when(b, _field_varint(_TE_NAME_IID, s["name"][r] + 1)),
        _when(b, _field_varint(_TE_CAT_IIDS, s["cat"][r] + 1)),
        _when(b & (node >= 0), _field_message(_TE_ANNOT, _cat(_const(_pb_str(10, "node_id"), n_ev),
                                                              _field_varint(4, np.maximum(node, 0))))),
        _when(has_flow, _field_fixed64(_TE_FLOW_IDS, flow[r])),
    )
    pkt = _cat(_field_varint(_PKT_TIMESTAMP, np.maximum(ev["ts"], 0)), _field_varint(_PKT_SEQ_ID, np.full(n_ev, _SEQ)),
               _field_message(_PKT_TRACK_EVENT, te), _const(_pb_varint(_PKT_SEQ_FLAGS, _SEQ_NEEDS_STATE), n_ev))
    body = _field_message(1, pkt)
    events_bytes = _flat(body)
    offs = np.concatenate([[0], np.cumsum(body[1])])
    # the few packets that carry more: flagged steps (their BEGIN replaced) and suspects (inserted
    # before the first event at or after their time)
    splice: list[tuple[int, int, bytes]] = []  # (event position, 0 insert | 1 replace, packet)
    if m.annotations:
        for p_ in np.flatnonzero(b & np.isin(r, np.fromiter(m.annotations, np.int64))).tolist():
            extra = b"".join(_pb_len(_TE_ANNOT, _annotation(k2, v)) for k2, v in m.annotations[int(r[p_])].items())
            splice.append((p_, 1, _begin_packet(int(ev["ts"][p_]), int(uuid[p_]), int(s["name"][r[p_]]) + 1,
                                                int(s["cat"][r[p_]]) + 1, extra)))
    for x in m.instants:
        te_i = (_pb_varint(_TE_TYPE, _INSTANT) + _pb_varint(_TE_TRACK_UUID, _UUID_BASE + x["track"]) + _pb_str(_TE_NAME, x["name"])
                + b"".join(_pb_len(_TE_ANNOT, _annotation(k2, v)) for k2, v in x["args"].items() if v is not None))
        one = _pb_len(1, _pb_varint(_PKT_TIMESTAMP, max(x["ts"], 0)) + _pb_varint(_PKT_SEQ_ID, _SEQ)
                      + _pb_len(_PKT_TRACK_EVENT, te_i) + _pb_varint(_PKT_SEQ_FLAGS, _SEQ_NEEDS_STATE))
        splice.append((int(np.searchsorted(ev["ts"], x["ts"], side="left")), 0, one))
    chunks, last = [], 0
    for p_, replace, one in sorted(splice, key=lambda x: (x[0], x[1])):
        chunks.append(events_bytes[last:offs[p_]])
        chunks.append(one)
        last = offs[p_ + 1] if replace else offs[p_]
    chunks.append(events_bytes[last:])
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(head)
        for c in chunks:
            fh.write(c)
    tmp.replace(out)
    return n_ev + len(m.instants)


def _begin_packet(ts: int, uuid: int, name_iid: int, cat_iid: int, extra: bytes) -> bytes:
    te = (_pb_varint(_TE_TYPE, _SLICE_BEGIN) + _pb_varint(_TE_TRACK_UUID, uuid) + _pb_varint(_TE_NAME_IID, name_iid)
          + _pb_varint(_TE_CAT_IIDS, cat_iid) + extra)
    return _pb_len(1, _pb_varint(_PKT_TIMESTAMP, max(ts, 0)) + _pb_varint(_PKT_SEQ_ID, _SEQ)
                   + _pb_len(_PKT_TRACK_EVENT, te) + _pb_varint(_PKT_SEQ_FLAGS, _SEQ_NEEDS_STATE))


# ------------------------------------------------------------------------------------------------
# JSON trace event format, column by column


def _us(ns: np.ndarray) -> pa.Array:
    """ns → µs text with exact ns decimals ("12.345")."""
    ns = np.asarray(ns, np.int64)
    neg = ns < 0
    a = np.abs(ns)
    whole = pc.cast(pa.array(a // 1000), pa.string())
    frac = pc.utf8_lpad(pc.cast(pa.array(a % 1000), pa.string()), 3, "0")
    txt = pc.binary_join_element_wise(whole, frac, ".")
    return pc.if_else(pa.array(neg), pc.binary_join_element_wise(pa.scalar("-"), txt, ""), txt)


def _jstr(values: list[str]) -> list[str]:
    return [json.dumps(v, ensure_ascii=False) for v in values]


def _write_chrome(m: _Model, s: dict[str, np.ndarray], out: Path) -> int:
    k = len(s["track"])
    tr_pid = np.array([t.pid for t in m.tracks] or [0], np.int64)
    tr_tid = np.array([t.tid for t in m.tracks] or [0], np.int64)
    names = pa.array(_jstr(m.names) or ['""'])
    cats = pa.array(_jstr(m.cats) or ['""'])
    lines: list[pa.Array] = []
    meta = []
    seen: set[int] = set()
    for t in m.tracks:
        if t.pid not in seen:
            seen.add(t.pid)
            meta.append(json.dumps({"ph": "M", "name": "process_name", "pid": t.pid, "args": {"name": t.process_name}}))
        meta.append(json.dumps({"ph": "M", "name": "thread_name", "pid": t.pid, "tid": t.tid, "args": {"name": t.name}}))
    lines.append(pa.array(meta, pa.string()))
    if k:
        j = pc.binary_join_element_wise
        plain = [i for i in range(k) if i not in m.annotations]
        idx = pa.array(np.asarray(plain, np.int64))

        def col(strings: pa.Array) -> pa.Array:
            return strings.take(idx)

        ts = _us(s["start"])
        dur = _us(s["end"] - s["start"])
        pid_s = pc.cast(pa.array(tr_pid[s["track"]]), pa.string())
        tid_s = pc.cast(pa.array(tr_tid[s["track"]]), pa.string())
        nm = names.take(pa.array(s["name"]))
        ct = cats.take(pa.array(s["cat"]))
        nid = pc.cast(pa.array(s["node_id"]), pa.string())
        x = j('{"ph":"X","name":', col(nm), ',"cat":', col(ct), ',"ts":', col(ts), ',"dur":', col(dur),
              ',"pid":', col(pid_s), ',"tid":', col(tid_s), ',"args":{"node_id":', col(nid), "}}", "")
        lines.append(x)
        ann = []
        for i, a in m.annotations.items():
            ann.append(json.dumps({"ph": "X", "name": m.names[int(s["name"][i])], "cat": m.cats[int(s["cat"][i])],
                                   "ts": int(s["start"][i]) / 1000, "dur": int(s["end"][i] - s["start"][i]) / 1000,
                                   "pid": int(tr_pid[s["track"][i]]), "tid": int(tr_tid[s["track"][i]]), "args": a}))
        if ann:
            lines.append(pa.array(ann, pa.string()))
        if len(m.flows):
            src, dst, fid = m.flows[:, 0], m.flows[:, 1], pc.cast(pa.array(m.flows[:, 2]), pa.string())
            sp = pid_s.take(pa.array(src))
            st_ = tid_s.take(pa.array(src))
            dp = pid_s.take(pa.array(dst))
            dt = tid_s.take(pa.array(dst))
            lines.append(j('{"ph":"s","name":"launch","cat":"launch","id":', fid, ',"ts":', ts.take(pa.array(src)),
                           ',"pid":', sp, ',"tid":', st_, "}", ""))
            lines.append(j('{"ph":"f","bp":"e","name":"launch","cat":"launch","id":', fid, ',"ts":',
                           ts.take(pa.array(dst)), ',"pid":', dp, ',"tid":', dt, "}", ""))
    if m.instants:
        lines.append(pa.array([json.dumps({"ph": "i", "s": "t", "name": x["name"], "ts": x["ts"] / 1000,
                                           "pid": m.tracks[x["track"]].pid, "tid": m.tracks[x["track"]].tid,
                                           "args": {a: v for a, v in x["args"].items() if v is not None}})
                               for x in m.instants], pa.string()))
    tmp = out.with_name(out.name + ".tmp")
    n = 0
    with open(tmp, "wb") as fh:
        fh.write(b'{"displayTimeUnit":"ns","otherData":{"producer":"teller export"},"traceEvents":[\n')
        first = True
        for arr in lines:
            if not len(arr):
                continue
            for i in range(0, len(arr), 100_000):  # joined in chunks: no Python string per event
                part = arr.slice(i, 100_000)
                lists = pa.ListArray.from_arrays(pa.array([0, len(part)], pa.int32()), part)
                body = pc.binary_join(lists, "\n,")[0].as_py()
                fh.write(((",\n" if not first else "") + body).encode("utf-8", "replace"))
                first = False
            n += len(arr)
        fh.write(b"\n]}\n")
    tmp.replace(out)
    return n


# ------------------------------------------------------------------------------------------------


def export_trace(run: str | os.PathLike, out: str | os.PathLike, fmt: str = "perfetto",
                 diagnosis: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write the reconstructed ``run`` as a Perfetto (protobuf) or Chrome (JSON) trace at ``out``.

    ``diagnosis``: a ``diagnosis.json``; by default ``RUN/diagnosis.json`` when it exists.
    Returns counts: tracks, slices, flows, instants, annotated steps, clipped slices."""
    if fmt not in FORMATS:
        raise TellerError(f"--format {fmt!r}: unknown; use one of {', '.join(FORMATS)}")
    run = Path(run)
    out = Path(out)
    diag = None
    dp = Path(diagnosis) if diagnosis is not None else run / "diagnosis.json"
    if diagnosis is not None and not dp.is_file():
        raise TellerError(f"{dp}: no such diagnosis; run `teller diagnose {run}` first or leave --diagnosis out")
    if dp.is_file():
        try:
            diag = json.loads(dp.read_text())
        except (OSError, ValueError) as e:
            raise TellerError(f"{dp}: unreadable diagnosis ({e}); re-run `teller diagnose {run}`") from e
        if not isinstance(diag, dict) or diag.get("format") != "teller.diagnosis":
            raise TellerError(f"{dp}: not a teller diagnosis (no \"format\": \"teller.diagnosis\"); re-run `teller diagnose {run}`")
    m = _build(run, diag)
    s = _concat_parts(m)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = (_write_perfetto if fmt == "perfetto" else _write_chrome)(m, s, out)
    return {"format": fmt, "output": str(out), "tracks": len(m.tracks), "slices": int(len(s["track"])),
            "flows": int(len(m.flows)), "instants": len(m.instants), "annotated_steps": len(m.annotations),
            "clipped": m.clipped, "records": n, "bytes": out.stat().st_size}


