"""Kineto / PyTorch-profiler Chrome-trace reader (docs/design.md §3, §4, §14).

``read_kineto(path)`` turns one trace file into the canonical event table; ``ingest_kineto(src,
out)`` turns a file or a folder of per-rank files into a run directory. What it understands:

- every Kineto layout seen in the wild: fractional-µs ``ts``/``dur`` with ``baseTimeNanoseconds``
  (absolute ns = ts·1000 + base), older files whose ``ts`` is already Unix µs, the 2022 format
  (``Runtime``/``Kernel``/``Memcpy``/``Memset``, lowercase ``external id``), ns-resolution traces
  (``displayTimeUnit: "ns"``; ``ts`` stays µs but carries three decimals, which float64 cannot hold
  at Unix-epoch magnitudes, so such files are parsed with exact decimals), CPU-only traces and
  AMD/ROCm traces (``hip*`` calls are ``cuda_runtime`` rows there);
- categories → kinds: ``cuda_runtime``/``Runtime`` → RUNTIME, ``cuda_driver`` → DRIVER, ``kernel`` →
  KERNEL, ``gpu_memcpy`` → MEMCPY, ``gpu_memset`` → MEMSET, ``cuda_sync`` → SYNC, every other
  complete (``X``) event → RANGE, instant events → MARKER, ``B``/``E`` → NVTX_PUSH/NVTX_POP.
  Metadata (``M``), flows (``s``/``f``/``t``: ``ac2g``, ``fwdbwd``) and counters are counted and
  skipped: the correlation id in ``args`` already links host calls and GPU work;
- layer tags from the data file ``layer_rules.toml``, evaluated on the dictionaries of categories
  and names, never per event.

The text is streamed (a ``.gz`` decompressed block by block as it is parsed; only the chunk being
read and what follows it are held) and the ``traceEvents`` array is parsed in chunks of about
``CHUNK_BYTES``. Each chunk is decoded by ``msgspec`` into small typed structs with only the
fields the reader uses, ``ts``/``dur``/``args`` kept as raw JSON text: times are read exactly
from their digits in numpy, the args text is compacted in one pass, columns are built with
comprehensions and numpy/Arrow (no dict per event). A chunk that path does not cover (odd types,
NaN, lone surrogates, 2022 key spellings, invalid UTF-8, ...) is read by the stdlib ``json``
path, which gives the same rows for anything both accept (tests compare the two). A damaged file
(cut gzip, cut or corrupt JSON) yields every complete event that can be read, flagged
``FLAG_REPAIRED`` and reported; a file with nothing readable raises :class:`InputError`.

Hostile values, decided here (each counted, each reason a warning in run.json):

- times: a ``ts``/``dur`` that is not a finite number within ±2^62 ns is unusable (``ts``: the
  row is skipped as ``bad_timestamp``; ``dur``: an absurd duration, set to 0), so no later sum
  overflows int64; a ``baseTimeNanoseconds`` outside that range is ignored;
- absurd durations: an event ending more than ``max(span, 1 h)`` after the file's last event start
  (``span``: first to last start) keeps its start with duration 0, flagged repaired
  (``absurd_duration``), like a missing duration;
- exact duplicates: a row equal to an earlier one in kind, category, name, process, thread,
  device, stream, start, duration and args is a copied record: dropped and counted in
  ``skipped`` (``exact_duplicate``), so the counts still balance;
- lone surrogates (``"\\ud800"`` escapes, not encodable as UTF-8) in names, categories or args
  become U+FFFD, flagged repaired (``invalid_unicode``).
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
import zlib
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from itertools import repeat
from operator import attrgetter
from pathlib import Path
from typing import Any, Iterator

try:  # the typed fast path; without it every chunk takes the stdlib path
    import msgspec
except ImportError:  # pragma: no cover - a declared dependency
    msgspec = None

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.errors import InputError, TellerError
from teller.ingest.common import prepare_out
from teller.rundir import (
    FLAG_DUPLICATE,
    FLAG_REPAIRED,
    GPU_KINDS,
    KIND_CODE,
    KINDS,
    LAYERS,
    RunDir,
    RunInfo,
    events_table,
    strip_api_version,
)

#: ``schemaVersion`` values whose layout this reader was written against.
KNOWN_SCHEMA_VERSIONS = (1,)
#: Bytes of JSON text parsed at once; bounds the Python objects alive during a parse.
CHUNK_BYTES = 4 << 20
#: files with more text than this show a progress bar on a terminal (a few seconds of reading)
PROGRESS_BYTES = 16 << 20
#: Above this many µs a float64 ``ts`` no longer holds whole nanoseconds (ulp > 1 ns).
_EXACT_US = 2.0**43
#: Largest |time| in ns a reader keeps (about year 2116): start + base + duration stay in int64.
_MAX_NS = 2**62
RULES_PATH = Path(__file__).with_name("layer_rules.toml")

# Kineto category (lower-cased) → canonical kind; any other category of a complete event is RANGE.
_CAT_KIND = {
    "cuda_runtime": "RUNTIME",
    "runtime": "RUNTIME",
    "hip_runtime": "RUNTIME",
    "cuda_driver": "DRIVER",
    "driver": "DRIVER",
    "kernel": "KERNEL",
    "gpu_memcpy": "MEMCPY",
    "memcpy": "MEMCPY",
    "gpu_memset": "MEMSET",
    "memset": "MEMSET",
    "cuda_sync": "SYNC",
}
#: Categories of RANGE events that sit on a GPU stream row (pid = device, tid = stream).
_GPU_RANGE_CATS = frozenset({"gpu_user_annotation"})

_K = KIND_CODE
_HOST_CALL = np.array([_K["RUNTIME"], _K["DRIVER"]], np.int8)
_GPU_WORK = np.array([_K[k] for k in GPU_KINDS], np.int8)
#: Kinds Kineto puts on GPU rows (pid = device, tid = stream): GPU work and device-side syncs.
_GPU_KINDS = np.array([_K[k] for k in (*GPU_KINDS, "SYNC")], np.int8)

# Phase classes: timed rows first, then the ones that are counted and skipped.
_X, _I, _B, _E, _META, _FLOW, _COUNTER, _OTHER, _MALFORMED = range(9)
_PH_CLASS = {
    "X": _X,
    "i": _I,
    "I": _I,
    "R": _I,
    "B": _B,
    "E": _E,
    "M": _META,
    "s": _FLOW,
    "f": _FLOW,
    "t": _FLOW,
    "C": _COUNTER,
}
_PH_CLASS_N = {**_PH_CLASS, None: _MALFORMED}
_CLASS_KIND = {_I: _K["MARKER"], _B: _K["NVTX_PUSH"], _E: _K["NVTX_POP"]}
_SKIP_REASON = {_META: "metadata", _FLOW: "flow", _COUNTER: "counter", _MALFORMED: "malformed"}

# Element sizes of the `dtype` names the profiler writes into collective records.
_DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "double": 8,
    "float64": 8,
    "int": 4,
    "int32": 4,
    "long": 8,
    "int64": 8,
    "short": 2,
    "int16": 2,
    "char": 1,
    "int8": 1,
    "byte": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complexhalf": 4,
    "complexfloat": 8,
    "complexdouble": 16,
}

_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_BOUNDARY_S = re.compile(r"\}\s*,\s*\{")
_TS_SAMPLE = re.compile(rb'"ts"\s*:\s*"?(-?\d+)(\.\d*)?')
_RANK_IN_NAME = re.compile(r"rank[_\-.]?(\d+)", re.I)
_FIRST_INT = re.compile(r"-?\d+")
_GRAPH_LAUNCH = re.compile(r"GraphLaunch", re.I)
_WS = b" \t\r\n"
_EMPTY: dict = {}


# --------------------------------------------------------------------------------------------
# layer rules


@dataclass(frozen=True)
class LayerRule:
    category: re.Pattern
    name: re.Pattern
    layer: str


@lru_cache(maxsize=8)
def load_layer_rules(path: str | Path | None = None) -> tuple[LayerRule, ...]:
    """The ordered layer rules of ``layer_rules.toml`` (or ``path``), compiled once."""
    p = Path(path) if path is not None else RULES_PATH
    try:
        doc = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TellerError(
            f"{p}: unreadable layer rules ({e}); fix the TOML or point at another file"
        ) from e
    rules = []
    for i, r in enumerate(doc.get("rule", [])):
        where = f"{p}: rule {i + 1}"
        if not isinstance(r, dict) or r.get("layer") not in LAYERS:
            raise TellerError(f"{where}: 'layer' must be one of {', '.join(LAYERS)}; fix the rule")
        try:
            rules.append(
                LayerRule(
                    re.compile(r.get("category", "")), re.compile(r.get("name", "")), r["layer"]
                )
            )
        except (re.error, TypeError) as e:
            raise TellerError(f"{where}: bad regex ({e}); fix the rule") from e
    return tuple(rules)


def layer_codes(
    cat_codes: np.ndarray,
    cat_dict: list[str],
    name_codes: np.ndarray,
    name_dict: list[str],
    rules: tuple[LayerRule, ...],
) -> np.ndarray:
    """Layer per row as an index into ``("",) + LAYERS``: first matching rule, 0 when none.

    Each rule's regexes run once per dictionary entry; rows only index the resulting masks.
    """
    out = np.zeros(len(cat_codes), np.int8)
    todo = np.ones(len(cat_codes), bool)
    for rule in rules:
        cat_ok = np.fromiter((bool(rule.category.search(c)) for c in cat_dict), bool, len(cat_dict))
        if not cat_ok.any():
            continue
        name_ok = np.fromiter((bool(rule.name.search(s)) for s in name_dict), bool, len(name_dict))
        hit = todo & cat_ok[cat_codes] & name_ok[name_codes]
        out[hit] = LAYERS.index(rule.layer) + 1
        todo &= ~hit
    return out


# --------------------------------------------------------------------------------------------
# bytes and JSON


class _Text:
    """The file's text, block by block, so the whole text is never held: a plain file is read
    as it is parsed, a gzip file decompressed as it is parsed (every member in turn).

    A damaged gzip yields what decompresses before the damage; ``damage`` then names the
    compressed byte where decompression stopped and how many bytes of text came out before it.
    ``consumed``: bytes of the file read so far (progress).
    """

    def __init__(self, path: Path, block: int = 1 << 18):
        self.path, self.block = path, block
        self.damage: list[str] = []
        self.consumed = 0
        try:
            self.f = open(path, "rb")  # closed by close(), after the last block
            self.size = self.f.seek(0, 2)
            self.f.seek(0)
            self.gz = self.f.read(2) == b"\x1f\x8b"
            self.f.seek(0)
        except OSError as e:
            raise InputError(
                path, f"cannot read ({e.strerror or e})", "check the path and permissions"
            ) from e
        if not self.size:
            self.f.close()
            raise InputError(
                path, "empty file", "re-export the trace (torch.profiler export_chrome_trace)"
            )
        self.blocks = self._gunzip() if self.gz else self._plain()

    def close(self) -> None:
        self.f.close()

    def _read(self, pos: int, n: int) -> bytes:
        try:
            self.f.seek(pos)
            b = self.f.read(n)
        except OSError as e:
            raise InputError(
                self.path, f"cannot read ({e.strerror or e})", "check the path and permissions"
            ) from e
        self.consumed = pos + len(b)
        return b

    def _plain(self) -> Iterator[bytes]:
        pos = 0
        while pos < self.size:
            b = self._read(pos, 1 << 22)
            if not b:
                return
            pos += len(b)
            yield b

    def _gunzip(self) -> Iterator[bytes]:
        size, out_n, pos = self.size, 0, 0
        while True:
            d = zlib.decompressobj(wbits=31)
            while pos < size and not d.eof:
                chunk = self._read(pos, self.block)
                saved = d.copy()
                try:
                    got = d.decompress(chunk)
                except zlib.error as e:
                    rec = bytearray()
                    at = pos + _replay_to_error(saved, memoryview(chunk), rec)
                    out_n += len(rec)
                    yield bytes(rec)
                    self.damage.append(
                        f"corrupt gzip data at compressed byte {at} ({e}); "
                        f"{out_n} bytes of text recovered before it"
                    )
                    return
                out_n += len(got)
                yield got
                pos += len(chunk)
            if not d.eof:
                got = d.flush()
                out_n += len(got)
                yield got
                self.damage.append(
                    f"gzip stream ends early (file cut at compressed byte {size}); "
                    f"{out_n} bytes of text recovered"
                )
                return
            pos -= len(d.unused_data)
            if pos >= size:
                return
            if self._read(pos, 2) != b"\x1f\x8b":
                self.damage.append(f"{size - pos} bytes after the gzip stream ignored")
                return


def _replay_to_error(d: Any, chunk: memoryview, out: bytearray) -> int:
    """Feed ``chunk`` to the decompressor ``d`` again in ever smaller pieces, appending what
    decompresses to ``out``; returns the offset in ``chunk`` of the byte that fails."""
    k = 0
    for step in (1 << 14, 1 << 8, 1):
        while k < len(chunk):
            trial = d.copy()
            try:
                got = trial.decompress(chunk[k : k + step])
            except zlib.error:
                break  # the bad byte is in chunk[k : k + step]: narrow down with smaller steps
            out += got
            d = trial
            k += step
    return min(k, len(chunk))


def _skip_ws(buf: bytes | bytearray, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] in _WS:
        i += 1
    return i


def _salvage_members(text: str, decoder: json.JSONDecoder) -> dict[str, Any]:
    """Members of a JSON object fragment (``"k": v, ...``) up to the first unreadable one."""
    out: dict[str, Any] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,{":
            i += 1
        if i >= n or text[i] == "}":
            break
        try:
            key, i = decoder.raw_decode(text, i)
            while i < n and text[i] in " \t\r\n":
                i += 1
            if i >= n or text[i] != ":" or not isinstance(key, str):
                break
            i += 1
            while i < n and text[i] in " \t\r\n":
                i += 1
            out[key], i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            break
    return out


def _json_default(o: Any) -> Any:
    if isinstance(o, Decimal):
        return int(o) if o == o.to_integral_value() else float(o)
    return str(o)


def _make_encoder():
    """Compact JSON text of one value; calls the C encoder directly (half the cost of dumps)."""
    from json import encoder as _enc

    if _enc.c_make_encoder is None:  # pragma: no cover - CPython always has it
        return json.JSONEncoder(
            ensure_ascii=False, separators=(",", ":"), default=_json_default
        ).encode
    c = _enc.c_make_encoder(
        None, _json_default, _enc.c_encode_basestring, None, ":", ",", False, False, True
    )
    return lambda o: "".join(c(o, 0))


_encode = _make_encoder()


#: Unreadable stretches named one by one in the damage notes; the rest are summed up.
_MAX_DAMAGE_NOTES = 20


class _ByteOffsets:
    """Byte offset in the file of a character index of the salvaged text (``offset(k)``).

    Indices asked for mostly grow, so the UTF-8 length of the prefix is extended from the last
    answer instead of re-encoding the text each time (ASCII text: the index itself).
    """

    def __init__(self, text: str, pos: int, n_raw: int):
        self.text, self.ascii = text, text.isascii()
        self.base = pos + n_raw - (len(text) if self.ascii else len(text.encode("utf-8")))
        self.k = self.b = 0

    def __call__(self, k: int) -> int:
        if self.ascii:
            return self.base + k
        if k < self.k:  # a step back: from the start again (callers ask in ascending order)
            self.k = self.b = 0
        self.b += len(self.text[self.k : k].encode("utf-8"))
        self.k = k
        return self.base + self.b


def _parse_one(dec: json.JSONDecoder, text: str, i: int) -> tuple[Any, int]:
    """The JSON value starting at ``text[i]`` and the index after it, or (None, i).

    Parses ``text[i:end]`` where ``end`` follows a ``},{`` boundary; a value that runs past the
    boundary (a nested ``},{`` or one inside a string) is retried up to a boundary at least
    twice as far, so the work stays proportional to the value's length. A parse that fails
    inside the slice (not at its end) is unreadable as it stands.
    """
    n, span = len(text), 0
    while True:
        m = _BOUNDARY_S.search(text, i + span + 1)
        end = m.start() + 1 if m is not None else n
        try:
            obj, k = dec.raw_decode(text[i:end])
            return obj, i + k
        except RecursionError:
            return None, i
        except ValueError as e:
            at_end = getattr(e, "pos", 0) >= end - i - 1 or str(e).startswith("Unterminated")
            if m is None or not at_end:
                return None, i
        span = max(2 * (end - i), m.end() - i)


def _exact_float(text: str) -> Decimal | float:
    """A JSON number of an exact-decimal document: a ``Decimal``, or past its exponent range (a
    damaged ``1e999999999999999999``) what ``json.loads`` makes of it (inf or 0.0), which the
    timestamp checks then count as invalid instead of the parse stopping on ``InvalidOperation``."""
    try:
        return Decimal(text)
    except InvalidOperation:
        return float(text)


class _EventStream:
    """Iterates the ``traceEvents`` array of a Chrome-trace document in chunks.

    The text arrives block by block (:class:`_Text`) into a window that holds the piece being
    parsed and what follows it; consumed text is dropped. The array is split at ``},{``
    boundaries about every ``chunk`` bytes; each piece is decoded by the typed path
    (:func:`_segment_fast`, yielding ``(table, stats)``) or, where that does not apply, by one
    ``json.loads`` call (yielding the list of dicts). A split that fell inside a nested value
    fails to parse and is retried merged with the next piece. What still fails (a cut or
    corrupt region) is read object by object with ``raw_decode`` from there on,
    resynchronising after unreadable bytes. Byte offsets in messages count from the start of
    the text.
    """

    def __init__(self, path: Path, text: _Text, chunk: int = CHUNK_BYTES, fast: bool = True):
        self.path, self.chunk = path, chunk
        self.src = text
        self._blocks = text.blocks
        self.buf = bytearray()
        self.origin = 0  # text offset of buf[0]
        self.eof = False
        self.fast = fast and msgspec is not None
        self.damage: list[str] = []
        self.complete = False
        self.header, start = self._locate()
        self.start = start
        self.exact = self._needs_exact()
        self._loads = (lambda b: json.loads(b, parse_float=_exact_float)) if self.exact else json.loads
        self._decoder = json.JSONDecoder(parse_float=_exact_float) if self.exact else json.JSONDecoder()
        self.trailer: dict[str, Any] = {}
        self.pos = self.start  # text offset consumed so far

    # -- the window
    def _more(self) -> bool:
        """Append the next block of text; False at the end of the text."""
        while not self.eof:
            b = next(self._blocks, None)
            if b is None:
                self.eof = True
                self.src.close()
                return False
            if b:
                self.buf += b
                return True
        return False

    def _fill(self, k: int) -> None:
        """At least ``k`` bytes in the window, unless the text ends first."""
        while len(self.buf) < k and self._more():
            pass

    def _fill_all(self) -> None:
        while self._more():
            pass

    def _ws_from(self, i: int) -> int:
        """The first non-whitespace index at or after ``i`` (reading on as needed)."""
        while True:
            i = _skip_ws(self.buf, i)
            if i < len(self.buf) or not self._more():
                return i

    def _boundary(self, i: int) -> re.Match | None:
        """The next ``},{`` at or after ``i``, reading on until one is found or the text ends."""
        frm = i
        while True:
            m = _BOUNDARY.search(self.buf, frm)
            if m is not None or self.eof:
                return m
            frm = max(i, len(self.buf) - 4096)  # a boundary cut by the window's end is re-seen
            grow = max(len(self.buf) - i, 1 << 20)
            target = len(self.buf) + grow
            while len(self.buf) < target and self._more():
                pass

    def _drop(self, pos: int) -> int:
        """Forget the text before ``pos`` but one byte (see :meth:`_piece`); returns ``pos`` in
        the new window."""
        if pos > (1 << 20):
            del self.buf[: pos - 1]
            self.origin += pos - 1
            return 1
        return pos

    # -- document layout
    def _locate(self) -> tuple[dict[str, Any], int]:
        path = self.path
        i = self._ws_from(0)
        self._fill(i + 3)
        if self.buf[i : i + 3] == b"\xef\xbb\xbf":
            i = self._ws_from(i + 3)
        buf = self.buf
        if i >= len(buf):
            if self.src.damage:  # a gzip damaged before any text came out
                raise InputError(
                    path,
                    f"{self.src.damage[0]}; nothing readable before it",
                    "the file is damaged; re-export it",
                )
            raise InputError(path, "file holds only whitespace", "re-export the trace")
        if buf[i] == ord("["):  # a bare event array (allowed by the Chrome trace format)
            return {}, i + 1
        if buf[i] != ord("{"):
            raise InputError(
                path,
                f"not JSON (starts with {bytes(buf[i : i + 8])!r})",
                "pass a Kineto/Chrome trace .json or .json.gz",
            )
        frm = 0
        while True:
            m = _EVENTS_KEY.search(self.buf, frm)
            if m is not None or not self._more():
                break
            frm = max(0, len(self.buf) - (1 << 20) - 64)
        buf = self.buf
        if m is None:
            try:
                doc = json.loads(buf)
            except (ValueError, RecursionError) as e:
                raise InputError(
                    path,
                    f"JSON is damaged before any traceEvents array ({e})",
                    "nothing is recoverable; re-export the trace",
                ) from e
            what = "a JSON object" if isinstance(doc, dict) else f"JSON {type(doc).__name__}"
            raise InputError(
                path,
                f"{what} without a 'traceEvents' array",
                "pass a Kineto / PyTorch profiler trace",
            )
        try:
            header = json.loads(buf[: m.start()] + b'"traceEvents":null}')
        except (ValueError, RecursionError):
            header = _salvage_members(
                buf[: m.start()].decode("utf-8", "replace"), json.JSONDecoder()
            )
            self.damage.append("trace header unreadable; kept the keys that parse")
        if not isinstance(header, dict):
            header = {}
        header.pop("traceEvents", None)
        return header, m.end()

    def _needs_exact(self) -> bool:
        """True when ``ts`` has a fraction at magnitudes where float64 loses nanoseconds."""
        self._fill(self.start + (1 << 20))
        for k, m in enumerate(_TS_SAMPLE.finditer(self.buf, self.start, self.start + (1 << 20))):
            whole = m.group(1).lstrip(b"-")
            if m.group(2) and len(m.group(2)) > 1 and (len(whole) > 15 or int(whole) >= _EXACT_US):
                return True
            if k > 2000:
                break
        return False

    # -- events
    def _piece(self, pos: int, end: int) -> bytes:
        """``[`` + the window's ``[pos, end)`` + ``]`` in one copy (``pos`` > 0 always: the
        array's ``[`` or a ``,`` precedes it)."""
        buf = self.buf
        a, b = buf[pos - 1], buf[end]
        buf[pos - 1], buf[end] = 91, 93
        try:
            with memoryview(buf) as mv:
                return bytes(mv[pos - 1 : end + 1])
        finally:
            buf[pos - 1], buf[end] = a, b

    def _array_end(self, piece: bytes, pos: int) -> int | None:
        """Where the array closes inside ``piece`` (``[`` + the window from ``pos``), when msgspec
        found text after it and the rest of the window is valid UTF-8 (as the stdlib path needs);
        None otherwise."""
        m = re.search(r"trailing characters \(byte (\d+)\)", str(self._error))
        end = len(piece[: int(m.group(1)) - 1].rstrip()) if m is not None else 0  # N: 1-based
        if not end or piece[end - 1] != 93:
            return None
        rest = self.buf[pos:]
        try:
            if not rest.isascii():
                rest.decode("utf-8")
        except ValueError:
            return None
        return end

    def _typed(self, piece: bytes) -> tuple[pa.Table | None, _Stats] | None:
        """The piece read by the typed fast path, or None where it does not apply."""
        self._error = None
        if not self.fast:
            return None
        try:
            if not piece.isascii():  # msgspec skips unknown keys and raw values unchecked
                piece.decode("utf-8")
            return _segment_fast(_EV_DECODER.decode(piece), self.exact, self._loads)
        except (msgspec.MsgspecError, _Fallback, RecursionError, ValueError) as e:
            # RecursionError: nested too deep; ValueError: invalid UTF-8
            self._error = e
            return None

    def __iter__(self) -> Iterator[list | tuple]:
        """Yields lists of decoded events, or (table, stats) of a chunk the typed path read;
        ``self.damage`` says what could not be read."""
        pos = self._drop(self._ws_from(self.start))
        while pos < len(self.buf):
            buf = self.buf
            if buf[pos] == ord("]"):
                self._finish(pos + 1)
                return
            cut = pos + self.chunk
            self._fill(cut + 1)
            m = self._boundary(cut) if cut < len(self.buf) else None
            buf = self.buf
            if m is None:  # last piece: parse through the closing bracket and keep the trailer
                self._fill_all()
                buf = self.buf
                last = self._last_boundary(pos) if self.fast else None
                if last is not None:  # all but the last event by the typed path
                    piece = self._piece(pos, last.start() + 1)
                    got = self._typed(piece)
                    if got is not None:
                        pos = _skip_ws(buf, last.end() - 1)
                        self.pos = self.origin + pos
                        yield got
                    elif (end := self._array_end(piece, pos)) is not None:
                        # that boundary was in the trailer: the array closed before it
                        got = self._typed(piece[:end])
                        if got is not None:
                            pos += end - 2  # at the array's "]"
                            self.pos = self.origin + pos
                            yield got
                            continue
                try:
                    s = buf[pos:].decode("utf-8")
                    evs, end = self._decoder.raw_decode("[" + s)
                except (ValueError, RecursionError):
                    break
                self._finish_text(s[end - 1 :])
                yield evs
                return
            evs = None
            for _ in range(3):  # a boundary inside a nested value: merge with the next piece
                piece = self._piece(pos, m.start() + 1)
                evs = self._typed(piece)
                if evs is not None:
                    break
                try:
                    evs = self._loads(piece)
                    break
                except (ValueError, RecursionError):
                    m = self._boundary(m.end())
                    if m is None:
                        break
            del piece
            if evs is None:
                break
            pos = self._drop(self._ws_from(m.end() - 1))
            self.pos = self.origin + pos
            yield evs
        else:
            self.damage.append("traceEvents array is not closed (file cut)")
            return
        yield from self._salvage(pos)

    def _last_boundary(self, pos: int) -> re.Match | None:
        """The last ``},{`` after ``pos`` (searched in a tail window that doubles until one is
        found), or None."""
        n, win = len(self.buf), 1 << 16
        while True:
            found = list(_BOUNDARY.finditer(self.buf, max(pos, n - win)))
            if found or n - win <= pos:
                return found[-1] if found else None
            win *= 2

    def _salvage(self, pos: int) -> Iterator[list]:
        """Object-by-object read of ``buf[pos:]`` that skips what it cannot parse.

        After unreadable bytes it resumes at the next ``},{``; until an object with a ``ph`` key
        is read from there (the boundary may have been inside a nested value or a string), what
        it finds is not trusted: fragments are skipped and a ``]`` does not end the array.

        Linear in the text: each object is parsed from a slice that ends at a ``},{`` boundary
        (:func:`_parse_one`), so a failed parse costs the slice, never the text before it (the
        stdlib builds every parse error by counting lines from the start of the string it was
        given: on a whole garbled file that was quadratic).
        """
        self._fill_all()
        raw = self.buf[pos:]
        pos = self.origin + pos  # offsets in messages count from the start of the text
        text = raw.decode("utf-8", "replace")
        if "\ufffd" in text and b"\xef\xbf\xbd" not in raw:
            self.damage.append("invalid UTF-8 bytes replaced")
        dec, i, n = self._decoder, 0, len(text)
        batch: list = []
        trusted = True
        bad_at = -1  # start of the unreadable stretch being skipped
        offset = _ByteOffsets(text, pos, len(raw))
        stretches = skipped_bytes = 0

        while True:
            while i < n and text[i] in " \t\r\n,":
                i += 1
            if i >= n:
                where = offset(bad_at) if bad_at >= 0 else pos + len(raw)
                self.damage.append(f"file cut at byte {where}: traceEvents array not closed")
                break
            if bad_at < 0:
                good_from = i
            if text[i] == "]" and trusted:
                self._finish_text(text[i + 1 :])
                break
            obj = None
            if text[i] != "]":
                obj, j = _parse_one(dec, text, i)
            if obj is not None and (trusted or (isinstance(obj, dict) and "ph" in obj)):
                if bad_at >= 0:
                    at = offset(bad_at)  # ascending indices: the offsets stay incremental
                    lost = offset(good_from) - at
                    stretches += 1
                    skipped_bytes += lost
                    if stretches <= _MAX_DAMAGE_NOTES:
                        self.damage.append(f"skipped {lost} unreadable bytes at byte {at}")
                    bad_at = -1
                trusted = True
                batch.append(obj)
                i = j
            else:  # resume at the next object boundary
                if bad_at < 0:
                    bad_at = i
                trusted = False
                m = _BOUNDARY_S.search(text, i + 1)
                if m is None:
                    self.damage.append(
                        f"file cut or corrupt at byte {offset(bad_at)}: "
                        f"{len(raw) - (offset(bad_at) - pos)} trailing bytes hold no complete event"
                    )
                    break
                i = good_from = m.end() - 1
            if len(batch) >= 8192:
                yield batch
                batch = []
        if stretches > _MAX_DAMAGE_NOTES:
            self.damage.append(
                f"... {stretches} unreadable stretches in all ({skipped_bytes} bytes skipped)"
            )
        if batch:
            yield batch

    def _finish(self, after: int) -> None:
        self._fill_all()
        self._finish_text(self.buf[after:].decode("utf-8", "replace"))

    def _finish_text(self, rest: str) -> None:
        self.complete = True
        rest = rest.strip()
        if not rest or rest == "}" or not rest.startswith(","):
            return
        try:
            tr = json.loads("{" + rest[1:])
        except ValueError:
            tr = _salvage_members(rest[1:], json.JSONDecoder())
            self.damage.append("trace trailer (keys after traceEvents) damaged; kept what parses")
        if isinstance(tr, dict):
            self.trailer = tr


# --------------------------------------------------------------------------------------------
# columns


_SURROGATE = re.compile("[\ud800-\udfff]")


def _str_array(vals: list) -> pa.Array:
    """Strings (nulls for None); other scalars become their text; lone surrogates (a JSON
    ``"\\ud800"`` escape, not encodable as UTF-8) become U+FFFD."""
    return _str_array_marked(vals)[0]


def _str_array_marked(vals: list) -> tuple[pa.Array, np.ndarray | None]:
    """:func:`_str_array` and the mask of values whose lone surrogates were replaced (None
    when there were none)."""
    try:
        return pa.array(vals, pa.string()), None
    except UnicodeEncodeError:
        pass
    except (pa.ArrowException, TypeError, ValueError):
        vals = [v if v is None or type(v) is str else str(v) for v in vals]
        try:
            return pa.array(vals, pa.string()), None
        except UnicodeEncodeError:
            pass
    vals = [v if v is None or type(v) is str else str(v) for v in vals]
    bad = np.fromiter((v is not None and bool(_SURROGATE.search(v)) for v in vals), bool, len(vals))
    vals = [_SURROGATE.sub("\ufffd", v) if b else v for v, b in zip(vals, bad, strict=True)]
    return pa.array(vals, pa.string()), bad


def _to_int(v: Any) -> int | None:
    if type(v) is int:
        return v if -(2**63) <= v < 2**63 else None
    if isinstance(v, (float, Decimal)):
        try:
            return int(v) if v == int(v) and -(2**63) <= v < 2**63 else None
        except (ValueError, OverflowError, InvalidOperation):
            return None
    if isinstance(v, str):
        m = _FIRST_INT.search(v)
        return int(m.group()) if m and abs(int(m.group())) < 2**63 else None
    return None


_INT_STR_NONE = frozenset({int, str, type(None)})


def _int_array(vals: list, fill: int = -1) -> tuple[np.ndarray, np.ndarray | None]:
    """int64 column; ``fill`` where missing. Also the mask of rows whose value was not an int.

    Whether a value is an int is the value's own property, never its neighbours': the first try
    infers the type instead of converting to int64, which would also take a float (truncated)
    when every other value is a number, and so read a row one way or the other depending on the
    rows read beside it (the chunk)."""
    try:
        arr = pa.array(vals)
        if pa.types.is_integer(arr.type) or pa.types.is_null(arr.type):
            arr = arr.cast(pa.int64())
            return arr.fill_null(fill).to_numpy(zero_copy_only=False, writable=True), None
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    if set(map(type, vals)) <= _INT_STR_NONE:  # ints with a few labels (pid "Spans"): C loops
        odd = np.fromiter(map(isinstance, vals, repeat(str)), bool, len(vals))
        conv = list(vals)
        for i in np.flatnonzero(odd).tolist():
            conv[i] = _to_int(conv[i])
        try:
            arr = pa.array(conv, pa.int64())
            return arr.fill_null(fill).to_numpy(zero_copy_only=False, writable=True), odd
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass  # an int beyond int64
    odd = np.fromiter((v is not None and type(v) is not int for v in vals), bool, len(vals))
    conv = [v if type(v) is int and -(2**63) <= v < 2**63 else _to_int(v) for v in vals]
    return pa.array(conv, pa.int64()).fill_null(fill).to_numpy(
        zero_copy_only=False, writable=True
    ), odd


_MAX_US_INT = _MAX_NS // 1000
_MAX_US_DEC = Decimal(_MAX_US_INT)


def _exact_ns(v: Any) -> int | None:
    """µs value → exact ns, None when not a finite number within ±:data:`_MAX_NS` ns."""
    try:
        if type(v) is int:
            return v * 1000 if -_MAX_US_INT < v < _MAX_US_INT else None
        if isinstance(v, Decimal):
            if not v.is_finite() or not -_MAX_US_DEC < v < _MAX_US_DEC:
                return None
            return int((v * 1000).to_integral_value())
        if isinstance(v, float):
            return round(v * 1000) if np.isfinite(v) and abs(v) < _MAX_US_INT else None
        if isinstance(v, str) and len(v) < 64:
            return _exact_ns(Decimal(v))
    except (InvalidOperation, ValueError, OverflowError):
        pass
    return None


def _to_float(v: Any) -> float:
    try:
        return float(v) if not isinstance(v, str) or len(v) < 64 else float("nan")
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def _us_to_ns(vals: list, exact: bool) -> tuple[np.ndarray, np.ndarray]:
    """Microsecond values → (int64 nanoseconds, valid mask); exact for ints and decimals.

    Values that are not finite numbers or beyond ±:data:`_MAX_NS` ns are invalid (0 in the
    result), so nothing later overflows.
    """
    if exact:
        lim = _MAX_US_DEC
        ns = [
            int(v * 1000)
            if ((t := type(v)) is Decimal or t is int) and -lim < v < lim
            else _exact_ns(v)
            for v in vals
        ]
        arr = pa.array(ns, pa.int64())
        ok = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), bool)
        out = arr.fill_null(0).to_numpy(zero_copy_only=False, writable=True)
        big = ok & (np.abs(out) >= _MAX_NS)
        if big.any():
            ok &= ~big
            out[big] = 0
        return out, ok
    try:
        f = np.asarray(vals, dtype=np.float64)
        if f.shape != (len(vals),):  # every value a list of the same length: not times
            raise ValueError("not one number per event")
    except (TypeError, ValueError, OverflowError):
        f = np.fromiter((_to_float(v) for v in vals), np.float64, len(vals))
    ok = np.isfinite(f) & (np.abs(f) < _MAX_NS / 1000)
    f = np.where(ok, f, 0.0)
    whole = np.floor(f)
    # whole µs and the fraction separately: ts·1000 in one float64 would round to 256 ns at epoch
    return whole.astype(np.int64) * 1000 + np.rint((f - whole) * 1000.0).astype(np.int64), ok


@dataclass
class _Stats:
    """Per-file counts; ``events_in == events_out + sum(skipped)`` always holds."""

    in_by_category: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    repaired: Counter = field(default_factory=Counter)
    metadata: list = field(default_factory=list)

    def merge(self, other: _Stats) -> None:
        self.in_by_category.update(other.in_by_category)
        self.skipped.update(other.skipped)
        self.repaired.update(other.repaired)
        self.metadata.extend(other.metadata)


def _count_in(cat: list, ph: list, stats: _Stats) -> None:
    """Events in, by category (``(ph X)`` for events without one)."""
    cat_a = _str_array(cat)
    if cat_a.null_count:
        ph_a = _str_array(ph)
        label = pc.binary_join_element_wise("(ph ", pc.fill_null(ph_a, "?"), ")", "")
        cat_a = pc.coalesce(cat_a, label)
    vc = pc.value_counts(cat_a).to_pylist()
    stats.in_by_category.update({d["values"]: d["counts"] for d in vc})


def _segment(evs: list, exact: bool, stats: _Stats) -> pa.Table | None:
    """One chunk of decoded events → a table of its timed rows (ns on the file's own clock)."""
    if not all(type(e) is dict for e in evs):
        bad = sum(1 for e in evs if type(e) is not dict)
        stats.in_by_category["(not an object)"] += bad
        stats.skipped["malformed"] += bad
        evs = [e for e in evs if type(e) is dict]
    if not evs:
        return None
    ph = [e.get("ph") for e in evs]
    cat = [e.get("cat") for e in evs]
    _count_in(cat, ph, stats)

    ph_d = _str_array(ph).dictionary_encode()
    ph_cls_of = np.array(
        [_PH_CLASS.get(p, _OTHER) for p in ph_d.dictionary.to_pylist()] + [_MALFORMED], np.int8
    )
    ph_idx = ph_d.indices.fill_null(len(ph_d.dictionary)).to_numpy(zero_copy_only=False)
    cls = ph_cls_of[ph_idx]
    if (cls == _META).any():
        stats.metadata.extend(evs[i] for i in np.flatnonzero(cls == _META))
    skipped = np.bincount(cls, minlength=9)
    for c, reason in _SKIP_REASON.items():
        if skipped[c]:
            stats.skipped[reason] += int(skipped[c])
    if skipped[_OTHER]:
        odd = Counter(p if type(p) is str else repr(p) for p in (ph[i] for i in np.flatnonzero(cls == _OTHER)))
        for p, k in odd.items():
            stats.skipped[f"phase_{p}"] += k

    timed = cls <= _E
    if not timed.any():
        return None
    if not timed.all():
        idx = np.flatnonzero(timed)
        evs = [evs[i] for i in idx]
        cat = [cat[i] for i in idx]
        cls = cls[idx]
    n = len(evs)

    start, ok = _us_to_ns([e.get("ts") for e in evs], exact)
    dur, dur_ok = _us_to_ns([e.get("dur") for e in evs], exact)
    dur, flags = _durations(cls, dur, dur_ok, ok, stats, lambda i: evs[i].get("dur"))

    # kinds: complete events by category, the rest by phase
    cat_a, surr_cat = _str_array_marked(cat)
    cat_a = pc.fill_null(cat_a, "").dictionary_encode()
    cat_dict = cat_a.dictionary.to_pylist()
    cat_codes = cat_a.indices.to_numpy(zero_copy_only=False)
    kind_of_cat = np.array([_K[_CAT_KIND.get(c.lower(), "RANGE")] for c in cat_dict], np.int8)
    kind = kind_of_cat[cat_codes]
    for c, k in _CLASS_KIND.items():
        kind[cls == c] = k

    names, surr_name = _str_array_marked([e.get("name") for e in evs])
    names = pc.fill_null(names, "").dictionary_encode()
    pid, pid_odd = _int_array([e.get("pid") for e in evs])
    tid, tid_odd = _int_array([e.get("tid") for e in evs])

    args = [e.get("args") or _EMPTY for e in evs]
    if not all(type(a) is dict for a in args):
        args = [a if type(a) is dict else {"value": a} for a in args]
    odd_rows = None
    if pid_odd is not None or tid_odd is not None:
        # pid "Spans" / tid "PyTorch Profiler" etc.: keep the labels, the columns hold -1 or the number
        odd_rows = np.flatnonzero(
            (pid_odd if pid_odd is not None else False)
            | (tid_odd if tid_odd is not None else False)
        )
        for i in odd_rows:
            args[i] = {**args[i], "pid": evs[i].get("pid"), "tid": evs[i].get("tid")}
    ext_lc = [i for i, a in enumerate(args) if "external id" in a and "External id" not in a]
    for i in ext_lc:  # 2022 format: same key spelling as today's traces
        a = dict(args[i])
        a["External id"] = a.pop("external id")
        args[i] = a

    corr, _ = _int_array([a.get("correlation") for a in args])
    need = np.flatnonzero((corr < 0) & (kind >= _K["RUNTIME"]))
    if len(need):
        alt, _ = _int_array([evs[i].get("correlation") for i in need])
        corr[need] = alt

    # GPU rows: Kineto puts pid = device and tid = stream (_gpu_columns)
    is_gpu, device, stream, graph = _gpu_columns(
        kind, cat_dict, cat_codes, pid, tid,
        lambda gi: ([args[i].get("device") for i in gi], [args[i].get("stream") for i in gi],
                    [args[i].get("graph id", args[i].get("graph_id")) for i in gi]))

    nbytes = np.full(n, -1, np.int64)
    mi = np.flatnonzero(np.isin(kind, (_K["MEMCPY"], _K["MEMSET"])))
    if len(mi):
        nbytes[mi], _ = _int_array([args[i].get("bytes") for i in mi])
    ci = [i for i, a in enumerate(args) if "In msg nelems" in a or "Out msg nelems" in a]
    if ci:
        nbytes[ci] = _collective_bytes([args[i] for i in ci])

    cat_json = {c: _encode(c) for c in cat_dict}
    args_json = [
        '{"cat":' + cat_json[c] + ("," + _encode(a)[1:] if a else "}")
        for c, a in zip((cat_dict[k] for k in cat_codes), args, strict=True)
    ]

    args_arr, surr_args = _str_array_marked(args_json)
    surr = [m for m in (surr_cat, surr_name, surr_args) if m is not None]
    if surr:  # "\ud800" escapes: replaced by U+FFFD, the rows flagged
        bad = np.logical_or.reduce(surr)
        flags[bad] |= FLAG_REPAIRED
        stats.repaired["invalid_unicode"] += int((bad & ok).sum())
    t = _chunk_table(ok, stats, kind=kind, cat=cat_a, name=names, pid=pid, tid=tid, device=device, stream=stream,
                     start=start, dur=dur, corr_id=corr, graph_id=graph, bytes=nbytes, flags=flags, args=args_arr,
                     gpu=is_gpu)
    return t


def _durations(cls: np.ndarray, dur: np.ndarray, dur_ok: np.ndarray, ok: np.ndarray, stats: Any,
               raw: Any) -> tuple[np.ndarray, np.ndarray]:
    """Durations of a chunk's complete events, repaired: missing, absurd (a number too large or
    infinite to be a duration, not missing) and negative ones become 0 and are flagged and
    counted (rows with a readable timestamp, ``ok``). ``raw(i)``: row i's ``dur`` as decoded.
    Returns the durations and the rows' flags."""
    flags = np.zeros(len(cls), np.int32)
    is_x = cls == _X
    miss = is_x & ~dur_ok
    neg = is_x & dur_ok & (dur < 0)
    if miss.any():
        mi = np.flatnonzero(miss & ok)
        huge = sum(1 for i in mi.tolist() if type(raw(i)) in (int, float, Decimal))
        if huge:
            stats.repaired["absurd_duration"] += huge
        if len(mi) - huge:
            stats.repaired["missing_duration"] += len(mi) - huge
    if neg.any():
        stats.repaired["negative_duration"] += int((neg & ok).sum())
    flags[miss | neg] |= FLAG_REPAIRED
    return np.where(is_x & dur_ok & (dur > 0), dur, 0), flags


def _gpu_columns(kind: np.ndarray, cat_dict: list[str], cat_codes: np.ndarray, pid: np.ndarray, tid: np.ndarray,
                 fields: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """GPU rows of a chunk and their device, stream and graph id. Kineto puts pid = device and
    tid = stream; canonical rows keep them in device/stream and set tid = -1 (changed in place;
    pid becomes the file's main process in _finish_file). ``fields(gi)``: the args' device,
    stream and graph id values of the rows ``gi`` (three lists, None where absent)."""
    n = len(kind)
    gpu_cat = np.fromiter((c in _GPU_RANGE_CATS for c in cat_dict), bool, len(cat_dict))
    is_gpu = np.isin(kind, _GPU_KINDS) | (gpu_cat[cat_codes] & (kind == _K["RANGE"]))
    device = np.full(n, -1, np.int32)
    stream = np.full(n, -1, np.int64)
    graph = np.full(n, -1, np.int64)
    gi = np.flatnonzero(is_gpu)
    if len(gi):
        devs, stms, graphs = fields(gi)
        dev, _ = _int_array(devs, fill=-(2**62))
        stm, _ = _int_array(stms, fill=-(2**62))
        device[gi] = np.where(dev != -(2**62), dev, pid[gi]).astype(np.int32)
        stream[gi] = np.where(stm != -(2**62), stm, tid[gi])
        tid[gi] = -1
        graph[gi], _ = _int_array(graphs)
    return is_gpu, device, stream, graph


_CHUNK_TYPES = {"kind": pa.int8(), "pid": pa.int64(), "tid": pa.int64(), "device": pa.int32(), "stream": pa.int64(),
                "start": pa.int64(), "dur": pa.int64(), "corr_id": pa.int64(), "graph_id": pa.int64(),
                "bytes": pa.int64(), "flags": pa.int32(), "gpu": pa.bool_()}


def _chunk_table(ok: np.ndarray, stats: Any, **cols: Any) -> pa.Table:
    """One chunk's rows as a table (columns in the order given; the numeric ones typed by
    :data:`_CHUNK_TYPES`, ``cat``/``name``/``args`` already Arrow arrays), the rows whose
    timestamp could not be read (``~ok``) left out and counted as ``bad_timestamp``."""
    if not ok.all():
        stats.skipped["bad_timestamp"] += int((~ok).sum())
    t = pa.table({k: pa.array(v, _CHUNK_TYPES[k]) if k in _CHUNK_TYPES else v for k, v in cols.items()})
    return t if ok.all() else t.filter(pa.array(ok))


# --------------------------------------------------------------------------------------------
# typed fast path (msgspec)
#
# A chunk of the array is decoded by msgspec straight into small structs holding only the fields
# the reader uses; ``ts``/``dur``/``args`` stay raw JSON text (``msgspec.Raw``), so times are
# read exactly from their digits (vectorised) and args are kept as text, compacted in numpy. A
# chunk outside what this path covers raises ``_Fallback`` (or msgspec's own error) and is read
# again by the stdlib path above, so every value the fast path accepts gives the same rows.


class _Fallback(Exception):
    """A chunk the typed path does not cover: it is read again with the stdlib decoder."""


if msgspec is not None:
    _RAW_NULL = msgspec.Raw(b"null")
    _RAW_EMPTY = msgspec.Raw(b"{}")
    _UNSET = msgspec.UNSET

    class _Ev(msgspec.Struct, gc=False):
        ph: str | None = None
        cat: str | None = None
        name: str | None = None
        pid: int | str | None = None
        tid: int | str | None = None
        ts: msgspec.Raw = _RAW_NULL
        dur: msgspec.Raw = _RAW_NULL
        args: msgspec.Raw = _RAW_EMPTY
        correlation: int | None = None

    class _Args(msgspec.Struct, gc=False):
        correlation: int | None = None
        device: int | None = None
        stream: int | None = None
        graph_sp: int | None | msgspec.UnsetType = msgspec.field(default=_UNSET, name="graph id")
        graph_id: int | None = None
        bytes: int | None = None
        n_in: int | None | msgspec.UnsetType = msgspec.field(default=_UNSET, name="In msg nelems")
        n_out: int | None | msgspec.UnsetType = msgspec.field(
            default=_UNSET, name="Out msg nelems"
        )
        dtype: str | None = None

    _EV_DECODER = msgspec.json.Decoder(list[_Ev])
    _G_PH, _G_CAT, _G_NAME, _G_PID, _G_TID, _G_TS, _G_DUR, _G_ARGS = map(
        attrgetter, ("ph", "cat", "name", "pid", "tid", "ts", "dur", "args")
    )
    _ARGS_DECODER = msgspec.json.Decoder(list[_Args])

_POW10 = 10 ** np.arange(19, dtype=np.uint64)
#: A ``\uD800``–``\uDFFF`` escape: maybe a lone surrogate, which the stdlib path replaces.
_SURROGATE_ESC = re.compile(rb"\\u[dD][89a-fA-F]")
#: Below 2^43 µs a float64 ``W.fff`` is within 2^-11 µs (0.49 ns) of the decimal, so the
#: float path's floor + rint of the fraction gives the exact nanoseconds: there the digits are
#: read exactly on a float-timed file too (beyond it the float reading is kept, value by value).
_FLOAT_SAFE_NS = (1 << 43) * 1000


def _plain_us_to_ns(raws: list, exact: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The common layouts of :func:`_raw_us_to_ns` in a few passes: every value an integer, or
    every value one decimal point with at most 3 decimals (``null``: missing). Parsed by
    ``np.fromstring`` (integers, the point read as a separator). Returns (ns, valid, rows to
    read one by one), or None for any other layout."""
    n = len(raws)
    text = bytearray(b",").join(raws)
    buf = np.frombuffer(text, np.uint8)
    if not (((buf - np.uint8(44)) <= 13) & (buf != 47)).all():  # only digits , - .
        nul = np.flatnonzero(buf == 110)
        if not len(nul) or nul[-1] + 3 >= len(buf):
            return None
        if not ((buf[nul + 1] == 117) & (buf[nul + 2] == 108) & (buf[nul + 3] == 108)).all():
            return None
        nul_bytes = np.concatenate([nul, nul + 1, nul + 2, nul + 3])
        buf[nul_bytes] = 48  # "0000" for now
        if not (((buf - np.uint8(44)) <= 13) & (buf != 47)).all():
            return None
    else:
        nul = nul_bytes = np.zeros(0, np.int64)
    ends = np.flatnonzero(buf == 44)
    if len(ends) != n - 1:
        return None
    starts = np.empty(n, np.int64)
    starts[0] = 0
    starts[1:] = ends + 1
    ends = np.append(ends, len(buf))
    dots = np.flatnonzero(buf == 46)
    missing = np.zeros(n, bool)
    missing[np.searchsorted(ends, nul)] = True
    if len(dots) == 0:  # integers
        v = np.fromstring(bytes(text), dtype=np.int64, sep=",")
        if len(v) != n:
            return None
        good = (np.abs(v) < _MAX_US_INT) & (ends - starts <= 17)
        ns = np.where(good, v, 0) * 1000
    else:
        if len(dots) + len(nul) != n:
            return None
        if len(nul):  # "0.00" for a null
            buf[nul + 1] = 46
            dots = np.flatnonzero(buf == 46)
        if (dots <= starts).any() or (dots >= ends).any():  # not one point in each value
            return None
        k = ends - dots - 1
        if (k > 3).any():
            return None
        buf[dots] = 44
        v = np.fromstring(bytes(text), dtype=np.int64, sep=",")
        if len(v) != 2 * n:
            return None
        whole, frac = v[0::2], v[1::2]
        neg = buf[starts] == 45
        good = (np.abs(whole) < _MAX_US_INT // 1000 * 1000) & (dots - starts <= 17)
        ns = np.where(good, whole, 0) * 1000 + np.where(neg, -frac, frac) * _POW10[3 - k].astype(
            np.int64
        )
        if not exact:
            good &= np.abs(ns) < _FLOAT_SAFE_NS
        ns = np.where(good, ns, 0)
    ok = good & ~missing
    ns[missing] = 0
    return ns, ok, np.flatnonzero(~good & ~missing)


def _raw_us_to_ns(raws: list, exact: bool, loads) -> tuple[np.ndarray, np.ndarray, dict]:
    """Raw JSON µs values → (int64 ns, valid mask, {row: decoded value} of the rows read one by
    one), equal to :func:`_us_to_ns` on the decoded values.

    Plain numbers (``-?digits[.d{0,3}]`` below ±2^62 ns) are read from their digits
    in numpy, exactly; ``null`` is invalid; anything else (exponents, more decimals, strings, huge
    values, fractions past 2^43 µs on a float-timed file) is decoded on its own and converted
    by :func:`_us_to_ns`, as the stdlib path does.
    """
    n = len(raws)
    got = _plain_us_to_ns(raws, exact)
    if got is not None:
        val, ok, odd = got
        if len(odd):
            return _odd_us_to_ns(raws, odd, val, ok, exact, loads)
        return val, ok, {}
    text = b",".join(raws) + b","
    buf = np.frombuffer(text, np.uint8)
    comma = buf == 44
    ends = np.flatnonzero(comma)
    if len(ends) != n:  # a value holding a comma (a string, a list): read each one on its own
        val, ok = np.zeros(n, np.int64), np.zeros(n, bool)
        return _odd_us_to_ns(raws, np.arange(n), val, ok, exact, loads)
    starts = np.empty(n, np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    tok = np.cumsum(comma) - comma  # token of each byte
    digit = buf - np.uint8(48)
    is_digit = digit < 10
    dot = buf == 46
    first = buf[starts]
    neg = first == 45
    other = ~(is_digit | dot | comma)
    other[starts[neg]] = False
    bad = np.bincount(tok[other], minlength=n) > 0
    ndot = np.bincount(tok[dot], minlength=n)
    dotpos = ends.copy()
    di = np.flatnonzero(dot)
    dotpos[tok[di]] = di
    k = np.where(ndot == 1, ends - dotpos - 1, 0)
    ndig = ends - starts - ndot - neg
    good = ~bad & (ndot <= 1) & (k <= 3) & (ndig + 3 - k <= 19)
    idx = np.arange(len(buf))
    power = (ends - k - 1 - (ndot == 1) + 3)[tok] - idx + ((idx > dotpos[tok]) & (ndot[tok] == 1))
    # digit at idx: 10^(3 - k + places to the right of it, not counting the dot)
    contrib = np.where(is_digit & good[tok], digit * _POW10[np.clip(power, 0, 18)], np.uint64(0))
    uval = np.add.reduceat(contrib, starts)  # < 10^19 < 2^64: no wrap-around
    good &= uval < np.uint64(_MAX_US_INT * 1000)  # else: out of range, judged one by one
    val = np.where(good, uval, 0).astype(np.int64)
    val[neg] = -val[neg]
    if not exact:
        good &= (k == 0) | (np.abs(val) < _FLOAT_SAFE_NS)
    null = ~good & (first == 110) & (ends - starts == 4)  # "null": missing, as in the stdlib path
    ok = good.copy()
    val[~good] = 0
    odd = np.flatnonzero(~good & ~null)
    if len(odd):
        return _odd_us_to_ns(raws, odd, val, ok, exact, loads)
    return val, ok, {}


def _odd_us_to_ns(raws, rows, val, ok, exact, loads):
    vals = [loads(bytes(raws[i])) for i in rows]
    v, o = _us_to_ns(vals, exact)
    val[rows] = v
    ok[rows] = o
    return val, ok, dict(zip(rows.tolist(), vals, strict=True))


_SEP = b",0,"  # joins the rows' args objects for one compacting pass: "},0,{" between rows


def _args_text(raws: list, prefix: pa.Array, cat_codes: np.ndarray) -> pa.Array:
    """The canonical args text of each row: ``{"cat":…`` then the row's args object, compacted.

    The rows' objects are joined by ``,0,`` and compacted in one ``msgspec.json.format`` pass;
    the ``},0,{`` separators (exactly n - 1 of them, else some string holds one: the stdlib path
    takes the chunk) give each row's span. The ``{`` of each object becomes the ``,`` after the
    category; an empty object leaves just ``}``.
    """
    n = len(raws)
    c = msgspec.json.format(b"[" + _SEP.join(raws) + b"]", indent=-1)
    buf = np.frombuffer(c, np.uint8).copy()
    s = np.flatnonzero(buf[2:-2] == 48) + 2  # candidate '0's
    s = s[(buf[s - 1] == 44) & (buf[s + 1] == 44) & (buf[s - 2] == 125) & (buf[s + 2] == 123)]
    if len(s) != n - 1 or c.count(b"},0,{") != n - 1:
        raise _Fallback("args text holds the row separator")
    starts = np.empty(n, np.int64)
    starts[0] = 1
    starts[1:] = s + 2
    if (buf[starts] != 123).any():
        raise _Fallback("args not an object")
    ends = np.empty(n, np.int64)  # exclusive
    ends[:-1] = s - 1
    ends[-1] = len(buf) - 1
    empty = ends - starts == 2
    buf[starts[~empty]] = 44
    keep = np.ones(len(buf), bool)
    keep[[0, -1]] = False
    keep[s - 1] = keep[s] = keep[s + 1] = False
    keep[starts[empty]] = False
    final = buf[keep]
    e_before = np.zeros(n, np.int64)
    np.cumsum(empty[:-1], out=e_before[1:])
    offsets = np.empty(n + 1, np.int64)
    offsets[:-1] = starts - 1 - 3 * np.arange(n) - e_before
    offsets[-1] = len(final)
    if len(final) >= 2**31:
        raise _Fallback("chunk too large for 32-bit offsets")
    body = pa.StringArray.from_buffers(
        n, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(final)
    )
    try:
        body.validate(full=True)
    except pa.ArrowInvalid as err:
        raise _Fallback("args not UTF-8") from err
    return pc.binary_join_element_wise(prefix.take(pa.array(cat_codes)), body, "")


def _meta_event(e: Any, loads) -> dict:
    """A metadata event as the dict :func:`_names` reads."""
    return {"ph": e.ph, "name": e.name, "pid": e.pid, "tid": e.tid, "args": loads(bytes(e.args))}


def _segment_fast(evs: list, exact: bool, loads) -> tuple[pa.Table | None, _Stats]:
    """:func:`_segment` for a chunk decoded into :class:`_Ev` structs; the counts come back in a
    fresh :class:`_Stats` (merged by the caller only if no :class:`_Fallback` was raised)."""
    stats = _Stats()
    if not evs:
        return None, stats
    ph = list(map(_G_PH, evs))
    cls = np.fromiter(map(_PH_CLASS_N.get, ph, repeat(_OTHER)), np.int8, len(ph))
    # categories: one dictionary for the count in and the kinds (None: "(ph X)" in the count)
    cat_d = pa.array(list(map(_G_CAT, evs)), pa.string()).dictionary_encode()
    cat_dict = cat_d.dictionary.to_pylist()
    cat_codes = cat_d.indices.fill_null(-1).to_numpy(zero_copy_only=False)
    counts = np.bincount(cat_codes + 1, minlength=len(cat_dict) + 1)
    stats.in_by_category.update({c: int(k) for c, k in zip(cat_dict, counts[1:], strict=True) if k})
    if counts[0]:
        stats.in_by_category.update(
            f"(ph {ph[i] if ph[i] is not None else '?'})" for i in np.flatnonzero(cat_codes < 0)
        )
        if "" not in cat_dict:
            cat_dict.append("")
        cat_codes = np.where(cat_codes < 0, cat_dict.index(""), cat_codes)

    if (cls == _META).any():
        stats.metadata.extend(_meta_event(evs[i], loads) for i in np.flatnonzero(cls == _META))
    skipped = np.bincount(cls, minlength=9)
    for c, reason in _SKIP_REASON.items():
        if skipped[c]:
            stats.skipped[reason] += int(skipped[c])
    if skipped[_OTHER]:
        odd = Counter(ph[i] for i in np.flatnonzero(cls == _OTHER))
        for p, k in odd.items():
            stats.skipped[f"phase_{p}"] += k

    timed = cls <= _E
    if not timed.any():
        return None, stats
    if not timed.all():
        idx = np.flatnonzero(timed)
        evs = [evs[i] for i in idx.tolist()]
        cat_codes = cat_codes[idx]
        cls = cls[idx]
    n = len(evs)

    start, ok, _ = _raw_us_to_ns(list(map(_G_TS, evs)), exact, loads)
    dur, dur_ok, dur_odd = _raw_us_to_ns(list(map(_G_DUR, evs)), exact, loads)
    dur, flags = _durations(cls, dur, dur_ok, ok, stats, dur_odd.get)

    cat_a = pa.DictionaryArray.from_arrays(
        pa.array(cat_codes.astype(np.int32)), pa.array(cat_dict, pa.string())
    )
    kind_of_cat = np.array([_K[_CAT_KIND.get(c.lower(), "RANGE")] for c in cat_dict], np.int8)
    kind = kind_of_cat[cat_codes]
    for c, k in _CLASS_KIND.items():
        kind[cls == c] = k

    names = pc.fill_null(pa.array(list(map(_G_NAME, evs)), pa.string()), "").dictionary_encode()
    pids = list(map(_G_PID, evs))
    tids = list(map(_G_TID, evs))
    pid, pid_odd = _int_array(pids)
    tid, tid_odd = _int_array(tids)

    raw_args = list(map(_G_ARGS, evs))
    text = b",".join(raw_args)
    if b'"external id"' in text or _SURROGATE_ESC.search(text):
        raise _Fallback("2022-format args or a surrogate escape")
    args = _ARGS_DECODER.decode(b"[" + text + b"]")

    corr, _ = _int_array([a.correlation for a in args])
    need = np.flatnonzero((corr < 0) & (kind >= _K["RUNTIME"]))
    if len(need):
        alt, _ = _int_array([evs[i].correlation for i in need])
        corr[need] = alt

    is_gpu, device, stream, graph = _gpu_columns(
        kind, cat_dict, cat_codes, pid, tid,
        lambda gi: ([args[i].device for i in gi], [args[i].stream for i in gi],
                    [a.graph_id if (a := args[i]).graph_sp is _UNSET else a.graph_sp for i in gi]))

    nbytes = np.full(n, -1, np.int64)
    mi = np.flatnonzero(np.isin(kind, (_K["MEMCPY"], _K["MEMSET"])))
    if len(mi):
        nbytes[mi], _ = _int_array([args[i].bytes for i in mi])
    ci = [i for i, a in enumerate(args) if a.n_in is not _UNSET or a.n_out is not _UNSET]
    if ci:
        n_in, _ = _int_array([None if (v := args[i].n_in) is _UNSET else v for i in ci], fill=0)
        n_out, _ = _int_array([None if (v := args[i].n_out) is _UNSET else v for i in ci], fill=0)
        size = np.array([_DTYPE_BYTES.get(str(args[i].dtype).lower(), -1) for i in ci], np.int64)
        nel = np.maximum(n_in, n_out)
        nbytes[ci] = np.where((size > 0) & (nel > 0), nel * size, -1)

    prefix = pa.array(['{"cat":' + _encode(c) for c in cat_dict], pa.string())
    args_arr = _args_text(raw_args, prefix, cat_codes)
    if pid_odd is not None or tid_odd is not None:
        # pid "Spans" / tid "PyTorch Profiler": the labels go into args, as in _segment
        odd_rows = np.flatnonzero(
            (pid_odd if pid_odd is not None else False)
            | (tid_odd if tid_odd is not None else False)
        )
        patched = []
        for i in odd_rows.tolist():
            a = {**loads(bytes(raw_args[i])), "pid": pids[i], "tid": tids[i]}
            patched.append('{"cat":' + _encode(cat_dict[cat_codes[i]]) + "," + _encode(a)[1:])
        mask = np.zeros(n, bool)
        mask[odd_rows] = True
        args_arr = pc.replace_with_mask(args_arr, pa.array(mask), pa.array(patched, pa.string()))

    # no lone surrogates here: msgspec rejects them in strings, the args were checked above
    t = _chunk_table(ok, stats, kind=kind, cat=cat_a, name=names, pid=pid, tid=tid, device=device, stream=stream,
                     start=start, dur=dur, corr_id=corr, graph_id=graph, bytes=nbytes, flags=flags, args=args_arr,
                     gpu=is_gpu)
    return t, stats


def _collective_bytes(args: list[dict]) -> np.ndarray:
    """Message size of collective records: max(in, out) elements × element size, -1 if unknown.

    max(in, out) is the size nccl-tests report: the output of all-gather, the input of
    reduce-scatter, either of all-reduce.
    """
    n_in, _ = _int_array([a.get("In msg nelems") for a in args], fill=0)
    n_out, _ = _int_array([a.get("Out msg nelems") for a in args], fill=0)
    size = np.array([_DTYPE_BYTES.get(str(a.get("dtype", "")).lower(), -1) for a in args], np.int64)
    nel = np.maximum(n_in, n_out)
    return np.where((size > 0) & (nel > 0), nel * size, -1)


#: An event ending more than this long after the trace's last event start (or more than the
#: trace's whole span, if longer) has an absurd duration.
ABSURD_DURATION_MARGIN_NS = 3600 * 10**9


def _repair_absurd_durations(t: pa.Table, stats: _Stats, warnings: list[str], name: str) -> pa.Table:
    """Durations no trace can hold (a ``dur`` of 1e12 µs in a trace of seconds) become 0,
    flagged repaired and counted as ``absurd_duration``, as a missing duration is.

    The rule: an event is absurd when it ends more than ``max(span, 1 h)`` after the last event
    start of its file, ``span`` being the time from the first start to the last. Kept at its
    start with duration 0 it no longer swallows every later event of its thread.
    """
    dur = t["dur"].to_numpy()
    if not len(dur) or not (dur > 0).any():
        return t
    start = t["start"].to_numpy().astype(np.float64)
    lo, hi = start.min(), start.max()
    limit = min(hi + max(hi - lo, ABSURD_DURATION_MARGIN_NS), float(_MAX_NS))
    bad = start + dur.astype(np.float64) > limit
    if not bad.any():
        return t
    k = int(bad.sum())
    stats.repaired["absurd_duration"] += k
    warnings.append(
        f"{name}: {k} events end more than max(trace span, 1 h) after the last event start "
        "(absurd durations); kept with duration 0, flagged repaired"
    )
    flags = t["flags"].to_numpy() | np.where(bad, FLAG_REPAIRED, 0).astype(np.int32)
    t = t.set_column(t.schema.get_field_index("dur"), "dur", pa.array(np.where(bad, 0, dur)))
    return t.set_column(t.schema.get_field_index("flags"), "flags", pa.array(flags, pa.int32()))


_DUP_KEYS = ("start", "dur", "pid", "tid", "device", "stream", "kind", "name", "cat")


def _drop_exact_duplicates(t: pa.Table, stats: _Stats, warnings: list[str], name: str) -> pa.Table:
    """Drop rows that repeat an earlier row exactly (same kind, category, name, process,
    thread, device, stream, start, duration and args): a copied record, not a second event.
    Counted in ``skipped`` as ``exact_duplicate`` so the counts still balance.

    One lexsort over the integer columns finds runs of equal keys; only rows in such runs have
    their ``args`` compared.
    """
    n = t.num_rows
    if n < 2:
        return t

    def column(c: str) -> np.ndarray:
        col = t[c].combine_chunks() if isinstance(t[c], pa.ChunkedArray) else t[c]
        if pa.types.is_dictionary(col.type):
            col = col.indices.fill_null(-1)
        return col.to_numpy(zero_copy_only=False)

    # candidates first: rows whose hash of the key columns another row shares (one uint64 per
    # row instead of every key column at once); only those are compared exactly
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for k, c in enumerate(_DUP_KEYS):
            h = (h ^ column(c).astype(np.uint64)) * np.uint64(0x100000001B3 + 2 * k)
            h ^= h >> np.uint64(29)
    oh = np.argsort(h, kind="stable")
    hs = h[oh]
    del h
    eq = hs[1:] == hs[:-1]
    del hs
    if not eq.any():
        return t
    in_group = np.zeros(n, bool)
    in_group[1:] |= eq
    in_group[:-1] |= eq
    cand = np.sort(oh[in_group])
    del oh, eq, in_group
    cols = [column(c)[cand] for c in _DUP_KEYS]
    o = cand[np.lexsort(cols[::-1])]
    cols = [column(c)[o] for c in _DUP_KEYS]
    same = np.ones(len(o) - 1, bool)
    for cs in cols:
        same &= cs[1:] == cs[:-1]
    if not same.any():
        return t
    in_run = np.zeros(len(o), bool)
    in_run[1:] |= same
    in_run[:-1] |= same
    rows = o[in_run]  # grouped by key, in sorted order
    key_group = np.cumsum(np.concatenate([[True], ~same]))[in_run]
    args = _take_few(t["args"], rows)
    acode = args.dictionary_encode().indices.fill_null(-1).to_numpy(zero_copy_only=False)
    o2 = np.lexsort((rows, acode, key_group))  # within a key group: by args, first row first
    g, a, r = key_group[o2], acode[o2], rows[o2]
    dup = np.zeros(n, bool)
    dup[r[1:][(g[1:] == g[:-1]) & (a[1:] == a[:-1])]] = True
    k = int(dup.sum())
    if not k:
        return t
    stats.skipped["exact_duplicate"] += k
    warnings.append(
        f"{name}: {k} exact duplicate events (same kind, name, thread, start, end and args as "
        "an earlier one) dropped"
    )
    return t.filter(pa.array(~dup))


# --------------------------------------------------------------------------------------------
# one file


@dataclass
class KinetoFile:
    """One parsed trace file: timed rows on an absolute (or raw) ns clock, plus what it says."""

    path: Path
    table: pa.Table  # canonical columns, start_ns/end_ns not yet shifted to τ
    meta: dict[str, Any]
    stats: _Stats
    clock: dict[str, Any]
    damage: list[str]
    warnings: list[str]
    main_pid: int
    host_pids: list[int]

    @property
    def rank(self) -> int | None:
        info = self.meta.get("distributedInfo")
        r = info.get("rank") if isinstance(info, dict) else None
        return r if isinstance(r, int) and not isinstance(r, bool) else None


def parse_kineto_file(
    path: str | Path,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    layer_rules: str | Path | None = None,
    progress: bool | None = None,
    fast: bool = True,
) -> KinetoFile:
    """Parse one Kineto JSON(.gz) file. Times are absolute ns when the file anchors them.

    ``fast=False`` reads every chunk with the stdlib path (the reference the typed msgspec path
    is tested against; same rows, slower)."""
    path = Path(path)
    rules = load_layer_rules(layer_rules)
    text = _Text(path)
    try:
        stream = _EventStream(path, text, chunk_bytes, fast)
    except BaseException:
        text.close()
        raise
    stats = _Stats()
    parts: list[pa.Table] = []
    total = text.size  # progress in bytes of the file (compressed ones for a .gz)
    big = total > (PROGRESS_BYTES // 8 if text.gz else PROGRESS_BYTES)
    show = progress if progress is not None else (big and sys.stderr.isatty())
    bar = None
    if show:
        from rich.console import Console
        from rich.progress import Progress

        bar = Progress(console=Console(stderr=True), transient=True)
        bar.start()
        task = bar.add_task(f"reading {path.name}", total=total)
    try:
        for evs in stream:
            if type(evs) is tuple:  # read by the typed path
                t, st = evs
                stats.merge(st)
            else:
                t = _segment(evs, stream.exact, stats)
            if t is not None and t.num_rows:
                parts.append(t)
            if bar is not None:
                bar.update(task, completed=text.consumed)
    except RecursionError:
        raise InputError(path, "JSON nested too deeply to read", "re-export the trace") from None
    finally:
        text.close()
        if bar is not None:
            bar.stop()
    stream.buf = bytearray()  # the text is no longer needed: free it before building columns
    damage = text.damage + stream.damage
    meta = {**stream.header, **stream.trailer}
    n_in = sum(stats.in_by_category.values())
    if n_in == 0:
        what = "no complete trace event could be read" if damage else "traceEvents is empty"
        fix = (
            "the file is damaged beyond repair; re-export it"
            if damage
            else "re-record with the profiler active around the workload"
        )
        raise InputError(path, what + (f" ({'; '.join(damage)})" if damage else ""), fix)
    warnings: list[str] = [f"{path.name}: {d}" for d in damage]
    sv = meta.get("schemaVersion")
    if sv is not None and sv not in KNOWN_SCHEMA_VERSIONS:
        warnings.append(
            f"{path.name}: unknown schemaVersion {sv!r}; read with the version-1 layout"
        )

    table = pa.concat_tables(parts).unify_dictionaries() if parts else None
    parts.clear()
    if table is not None:
        table = _drop_exact_duplicates(table, stats, warnings, path.name)
        table = _repair_absurd_durations(table, stats, warnings, path.name)
    if damage and table is not None:
        stats.repaired["salvaged_from_damaged_file"] += table.num_rows
        table = table.set_column(
            table.schema.get_field_index("flags"),
            "flags",
            pc.bit_wise_or(table["flags"], pa.scalar(FLAG_REPAIRED, pa.int32())),
        )
        warnings.append(
            f"{path.name}: damaged file: the {table.num_rows} complete events read are kept, "
            "flagged repaired"
        )
    base = meta.get("baseTimeNanoseconds")
    base = base if isinstance(base, int) and not isinstance(base, bool) else None
    if base is not None and not 0 <= base < _MAX_NS:
        warnings.append(
            f"{path.name}: baseTimeNanoseconds {base} is not a plausible wall-clock time; ignored"
        )
        base = None
    box = [table] if table is not None else []
    del table
    canon, main_pid, host_pids = _finish_file(box, base, rules, stats)
    clock = _clock_of(canon, base, meta)
    if clock["source"] == "none" and canon.num_rows:
        warnings.append(
            f"{path.name}: no baseTimeNanoseconds and ts is not Unix time; t0_unix_ns unknown"
        )
    processes, threads = _names(stats.metadata)
    meta_small = {k: v for k, v in meta.items() if k not in ("deviceProperties", "INFO")}
    if "distributedInfo" in meta_small:
        meta_small["distributedInfo"] = _shrink(meta_small["distributedInfo"])
    meta_small["devices"] = [
        d.get("name") for d in meta.get("deviceProperties") or [] if isinstance(d, dict)
    ]
    meta_small["processes"] = processes
    meta_small["threads"] = threads
    meta_small["exact_decimal_ts"] = stream.exact
    return KinetoFile(path, canon, meta_small, stats, clock, damage, warnings, main_pid, host_pids)


def _shrink(o: Any) -> Any:
    """distributedInfo without thousand-entry rank lists (a 300-rank job repeats them per group)."""
    if isinstance(o, dict):
        return {k: _shrink(v) for k, v in o.items()}
    if isinstance(o, list):
        if len(o) > 32 and all(isinstance(x, int) for x in o):
            return {"count": len(o), "first": o[0], "last": o[-1]}
        return [_shrink(x) for x in o]
    return o


def _names(metadata: list[dict]) -> tuple[dict[str, dict], list[dict]]:
    """Process and thread names from ``M`` events (few per trace: a loop is fine)."""
    procs: dict[str, dict] = {}
    threads: dict[tuple, dict] = {}
    for e in metadata:
        a = e.get("args") if isinstance(e.get("args"), dict) else {}
        what, pid, tid = e.get("name"), e.get("pid"), e.get("tid")
        if what == "process_name":
            procs.setdefault(str(pid), {})["name"] = a.get("name")
        elif what == "process_labels":
            procs.setdefault(str(pid), {})["labels"] = a.get("labels")
        elif what == "thread_name":
            threads[(str(pid), str(tid))] = {
                "pid": pid,
                "tid": tid,
                "name": str(a.get("name", "")).strip(),
            }
    return procs, list(threads.values())


def _finish_file(
    box: list, base: int | None, rules: tuple[LayerRule, ...], stats: _Stats
) -> tuple[pa.Table, int, list[int]]:
    """File-level passes: clock base, API names, layers, the GPU rows' process, duplicates, order.

    ``box`` holds the file's (chunked) table and is emptied: the unsorted columns are released
    as their sorted copies are made, so the file's rows are held about once, not twice.
    """
    t = box.pop() if box else None
    if t is None or t.num_rows == 0:
        return events_table({}, 0), -1, []
    kind = t["kind"].to_numpy()
    pid = t["pid"].to_numpy().copy()
    corr = t["corr_id"].to_numpy()
    flags = t["flags"].to_numpy().copy()
    gpu = t["gpu"].to_numpy()
    start = t["start"].to_numpy() + (base or 0)
    end = start + t["dur"].to_numpy()
    t = t.drop_columns(["kind", "pid", "corr_id", "flags", "gpu", "start", "dur"])  # copied

    # names of runtime/driver calls without the `_v7000`-style version suffix
    name_col = t["name"].combine_chunks() if isinstance(t["name"], pa.ChunkedArray) else t["name"]
    name_dict = name_col.dictionary.to_pylist()
    name_codes = name_col.indices.to_numpy(zero_copy_only=False).astype(np.int32)
    del name_col
    stripped = [strip_api_version(s) for s in name_dict]
    if stripped != name_dict:
        merged = list(dict.fromkeys(name_dict + stripped))
        pos = {s: i for i, s in enumerate(merged)}
        as_is = np.array([pos[s] for s in name_dict], np.int32)
        as_api = np.array([pos[s] for s in stripped], np.int32)
        name_codes = np.where(np.isin(kind, _HOST_CALL), as_api[name_codes], as_is[name_codes])
        name_dict = merged

    cat_col = t["cat"].combine_chunks() if isinstance(t["cat"], pa.ChunkedArray) else t["cat"]
    cat_dict = cat_col.dictionary.to_pylist()
    cat_codes = cat_col.indices.to_numpy(zero_copy_only=False)
    del cat_col
    layer = layer_codes(cat_codes, cat_dict, name_codes, name_dict, rules)
    del cat_codes

    # the trace's main host process: the pid with most host-side rows
    host_rows = ~gpu & (pid >= 0)
    host_pids, counts = np.unique(pid[host_rows], return_counts=True)
    main_pid = int(host_pids[np.argmax(counts)]) if len(host_pids) else -1
    del host_rows

    # GPU rows belong to the profiled process: Kineto records the CUPTI activity of the process
    # that ran the profiler, whose host rows are the file's main pid (Kineto writes pid = device
    # on GPU rows). Which call launched each row is decided by reconstruction, by (pid, corr_id).
    hi = np.flatnonzero(np.isin(kind, _HOST_CALL) & (corr >= 0))
    gi = np.flatnonzero(gpu)
    pid[gi] = main_pid

    # duplicate correlation ids: a second host call with the same (pid, corr), or a second GPU
    # activity with the same corr unless a graph launch (one corr, many kernels) issued it
    dup = np.zeros(len(kind), bool)
    _mark_later_duplicates(dup, hi, pid, corr, start)
    graph_name = np.fromiter(
        (bool(_GRAPH_LAUNCH.search(s)) for s in name_dict), bool, len(name_dict)
    )
    graph_corr = corr[hi[graph_name[name_codes[hi]]]]
    from_graph = np.zeros(len(kind), bool)
    from_graph[gi] = np.isin(corr[gi], graph_corr) & (corr[gi] >= 0)
    wi = np.flatnonzero(np.isin(kind, _GPU_WORK) & (corr >= 0) & ~from_graph)
    _mark_later_duplicates(dup, wi, np.zeros_like(pid), corr, start)
    if dup.any():
        flags[dup] |= FLAG_DUPLICATE
        stats.repaired["duplicate_corr_id"] += int(dup.sum())
    del dup, from_graph, hi, gi, wi

    order = np.lexsort((-(end - start), start))
    cols: dict[str, Any] = {}
    # the largest column first, its unsorted chunks released one by one
    chunks = list(t["args"].chunks)
    t = t.drop_columns(["args", "name", "cat"])
    cols["args"] = _take_strings(chunks, order)
    cols["kind"] = pa.DictionaryArray.from_arrays(pa.array(kind[order]), pa.array(KINDS))
    cols["name"] = pa.DictionaryArray.from_arrays(
        pa.array(name_codes[order]), pa.array(name_dict, pa.string())
    )
    del name_codes
    cols["layer"] = pa.DictionaryArray.from_arrays(
        pa.array(layer[order]), pa.array(("",) + LAYERS)
    )
    # Arrow arrays over the sorted numpy columns (zero-copy; events_table keeps them as they are)
    cols["pid"] = pa.array(pid[order])
    cols["start_ns"] = pa.array(start[order])
    cols["end_ns"] = pa.array(end[order])
    cols["corr_id"] = pa.array(corr[order])
    cols["flags"] = pa.array(flags[order])
    del kind, layer, pid, start, end, corr, flags
    for c in ("tid", "device", "stream", "graph_id", "bytes"):
        cols[c] = pa.array(t[c].to_numpy()[order])
        t = t.drop_columns([c])
    n = len(order)
    cols["node"] = cols["rank"] = pa.array(np.zeros(n, np.int32))
    canon = events_table(cols)
    return canon, main_pid, [int(p) for p in host_pids]


def _take_few(col: pa.ChunkedArray | pa.Array, rows: np.ndarray) -> pa.Array:
    """``col.take(rows)`` chunk by chunk (no concatenation of the whole column), in ``rows``'
    order."""
    if not isinstance(col, pa.ChunkedArray):
        return col.take(pa.array(rows))
    bounds = np.cumsum([0] + [len(c) for c in col.chunks])
    which = np.searchsorted(bounds, rows, side="right") - 1
    by = np.argsort(which, kind="stable")
    parts = []
    for ci in np.unique(which):
        sel = by[which[by] == ci]
        parts.append(col.chunk(int(ci)).take(pa.array(rows[sel] - bounds[ci])))
    got = pa.concat_arrays(parts) if parts else pa.array([], col.type)
    back = np.empty(len(rows), np.int64)
    back[by] = np.arange(len(rows))
    return got.take(pa.array(back))


def _take_strings(chunks: list, order: np.ndarray) -> pa.Array:
    """The string column in ``chunks`` (no nulls) taken in ``order``, chunk by chunk: each
    chunk's bytes are copied to their sorted places, then the chunk is let go from ``chunks``
    (Arrow's take of a chunked array concatenates it first: twice the column at once)."""
    n = len(order)
    if any(c.null_count for c in chunks) or any(c.type != pa.string() for c in chunks):
        return pa.chunked_array(chunks, pa.string()).take(pa.array(order)).combine_chunks()
    lens = np.empty(n, np.int64)
    k = 0
    for c in chunks:
        off = np.frombuffer(c.buffers()[1], np.int32)[c.offset : c.offset + len(c) + 1]
        lens[k : k + len(c)] = np.diff(off)
        k += len(c)
    out_off = np.zeros(n + 1, np.int64)
    np.cumsum(lens[order], out=out_off[1:])
    total = int(out_off[-1])
    if total >= 2**31:
        return pa.chunked_array(chunks, pa.string()).take(pa.array(order)).combine_chunks()
    inv = np.empty(n, np.int64)
    inv[order] = np.arange(n)
    out = pa.allocate_buffer(total)  # from Arrow's pool, where the released chunks go back
    data = np.frombuffer(out, np.uint8)
    k = 0
    for i in range(len(chunks)):
        c = chunks[i]
        m = len(c)
        if m:
            off = np.frombuffer(c.buffers()[1], np.int32)[c.offset : c.offset + m + 1]
            src = np.frombuffer(c.buffers()[2], np.uint8)[off[0] : off[-1]]
            ln = lens[k : k + m]
            shift = out_off[inv[k : k + m]] - (off[:-1] - off[0])  # dest minus source start
            # int32 positions (total < 2^31): half the index bytes to write and read
            data[np.repeat(shift.astype(np.int32), ln) + np.arange(len(src), dtype=np.int32)] = src
        k += m
        chunks[i] = c = None  # release the chunk
    return pa.StringArray.from_buffers(n, pa.py_buffer(out_off.astype(np.int32)), out)


def _mark_later_duplicates(
    dup: np.ndarray, rows: np.ndarray, key_a: np.ndarray, key_b: np.ndarray, t: np.ndarray
) -> None:
    """Set ``dup`` on every row of ``rows`` whose (key_a, key_b) an earlier row already had."""
    if len(rows) < 2:
        return
    o = rows[np.lexsort((t[rows], key_b[rows], key_a[rows]))]
    same = (key_a[o][1:] == key_a[o][:-1]) & (key_b[o][1:] == key_b[o][:-1])
    dup[o[1:][same]] = True


def _clock_of(t: pa.Table, base: int | None, meta: dict) -> dict[str, Any]:
    """How the file's times relate to wall-clock time."""
    first = int(pc.min(t["start_ns"]).as_py()) if t.num_rows else None
    if base is not None:
        source = "baseTimeNanoseconds"
    elif first is not None and 946_684_800 * 10**9 <= first < 4_102_444_800 * 10**9:
        source = "ts_unix_us"  # older Kineto writes ts as Unix µs (2000-01-01 .. 2100-01-01)
    else:
        source = "none"
    return {
        "source": source,
        "baseTimeNanoseconds": base,
        "first_event_ns": first,
        "displayTimeUnit": meta.get("displayTimeUnit"),
        "traceTimeUnit": meta.get("traceTimeUnit"),
    }


def read_kineto(path: str | Path, **options: Any) -> pa.Table:
    """Canonical events of one Kineto file, τ = ns since its earliest event.

    The file's clock anchor and counts travel in the schema metadata key ``teller.kineto``
    (JSON: ``t0_unix_ns``, ``clock``, ``counts``, ``warnings``).
    """
    f = parse_kineto_file(path, **options)
    t0 = f.clock["first_event_ns"] or 0
    table = _shift(f.table, t0)
    info = {
        "t0_unix_ns": t0 if f.clock["source"] != "none" and f.table.num_rows else None,
        "clock": f.clock,
        "counts": _counts([f]),
        "warnings": f.warnings,
    }
    return table.replace_schema_metadata({"teller.kineto": json.dumps(info, default=str)})


def _shift(t: pa.Table, t0: int) -> pa.Table:
    if t0 == 0 or t.num_rows == 0:
        return t
    s = pa.scalar(t0, pa.int64())
    t = t.set_column(
        t.schema.get_field_index("start_ns"), "start_ns", pc.subtract(t["start_ns"], s)
    )
    return t.set_column(t.schema.get_field_index("end_ns"), "end_ns", pc.subtract(t["end_ns"], s))


def _counts(files: list[KinetoFile]) -> dict[str, Any]:
    """Summed counts; events_in = events_out + skipped."""
    cin, skipped, repaired, out, flags = Counter(), Counter(), Counter(), Counter(), Counter()
    for f in files:
        cin.update(f.stats.in_by_category)
        skipped.update(f.stats.skipped)
        repaired.update(f.stats.repaired)
        kinds = f.table["kind"].combine_chunks()
        vc = pc.value_counts(
            kinds.dictionary_decode() if f.table.num_rows else pa.array([], pa.string())
        )
        out.update({d["values"]: d["counts"] for d in vc.to_pylist()})
        fl = f.table["flags"].to_numpy() if f.table.num_rows else np.zeros(0, np.int32)
        for bit, name in ((FLAG_REPAIRED, "repaired"), (FLAG_DUPLICATE, "duplicate")):
            flags[name] += int(((fl & bit) != 0).sum())
    return {
        "events_in": sum(cin.values()),
        "events_out": sum(out.values()),
        "skipped": sum(skipped.values()),
        "repaired": sum(repaired.values()),
        "in_by_category": dict(sorted(cin.items())),
        "out_by_kind": {k: out[k] for k in KINDS if out[k]},
        "skipped_by_reason": dict(sorted(skipped.items())),
        "repaired_by_reason": dict(sorted(repaired.items())),
        "flagged": dict(flags),
    }


# --------------------------------------------------------------------------------------------
# run directory


def _trace_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    files = sorted(
        p for p in src.iterdir() if p.is_file() and p.name.lower().endswith((".json", ".json.gz"))
    )
    if not files:
        raise InputError(
            src,
            "folder holds no .json or .json.gz trace",
            "point at a Kineto trace or a folder of per-rank traces",
        )
    return files


def _assign_ranks(files: list[KinetoFile]) -> tuple[list[int], list[str]]:
    """Rank per file: distributedInfo.rank, else `rankN` in the file name, else file order."""
    ranks, warnings = [], []
    for i, f in enumerate(files):
        r = f.rank
        if r is None:
            m = _RANK_IN_NAME.search(f.path.name)
            r = int(m.group(1)) if m else i
        ranks.append(r)
    dup = [r for r, k in Counter(ranks).items() if k > 1]
    if dup:
        warnings.append(
            f"several files claim rank(s) {sorted(dup)}; their events share those ranks"
        )
    return ranks, warnings


def ingest_kineto(src: Path, out: Path, **options: Any) -> dict[str, Any]:
    """Read a Kineto trace file or a folder of per-rank traces into the run directory ``out``.

    Options: ``layer_rules`` (path to a rules TOML), ``chunk_bytes``, ``progress``. Returns the
    counts (also stored in run.json): ``events_in == events_out + skipped``.
    """
    src, out = Path(src), Path(out)
    paths = _trace_files(src)
    files = [parse_kineto_file(p, **options) for p in paths]
    ranks, warnings = _assign_ranks(files)
    hosts = [f.meta.get("host_name") for f in files]
    node_of = {h: i for i, h in enumerate(dict.fromkeys(h for h in hosts if h))}
    anchored = [
        f.clock["first_event_ns"] for f in files if f.clock["source"] != "none" and f.table.num_rows
    ]
    t0 = min(anchored) if anchored else None
    if anchored and len(anchored) < sum(1 for f in files if f.table.num_rows):
        warnings.append(
            "some files have no absolute clock; each is placed with its first event at τ=0"
        )

    counts = _counts(files)
    if counts["events_out"] == 0:
        warnings.append("no timed events (only metadata, flows or counters): the run is empty")
    end_ns = max(
        (
            int(pc.max(f.table["end_ns"]).as_py())
            for f in files
            if f.table.num_rows and f.clock["source"] != "none"
        ),
        default=None,
    )

    prepare_out(out)
    rd = RunDir(out)
    used: set[str] = set()
    rank_info = []
    for f, rank, host in zip(files, ranks, hosts, strict=True):
        node = node_of.get(host, 0)
        shift = (
            t0
            if (t0 is not None and f.clock["source"] != "none")
            else (f.clock["first_event_ns"] or 0)
        )
        t = _shift(f.table, shift)
        n = t.num_rows
        t = t.set_column(
            t.schema.get_field_index("rank"), "rank", pa.array(np.full(n, rank, np.int32))
        )
        t = t.set_column(
            t.schema.get_field_index("node"), "node", pa.array(np.full(n, node, np.int32))
        )
        stem = re.sub(
            r"[^A-Za-z0-9_.-]+", "_", re.sub(r"\.json(\.gz)?$", "", f.path.name, flags=re.I)
        )
        name = f"kineto_rank{rank}_{stem}"
        while name in used:
            name += "_"
        used.add(name)
        if n:
            rd.write_events(t, name=name)
        f.table = t = f.table.slice(0, 0)  # written: free the rows
        rank_info.append(
            {
                "node": node,
                "rank": rank,
                "pid": f.main_pid,
                "pids": f.host_pids,
                "host": host,
                "file": f.path.name,
                "events": n,
            }
        )
        warnings.extend(f.warnings)

    info = RunInfo(
        source=str(src),
        ranks=rank_info,
        clock={
            "t0_unix_ns": t0,
            "tau": "ns since the earliest event of the run",
            "per_file": [{"file": f.path.name, **f.clock} for f in files],
        },
        collector={"reader": "kineto", "files": [str(p) for p in paths]},
        counts=counts,
        start_wall=t0 / 1e9 if t0 is not None else None,
        end_wall=end_ns / 1e9 if end_ns is not None else None,
        extra={"kineto": [{"file": f.path.name, **f.meta} for f in files], "warnings": warnings},
    )
    rd.write_info(info)
    return {"files": len(files), "ranks": len(set(ranks)), **counts, "warnings": warnings}
