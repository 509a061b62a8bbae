"""Read log files into normalized columns: one row per line, time in wall-clock Unix ns.

Two kinds of input:

- ``*.jsonl`` written by the recorder: one object per line ``{ts_ns, node, pid, stream, text}``;
  ``ts_ns`` is the wall-clock arrival time (ns). The text is still matched against the formats
  to pull out level, logger, message and, for vLLM's ``(EngineCore_DP0 pid=N)`` prefix, the pid
  of the process that logged it (it overrides the recorder's pid, which may be the parent's).
- plain text logs (``*.log``, ``*.txt`` or files given explicitly) in one of the formats of
  :mod:`teller.logs.formats`; the time comes from the text.

Repairs, each flagged in ``flags`` (never a dropped line):

- bytes that are not UTF-8 are replaced (U+FFFD) → :data:`FLAG_NON_UTF8`;
- a line without a timestamp (a traceback or other continuation line, or no format matched)
  takes the time of the previous line that had one, and in plain logs also its level, logger
  and pid → :data:`FLAG_NO_TIMESTAMP` (time stays unknown, −1, when no earlier line had one);
- a time earlier than an earlier line of the same file and pid is kept → :data:`FLAG_BACKWARDS`;
- a JSONL line that is not a JSON object (or nests too deeply to parse), or whose ``ts_ns``,
  ``pid`` or ``node`` is not a usable integer (huge, infinite, NaN, text), is kept as text
  → :data:`FLAG_BAD_RECORD`, and the file's note names its line numbers; a plain-log
  timestamp that fails to parse (month 13) likewise.

Whitespace-only lines are skipped and counted (``blank``); ANSI colour codes are removed from
``text``. Everything is columnar: one RE2 pass per format over a file's column of lines.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from teller.errors import InputError
from teller.logs.align import segment_cummax
from teller.logs.formats import ANSI_RE, Preset, detect, local_utc_offset_s, parse_timestamps

FLAG_NON_UTF8 = 1
FLAG_NO_TIMESTAMP = 2
FLAG_BACKWARDS = 4
FLAG_BAD_RECORD = 8
LOG_FLAG_NAMES = {
    FLAG_NON_UTF8: "non_utf8",
    FLAG_NO_TIMESTAMP: "no_timestamp",
    FLAG_BACKWARDS: "backwards",
    FLAG_BAD_RECORD: "bad_record",
}

#: Columns of a normalized file table, in order.
LINE_SCHEMA = pa.schema(
    [
        ("file", pa.string()),
        ("file_line", pa.int64()),
        ("wall_ns", pa.int64()),
        ("res_ns", pa.int64()),
        ("node", pa.int32()),
        ("pid", pa.int64()),
        ("stream", pa.string()),
        ("level", pa.string()),
        ("logger", pa.string()),
        ("message", pa.string()),
        ("text", pa.string()),
        ("flags", pa.int32()),
    ]
)

_JSONL_SCHEMA = pa.schema([("ts_ns", pa.int64()), ("node", pa.int64()), ("pid", pa.int64()),
                           ("stream", pa.string()), ("text", pa.string())])


@dataclass
class ParseContext:
    """What parsing needs beyond the file: candidate formats and how to complete timestamps."""

    presets: list[Preset]
    forced: bool = False  # only presets[0], no detection and no fallback formats
    ref_unix_ns: int | None = None  # for timestamps without a year (None: the file's mtime)
    utc_offset_s: int | None = None  # for timestamps without an offset (None: this machine's zone)


@dataclass
class FileResult:
    table: pa.Table
    format: str
    blank: int = 0
    notes: list[str] = field(default_factory=list)


def _decode(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _split_lines(text: str) -> tuple[list[str], np.ndarray]:
    """Lines (split on \\n, a trailing \\r removed) and their 1-based numbers, blank ones dropped."""
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    arr = pa.array(parts, pa.string())
    arr = pc.replace_substring_regex(arr, r"\r$", "")
    nonblank = np.asarray(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(arr)), 0)
                          .to_numpy(zero_copy_only=False), dtype=bool)
    idx = np.flatnonzero(nonblank)
    return arr.filter(pa.array(nonblank)), idx.astype(np.int64) + 1


def _utf8_flags(lines: pa.Array, replaced: bool) -> np.ndarray:
    if not replaced:
        return np.zeros(len(lines), np.int32)
    bad = pc.match_substring(lines, "\ufffd").fill_null(False).to_numpy(zero_copy_only=False)
    return np.where(np.asarray(bad, dtype=bool), FLAG_NON_UTF8, 0).astype(np.int32)


def _strip_ansi(lines: pa.Array) -> pa.Array:
    if not len(lines) or not pc.any(pc.match_substring(lines, "\x1b")).as_py():
        return lines  # a literal search is much cheaper than the regex replacement
    return pc.replace_substring_regex(lines, ANSI_RE, "")


def _ffill_index(has: np.ndarray) -> np.ndarray:
    """Index of the last position ≤ i where ``has`` is true (−1 before the first)."""
    idx = np.where(has, np.arange(len(has)), -1)
    return np.maximum.accumulate(idx) if len(idx) else idx


def _match_formats(lines: pa.Array, ctx: ParseContext, with_time: bool, ref_ns: int, utc_off: int
                   ) -> tuple[dict[str, pa.Array], np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """Apply the formats to a column of lines: (groups, matched, wall, res, bad_ts, format name)."""
    n = len(lines)
    order: list[Preset]
    primary: Preset | None
    if ctx.forced:
        order = ctx.presets[:1]
        primary = order[0] if order else None
    else:
        primary = detect(lines, ctx.presets)
        order = ([primary] if primary else []) + [p for p in ctx.presets if p is not primary]
    matched = np.zeros(n, bool)
    wall = np.full(n, -1, np.int64)
    res = np.full(n, 1_000_000_000, np.int64)
    bad_ts = np.zeros(n, bool)
    pieces_idx, pieces = [], []
    for p in order:
        rem = np.flatnonzero(~matched)
        if len(rem) == 0:
            break
        sub = lines.take(pa.array(rem))
        m = p.match_mask(sub)
        if not m.any():
            continue
        idx = rem[m]
        hit = sub.filter(pa.array(m))
        ext = p.extract(hit)
        ext.setdefault("msg", hit)  # a format without a msg group: the message is the line
        matched[idx] = True
        pieces_idx.append(idx)
        pieces.append(ext)
        if primary is None:
            primary = p
        if with_time and "ts" in ext:
            w, r = parse_timestamps(ext["ts"], p.time_format, ref_ns, utc_off)
            wall[idx], res[idx] = w, r
            bad_ts[idx] = w < 0
    # scatter the matched pieces back into line order with one take() per column
    unmatched = np.flatnonzero(~matched)
    pos = np.concatenate(pieces_idx + [unmatched]) if n else np.zeros(0, np.int64)
    inv = np.empty(n, np.int64)
    inv[pos] = np.arange(n)
    inv_arr = pa.array(inv)
    groups: dict[str, pa.Array] = {}
    for g in ("level", "logger", "msg", "pid"):
        vals = [e[g] if g in e else pa.array([""] * len(i), pa.string())
                for e, i in zip(pieces, pieces_idx, strict=True)]
        vals.append(lines.take(pa.array(unmatched)) if g == "msg"
                    else pa.array([""] * len(unmatched), pa.string()))
        groups[g] = pa.concat_arrays([v.cast(pa.string()) for v in vals]).take(inv_arr)
    return groups, matched, wall, res, bad_ts, (primary.name if primary else "none")


def _pid_col(groups: dict[str, pa.Array], fallback: np.ndarray) -> np.ndarray:
    s = groups["pid"]
    s = pc.if_else(pc.equal(s, ""), pa.scalar(None, pa.string()), s)
    v = pc.cast(s, pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.where(v >= 0, v, fallback)


def _backwards(pid: np.ndarray, wall: np.ndarray) -> np.ndarray:
    """Lines whose time is earlier than an earlier line of the same pid (file order)."""
    has = wall >= 0
    if not has.any():
        return np.zeros(len(wall), bool)
    order = np.argsort(pid, kind="stable")
    g = np.unique(pid[order], return_inverse=True)[1]
    w = np.where(has, wall, -1)[order]
    cm, _ = segment_cummax(g, w)
    out = np.zeros(len(wall), bool)
    out[order] = w < cm
    return out & has


def _ref_ns(path: Path, ctx: ParseContext) -> int:
    if ctx.ref_unix_ns is not None:
        return int(ctx.ref_unix_ns)
    try:
        return int(os.stat(path).st_mtime_ns)
    except OSError:
        return 0


def _utc_offset(ref_ns: int, ctx: ParseContext) -> int:
    if ctx.utc_offset_s is not None:
        return int(ctx.utc_offset_s)
    return local_utc_offset_s(ref_ns / 1e9)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise InputError(path, f"cannot read log file ({e.strerror or e})", "check the path and permissions") from e


def read_plain(path: str | os.PathLike, ctx: ParseContext, label: str | None = None) -> FileResult:
    """A plain text log file → normalized line table (time from the text)."""
    path = Path(path)
    data = _read_bytes(path)
    text, replaced = _decode(data)
    lines, line_no = _split_lines(text)
    n_total = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    blank = n_total - len(lines)
    flags = _utf8_flags(lines, replaced)
    lines = _strip_ansi(lines)
    ref = _ref_ns(path, ctx)
    off = _utc_offset(ref, ctx)
    groups, matched, wall, res, bad_ts, fmt = _match_formats(lines, ctx, True, ref, off)
    n = len(lines)
    pid = _pid_col(groups, np.full(n, -1, np.int64))
    # continuation lines: time from the last line that had one; level/logger/pid from the last
    # line a format matched
    has_ts = wall >= 0
    src = _ffill_index(has_ts)
    no_ts = ~has_ts
    wall = np.where(src >= 0, wall[np.maximum(src, 0)], -1)
    res = np.where(src >= 0, res[np.maximum(src, 0)], 1_000_000_000)
    msrc = _ffill_index(matched)
    inherit = ~matched & (msrc >= 0)
    if inherit.any():
        take = pa.array(np.where(inherit, msrc, np.arange(n)))
        groups["level"] = groups["level"].take(take)
        groups["logger"] = groups["logger"].take(take)
        pid = np.where(inherit, pid[np.maximum(msrc, 0)], pid)
    flags |= np.where(no_ts, FLAG_NO_TIMESTAMP, 0).astype(np.int32)
    flags |= np.where(bad_ts, FLAG_BAD_RECORD, 0).astype(np.int32)
    flags |= np.where(_backwards(pid, wall) & ~no_ts, FLAG_BACKWARDS, 0).astype(np.int32)
    table = _table(label or str(path), line_no, wall, res, np.full(n, -1, np.int32), pid,
                   pa.array([""] * n, pa.string()), groups, lines, flags)
    return FileResult(table, fmt, blank)


#: Largest ``ts_ns`` taken as a time (about year 2116); beyond it the record is unusable.
_MAX_TS_NS = 2**62
_SURROGATES = re.compile("[\ud800-\udfff]")


def _as_int(v: object, lo: int, hi: int) -> tuple[int, bool]:
    """(value, ok): an int (or a finite whole float) in ``[lo, hi)``; (-1, True) when absent,
    (-1, False) when present but unusable (huge, infinite, NaN, text, a list...)."""
    if v is None:
        return -1, True
    if type(v) is int:
        return (v, True) if lo <= v < hi else (-1, False)
    if type(v) is float and v == v and lo <= v < hi and v == int(v):
        return int(v), True
    return -1, False


def _clean(s: str) -> str:
    """A string Arrow can store: lone surrogates (a JSON ``\\ud800`` escape) become U+FFFD."""
    return _SURROGATES.sub("\ufffd", s) if not s.isascii() and _SURROGATES.search(s) else s


def _jsonl_fallback(data: bytes) -> tuple[dict[str, list], np.ndarray, np.ndarray, int]:
    """Line-by-line JSONL reading for files Arrow's reader rejects (bad lines, mixed types).

    A line that is not a JSON object (or nests too deeply to parse), or whose ``ts_ns``,
    ``pid`` or ``node`` is not a usable integer (huge, infinite, NaN, text), is kept as text
    and marked bad; a ``node`` given as a host name only leaves the node unknown.
    """
    cols: dict[str, list] = {k: [] for k in ("ts_ns", "node", "pid", "stream", "text")}
    bad, line_nos, blank = [], [], 0
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    for i, raw in enumerate(parts):
        if not raw.strip():
            blank += 1
            continue
        s = raw.decode("utf-8", errors="replace").rstrip("\r")
        try:
            obj = json.loads(s)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError):
            obj, is_bad = {"text": s}, True
        else:
            is_bad = False
        ts, ok_ts = _as_int(obj.get("ts_ns"), 0, _MAX_TS_NS)
        node_v = obj.get("node")
        node, ok_node = _as_int(node_v, -1, 2**31)
        ok_node = ok_node or isinstance(node_v, str)  # a host name: the node number is unknown
        pid, ok_pid = _as_int(obj.get("pid"), -1, 2**63)
        is_bad = is_bad or not (ok_ts and ok_node and ok_pid)
        text = obj.get("text")
        text = text if isinstance(text, str) else ("" if text is None else str(text))
        stream = obj.get("stream")
        stream = stream if isinstance(stream, str) else str(stream or "")
        cols["ts_ns"].append(ts)
        cols["node"].append(node)
        cols["pid"].append(pid)
        cols["stream"].append(_clean(stream))
        cols["text"].append(_clean(text))
        bad.append(is_bad)
        line_nos.append(i + 1)
    return cols, np.asarray(bad, bool), np.asarray(line_nos, np.int64), blank


def _bad_note(label: str, line_no: np.ndarray, bad: np.ndarray) -> list[str]:
    """One note naming the file and the first line numbers of its unusable records."""
    if not bad.any():
        return []
    lines = line_no[bad]
    shown = ", ".join(str(int(x)) for x in lines[:8]) + (", ..." if len(lines) > 8 else "")
    return [f"{label}: {len(lines)} unusable records kept as text (not a JSON object, or ts_ns/"
            f"pid/node not a usable integer) at line{'s' if len(lines) > 1 else ''} {shown}"]


def read_jsonl(path: str | os.PathLike, ctx: ParseContext, label: str | None = None) -> FileResult:
    """A recorder ``logs/*.jsonl`` file → normalized line table (time from ``ts_ns``)."""
    path = Path(path)
    data = _read_bytes(path)
    # 1-based numbers of the non-blank lines, found on the raw bytes: empty lines by their
    # length; lines starting with whitespace (rare: records start with "{") are checked one by one
    buf = np.frombuffer(data, np.uint8)
    nl = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], nl + 1])
    ends = np.concatenate([nl, [len(buf)]])
    nonblank = (ends - starts) > 0
    first = buf[np.minimum(starts, max(len(buf) - 1, 0))] if len(buf) else np.zeros(len(starts), np.uint8)
    for i in np.flatnonzero(nonblank & np.isin(first, (9, 11, 12, 13, 32))).tolist():
        nonblank[i] = bool(data[starts[i]:ends[i]].strip())
    if len(buf) == 0 or buf[-1] == 10:  # nothing after the last newline: not a line
        nonblank = nonblank[:-1]
    line_no = np.flatnonzero(nonblank).astype(np.int64) + 1
    blank = int((~nonblank).sum())
    try:
        data.decode("utf-8")
        replaced = False
    except UnicodeDecodeError:
        replaced = True
    # Arrow's reader only for files whose every record starts with "{": it segfaults on a
    # top-level `null` line (pyarrow 26), and anything else unusual needs the line-by-line path
    objects_only = bool(np.all(first[:len(nonblank)][nonblank] == ord("{")))
    try:
        if replaced or not objects_only:
            raise pa.ArrowInvalid("not UTF-8 or not one JSON object per line")
        t = pj.read_json(pa.BufferReader(data), parse_options=pj.ParseOptions(
            explicit_schema=_JSONL_SCHEMA, unexpected_field_behavior="ignore"))
        if t.num_rows != len(line_no):
            raise pa.ArrowInvalid("row count differs from line count")
        ts = t.column("ts_ns").fill_null(-1).to_numpy().astype(np.int64)
        node = t.column("node").fill_null(-1).to_numpy().astype(np.int64)
        pid = t.column("pid").fill_null(-1).to_numpy().astype(np.int64)
        stream = t.column("stream").combine_chunks().fill_null("")
        texts = t.column("text").combine_chunks().fill_null("")
        bad = (ts < 0) | (ts >= _MAX_TS_NS) | (node >= 2**31)
        node = np.where(node >= 2**31, -1, node)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        cols, bad, line_no, blank = _jsonl_fallback(data)
        ts = np.asarray(cols["ts_ns"], np.int64)
        node = np.asarray(cols["node"], np.int64)
        pid = np.asarray(cols["pid"], np.int64)
        stream = pa.array(cols["stream"], pa.string())
        texts = pa.array(cols["text"], pa.string())
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    if isinstance(stream, pa.ChunkedArray):
        stream = stream.combine_chunks()
    n = len(texts)
    flags = _utf8_flags(texts, replaced)
    flags |= np.where(bad, FLAG_BAD_RECORD, 0).astype(np.int32)
    texts = _strip_ansi(texts)
    groups, matched, _, _, _, fmt = _match_formats(texts, ctx, False, 0, 0)
    pid = _pid_col(groups, pid)
    has_ts = ts >= 0
    src = _ffill_index(has_ts)
    wall = np.where(src >= 0, ts[np.maximum(src, 0)], -1)
    flags |= np.where(~has_ts, FLAG_NO_TIMESTAMP, 0).astype(np.int32)
    flags |= np.where(_backwards(pid, wall) & has_ts, FLAG_BACKWARDS, 0).astype(np.int32)
    table = _table(label or str(path), line_no, wall, np.ones(n, np.int64),
                   np.clip(node, -1, 2**31 - 1).astype(np.int32), pid, stream, groups, texts, flags)
    return FileResult(table, fmt, blank, _bad_note(label or str(path), line_no, bad))


def _table(file: str, line_no, wall, res, node, pid, stream, groups, text, flags) -> pa.Table:
    n = len(text)
    return pa.Table.from_arrays(
        [
            pa.array([file] * n, pa.string()),
            pa.array(np.asarray(line_no, np.int64)),
            pa.array(np.asarray(wall, np.int64)),
            pa.array(np.asarray(res, np.int64)),
            pa.array(np.asarray(node, np.int32)),
            pa.array(np.asarray(pid, np.int64)),
            stream.cast(pa.string()),
            groups["level"].cast(pa.string()),
            groups["logger"].cast(pa.string()),
            groups["msg"].cast(pa.string()),
            text.cast(pa.string()),
            pa.array(np.asarray(flags, np.int32)),
        ],
        schema=LINE_SCHEMA,
    )
