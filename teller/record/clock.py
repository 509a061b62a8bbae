"""The run's time base τ inside a recorded process.

The launcher fixes τ = 0 at its own start and passes the wall-clock instant in ``TELLER_T0_NS``.
Inside a process, ranges are timed with ``time.perf_counter_ns`` (monotonic, cheap) and mapped to
τ through one anchor pair taken at import; other clocks (CUPTI's) are mapped with anchors of their
own taken against the same pair (:func:`anchor`).
"""

from __future__ import annotations

import os
import time

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
