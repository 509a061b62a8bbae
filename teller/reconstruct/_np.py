"""Small vectorized building blocks: factorizing row tuples, multi-key sorts, segment helpers."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def index_dtype(n: int) -> type:
    """int32 indices while they fit (halves the memory of every index array), else int64."""
    return np.int32 if n < 2**31 - 2 else np.int64


def _encode(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes and distinct values of one column (hash-based; fast for few distinct values)."""
    enc = pc.dictionary_encode(pa.array(col))
    return enc.indices.to_numpy(zero_copy_only=False), enc.dictionary.to_numpy(zero_copy_only=False)


def factorize(cols: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Code every row tuple of ``cols``; return (codes int32, distinct values per column).

    Codes follow the lexicographic order of the tuples, so the result does not depend on the
    input's row order. Runs of equal rows (events of one thread written together) are encoded
    once, which makes the common case a handful of vector compares.
    """
    n = len(cols[0]) if cols else 0
    if n == 0:
        return np.zeros(0, np.int32), [c[:0] for c in cols]
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for c in cols:
        np.not_equal(c[1:], c[:-1], out=change[1:], where=~change[1:])
    starts = np.flatnonzero(change)
    use_runs = len(starts) < n // 2
    sub = [c[starts] for c in cols] if use_runs else cols
    key = np.zeros(len(sub[0]), dtype=np.int64)
    card = 1
    values = []
    for c in sub:
        codes, uniq = _encode(c)
        values.append(uniq)
        if card * max(len(uniq), 1) >= 2**62:  # re-encode to keep the mixed radix in range
            key, kd = _encode(key)
            key = key.astype(np.int64)
            card = len(kd)
        key = key * max(len(uniq), 1) + codes
        card *= max(len(uniq), 1)
    codes, _ = _encode(key)
    # distinct tuples, in sorted order
    first = np.zeros(int(codes.max()) + 1, dtype=np.int64)
    first[codes] = np.arange(len(codes))  # any row of a code will do: its tuple is the same
    tuples = [c[first] for c in sub]
    order = np.lexsort(tuples[::-1])
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    codes = rank[codes].astype(np.int32)
    tuples = [t[order] for t in tuples]
    if use_runs:
        codes = np.repeat(codes, np.diff(np.append(starts, n)))
    return codes, tuples


def _bits(x: np.ndarray) -> tuple[int, int]:
    lo, hi = int(x.min()), int(x.max())
    return lo, max(hi - lo, 0).bit_length()


def pack(keys: list[np.ndarray]) -> np.ndarray | None:
    """One int64 whose order is the lexicographic order of ``keys`` (first = primary), if it fits."""
    if not len(keys[0]):
        return np.zeros(0, np.int64)
    spans = [_bits(k) for k in keys]
    if sum(b for _, b in spans) > 62:
        return None
    out = np.zeros(len(keys[0]), dtype=np.int64)
    for k, (lo, b) in zip(keys, spans, strict=True):
        out <<= b
        out += k
        if lo:
            out -= lo
    return out


def lexorder(keys: list[np.ndarray]) -> np.ndarray:
    """Indices sorting rows by ``keys`` (first = primary); stable on ties."""
    packed = pack(keys)
    if packed is not None:
        return np.argsort(packed, kind="stable")
    return np.lexsort(keys[::-1])


def sort_with_ties(primary: list[np.ndarray], ties: list[np.ndarray] | Callable[[np.ndarray], list[np.ndarray]]) -> np.ndarray:
    """Order by ``primary`` keys, then ``ties`` keys; the last tie key should be unique.

    The primary keys are packed into one int64 and sorted once; only rows sharing a primary key
    are sorted again by the tie keys (few in practice), which is much cheaper than a full lexsort.
    ``ties`` may be a function of the row indices that need them, so they are built for those
    rows only.
    """
    tie_keys = ties if callable(ties) else (lambda rows: [t[rows] for t in ties])
    packed = pack(primary)
    if packed is None:
        rows = np.arange(len(primary[0]))
        return np.lexsort(list(reversed(primary + tie_keys(rows))))
    if len(packed) < 2 or (packed[1:] >= packed[:-1]).all():  # already in order (common)
        order = np.arange(len(packed))
        ps = packed
    else:
        order = np.argsort(packed, kind="stable")  # timsort: cheap on time-ordered runs
        ps = packed[order]
    eq = ps[1:] == ps[:-1]
    if not eq.any():
        return order
    member = np.zeros(len(ps), dtype=bool)
    member[1:] |= eq
    member[:-1] |= eq
    pos = np.flatnonzero(member)
    grp = ps[pos]
    rows = order[pos]
    sub = np.lexsort(list(reversed(tie_keys(rows))) + [grp])
    order[pos] = rows[sub]
    return order


def segment_starts(sorted_codes: np.ndarray) -> np.ndarray:
    """Boolean mask of the first row of each run of equal codes."""
    first = np.ones(len(sorted_codes), dtype=bool)
    if len(sorted_codes):
        first[1:] = sorted_codes[1:] != sorted_codes[:-1]
    return first


def exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.cumsum(x)
    out -= x
    return out


def group_offsets(keys_sorted: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Exclusive running sum of ``values`` within runs of equal ``keys_sorted``."""
    cs = exclusive_cumsum(values.astype(np.int64))
    first = segment_starts(keys_sorted)
    idx = np.maximum.accumulate(np.where(first, np.arange(len(first)), 0))
    return cs - cs[idx]


def cumcount(keys_sorted: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... within runs of equal ``keys_sorted``."""
    first = segment_starts(keys_sorted)
    idx = np.maximum.accumulate(np.where(first, np.arange(len(first)), 0))
    return np.arange(len(first)) - idx
