"""What ``teller ingest``, ``reconstruct``, ``logs`` and ``record`` print when they finish: the
stage's summary dict in two to four lines of words (what came in, what was built, what was
repaired or dropped and why). The dicts themselves stay in ``run.json`` / ``reconstruct.json``;
:func:`counter_lines` prints them whole for ``--verbose``.

Pure functions from dicts to strings, so the wording is tested without running a stage.
"""

from __future__ import annotations

import json
from typing import Any

from rich.markup import escape

#: event kinds (teller.rundir.KINDS) as a user reads them
KIND_WORDS = {
    "NVTX_PUSH": ("range start", "range starts"),
    "NVTX_POP": ("range end", "range ends"),
    "RANGE": ("range", "ranges"),
    "MARKER": ("marker", "markers"),
    "RUNTIME": ("runtime call", "runtime calls"),
    "DRIVER": ("driver call", "driver calls"),
    "KERNEL": ("kernel", "kernels"),
    "MEMCPY": ("copy", "copies"),
    "MEMSET": ("memset", "memsets"),
    "SYNC": ("synchronization", "synchronizations"),
}

#: why the Kineto reader skipped or repaired records (teller.ingest.kineto), in words
REASON_WORDS = {
    "flow": "flow arrows (kept as correlation ids)",
    "metadata": "metadata records",
    "counter": "counter samples",
    "malformed": "malformed records",
    "bad_timestamp": "records with an unusable timestamp",
    "exact_duplicate": "exact duplicates",
    "absurd_duration": "absurd durations clipped",
    "missing_duration": "missing durations set to 0",
    "negative_duration": "negative durations set to 0",
    "invalid_unicode": "names with invalid UTF-8 replaced",
    "salvaged_from_damaged_file": "events salvaged from a damaged file",
    "duplicate_corr_id": "duplicate correlation ids renumbered",
}


def n(count: int, one: str, many: str | None = None) -> str:
    """``n(1, "file")`` → ``1 file``; ``n(7534, "event")`` → ``7,534 events``."""
    return f"{count:,} {one if count == 1 else (many or one + 's')}"


def _kinds(kinds: dict[str, int], top: int = 6) -> str:
    items = sorted(((v, k) for k, v in kinds.items() if v), reverse=True)
    words = [n(v, *KIND_WORDS.get(k, (k.lower(), k.lower() + "s"))) for v, k in items[:top]]
    rest = sum(v for v, _ in items[top:])
    return ", ".join(words + ([f"{rest:,} other"] if rest else []))


def _reasons(by_reason: dict[str, int]) -> str:
    return ", ".join(f"{v:,} {REASON_WORDS.get(k, k.replace('_', ' '))}"
                     for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v)


def _pct(x: float) -> str:
    return "100%" if x >= 1 else f"{x:.1%}"


def ingest_lines(s: dict[str, Any], src: str, out: str) -> list[str]:
    """Two or three lines: what was read, what was written, what was left out or repaired."""
    src, out = escape(str(src)), escape(str(out))
    fmt = s.get("format") or "kineto"
    label = {"kineto": "Kineto trace", "nsys": "Nsight Systems export", "canonical": "canonical run"}.get(fmt, fmt)
    files = n(int(s.get("files", 0)), "file")
    ranks = f", {n(int(s['ranks']), 'rank')}" if s.get("ranks") else ""
    kinds = s.get("out_by_kind") or s.get("kinds") or {}
    events = int(s.get("events_out", s.get("events", 0)))
    if s.get("validated_only"):
        return [f"checked {out} ({label}, {files}): {n(events, 'event')} valid ({_kinds(kinds)}); nothing rewritten"]
    lines = [f"ingested {src} ({label}, {files}{ranks}) into {out}: {n(events, 'event')}"
             + (f" ({_kinds(kinds)})" if kinds else "")]
    notes = []
    skipped = s.get("skipped_by_reason") or s.get("skipped_rows") or {}
    if isinstance(skipped, dict) and sum(skipped.values()):
        notes.append(f"left out {n(sum(skipped.values()), 'record')} that are not timed events: {_reasons(skipped)}")
    repaired = s.get("repaired_by_reason") or {}
    if sum(repaired.values()):
        notes.append(f"repaired {n(sum(repaired.values()), 'record')}: {_reasons(repaired)}")
    dropped = {f: cols for f, cols in (s.get("dropped_columns") or {}).items() if cols}
    if dropped:
        cols = sorted({c for v in dropped.values() for c in v})
        notes.append(f"dropped columns outside the schema: {', '.join(cols)}")
    if s.get("filled_nulls"):
        notes.append(f"filled missing values in {n(len(s['filled_nulls']), 'file')}")
    if s.get("log_files") or s.get("labels"):
        notes.append("copied " + " and ".join(x for x in (n(int(s.get("log_files", 0)), "log file") if s.get("log_files") else "",
                                                            "labels.json" if s.get("labels") else "") if x))
    lines.append("; ".join(notes) if notes else "nothing left out or repaired")
    lines.append(f"next: teller reconstruct {out}")
    return lines


#: reconstruct.json counters of repairs and drops: (key, what is counted, what was done)
_REPAIRS = (
    ("repaired_pops_without_push", "range end", "with no start dropped"),
    ("repaired_negative_duration", "range", "ending before its start set to zero length"),
    ("repaired_partial_overlap", "range", "sticking out of its parent clipped to it"),
    ("truncated", "range", "never closed ended at the last event of its thread"),
    ("duplicate", "record", "repeating an id already seen kept apart"),
    ("dropped_copied_events", "event", "of copied events files left out"),
)


def reconstruct_lines(s: dict[str, Any], run: str) -> list[str]:
    """Three lines: the forest, steps and requests; GPU binding; what was repaired and why."""
    run = escape(str(run))
    rule = s.get("steps_rule") or "?"
    if s.get("steps_detail") and rule != "STEP ranges":
        rule = f"{rule}: {s['steps_detail']}"
    comm = f", {n(int(s['comm_edges']), 'collective edge')}" if s.get("comm_edges") else ""
    it = s.get("iterations") if isinstance(s.get("iterations"), dict) else {}
    if it.get("count"):
        comm += f", {n(int(it['count']), 'engine iteration')}"
    bare = int(s.get("steps_without_detail") or 0)
    if bare:  # teller record --detail-every: the steps between detail windows
        rule += f"; {bare:,} recorded without detail"
    lines = [f"reconstructed {run}: {n(int(s.get('nodes', 0)), 'node')} on {n(int(s.get('threads', 0)), 'thread')}, "
             f"{n(int(s.get('steps', 0)), 'step')} ({rule}), {n(int(s.get('requests', 0)), 'request')}{comm}"]
    gpu, bound = int(s.get("gpu_activity") or 0), int(s.get("gpu_bound") or 0)
    if gpu:
        miss = gpu - bound
        lines.append(f"GPU work: {_pct(bound / gpu)} of {n(gpu, 'kernel, copy or memset', 'kernels, copies and memsets')} "
                     "bound to the host call that launched it"
                     + (f"; {miss:,} with no launching call in the trace" if miss else ""))
    else:
        lines.append("GPU work: none in the trace (host ranges only)")
    fixes = [f"{n(int(s[key]), noun)} {what}" for key, noun, what in _REPAIRS if s.get(key)]
    clocks = s.get("clocks") if isinstance(s.get("clocks"), dict) else {}
    if clocks.get("threads_repaired"):
        fixes.append(f"the clock of {n(int(clocks['threads_repaired']), 'thread')} moved onto the GPU's "
                     f"({int(clocks.get('repaired_rows', 0)):,} rows flagged clock_repaired)")
    line = "repaired: " + "; ".join(fixes) if fixes else "nothing repaired"
    if s.get("reconciled") is False:
        line += "; [bold red]counts do not reconcile[/] (events in ≠ nodes + consumed range ends): see reconstruct.json"
    lines.append(line)
    return lines


def logs_lines(s: dict[str, Any]) -> list[str]:
    """One or two lines: lines read and how they were aligned; lines that could not be read."""
    total = int(s.get("lines", 0))
    by_id = int(s.get("request_id", 0)) + int(s.get("request_id_nearest", 0))
    lines = [f"logs: {n(total, 'line')} from {n(int(s.get('files', 0)), 'file')}, "
             f"{by_id:,} aligned to a step by the request they name, {int(s.get('time_window', 0)):,} by time, "
             f"{int(s.get('unaligned', 0)):,} unaligned; {n(int(s.get('templates', 0)), 'template')}"]
    bad = [(s.get("non_utf8"), "not UTF-8"), (s.get("no_timestamp"), "without a timestamp"),
           (s.get("backwards"), "going back in time"), (s.get("bad_records"), "unreadable records")]
    bad = [f"{int(k):,} {w}" for k, w in bad if k]
    if bad:
        lines.append("log lines kept but marked: " + ", ".join(bad))
    return lines


def record_lines(s: dict[str, Any]) -> list[str]:
    """Two lines: what was recorded, and what to do next (or how the command ended)."""
    logs = s.get("log_lines") or {}
    nlog = sum(logs.values()) if isinstance(logs, dict) else int(logs or 0)
    code = s.get("exit_code")
    run = escape(str(s.get("run")))
    first = (f"recorded {run} ({s.get('collector')} collector): {n(int(s.get('processes', 0)), 'process', 'processes')}, "
             f"{n(int(s.get('event_rows', 0)), 'event')}, {n(nlog, 'log line')}"
             + (f"; [yellow]{int(s['dropped_rows']):,} rows dropped[/] (buffers full: see run.json dropped_records)"
                if s.get("dropped_rows") else ""))
    nxt = f"next: teller reconstruct {run}" if code == 0 else f"[yellow]the command exited with code {code}[/]"
    return [first, nxt]


def counter_lines(title: str, s: dict[str, Any]) -> list[str]:
    """Every counter of a summary, one ``key: value`` a line (``--verbose``)."""
    out = [f"{title}:"]
    for k, v in s.items():
        out.append(f"  {k}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}")
    return out
