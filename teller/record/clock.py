"""The run's time base τ inside a recorded process, and the anchors that map other clocks onto it.

The launcher fixes τ = 0 at its own start and passes the wall-clock instant in ``TELLER_T0_NS``.
Inside a process, ranges are timed with ``time.perf_counter_ns`` (monotonic, cheap) and mapped to
τ through one anchor pair taken at import. Other clocks (CUPTI's timestamps, the wall clock
Kineto writes, the profiler's) are mapped with anchors of their own taken against τ
(:func:`take_anchor`) and interpolated between them (:class:`ClockMap`), which corrects drift.

Only the standard library is imported at load (this module is imported from ``sitecustomize``);
numpy loads when a :class:`ClockMap` first maps an array.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

T0_ENV = "TELLER_T0_NS"


def _t0() -> int:
    try:
        return int(os.environ[T0_ENV])
    except (KeyError, ValueError):
        return time.time_ns()


#: wall-clock Unix ns of τ = 0
T0_UNIX_NS: int = _t0()
# one anchor pair: perf_counter_ns ↔ wall clock, taken once per process
_PERF0 = time.perf_counter_ns()
_WALL0 = time.time_ns()
#: add to a perf_counter_ns reading to get τ
PERF_TO_TAU: int = (_WALL0 - T0_UNIX_NS) - _PERF0


def tau_now() -> int:
    """Current τ in ns."""
    return time.perf_counter_ns() + PERF_TO_TAU


def perf_to_tau(perf_ns):
    """Map perf_counter_ns readings (int or numpy array) to τ."""
    return perf_ns + PERF_TO_TAU


def wall_to_tau(wall_ns):
    """Map wall-clock Unix ns (int or numpy array) to τ."""
    return wall_ns - T0_UNIX_NS


def anchor(other_clock_ns: int) -> int:
    """Offset that maps another clock onto τ, given a reading of it taken just now."""
    return tau_now() - other_clock_ns


class ClockMap:
    """Piecewise-linear map from another clock (CUPTI's, the wall clock) onto τ.

    Anchors are (source ns, τ ns) pairs taken back to back. Between anchors the offset
    τ − source is interpolated linearly, so a constant rate difference (drift) between the clocks
    is corrected; before the first and after the last anchor the nearest anchor's offset holds.
    Arithmetic is done on offsets relative to the first anchor, so float64 loses no precision on
    epoch-sized timestamps.
    """

    def __init__(self) -> None:
        self.src: list[int] = []
        self.tau: list[int] = []
        self.err: list[int] = []

    def add(self, src_ns: int, tau_ns: int, err_ns: int = 0) -> bool:
        """Add an anchor; ignored (False) unless its source time is after the last one."""
        src_ns, tau_ns = int(src_ns), int(tau_ns)
        if self.src and src_ns <= self.src[-1]:
            return False
        self.src.append(src_ns)
        self.tau.append(tau_ns)
        self.err.append(int(err_ns))
        return True

    def __len__(self) -> int:
        return len(self.src)

    def map(self, src_ns: Any) -> Any:
        """Map source-clock ns (array) to τ ns (int64 array)."""
        import numpy as np  # not at module load: this module is imported at interpreter start

        x = np.asarray(src_ns, dtype=np.int64)
        if not self.src:
            raise ValueError("ClockMap has no anchors")
        src0 = self.src[0]
        off0 = self.tau[0] - src0
        if len(self.src) == 1:
            return x + off0
        xs = np.array([s - src0 for s in self.src], dtype=np.float64)
        drift = np.array([(t - s) - off0 for s, t in zip(self.src, self.tau, strict=True)], dtype=np.float64)
        d = np.interp((x - src0).astype(np.float64), xs, drift)
        return x + off0 + np.rint(d).astype(np.int64)

    def drift_ppm(self) -> float | None:
        """Rate difference between the clocks over the whole anchor span, in parts per million."""
        if len(self.src) < 2 or self.src[-1] == self.src[0]:
            return None
        d_off = (self.tau[-1] - self.src[-1]) - (self.tau[0] - self.src[0])
        return 1e6 * d_off / (self.src[-1] - self.src[0])

    def summary(self, keep: int = 4) -> dict[str, Any]:
        """Anchors for run.json: the first and last few, their count and the drift."""
        pairs = [[s, t, e] for s, t, e in zip(self.src, self.tau, self.err, strict=True)]
        kept = pairs if len(pairs) <= 2 * keep else pairs[:keep] + pairs[-keep:]
        return {"count": len(pairs), "pairs_src_tau_err_ns": kept, "drift_ppm": self.drift_ppm(),
                "max_err_ns": max(self.err) if self.err else None}


#: drift bounds (ppm) tried in turn by :func:`tighten_brackets`, smallest first
DRIFT_BOUNDS_PPM = (20, 50, 100, 200, 500, 1000)


def tighten_brackets(src_ns: Any, lo_ns: Any, hi_ns: Any,
                     bounds_ppm: tuple[float, ...] = DRIFT_BOUNDS_PPM) -> tuple[Any, Any, float | None]:
    """Narrow each anchor's τ bracket with what the other anchors say about the clock offset.

    Anchor ``i`` says that source time ``src_ns[i]`` happened at some τ in ``[lo_ns[i], hi_ns[i]]``
    (two τ readings around the event that produced the source timestamp). Where in the bracket
    is not known: the midpoint is only a guess, off by up to half the bracket, and the work
    inside a bracket is seldom symmetric around the timestamp. The offset τ − source changes by
    at most ρ per ns between two instants (ρ: the drift bound), so every anchor ``j`` bounds the
    offset at anchor ``i`` to its own interval widened by ``ρ·|src_i − src_j|``; intersecting all
    of them (cumulative max/min sweeps both ways, O(n log n)) narrows wide brackets to what their
    neighbours allow. The bounds in ``bounds_ppm`` are tried smallest first; the first one under
    which every narrowed bracket is non-empty is used (a larger drift, a clock step or a
    bracket that misses its timestamp makes a small bound inconsistent).

    Returns the narrowed ``(lo, hi)`` as int64 arrays (inside the given brackets) and the drift
    bound used in ppm, or the brackets unchanged and None when no bound is consistent.
    """
    import numpy as np  # not at module load (module docstring)

    src = np.asarray(src_ns, dtype=np.int64)
    lo = np.asarray(lo_ns, dtype=np.int64)
    hi = np.asarray(hi_ns, dtype=np.int64)
    if len(src) < 2:
        return lo.copy(), hi.copy(), None
    order = np.argsort(src, kind="stable")
    # offsets relative to the first anchor's lower bound, times relative to the first source
    # time: float64 holds them exactly (epoch-sized values would not)
    x = (src[order] - src[order[0]]).astype(np.float64)
    base = int(lo[order[0]] - src[order[0]])
    lo_off = (lo[order] - src[order] - base).astype(np.float64)
    hi_off = (hi[order] - src[order] - base).astype(np.float64)
    for ppm in bounds_ppm:
        r = ppm * 1e-6
        # lower: max_j lo_j − r|x_i − x_j|, over j ≤ i (forward sweep) and j ≥ i (backward);
        # upper: min_j hi_j + r|x_i − x_j| the same way
        lo_f = np.maximum.accumulate(lo_off + r * x) - r * x
        lo_b = np.maximum.accumulate((lo_off - r * x)[::-1])[::-1] + r * x
        hi_f = np.minimum.accumulate(hi_off - r * x) + r * x
        hi_b = np.minimum.accumulate((hi_off + r * x)[::-1])[::-1] - r * x
        new_lo = np.maximum(lo_f, lo_b)
        new_hi = np.minimum(hi_f, hi_b)
        if np.all(new_lo <= new_hi + 1e-6):
            # whole ns, rounded outwards (float noise aside), never outside the given bracket
            out_lo = np.empty_like(lo)
            out_hi = np.empty_like(hi)
            out_lo[order] = np.maximum(np.floor(new_lo + 1e-6).astype(np.int64) + base + src[order], lo[order])
            out_hi[order] = np.minimum(np.ceil(new_hi - 1e-6).astype(np.int64) + base + src[order], hi[order])
            return out_lo, out_hi, float(ppm)
    return lo.copy(), hi.copy(), None


def take_anchor(read_src: Callable[[], int], tries: int = 3) -> tuple[int, int, int]:
    """Read the other clock between two τ readings; keep the tightest of ``tries`` pairs.

    Returns (source ns, τ ns at the midpoint, half-width of the bracket in ns).
    """
    best = None
    for _ in range(tries):
        a = tau_now()
        s = int(read_src())
        b = tau_now()
        if best is None or b - a < best[2] * 2:
            best = (s, (a + b) // 2, (b - a + 1) // 2)
    return best
