"""Helpers of `show` and `stats` over a :class:`teller.forest.Forest`: subtree shapes and durations."""

from __future__ import annotations

import math

import numpy as np

from teller.forest import Forest


def shapes(forest: Forest) -> np.ndarray:
    """A 64-bit signature per node of its subtree's shape (layers, names, child order; not
    times): equal signatures mean identical call trees, e.g. repeated launch → kernel pairs."""
    n, parent, child_rows, child_ptr = forest.n, forest.parent, forest.child_rows, forest.child_ptr
    mult = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        sig = (forest.layer.astype(np.uint64) * np.uint64(1_000_003) + forest.name_codes.astype(np.uint64) + np.uint64(1)) * mult
        # a child's position among its siblings weighs its signature, so order matters
        pos = np.empty(n, dtype=np.uint64)
        if len(child_rows):
            pos[child_rows] = np.arange(len(child_rows)) - child_ptr[parent[child_rows]]
        weight = (pos * np.uint64(2) + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9)
        for idx in forest.levels[:0:-1]:  # deepest first, roots excluded
            mixed = (sig[idx] ^ (sig[idx] >> np.uint64(31))) * weight[idx]
            np.add.at(sig, parent[idx], mixed)
    return sig


def fmt_ns(ns: float | None) -> str:
    """Human duration: 12.3 ms, 45.6 µs, 789 ns ("?" for none or not a number)."""
    if ns is None or not math.isfinite(float(ns)):
        return "?"
    ns = float(ns)
    a = abs(ns)
    if a >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if a >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if a >= 1e3:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.0f} ns"
