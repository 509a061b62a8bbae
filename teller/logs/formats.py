"""Log line formats, kept as data, and vectorized timestamp parsing.

A format (preset) is one line regex with named groups and one time format:

- groups: ``ts`` (timestamp text), ``level``, ``logger``, ``msg``, optional ``pid``; any group
  may be absent (a missing ``msg`` means "the whole line"). Other named groups are ignored.
- the time format is strptime syntax (``%Y-%m-%d %H:%M:%S,%f``) or one of the special names
  ``ISO8601`` and ``EPOCH`` (seconds, with an optional fraction). It is translated into a regex
  with one named group per field, so a whole column of timestamps is parsed by one RE2 pass in
  Arrow plus integer arithmetic in numpy (no ``datetime.strptime`` per line).

The line regexes stay inside the syntax shared by Python ``re`` and RE2 (no look-behind, no
back-references), so Arrow's ``extract_regex`` runs them over a column in C++. A user regex that
RE2 rejects still works through Python ``re`` (one match per line).

Facts about the formats (from the engines' logging set-up):

- vLLM: ``%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s`` with date format
  ``%m-%d %H:%M:%S`` (older releases print ``file.py:123]`` without the opening bracket). Newer
  releases prefix lines of child processes with ``(EngineCore_DP0 pid=1234) `` / ``(APIServer
  pid=...) `` / ``(Worker_TP0 pid=...) ``, sometimes wrapped in ANSI colour codes (stripped before
  matching). vLLM repeats the prefix on every line of a multi-line message, so traceback lines
  parse as ordinary lines. The timestamp has no year and no sub-second part: the year comes from
  the run (``run.json`` start time, else the file's mtime; the one of year−1, year, year+1 nearest
  that reference wins, which handles New Year), and the alignment tolerance for such lines is at
  least one second. vLLM has no logger name in the line: ``logger`` is the file info.
- Python ``logging``: ``%(asctime)s - %(name)s - %(levelname)s - %(message)s`` with
  ``2026-11-29 08:15:02,123`` (local time, millisecond resolution).
- transformers: by default ``[transformers] message`` (no time); with ``enable_explicit_format()``
  ``[INFO|continuous_api.py:1291] 2026-11-29 08:15:02,123 >> message``; with
  ``TRANSFORMERS_VERBOSITY=detail`` ``INFO [transformers.generation...:1291] 2026-11-29
  08:15:02,123 message``. Continuous batching names requests ``req_<n>``.
- SGLang: ``[2026-11-29 08:15:02 TP0] message``.
- ISO-8601 lines: ``2026-11-29T08:15:02.123456Z INFO message`` (offset optional).

Timestamps without an offset are local time of the host that wrote them: the UTC offset comes
from the caller (``run.json["clock"]["utc_offset_s"]`` when the recorder wrote it), else the
offset of this machine's time zone at the reference instant; the summary says which.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.errors import TellerError

_LEVELS = r"TRACE|DEBUG|INFO|NOTICE|WARNING|WARN|ERROR|CRITICAL|FATAL"

#: Presets: name -> (line regex, time format or None, description). Order = detection priority.
PRESETS_DATA: dict[str, tuple[str, str | None, str]] = {
    "vllm": (
        r"^(?:\((?P<proc>[^()]*?)\s*pid=(?P<pid>\d+)[^()]*\)\s+)?"
        r"(?P<level>" + _LEVELS + r")\s+(?P<ts>\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2})\s+"
        r"\[?(?P<logger>[^\]\s]+?):\d+\]\s?(?P<msg>.*)$",
        "%m-%d %H:%M:%S",
        "vLLM: [(Proc pid=N) ]LEVEL MM-DD HH:MM:SS [file.py:line] message",
    ),
    "python": (
        r"^(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}) - (?P<logger>\S+) - "
        r"(?P<level>[A-Z]+) - (?P<msg>.*)$",
        "%Y-%m-%d %H:%M:%S,%f",
        "Python logging: %(asctime)s - %(name)s - %(levelname)s - %(message)s",
    ),
    "transformers": (
        r"^\[(?P<level>[A-Z]+)\|(?P<logger>[^:\]]+):\d+\] "
        r"(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}) >> (?P<msg>.*)$",
        "%Y-%m-%d %H:%M:%S,%f",
        "transformers explicit format: [LEVEL|file.py:line] YYYY-MM-DD HH:MM:SS,mmm >> message",
    ),
    "transformers_detail": (
        r"^(?P<level>" + _LEVELS + r") \[(?P<logger>[^:\]\s]+):\d+\] "
        r"(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}) (?P<msg>.*)$",
        "%Y-%m-%d %H:%M:%S,%f",
        "transformers TRANSFORMERS_VERBOSITY=detail: LEVEL [logger:line] YYYY-MM-DD HH:MM:SS,mmm message",
    ),
    "sglang": (
        r"^\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?: (?P<logger>[^\]]+))?\] (?P<msg>.*)$",
        "%Y-%m-%d %H:%M:%S",
        "SGLang: [YYYY-MM-DD HH:MM:SS TP0] message",
    ),
    "iso8601": (
        r"^\[?(?P<ts>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?(?:Z|[+-]\d{2}:?\d{2})?)\]?"
        r"\s+(?:\[?(?P<level>" + _LEVELS + r")\]?:?\s+)?(?P<msg>.*)$",
        "ISO8601",
        "ISO-8601 timestamp first, optional level: 2026-11-29T08:15:02.123Z INFO message",
    ),
    "transformers_default": (
        r"^\[(?P<logger>transformers)\] (?P<msg>.*)$",
        None,
        "transformers default: [transformers] message (no timestamp)",
    ),
}

#: ANSI colour/escape sequences (vLLM colours its process prefix).
ANSI_RE = r"\x1b\[[0-9;?]*[A-Za-z]"

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_MONTHS_FULL = ("january", "february", "march", "april", "may", "june", "july", "august",
                "september", "october", "november", "december")

# strptime directive -> regex with named group(s)
_DIRECTIVES = {
    "Y": r"(?P<Y>\d{4})",
    "y": r"(?P<y>\d{2})",
    "m": r"(?P<m>\d{1,2})",
    "d": r"(?P<d>\d{1,2})",
    "e": r"\s?(?P<d>\d{1,2})",
    "H": r"(?P<H>\d{1,2})",
    "I": r"(?P<I>\d{1,2})",
    "M": r"(?P<M>\d{1,2})",
    "S": r"(?P<S>\d{1,2})",
    "f": r"(?P<f>\d{1,9})",
    "z": r"(?P<z>Z|[+-]\d{2}:?\d{2})",
    "Z": r"(?P<Z>[A-Za-z]{1,5})",
    "b": r"(?P<b>[A-Za-z]{3})",
    "h": r"(?P<b>[A-Za-z]{3})",
    "B": r"(?P<B>[A-Za-z]{3,9})",
    "a": r"[A-Za-z]{3}",
    "A": r"[A-Za-z]{6,9}",
    "p": r"(?P<p>[AaPp][Mm])",
    "j": r"(?P<j>\d{1,3})",
    "s": r"(?P<s>\d+)(?:\.(?P<f>\d{1,9}))?",
    "T": r"(?P<H>\d{1,2}):(?P<M>\d{1,2}):(?P<S>\d{1,2})",
    "F": r"(?P<Y>\d{4})-(?P<m>\d{1,2})-(?P<d>\d{1,2})",
    "%": "%",
}

_SPECIAL_TIME = {
    "ISO8601": r"^\s*(?P<Y>\d{4})-(?P<m>\d{2})-(?P<d>\d{2})[T ](?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})"
               r"(?:[.,](?P<f>\d{1,9}))?\s*(?P<z>Z|[+-]\d{2}:?\d{2})?\s*$",
    "EPOCH": r"^\s*(?P<s>\d+)(?:\.(?P<f>\d{1,9}))?\s*$",
}


def time_format_regex(fmt: str) -> str:
    """Translate a strptime-style format (or ``ISO8601``/``EPOCH``) into an anchored regex."""
    if fmt.upper() in _SPECIAL_TIME:
        return _SPECIAL_TIME[fmt.upper()]
    out, seen, i = ["^\\s*"], set(), 0
    while i < len(fmt):
        c = fmt[i]
        if c == "%" and i + 1 < len(fmt):
            d = fmt[i + 1]
            if d not in _DIRECTIVES:
                raise TellerError(f"time format {fmt!r}: directive %{d} is not supported; use %Y %y %m %d %e %H %I %M %S %f %z %Z %b %B %a %A %p %j %s %T %F or ISO8601/EPOCH")
            rx = _DIRECTIVES[d]
            for name in re.findall(r"\(\?P<(\w+)>", rx):
                if name in seen:  # a field given twice (e.g. %F and %d): match the 2nd as plain text
                    rx = rx.replace(f"(?P<{name}>", "(?:")
                seen.add(name)
            out.append(rx)
            i += 2
        elif c.isspace():
            out.append(r"\s+")
            while i < len(fmt) and fmt[i].isspace():
                i += 1
        else:
            out.append(re.escape(c))
            i += 1
    out.append("\\s*$")
    return "".join(out)


@dataclass
class Preset:
    """One log format: a compiled line regex plus the time format of its ``ts`` group."""

    name: str
    regex: str
    time_format: str | None
    description: str = ""
    groups: tuple[str, ...] = field(default=(), init=False)
    re2: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        try:
            compiled = re.compile(self.regex)
        except re.error as e:
            raise TellerError(f"log format {self.name!r}: invalid regex {self.regex!r} ({e}); fix the pattern") from e
        self.groups = tuple(compiled.groupindex)
        self._compiled = compiled
        if "ts" in self.groups and not self.time_format:
            raise TellerError(f"log format {self.name!r}: the regex has a 'ts' group but no time format; pass --time-format (strptime syntax, ISO8601 or EPOCH)")
        self.time_regex = time_format_regex(self.time_format) if self.time_format else None
        try:  # RE2 accepts the pattern? then Arrow runs it over whole columns
            pc.extract_regex(pa.array(["x"]), self.regex) if self.groups else None
            pc.match_substring_regex(pa.array(["x"]), self.regex)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            self.re2 = False

    @property
    def has_year(self) -> bool:
        tr = self.time_regex or ""
        return any(f"(?P<{g}>" in tr for g in ("Y", "y", "s"))

    def match_mask(self, lines: pa.Array) -> np.ndarray:
        """Which lines this format matches (bool array)."""
        if self.re2:
            m = pc.match_substring_regex(lines, self.regex)
            return np.asarray(m.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
        rx = self._compiled
        return np.fromiter((s is not None and rx.search(s) is not None for s in lines.to_pylist()),
                           dtype=bool, count=len(lines))

    def extract(self, lines: pa.Array) -> dict[str, pa.Array]:
        """Named groups of every line (empty strings where a line or group did not match)."""
        names = [g for g in ("ts", "level", "logger", "msg", "pid") if g in self.groups]
        if not names:
            return {}
        if self.re2:
            st = pc.extract_regex(lines, self.regex)
            out = {}
            for g in names:
                col = st.field(g)
                out[g] = pc.if_else(st.is_valid(), col, "")
            return out
        rx = self._compiled
        cols: dict[str, list[str]] = {g: [] for g in names}
        for s in lines.to_pylist():
            m = rx.search(s) if s is not None else None
            for g in names:
                cols[g].append((m.group(g) or "") if m else "")
        return {g: pa.array(v, pa.string()) for g, v in cols.items()}


def preset(name: str) -> Preset:
    """A built-in preset by name."""
    if name not in PRESETS_DATA:
        raise TellerError(f"unknown log format {name!r}; use one of {', '.join(PRESETS_DATA)} or --regex with --time-format")
    rx, tf, desc = PRESETS_DATA[name]
    return Preset(name, rx, tf, desc)


def custom_preset(regex: str, time_format: str | None) -> Preset:
    """A user format: regex with named groups ts/level/logger/msg/pid and a strptime format."""
    return Preset("custom", regex, time_format, "user regex")


def all_presets() -> list[Preset]:
    return [preset(n) for n in PRESETS_DATA]


def detect(lines: pa.Array, candidates: list[Preset], sample: int = 500) -> Preset | None:
    """The preset matching most of the first ``sample`` non-empty lines (None when none matches)."""
    head = lines.slice(0, min(len(lines), sample * 4))
    head = head.filter(pc.greater(pc.utf8_length(head), 0)).slice(0, sample)
    if len(head) == 0:
        return None
    best, best_n = None, 0
    for p in candidates:
        n = int(p.match_mask(head).sum())
        if n > best_n:
            best, best_n = p, n
    return best


# --------------------------------------------------------------------------------------------
# timestamps


def _int_col(st: pa.StructArray, name: str, default: int) -> np.ndarray:
    col = st.field(name)
    col = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
    return pc.cast(col, pa.int64()).fill_null(default).to_numpy(zero_copy_only=False).astype(np.int64)


def days_from_civil(y: np.ndarray, m: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Days since 1970-01-01 of proleptic Gregorian dates (vectorized; H. Hinnant's algorithm)."""
    y = y - (m <= 2)
    era = y // 400
    yoe = y - era * 400
    mp = (m + 9) % 12
    doy = (153 * mp + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def local_utc_offset_s(at_unix_s: float) -> int:
    """UTC offset in seconds of this machine's time zone at a given instant."""
    return int(time.localtime(at_unix_s).tm_gmtoff)


def parse_timestamps(ts: pa.Array, time_format: str, ref_unix_ns: int, utc_offset_s: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Parse a column of timestamp strings into Unix ns (−1 where unparseable) and resolution ns.

    Missing year: the year (ref year −1, +0, +1) that puts the instant nearest ``ref_unix_ns``.
    No offset in the text: ``utc_offset_s`` is subtracted (local time → UTC).
    """
    n = len(ts)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rx = time_format_regex(time_format)
    groups = set(re.compile(rx).groupindex)
    st = pc.extract_regex(ts, rx)
    ok = np.asarray(st.is_valid().to_numpy(zero_copy_only=False), dtype=bool)

    def get(name: str, default: int) -> np.ndarray:
        return _int_col(st, name, default) if name in groups else np.full(n, default, np.int64)

    ref_year = time.gmtime(ref_unix_ns / 1e9).tm_year
    # fraction: value scaled by its number of digits; resolution follows the digits present
    if "f" in groups:
        fstr = st.field("f")
        ndig = pc.utf8_length(fstr).to_numpy(zero_copy_only=False).astype(np.int64)
        fval = get("f", 0)
        frac_ns = fval * (10 ** np.clip(9 - ndig, 0, 9))
        res = np.where(ndig > 0, 10 ** np.clip(9 - ndig, 0, 9), 1_000_000_000).astype(np.int64)
    else:
        frac_ns = np.zeros(n, np.int64)
        res = np.full(n, 1_000_000_000, np.int64)

    if "s" in groups:  # epoch seconds
        wall = get("s", -1) * 1_000_000_000 + frac_ns
        wall = np.where(ok, wall, -1)
        return wall.astype(np.int64), res

    month = get("m", 1)
    if "b" in groups or "B" in groups:
        key = "b" if "b" in groups else "B"
        names = pc.utf8_lower(st.field(key))
        names = pc.utf8_slice_codeunits(names, 0, 3)
        idx = pc.index_in(names, value_set=pa.array(list(_MONTHS))).fill_null(-1)
        idx = idx.to_numpy(zero_copy_only=False).astype(np.int64)
        ok &= idx >= 0
        month = idx + 1
    day = get("d", 1)
    hour = get("H", 0)
    if "I" in groups:
        hour = get("I", 12) % 12
        if "p" in groups:
            pm = pc.equal(pc.utf8_lower(st.field("p")), "pm").fill_null(False)
            hour = hour + 12 * np.asarray(pm.to_numpy(zero_copy_only=False), dtype=np.int64)
    minute, sec = get("M", 0), get("S", 0)
    ok &= (month >= 1) & (month <= 12) & (day >= 1) & (day <= 31) & (hour <= 24) & (minute <= 59) & (sec <= 60)

    if "z" in groups:
        z = st.field("z")
        zs = pc.replace_substring(z, ":", "")
        has_z = np.asarray(pc.greater(pc.utf8_length(z), 0).fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
        is_utc = np.asarray(pc.equal(z, "Z").fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
        sign = np.where(np.asarray(pc.starts_with(zs, "-").fill_null(False).to_numpy(zero_copy_only=False), dtype=bool), -1, 1)
        digits = pc.utf8_slice_codeunits(zs, 1, 5)
        dig = pc.if_else(pc.equal(pc.utf8_length(digits), 4), digits, "0000")
        hh = pc.cast(pc.utf8_slice_codeunits(dig, 0, 2), pa.int64()).to_numpy(zero_copy_only=False)
        mm = pc.cast(pc.utf8_slice_codeunits(dig, 2, 4), pa.int64()).to_numpy(zero_copy_only=False)
        off = np.where(is_utc, 0, sign * (hh * 3600 + mm * 60))
        offset = np.where(has_z, off, utc_offset_s).astype(np.int64)
    elif "Z" in groups:
        zname = pc.utf8_upper(st.field("Z"))
        utc = pc.is_in(zname, value_set=pa.array(["UTC", "GMT", "Z"])).fill_null(False)
        offset = np.where(np.asarray(utc.to_numpy(zero_copy_only=False), dtype=bool), 0, utc_offset_s).astype(np.int64)
    else:
        offset = np.full(n, utc_offset_s, np.int64)

    secs_of_day = hour * 3600 + minute * 60 + sec

    def wall_for(year: np.ndarray) -> np.ndarray:
        if "j" in groups:
            days = days_from_civil(year, np.ones(n, np.int64), np.ones(n, np.int64)) + get("j", 1) - 1
        else:
            days = days_from_civil(year, month, day)
        return (days * 86400 + secs_of_day - offset) * 1_000_000_000 + frac_ns

    if "Y" in groups:
        wall = wall_for(get("Y", ref_year))
    elif "y" in groups:
        wall = wall_for(2000 + get("y", ref_year % 100))
    else:  # no year in the text: the candidate year nearest the reference instant
        cands = np.stack([wall_for(np.full(n, ref_year + k, np.int64)) for k in (-1, 0, 1)])
        pick = np.argmin(np.abs(cands - np.int64(ref_unix_ns)), axis=0)
        wall = cands[pick, np.arange(n)]
    wall = np.where(ok, wall, -1).astype(np.int64)
    return wall, res
