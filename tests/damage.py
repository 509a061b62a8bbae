"""Damaged variants of real traces, for the reader fuzz tests and ``benchmarks/fuzz_readers.py``.

Every builder takes the bytes (or path) of an intact input and a ``random.Random`` and writes one
damaged copy; it returns what was planted (``{"planted": k, "expect": ...}``) so that a checker can
tell a correct answer from a silently wrong one. Nothing here reads TELLER's code.
"""

from __future__ import annotations

import gzip
import json
import random
import shutil
import sqlite3
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).parent
EXTERNAL = HERE / "data" / "external"
KINETO_FILES = sorted((EXTERNAL / "kineto").glob("*.json*"))
NSYS_FILES = sorted((EXTERNAL / "nsys").glob("*.sqlite"))


# --------------------------------------------------------------------------------------------
# Kineto JSON


def kineto_text(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


def kineto_doc(path: Path) -> dict:
    doc = json.loads(kineto_text(path))
    return doc if isinstance(doc, dict) else {"traceEvents": doc}


def _write_doc(doc: dict, out: Path, gz: bool = True) -> Path:
    text = json.dumps(doc, indent=1).encode()  # NaN/Infinity and \ud800 escapes pass through
    out = out.with_name(out.name + (".json.gz" if gz else ".json"))
    out.write_bytes(gzip.compress(text, 6) if gz else text)
    return out


def _events(doc: dict, rng: random.Random, k: int, pred: Callable[[dict], bool]) -> list[dict]:
    evs = [e for e in doc["traceEvents"] if isinstance(e, dict) and pred(e)]
    return rng.sample(evs, min(k, len(evs)))


def _is_x(e: dict) -> bool:
    return e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))


def _is_host_x(e: dict) -> bool:
    return _is_x(e) and e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset", "gpu_user_annotation")


def k_truncate(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    """Cut the JSON text at a random point (written as plain .json)."""
    text = kineto_text(src)
    cut = rng.randrange(len(text) // 10, len(text) - 1)
    p = out.with_name(out.name + ".json")
    p.write_bytes(text[:cut])
    return p, {"cut_at": cut}


def k_truncate_gz(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    """Cut the gzip stream at a random point."""
    data = gzip.compress(kineto_text(src), 6)
    cut = rng.randrange(len(data) // 10, len(data) - 1)
    p = out.with_name(out.name + ".json.gz")
    p.write_bytes(data[:cut])
    return p, {"cut_at": cut}


def k_flip_json(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    """One byte of the JSON text flipped; gzip stream intact."""
    text = bytearray(kineto_text(src))
    i = rng.randrange(len(text) // 10, len(text))
    text[i] ^= 1 << rng.randrange(8)
    p = out.with_name(out.name + ".json.gz")
    p.write_bytes(gzip.compress(bytes(text), 6))
    return p, {"flipped": i}


def k_flip_gz(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    """One byte of the compressed stream flipped (after the header, before the trailer)."""
    data = bytearray(gzip.compress(kineto_text(src), 6))
    i = rng.randrange(20, max(21, len(data) - 8))
    data[i] ^= 1 << rng.randrange(8)
    p = out.with_name(out.name + ".json.gz")
    p.write_bytes(bytes(data))
    return p, {"flipped": i}


_SWAPS: list[tuple[str, Any]] = [
    ("ts", "abc"), ("ts", [1]), ("ts", None), ("ts", True), ("dur", "x"), ("dur", {"a": 1}),
    ("pid", {"p": 1}), ("pid", 1.5), ("tid", [None]), ("name", 123), ("name", None),
    ("cat", 7), ("cat", ["kernel"]), ("args", "text"), ("args", [1, 2]), ("ph", 5), ("ph", None),
]


def k_type_swap(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    doc = kineto_doc(src)
    evs = _events(doc, rng, 8, lambda e: "ph" in e)
    for e in evs:
        key, val = rng.choice(_SWAPS)
        e[key] = val
    return _write_doc(doc, out), {"planted": len(evs)}


_HUGE: list[tuple[str, Any]] = [
    ("ts", 1e300), ("dur", 1e25), ("ts", -1e300), ("dur", 10**40), ("pid", 10**30),
    ("tid", -(10**25)), ("ts", 10**30),
]


def k_huge(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    doc = kineto_doc(src)
    evs = _events(doc, rng, 6, _is_x)
    for e in evs:
        key, val = rng.choice(_HUGE)
        e[key] = val
        if rng.random() < 0.3:
            e.setdefault("args", {})["correlation"] = 10**40
    return _write_doc(doc, out), {"planted": len(evs)}


def k_nonfinite(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    doc = kineto_doc(src)
    evs = _events(doc, rng, 6, _is_x)
    for e in evs:
        e[rng.choice(("ts", "dur"))] = rng.choice((float("nan"), float("inf"), float("-inf")))
    return _write_doc(doc, out), {"planted": len(evs)}


def k_surrogate(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    doc = kineto_doc(src)
    evs = _events(doc, rng, 6, _is_x)
    for e in evs:
        where = rng.choice(("name", "cat", "args"))
        if where == "args":
            e.setdefault("args", {})[rng.choice(("note", "\udfffkey"))] = "bad \ud800 value"
        else:
            e[where] = str(e.get(where, "")) + "\ud800"
    return _write_doc(doc, out), {"planted": len(evs)}


def k_duplicates(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    """Exact copies of host events appended (same kind, name, thread, start, end, args)."""
    doc = kineto_doc(src)
    evs = _events(doc, rng, 12, _is_host_x)
    doc["traceEvents"].extend(json.loads(json.dumps(e)) for e in evs)
    return _write_doc(doc, out), {"planted": len(evs), "expect": "duplicates"}


def k_absurd_duration(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    doc = kineto_doc(src)
    evs = _events(doc, rng, 5, _is_host_x)
    for e in evs:
        e["dur"] = rng.choice((1e12, 3.5e13, 8.9e15, 10**14))
    return _write_doc(doc, out), {"planted": len(evs), "expect": "repaired"}


def k_deep(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    """One event's args replaced by a 100,000-deep nested list (built as text)."""
    text = kineto_text(src).decode("utf-8")
    i = text.find('"args"', rng.randrange(len(text) // 2))
    if i < 0:
        i = text.find('"args"')
    depth = 100_000
    deep = '"args": {"x": ' + "[" * depth + "]" * depth + "},"
    text = text[:i] + deep + text[i:]
    p = out.with_name(out.name + ".json.gz")
    p.write_bytes(gzip.compress(text.encode(), 6))
    return p, {}


KINETO_DAMAGE: dict[str, Callable] = {
    "truncate": k_truncate,
    "truncate_gz": k_truncate_gz,
    "flip_json": k_flip_json,
    "flip_gz": k_flip_gz,
    "type_swap": k_type_swap,
    "huge": k_huge,
    "nonfinite": k_nonfinite,
    "surrogate": k_surrogate,
    "duplicates": k_duplicates,
    "absurd_duration": k_absurd_duration,
    "deep": k_deep,
}


# --------------------------------------------------------------------------------------------
# Nsight Systems SQLite


def _copy(src: Path, out: Path) -> Path:
    p = out.with_name(out.name + ".sqlite")
    shutil.copyfile(src, p)
    return p


def _tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}


_TIMED = ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY")


def _timed_table(con: sqlite3.Connection, rng: random.Random) -> str:
    have = [t for t in _TIMED if t in _tables(con) and con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]]
    return rng.choice(have)


def n_text_in_time(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    """Text or a blob in the integer ``start``/``end`` column of a few rows."""
    p = _copy(src, out)
    con = sqlite3.connect(p)
    t = _timed_table(con, rng)
    col = rng.choice(("start", "end"))
    rows = [r[0] for r in con.execute(f'SELECT rowid FROM "{t}"')]
    pick = rng.sample(rows, min(5, len(rows)))
    for r in pick:
        val = rng.choice(("garbage", b"\x00\x01blob", "12abc"))
        con.execute(f'UPDATE "{t}" SET "{col}" = ? WHERE rowid = ?', (val, r))
    con.commit()
    con.close()
    return p, {"planted": len(pick), "expect": "rejected_rows", "table": t}


def n_drop_table(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    p = _copy(src, out)
    con = sqlite3.connect(p)
    t = rng.choice(sorted(_tables(con) & {"StringIds", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL",
                                          "TARGET_INFO_SESSION_START_TIME", "CUPTI_ACTIVITY_KIND_MEMCPY"}))
    con.execute(f'DROP TABLE "{t}"')
    con.commit()
    con.close()
    return p, {"dropped": t}


def n_drop_column(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    p = _copy(src, out)
    con = sqlite3.connect(p)
    t = _timed_table(con, rng)
    col = rng.choice(("start", "end", "globalTid", "correlationId", "nameId", "deviceId", "streamId", "globalPid"))
    cols = [r[1] for r in con.execute(f'PRAGMA table_info("{t}")')]
    if col in cols:
        con.execute(f'ALTER TABLE "{t}" DROP COLUMN "{col}"')
    con.commit()
    con.close()
    return p, {"dropped": f"{t}.{col}"}


def n_huge(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    p = _copy(src, out)
    con = sqlite3.connect(p)
    t = _timed_table(con, rng)
    col, val = rng.choice([("start", 2**63 - 1), ("end", -(2**63)), ("correlationId", 2**63 - 1),
                           ("start", 1e300), ("end", 9.9e18), ("globalTid", 2**63 - 1)])
    cols = [r[1] for r in con.execute(f'PRAGMA table_info("{t}")')]
    if col in cols:
        con.execute(f'UPDATE "{t}" SET "{col}" = ? WHERE rowid IN (SELECT rowid FROM "{t}" LIMIT 3)', (val,))
    con.commit()
    con.close()
    return p, {}


def n_huge_epoch(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    p = _copy(src, out)
    con = sqlite3.connect(p)
    if "TARGET_INFO_SESSION_START_TIME" in _tables(con):
        val = rng.choice((2**63 - 1, 1e30, -5, "soon"))
        con.execute("UPDATE TARGET_INFO_SESSION_START_TIME SET utcEpochNs = ?", (val,))
    con.commit()
    con.close()
    return p, {"expect": "no_epoch"}


def n_byte_damage(src: Path, out: Path, rng: random.Random) -> tuple[Path, dict]:
    p = _copy(src, out)
    data = bytearray(p.read_bytes())
    if rng.random() < 0.5:
        data = data[: rng.randrange(100, len(data))]
    else:
        for _ in range(8):
            i = rng.randrange(100, len(data))
            data[i] ^= 0xFF
    p.write_bytes(bytes(data))
    return p, {}


NSYS_DAMAGE: dict[str, Callable] = {
    "text_in_time": n_text_in_time,
    "drop_table": n_drop_table,
    "drop_column": n_drop_column,
    "huge": n_huge,
    "huge_epoch": n_huge_epoch,
    "byte_damage": n_byte_damage,
}


# --------------------------------------------------------------------------------------------
# log lines (recorder JSONL) and run-directory files


_BAD_LOG_LINES: list[bytes] = [
    b'{"ts_ns": 100000000000000000000000000000, "node": 0, "pid": 1, "stream": "stdout", "text": "huge ts"}',
    b'{"ts_ns": 1, "node": 0, "pid": 100000000000000000000000000000, "stream": "stdout", "text": "huge pid"}',
    b'{"ts_ns": 1, "node": 100000000000000000000000000000, "pid": 1, "stream": "stdout", "text": "huge node"}',
    b'{"ts_ns": Infinity, "node": 0, "pid": 1, "stream": "stdout", "text": "inf"}',
    b'{"ts_ns": NaN, "node": 0, "pid": 1, "stream": "stdout", "text": "nan"}',
    b'{"ts_ns": -Infinity, "node": 0, "pid": 1, "stream": "stdout", "text": "-inf"}',
    b'{"ts_ns": 1e300, "node": 0, "pid": 1, "stream": "stdout", "text": "float huge"}',
    b'{"ts_ns": "soon", "node": 0, "pid": 1, "stream": "stdout", "text": "str ts"}',
    b'{"ts_ns": [1], "node": {}, "pid": [], "stream": 5, "text": 7}',
    b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b"[" * 100_000,
    b"\xff\xfe\xfd not json at all",
    b"null",
    b'"just a string"',
]


#: Usable records with odd text: kept, their text repaired (not bad records).
_ODD_LOG_LINES: list[bytes] = [
    b'{"ts_ns": 1, "text": "bad \xff\xfe bytes"}',
    b'{"ts_ns": 1, "text": "lone \\ud800 surrogate"}',
]


def log_lines(rng: random.Random, t0_ns: int, n_good: int = 20, n_bad: int = 6) -> tuple[bytes, int]:
    """A JSONL log body mixing good recorder lines, odd but usable ones and unusable ones;
    returns (bytes, number of unusable lines)."""
    good = [json.dumps({"ts_ns": t0_ns + i * 1_000_000, "node": 0, "pid": 1, "stream": "stdout",
                        "text": f"INFO line {i}"}).encode() for i in range(n_good)]
    bad = rng.sample(_BAD_LOG_LINES, min(n_bad, len(_BAD_LOG_LINES)))
    lines = good + bad + _ODD_LOG_LINES
    rng.shuffle(lines)
    return b"\n".join(lines) + b"\n", len(bad)


# --------------------------------------------------------------------------------------------
# recorded runs (a copy of a run directory as `teller record` wrote it, damaged in place)

RECORDED_RUN = HERE.parent / "examples" / "h200_faulty_op_delay"
HOUR_NS = 3600 * 10**9


def _chunks(run: Path) -> list[Path]:
    return sorted((run / "events").glob("*.parquet"))


def _rewrite(run: Path, fn) -> None:
    import pyarrow.parquet as pq

    for f in _chunks(run):
        pq.write_table(fn(pq.read_table(f)), f)


def _keep_kinds(kinds: set[str]):
    import pyarrow as pa
    import pyarrow.compute as pc

    return lambda t: t.filter(pc.is_in(t["kind"].cast(pa.string()), pa.array(sorted(kinds))))


def r_kernels_only(run: Path, rng: random.Random) -> dict:
    """Only the GPU rows (a trace without its host side)."""
    _rewrite(run, _keep_kinds({"KERNEL", "MEMCPY", "MEMSET"}))
    return {"expect": "no_host"}


def r_single_kernel(run: Path, rng: random.Random) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = _keep_kinds({"KERNEL"})(pa.concat_tables([pq.read_table(f) for f in _chunks(run)]))
    for f in _chunks(run):
        f.unlink()
    k = rng.randrange(t.num_rows)
    pq.write_table(t.slice(k, 1), run / "events" / "471-00000.parquet")
    return {"expect": "no_host", "events": 1}


def r_no_runtime(run: Path, rng: random.Random) -> dict:
    """Ranges and GPU rows but no runtime/driver calls (an nsys export with RUNTIME empty)."""
    _rewrite(run, _keep_kinds({"NVTX_PUSH", "NVTX_POP", "RANGE", "MARKER", "KERNEL", "MEMCPY", "MEMSET", "SYNC"}))
    return {"expect": "unbound_all"}


def r_null_start(run: Path, rng: random.Random) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = rng.choice([c for c in _chunks(run) if pq.ParquetFile(c).metadata.num_rows > 10])
    t = pq.read_table(f)
    start = t.column("start_ns").to_numpy().copy()
    mask = np.zeros(len(start), bool)
    mask[rng.sample(range(len(start)), 3)] = True
    pq.write_table(t.set_column(t.schema.get_field_index("start_ns"), "start_ns", pa.array(start, mask=mask)), f)
    return {"expect": "error", "file": f.name, "words": "null values"}


def r_copied_chunk(run: Path, rng: random.Random, rewrite: bool = False) -> dict:
    """A chunk copied inside events/: its bytes, or (``rewrite``) its rows written again with
    other settings (compression, row groups of 1,000 rows: other row-group statistics)."""
    import pyarrow.parquet as pq

    f = rng.choice(_chunks(run))
    dst = f.with_name(f.stem + " (copy).parquet")
    if rewrite:
        pq.write_table(pq.read_table(f), dst, compression="snappy", row_group_size=1000)
    else:
        shutil.copy(f, dst)
    return {"expect": "copies", "planted": pq.ParquetFile(f).metadata.num_rows}


def r_rewritten_chunk(run: Path, rng: random.Random) -> dict:
    return r_copied_chunk(run, rng, rewrite=True)


def r_corrupt_pages(run: Path, rng: random.Random) -> dict:
    """Bytes flipped in the data pages of one chunk, its footer intact."""
    import pyarrow.parquet as pq

    f = max(_chunks(run), key=lambda c: c.stat().st_size)
    md = pq.ParquetFile(f).metadata
    b = bytearray(f.read_bytes())
    body = len(b) - md.serialized_size - 8
    for _ in range(40):
        i = rng.randrange(4, body)
        b[i] ^= 0xFF
    f.write_bytes(bytes(b))
    return {"expect": "error_or_same", "file": f.name, "words": "move it out of"}


def _drop(col: str):
    def fn(run: Path, rng: random.Random) -> dict:
        _rewrite(run, lambda t: t.drop_columns([col]))
        return {"expect": "error" if col in ("pid", "tid", "start_ns") else "same", "words": col}

    fn.__name__ = f"r_no_{col}"
    return fn


def r_no_events_dir(run: Path, rng: random.Random) -> dict:
    shutil.rmtree(run / "events")
    return {"expect": "error", "file": "events", "words": "missing"}


def r_thread_shift(run: Path, rng: random.Random) -> dict:
    """One host thread's events moved by +1 h (its clock wrong)."""
    import pyarrow.compute as pc

    def fn(t):
        m = pc.equal(t["tid"], 537)
        for c in ("start_ns", "end_ns"):
            t = t.set_column(t.schema.get_field_index(c), c, pc.if_else(m, pc.add(t[c], HOUR_NS), t[c]))
        return t

    _rewrite(run, fn)
    return {"expect": "skew_repaired", "thread": "pid 471 thread 537"}


RECORDED_DAMAGE: dict[str, Callable[[Path, random.Random], dict]] = {
    "kernels_only": r_kernels_only,
    "single_kernel": r_single_kernel,
    "no_runtime": r_no_runtime,
    "null_start": r_null_start,
    "copied_chunk": r_copied_chunk,
    "rewritten_chunk": r_rewritten_chunk,
    "corrupt_pages": r_corrupt_pages,
    "no_args": _drop("args"),
    "no_flags": _drop("flags"),
    "no_layer": _drop("layer"),
    "no_pid": _drop("pid"),
    "no_events_dir": r_no_events_dir,
    "thread_shift": r_thread_shift,
}


def recorded_copy(dst: Path) -> Path:
    """A fresh copy of the bundled recording (``RECORDED_RUN``) to damage."""
    shutil.copytree(RECORDED_RUN, dst)
    return dst
