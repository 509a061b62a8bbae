"""Service logs like a production server's: periodic engine statistics, KV warnings, request lines.

The workloads (:mod:`teller.workload.serve`, :mod:`teller.workload.tp`) log through Python
logging, with vLLM's wording so an operator (and the log modality) reads what it would read from
a real server:

- every ``interval_s`` seconds of engine time (or every ``every_steps`` steps), at the end of the
  step that crosses the boundary::

    Engine 000: Avg prompt throughput: 120.4 tokens/s, Avg generation throughput: 35.2 tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 18.8%, Prefix cache hit rate: 0.0%

- when a step's scheduling took requests out of the running set (offloaded or soft reset)::

    Offloaded 2 requests (KV cache full, 15/16 blocks in use): req_3,req_5; Running: 3 reqs, Waiting: 4 reqs

- when the KV cache is more than 90% used (at most once per interval)::

    KV cache usage is high: 93.8% (15/16 blocks in use); new requests may wait or be offloaded

- request lifecycle: ``Added request <id>: prompt_tokens=.. max_tokens=..`` and
  ``Finished request <id>: prompt_tokens=.. output_tokens=.. e2e=..s ttft=..s``.

:meth:`EngineStats.step` is called on the engine thread, once per step, with the step's batch;
it does O(1) work besides the log calls.
"""

from __future__ import annotations

import logging
import time

#: KV-cache use above which a memory warning is logged
KV_HIGH = 0.90


class EngineStats:
    """Accumulates per-step counts; logs the periodic statistics line and the warnings."""

    def __init__(self, log: logging.Logger, interval_s: float = 1.0, every_steps: int | None = None,
                 engine: int = 0) -> None:
        self.log = log
        self.interval_s = float(interval_s)
        self.every_steps = int(every_steps) if every_steps else None
        self.engine = f"{engine:03d}"
        self._t0 = time.perf_counter()
        self._steps = 0
        self._prompt = 0
        self._gen = 0
        self._warned_kv = -1e18
        self.lines = 0  # statistics lines logged

    def step(self, prefill: int, decode: int, running: int, waiting: int,
             kv_used: int | None = None, kv_total: int | None = None,
             offloaded: list[str] | None = None, generated: int | None = None) -> None:
        """One engine step: ``prefill``/``decode`` tokens processed, requests ``running`` (in the
        batch or active) and ``waiting``, KV blocks, the ids of requests it offloaded, and the
        tokens it generated (default: one per decoding request)."""
        now = time.perf_counter()
        self._steps += 1
        self._prompt += int(prefill)
        self._gen += int(decode if generated is None else generated)
        frac = (kv_used / kv_total) if kv_used is not None and kv_total else None
        if offloaded:
            kv = f", {kv_used}/{kv_total} blocks in use" if frac is not None else ""
            self.log.warning("Offloaded %d requests (KV cache full%s): %s; Running: %d reqs, Waiting: %d reqs",
                             len(offloaded), kv, ",".join(offloaded), running, waiting)
        if frac is not None and frac > KV_HIGH and now - self._warned_kv >= self.interval_s:
            self._warned_kv = now
            self.log.warning("KV cache usage is high: %.1f%% (%d/%d blocks in use); new requests may wait or be "
                             "offloaded", 100 * frac, kv_used, kv_total)
        due = (self._steps >= self.every_steps) if self.every_steps else (now - self._t0 >= self.interval_s)
        if due:
            dt = max(now - self._t0, 1e-9)
            self.log.info("Engine %s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                          "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: "
                          "0.0%%", self.engine, self._prompt / dt, self._gen / dt, running, waiting,
                          100 * (frac or 0.0))
            self.lines += 1
            self._t0, self._steps, self._prompt, self._gen = now, 0, 0, 0


def log_added(log: logging.Logger, rid: str, prompt_tokens: int, max_tokens: int) -> None:
    log.info("Added request %s: prompt_tokens=%d max_tokens=%d", rid, prompt_tokens, max_tokens)


def log_finished(log: logging.Logger, rid: str, prompt_tokens: int, output_tokens: int, e2e_s: float,
                 ttft_s: float | None) -> None:
    ttft = "n/a" if ttft_s is None else f"{ttft_s:.3f}s"
    log.info("Finished request %s: prompt_tokens=%d output_tokens=%d e2e=%.3fs ttft=%s", rid, prompt_tokens,
             output_tokens, e2e_s, ttft)
