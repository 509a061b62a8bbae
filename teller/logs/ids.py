"""Request ids named in log lines, and their mapping onto the ids of requests.parquet.

Patterns are data. A pattern with a capture group yields its first group, otherwise the whole
match; scoped flags (``(?i:...)``) are fine, a leading global flag group is made scoped.
Defaults:

- vLLM's OpenAI server: ``chatcmpl-<hex>`` and ``cmpl-<hex>``, optionally followed by the
  ``-<8 chars>`` that vLLM's engine appends to make its internal request id;
- transformers continuous batching: ``req_<n>`` (forked children ``req_<n>__child#<k>``);
- generic ``request_id=X`` / ``request id: X``.

The patterns are joined into one alternation and its matches are taken left to right without
overlap (``re.finditer`` semantics); ids are kept in order of appearance without repeats, with
trailing ``.``/``:`` removed; word boundaries and digits are ASCII-only, as in RE2.
Columnar: RE2 in Arrow counts the matches of every line and extracts the first; Python ``re``
runs only on lines naming two or more ids.

Normalization (suffix rules, also data): engines derive internal ids from external ones by a
suffix. A named id maps to a known id (one in requests.parquet) when it is known itself; else when
removing a suffix gives a known id (internal id named, external id recorded); else when it is the
suffix-free form of known ids (external id named, internal ids recorded: all of them are
candidates and the alignment picks by time).
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DEFAULT_ID_PATTERNS: tuple[str, ...] = (
    r"\b(?:chatcmpl|cmpl)-[0-9a-f]+(?:-[0-9A-Za-z]{8})?\b",
    r"\breq_\d+(?:__child#\d+)?",
    r"\b(?i:request[_ ]id)[=: ]+([^\s,;\"'()\[\]{}]+)",
)

#: Suffixes an engine appends to an external request id to make its internal one.
DEFAULT_SUFFIX_RULES: tuple[str, ...] = (
    r"-[0-9A-Za-z]{8}$",  # vLLM: f"{external}-{random 8 chars}"
    r"__child#\d+$",  # transformers: forked child requests
)

_TRAIL = ".:"


def _named(pattern: str, name: str) -> str:
    """The pattern with its first capture group named ``name`` (others made non-capturing);
    wrapped whole in the named group when it has none."""
    m = re.match(r"^\(\?([aiLmsux]+)\)(.*)$", pattern, re.S)
    if m:  # a leading global flag group cannot sit inside an alternation: scope it
        pattern = f"(?{m.group(1)}:{m.group(2)})"
    out, i, in_class, found = [], 0, False, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":
                out.append("[]")
                i += 2
                continue
        elif c == "(" and pattern[i + 1:i + 2] != "?":
            out.append("(?:" if found else f"(?P<{name}>")
            found = True
            i += 1
            continue
        out.append(c)
        i += 1
    body = "".join(out)
    return body if found else f"(?P<{name}>{body})"


def combined_pattern(patterns: tuple[str, ...]) -> str:
    """One alternation of all patterns, pattern k's id in group ``g<k>``."""
    return "|".join(f"(?:{_named(p, f'g{k}')})" for k, p in enumerate(patterns))


def _clean(ids: list[str]) -> list[str]:
    out: list[str] = []
    for v in ids:
        v = v.rstrip(_TRAIL)
        if v and v not in out:
            out.append(v)
    return out


def extract_ids_flat(lines: pa.Array, patterns: tuple[str, ...] = DEFAULT_ID_PATTERNS
                     ) -> tuple[np.ndarray, pa.Array]:
    """Request ids named by each line: (offsets into ids, ids); line i names
    ``ids[offsets[i]:offsets[i+1]]`` in order of appearance, without repeats."""
    n = len(lines)
    if n == 0 or not patterns:
        return np.zeros(n + 1, np.int64), pa.array([], pa.string())
    combined = combined_pattern(patterns)
    rx = re.compile(combined, re.ASCII)  # as RE2: ASCII word boundaries and digits
    names = [f"g{k}" for k in range(len(patterns))]
    try:
        cnt = pc.count_substring_regex(lines, combined).fill_null(0).to_numpy(zero_copy_only=False)
        cnt = np.asarray(cnt, np.int64)
        one = np.flatnonzero(cnt == 1)
        multi = np.flatnonzero(cnt >= 2)
        st = pc.extract_regex(lines.take(pa.array(one)), combined)
        first = pc.coalesce(*[pc.if_else(pc.equal(st.field(g), ""), pa.scalar(None, pa.string()), st.field(g))
                              for g in names])
        first = pc.utf8_rtrim(first.fill_null(""), characters=_TRAIL)
        ok = np.asarray(pc.greater(pc.utf8_length(first), 0).to_numpy(zero_copy_only=False), dtype=bool)
        one, first = one[ok], first.filter(pa.array(ok))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a pattern RE2 cannot run
        one, first = np.zeros(0, np.int64), pa.array([], pa.string())
        multi = np.arange(n)
    many: list[list[str]] = []
    for s in lines.take(pa.array(multi)).to_pylist():
        found = []
        for m in rx.finditer(s or ""):
            found.append(next((m.group(g) for g in names if m.group(g)), ""))
        many.append(_clean(found))
    per_line = np.zeros(n, np.int64)
    per_line[one] = 1
    per_line[multi] = [len(x) for x in many]
    offsets = np.concatenate([[0], np.cumsum(per_line)])
    # place the single ids and the Python-found lists at their lines' offsets
    vals = pa.concat_arrays([first.cast(pa.string()), pa.array([v for x in many for v in x], pa.string())])
    dest = np.concatenate([offsets[one], np.concatenate(
        [offsets[i] + np.arange(len(x)) for i, x in zip(multi.tolist(), many, strict=True)]
    ) if many else np.zeros(0, np.int64)]).astype(np.int64)
    inv = np.empty(len(vals), np.int64)
    inv[dest] = np.arange(len(vals))
    return offsets, vals.take(pa.array(inv))


def extract_ids(lines: pa.Array, patterns: tuple[str, ...] = DEFAULT_ID_PATTERNS) -> pa.ListArray:
    """Request ids named by each line, as a list<string> column."""
    offsets, vals = extract_ids_flat(lines, patterns)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), vals)


class RequestIndex:
    """Known request ids (sorted, coded) and the suffix-free forms that point at them."""

    def __init__(self, known: list[str] | pa.Array, suffix_rules: tuple[str, ...] = DEFAULT_SUFFIX_RULES):
        arr = pa.array(known, pa.string()) if not isinstance(known, pa.Array) else known.cast(pa.string())
        arr = pc.unique(arr.drop_null())
        self.ids_arrow = arr.take(pc.array_sort_indices(arr))
        self.ids = np.asarray(self.ids_arrow.to_pylist(), dtype=object)
        self.code = {r: i for i, r in enumerate(self.ids.tolist())}
        self.suffix_rules = tuple(suffix_rules)
        self._suffix = [re.compile(r) for r in suffix_rules]
        ext_key, ext_code = [], []
        for rule in self.suffix_rules:
            stripped = pc.replace_substring_regex(self.ids_arrow, rule, "")
            changed = np.flatnonzero(np.asarray(pc.not_equal(stripped, self.ids_arrow)
                                                .to_numpy(zero_copy_only=False), dtype=bool))
            ext_key += stripped.take(pa.array(changed)).to_pylist()
            ext_code += changed.tolist()
        self.by_external: dict[str, list[int]] = {}
        for k, c in zip(ext_key, ext_code, strict=True):
            self.by_external.setdefault(k, []).append(c)

    def __len__(self) -> int:
        return len(self.ids)

    def codes(self, values: pa.Array) -> np.ndarray:
        """Codes of request id strings (−1 for unknown ones), vectorized."""
        c = pc.index_in(values.cast(pa.string()), value_set=self.ids_arrow).fill_null(-1)
        return np.asarray(c.to_numpy(zero_copy_only=False), np.int64)

    def resolve(self, rid: str) -> list[int]:
        """Codes of the known requests a named id stands for (empty when none)."""
        c = self.code.get(rid)
        if c is not None:
            return [c]
        for rx in self._suffix:
            base = rx.sub("", rid)
            if base != rid and base in self.code:
                return [self.code[base]]
        return list(self.by_external.get(rid, ()))

    def pairs(self, offsets: np.ndarray, ids: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(line, request code, mention position) for every known request a line names.

        Same rules as :meth:`resolve`, run over the whole column.
        """
        m = len(ids)
        empty = np.zeros(0, np.int64)
        if m == 0 or len(self.ids) == 0:
            return empty, empty, empty
        per_line = np.diff(offsets)
        line = np.repeat(np.arange(len(per_line)), per_line)
        pos = np.arange(m) - np.repeat(offsets[:-1], per_line)
        code = self.codes(ids)
        for rule in self.suffix_rules:
            todo = np.flatnonzero(code < 0)
            if len(todo) == 0:
                break
            sub = ids.take(pa.array(todo))
            stripped = pc.replace_substring_regex(sub, rule, "")
            c = self.codes(stripped)
            changed = np.asarray(pc.not_equal(stripped, sub).to_numpy(zero_copy_only=False), dtype=bool)
            code[todo] = np.where(changed, c, -1)
        lines, reqs, poss = [line[code >= 0]], [code[code >= 0]], [pos[code >= 0]]
        todo = np.flatnonzero(code < 0)
        if len(todo) and self.by_external:  # external id named, internal ids known: all of them
            hit = pc.is_in(ids.take(pa.array(todo)), value_set=pa.array(list(self.by_external), pa.string()))
            todo = todo[np.asarray(hit.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)]
            for i, v in zip(todo.tolist(), ids.take(pa.array(todo)).to_pylist(), strict=True):
                cs = self.by_external.get(v, ())
                lines.append(np.full(len(cs), line[i]))
                reqs.append(np.asarray(cs, np.int64))
                poss.append(np.full(len(cs), pos[i]))
        pl, pr, pp = (np.concatenate(x).astype(np.int64) for x in (lines, reqs, poss))
        o = np.lexsort((pr, pp, pl))
        return pl[o], pr[o], pp[o]


_DIGITS = re.compile(r"(\d+)")


def natural_key(s: str) -> tuple:
    """Sort key that orders ids as a person counts: ``req_2`` before ``req_10`` (runs of digits
    compare as numbers, the text between them as text). For lists shown to a user; stored
    tables keep their own order."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(_DIGITS.split(str(s))))
