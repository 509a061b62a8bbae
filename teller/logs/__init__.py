"""Logs: read, parse, mine templates and align every line to (request, step) (docs/design.md §5.6).

``align_run(RUN)`` reads ``RUN/logs/*.jsonl`` (recorder), ``RUN/logs/*.log|*.txt`` and any extra
plain files, parses them with the format presets of :mod:`teller.logs.formats`, finds request
ids (:mod:`teller.logs.ids`), mines drain3 templates (:mod:`teller.logs.templates`), aligns each
line with :mod:`teller.logs.align` against ``steps.parquet``/``requests.parquet`` and writes
``RUN/log_alignment.parquet``, one row per line:

==================  ===========================================================================
line_no             int64, global order: files in the order read (recorder JSONL first, then
                    plain files, each sorted by name; explicit files last), lines in file order
file, file_line     the file (relative to RUN when inside it) and the 1-based line number in it
ts_ns               τ = wall_ns − clock.t0_unix_ns; −1 when unknown
wall_ns             wall-clock Unix ns (recorder arrival time, or parsed from the text); −1
node, pid, stream   where the line came from (−1 / "" when unknown)
level, logger       parsed (vLLM's logger is its file info, e.g. ``core.py``)
text, message       the line (ANSI codes removed) and its message part
template_id         drain3 cluster id; ``template`` its final template text
request_ids         list<string>: request ids as named in the line
request_id          the known request the line was aligned by (null otherwise)
step_id, step_num   the aligned step (−1 when unaligned)
rule                request_id | request_id_nearest | time_window | unaligned
flags               bits: 1 non-UTF-8 replaced, 2 no timestamp (inherited from the previous
                    line), 4 time went backwards, 8 unusable record/timestamp kept as text
==================  ===========================================================================

Tolerance: ``tolerance_ms`` (default 5 ms, for the recorder's ns arrival times), raised per line
to the resolution of its timestamp (1 s for vLLM's second-resolution times, 1 ms for Python
logging). Without ``clock.t0_unix_ns`` in run.json (foreign traces) no line can be put on τ:
lines naming a known request are aligned to that request's earliest step
(``request_id_nearest``), the rest are ``unaligned``, and the summary says why.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.errors import TellerError
from teller.logs.align import RULES, align
from teller.logs.formats import Preset, all_presets, custom_preset, preset
from teller.logs.ids import (
    DEFAULT_ID_PATTERNS,
    DEFAULT_SUFFIX_RULES,
    RequestIndex,
    extract_ids_flat,
)
from teller.logs.readers import (
    FLAG_BACKWARDS,
    FLAG_BAD_RECORD,
    FLAG_NO_TIMESTAMP,
    FLAG_NON_UTF8,
    LINE_SCHEMA,
    ParseContext,
    read_jsonl,
    read_plain,
)
from teller.logs.templates import mine_templates
from teller.rundir import RunDir

__all__ = ["align_run", "build_alignment", "ALIGNMENT_SCHEMA", "RULES"]

DEFAULT_TOLERANCE_MS = 5.0
PLAIN_GLOBS = ("*.log", "*.txt")
STEP_COLUMNS = ("step_id", "step_num", "rank", "pid", "start_ns", "end_ns")
REQUEST_COLUMNS = ("request_id", "step_id")

ALIGNMENT_SCHEMA = pa.schema(
    [
        ("line_no", pa.int64()),
        ("file", pa.dictionary(pa.int32(), pa.string())),
        ("file_line", pa.int64()),
        ("ts_ns", pa.int64()),
        ("wall_ns", pa.int64()),
        ("node", pa.int32()),
        ("pid", pa.int64()),
        ("stream", pa.dictionary(pa.int32(), pa.string())),
        ("level", pa.dictionary(pa.int32(), pa.string())),
        ("logger", pa.dictionary(pa.int32(), pa.string())),
        ("text", pa.string()),
        ("message", pa.string()),
        ("template_id", pa.int32()),
        ("template", pa.dictionary(pa.int32(), pa.string())),
        ("request_ids", pa.list_(pa.string())),
        ("request_id", pa.string()),
        ("step_id", pa.int64()),
        ("step_num", pa.int64()),
        ("rule", pa.dictionary(pa.int8(), pa.string())),
        ("flags", pa.int32()),
    ]
)


def _presets(fmt: str | None, regex: str | None, time_format: str | None) -> tuple[list[Preset], bool]:
    if regex:
        if fmt and fmt != "auto":
            raise TellerError("give either --format PRESET or --regex (with --time-format), not both")
        return [custom_preset(regex, time_format)], True
    if fmt and fmt != "auto":
        return [preset(fmt)], True
    return all_presets(), False


def _label(path: Path, run: Path) -> str:
    try:
        return str(path.resolve().relative_to(run.resolve()))
    except ValueError:
        return str(path)


def _load_steps(rd: RunDir) -> tuple[dict[str, np.ndarray] | None, str | None]:
    if not rd.has_table("steps"):
        return None, f"no steps.parquet in {rd.path}: nothing to align to (run `teller reconstruct {rd.path}`)"
    t = rd.read_table("steps")
    if t.num_rows and "rule" in t.column_names and t.column("rule")[0].as_py() == "fixed windows":
        return None, (f"{rd.artefact('steps.parquet')}: the steps are fixed windows (no STEP ranges nor profiler steps): "
                      "lines are not aligned to windows; record STEP ranges or name steps with `teller reconstruct --step-pattern`")
    missing = [c for c in STEP_COLUMNS if c not in t.column_names]
    if missing:
        raise TellerError(f"{rd.artefact('steps.parquet')}: missing columns {missing}; rewrite it with `teller reconstruct {rd.path}`")
    cols = {c: t.column(c).combine_chunks().fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
            for c in STEP_COLUMNS}
    o = np.argsort(cols["step_id"], kind="stable")
    return {c: v[o] for c, v in cols.items()}, None


def _load_membership(rd: RunDir, step_ids: np.ndarray, suffix_rules: tuple[str, ...]
                     ) -> tuple[RequestIndex | None, np.ndarray, np.ndarray, int]:
    """Request index and (request code, step index) rows; also rows whose step is unknown."""
    empty = np.zeros(0, np.int64)
    if not rd.has_table("requests") or len(step_ids) == 0:
        return None, empty, empty, 0
    t = rd.read_table("requests")
    missing = [c for c in REQUEST_COLUMNS if c not in t.column_names]
    if missing:
        raise TellerError(f"{rd.artefact('requests.parquet')}: missing columns {missing}; rewrite it with `teller reconstruct {rd.path}`")
    rid = t.column("request_id").combine_chunks().cast(pa.string())
    sid = t.column("step_id").combine_chunks().fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    valid = np.asarray(rid.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    pos = np.minimum(np.searchsorted(step_ids, sid), len(step_ids) - 1)
    known_step = valid & (step_ids[pos] == sid)
    rid_ok = rid.filter(pa.array(known_step))
    index = RequestIndex(rid_ok, suffix_rules)
    codes = index.codes(rid_ok)
    return index, codes.astype(np.int64), pos[known_step].astype(np.int64), int((~known_step).sum())


def _wall_ns(v: Any) -> int | None:
    """A run.json wall-clock value in ns, or None when absent or not a plausible time (a
    damaged or hand-edited run.json must not overflow the τ arithmetic)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return None
    return int(v) if 0 <= v < 2**62 else None


def _dict(arr: pa.Array, typ: pa.DataType) -> pa.Array:
    return arr.cast(pa.string()).dictionary_encode().cast(typ)


#: share of the timed lines outside the trace's span above which the two clocks are said to disagree
OUTSIDE_SHARE = 0.5


def _outside_span_note(tau: np.ndarray, start: np.ndarray, end: np.ndarray, tol: np.ndarray) -> str | None:
    """Words for log lines whose times fall outside the steps' span, when they are most of them:
    the logs' clock and the trace's disagree (skew, a time zone, logs of another run), so time
    alignment cannot hold and only request ids align them. None when they mostly fit."""
    if not len(tau) or not len(start):
        return None
    slack = int(np.max(tol)) if np.size(tol) else 0
    lo, hi = int(np.min(start)) - slack, int(np.max(end)) + slack
    out = int(((tau < lo) | (tau > hi)).sum())
    if out <= OUTSIDE_SHARE * len(tau):
        return None
    med = int(np.median(tau))
    where = "before" if med < lo else "after" if med > hi else "around"
    off = (lo - med) if med < lo else (med - hi) if med > hi else 0
    return (f"{out:,} of {len(tau):,} timed log lines fall outside the steps' time span (their median is "
            f"{off / 1e9:.3g} s {where} it): the logs' clock and the trace's disagree (clock skew, a time zone, or "
            "logs of another run), so lines align by request id only; set clock.utc_offset_s in run.json if it is a zone")


def align_run(run: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """Parse and align every log line of a run, write ``RUN/log_alignment.parquet``, return a summary.

    Options are those of :func:`build_alignment`.
    """
    table, summary = build_alignment(run, **options)
    summary["output"] = str(RunDir(run).write_table(table, "log_alignment"))
    return summary


def build_alignment(
    run: str | os.PathLike,
    fmt: str | None = None,
    regex: str | None = None,
    time_format: str | None = None,
    tolerance_ms: float = DEFAULT_TOLERANCE_MS,
    files: Iterable[str | os.PathLike] | None = None,
    id_patterns: tuple[str, ...] = DEFAULT_ID_PATTERNS,
    suffix_rules: tuple[str, ...] = DEFAULT_SUFFIX_RULES,
    utc_offset_s: int | None = None,
) -> tuple[pa.Table, dict[str, Any]]:
    """Parse and align every log line of a run: (alignment table, summary).

    ``fmt`` forces a preset for the plain files (default: detected per file), ``regex`` +
    ``time_format`` a user format (recorder JSONL text is matched against every format, since
    its time comes from ``ts_ns``); ``files`` adds plain log files outside ``RUN/logs``;
    ``utc_offset_s`` is the offset of naive timestamps (default: run.json
    ``clock.utc_offset_s``, else this machine's zone); ``id_patterns``/``suffix_rules`` replace
    the request-id rules of :mod:`teller.logs.ids`.
    """
    rd = RunDir(run)
    if not rd.path.is_dir():
        raise TellerError(f"{rd.path}: no such run directory; make one with `teller ingest` or `teller record`")
    if tolerance_ms < 0:
        raise TellerError(f"--tolerance-ms {tolerance_ms}: must be ≥ 0")
    presets, forced = _presets(fmt, regex, time_format)
    info = rd.read_info()
    clock = info.clock or {}
    notes: list[str] = []
    t0 = _wall_ns(clock.get("t0_unix_ns"))
    if t0 is None and clock.get("t0_unix_ns") is not None:
        notes.append(f"{rd.artefact('run.json')}: clock.t0_unix_ns {str(clock.get('t0_unix_ns'))[:40]!r} "
                     "is not a wall-clock time in ns; ignored")
    start_wall = info.start_wall if isinstance(info.start_wall, (int, float)) else None
    ref = t0 if t0 is not None else _wall_ns(start_wall * 1e9 if start_wall else None)
    off = utc_offset_s if utc_offset_s is not None else clock.get("utc_offset_s")
    off = int(off) if isinstance(off, (int, float)) and not isinstance(off, bool) and abs(off) < 86_400 else None
    ctx = ParseContext(presets, forced, ref, off)
    # recorder JSONL: the time is ts_ns whatever the text's format, so the text is always matched
    # against every format (a forced/user format first)
    ctx_jsonl = ParseContext(presets + [p for p in all_presets() if p.name not in {x.name for x in presets}],
                             False, ref, off)

    jsonl = rd.log_files()
    plain: list[Path] = []
    if rd.logs_dir.is_dir():
        plain = sorted({p for g in PLAIN_GLOBS for p in rd.logs_dir.glob(g)})
    seen = {p.resolve() for p in jsonl + plain}
    for f in files or ():
        p = Path(f)
        if not p.is_file():
            raise TellerError(f"{p}: no such log file; check the --file path")
        if p.resolve() not in seen:
            seen.add(p.resolve())
            plain.append(p)

    tables, formats, blank = [], {}, 0
    for p in jsonl:
        r = read_jsonl(p, ctx_jsonl, _label(p, rd.path))
        tables.append(r.table)
        formats[_label(p, rd.path)] = r.format
        blank += r.blank
        notes.extend(r.notes)
    naive_plain = False
    for p in plain:
        r = read_plain(p, ctx, _label(p, rd.path))
        tables.append(r.table)
        formats[_label(p, rd.path)] = r.format
        blank += r.blank
        fmt_p = next((x for x in presets if x.name == r.format), None)
        if fmt_p is not None and fmt_p.time_format and r.table.num_rows:
            naive_plain = True
            if not fmt_p.has_year:
                src = "the run's start" if ref is not None else "the file's modification time"
                notes.append(f"{_label(p, rd.path)}: {r.format} timestamps have no year; taken from {src}; "
                             "second resolution, so the tolerance for these lines is at least 1 s")
    lines = pa.concat_tables(tables) if tables else LINE_SCHEMA.empty_table()
    lines = lines.combine_chunks()
    n = lines.num_rows
    if naive_plain and ctx.utc_offset_s is None:
        notes.append("plain-log times without an offset were read as this machine's local time; "
                     "set clock.utc_offset_s in run.json (or pass utc_offset_s) if the logs came from another zone")

    wall = lines.column("wall_ns").to_numpy().astype(np.int64)
    res = lines.column("res_ns").to_numpy().astype(np.int64)
    pid = lines.column("pid").to_numpy().astype(np.int64)
    flags = lines.column("flags").to_numpy().astype(np.int32)
    tau_known = (wall >= 0) & (t0 is not None)
    tau = np.where(tau_known, wall - (t0 or 0), -1).astype(np.int64)
    tol = np.maximum(np.int64(round(tolerance_ms * 1e6)), res)
    if t0 is None and n:
        notes.append("run.json has no clock.t0_unix_ns: log times cannot be placed on the run's time base; "
                     "lines are aligned by request id only, the rest are unaligned")

    texts = lines.column("text").combine_chunks() if n else pa.array([], pa.string())
    id_off, id_vals = extract_ids_flat(texts, id_patterns)
    named = pa.ListArray.from_arrays(pa.array(id_off.astype(np.int32)), id_vals)

    steps, why = _load_steps(rd)
    n_known_req = 0
    missing_rows = 0
    if steps is None:
        if n:
            notes.append(why or "")
        step_idx = np.full(n, -1, np.int64)
        rule = np.full(n, RULES.index("unaligned"), np.int8)
        req_code = np.full(n, -1, np.int64)
        index = None
    else:
        index, mem_req, mem_step, missing_rows = _load_membership(rd, steps["step_id"], suffix_rules)
        if missing_rows:
            notes.append(f"requests.parquet: {missing_rows} rows name a step_id absent from steps.parquet; ignored")
        if index is None:
            pl = pr = pp = np.zeros(0, np.int64)
        else:
            n_known_req = len(index.ids)
            pl, pr, pp = index.pairs(id_off, id_vals)
        step_idx, rule, req_code = align(tau, tau_known, tol, pid, pl, pr, pp, steps["pid"],
                                         steps["start_ns"], steps["end_ns"], mem_req, mem_step)

        note = _outside_span_note(tau[tau_known], steps["start_ns"], steps["end_ns"], tol)
        if note:
            notes.append(note)

    tid, tmpl = mine_templates(lines.column("message").combine_chunks() if n else pa.array([], pa.string()))

    aligned = step_idx >= 0
    if steps is not None and len(steps["step_id"]):
        sid = np.where(aligned, steps["step_id"][np.maximum(step_idx, 0)], -1)
        snum = np.where(aligned, steps["step_num"][np.maximum(step_idx, 0)], -1)
    else:
        sid = snum = np.full(n, -1, np.int64)
    if index is not None and len(index.ids):
        req_str = index.ids_arrow.take(pa.array(np.maximum(req_code, 0)))
        request_id = pc.if_else(pa.array(req_code >= 0), req_str, pa.scalar(None, pa.string()))
    else:
        request_id = pa.nulls(n, pa.string())
    out = pa.Table.from_arrays(
        [
            pa.array(np.arange(n, dtype=np.int64)),
            _dict(lines.column("file").combine_chunks() if n else pa.array([], pa.string()), ALIGNMENT_SCHEMA.field("file").type),
            lines.column("file_line").combine_chunks() if n else pa.array([], pa.int64()),
            pa.array(tau),
            pa.array(wall),
            lines.column("node").combine_chunks() if n else pa.array([], pa.int32()),
            pa.array(pid),
            _dict(lines.column("stream").combine_chunks() if n else pa.array([], pa.string()), ALIGNMENT_SCHEMA.field("stream").type),
            _dict(lines.column("level").combine_chunks() if n else pa.array([], pa.string()), ALIGNMENT_SCHEMA.field("level").type),
            _dict(lines.column("logger").combine_chunks() if n else pa.array([], pa.string()), ALIGNMENT_SCHEMA.field("logger").type),
            texts,
            lines.column("message").combine_chunks() if n else pa.array([], pa.string()),
            pa.array(tid.astype(np.int32)),
            _dict(tmpl, ALIGNMENT_SCHEMA.field("template").type),
            named,
            request_id,
            pa.array(sid.astype(np.int64)),
            pa.array(snum.astype(np.int64)),
            pa.DictionaryArray.from_arrays(pa.array(rule.astype(np.int8)), pa.array(list(RULES))),
            pa.array(flags),
        ],
        schema=ALIGNMENT_SCHEMA,
    )
    counts = {r: int((rule == i).sum()) for i, r in enumerate(RULES)}
    assert sum(counts.values()) == n  # every line has exactly one rule
    summary: dict[str, Any] = {"lines": n, "files": len(jsonl) + len(plain), **counts,
                               "blank_lines_skipped": blank,
                               "non_utf8": int((flags & FLAG_NON_UTF8 > 0).sum()),
                               "no_timestamp": int((flags & FLAG_NO_TIMESTAMP > 0).sum()),
                               "backwards": int((flags & FLAG_BACKWARDS > 0).sum()),
                               "bad_records": int((flags & FLAG_BAD_RECORD > 0).sum()),
                               "templates": int(len(np.unique(tid))) if n else 0,
                               "steps": 0 if steps is None else int(len(steps["step_id"])),
                               "known_requests": n_known_req,
                               "formats": formats, "notes": notes}
    return out, summary
