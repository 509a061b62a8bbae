"""scheduling/software: GIL contention, delayed admission, a stalled scheduler step, a stalled engine loop."""

from __future__ import annotations

import threading
import time
from typing import Any

from teller.inject.mechanisms import Mechanism


class GilContention(Mechanism):
    name = "gil_contention"
    category = "scheduling"
    knob = "busy pure-Python threads in the engine process (count)"
    default_magnitude = 1.0
    targets = ()
    evidence = "step"
    cause = "a busy Python thread in the engine process holds the GIL, so the engine's host code waits for it"
    action = "check the engine process's other Python threads (a stack dump of the process) and move busy work out of it"

    def start(self, agent: Any, fault: dict[str, Any]) -> None:
        stop = threading.Event()
        agent.windows[fault["id"]]["extra"]["threads"] = int(fault["magnitude"])

        def spin() -> None:
            x = 0
            while not stop.is_set():
                for _ in range(1000):
                    x = (x * 1103515245 + 12345) & 0x7FFFFFFF

        fault["_stop"] = stop
        for i in range(max(1, int(fault["magnitude"]))):
            threading.Thread(target=spin, name=f"teller-gil-{i}", daemon=True).start()
        agent.count(fault, 1)

    def stop(self, agent: Any, fault: dict[str, Any]) -> None:
        ev = fault.pop("_stop", None)
        if ev is not None:
            ev.set()


CB = "transformers.generation.continuous_batching.continuous_api"


class DelayedAdmission(Mechanism):
    name = "delayed_admission"
    category = "scheduling"
    knob = "delay between a request's arrival and its admission to the engine (ms)"
    default_magnitude = 50.0
    targets = ("OTHER schedule",)
    evidence = "admission"
    needs = ("transformers_cb",)
    on_arrivals = True
    cause = "requests are admitted late (a slow admission path), so their first step comes late and batches shrink"
    action = "check the request admission path (front-end queue, tokenization) for what delays new requests"

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        delay = float(fault["magnitude"]) / 1e3

        def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            if not agent.active(fault):
                return wrapped(*args, **kwargs)
            rid = kwargs.get("request_id")
            reqs = agent.windows[fault["id"]]["extra"].setdefault("requests", [])
            if rid is not None and len(reqs) < 10000:
                reqs.append(str(rid))
            agent.count(fault, 1, "OTHER schedule")
            threading.Timer(delay, lambda: wrapped(*args, **kwargs)).start()
            return rid

        agent.wrap(CB, "ContinuousBatchingManager.add_request", wrapper)


class SchedulerStall(Mechanism):
    name = "scheduler_stall"
    category = "scheduling"
    knob = "stall of the engine's batch bookkeeping per step (ms, sleeping: the GIL is released)"
    default_magnitude = 3.0
    targets = ("STEP",)
    evidence = "step"
    needs = ("transformers_cb",)
    cause = "the scheduler's per-step bookkeeping stalls before update_batch, idling the step"
    action = "check the scheduler's per-step bookkeeping around update_batch with a profile of the engine loop"

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        delay = float(fault["magnitude"]) / 1e3

        def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            if agent.active(fault):
                time.sleep(delay)
                agent.count(fault, 1, "STEP")
            return wrapped(*args, **kwargs)

        agent.wrap(CB, "ContinuousBatchProcessor.update_batch", wrapper)


class LoopStall(Mechanism):
    """The engine thread is held up before each scheduling call, outside every recorded range.

    The hook is ``ContinuousBatchingManager._generation_loop_body``, before it runs: the
    recorder's wrapper of the same call (the STEP scope) opens no range itself, and its
    ``OTHER schedule`` opens inside ``prepare_next_batch``, so whichever wrapper is outer the sleep
    falls between one iteration's STEP and the next ``OTHER schedule`` (an untraced gap). Polls of
    an idle loop (nothing queued, nothing pending) are not held up.
    """

    name = "loop_stall"
    category = "scheduling"
    knob = "stall of the engine loop before each scheduling call (ms, sleeping, outside every recorded range)"
    default_magnitude = 20.0
    targets = ("GAP",)
    evidence = "step"
    needs = ("transformers_cb",)
    cause = "the engine thread is held up between iterations (before scheduling), so every iteration grows by an untraced gap"
    action = "check what holds the engine thread before scheduling (stack samples of the engine loop between iterations)"

    def install(self, agent: Any, fault: dict[str, Any]) -> None:
        delay = float(fault["magnitude"]) / 1e3

        def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            if agent.active(fault) and _has_work(args[0] if args else kwargs.get("batch_processor")):
                time.sleep(delay)
                agent.count(fault, 1, "GAP")
            return wrapped(*args, **kwargs)

        agent.wrap(CB, "ContinuousBatchingManager._generation_loop_body", wrapper)


def _has_work(bp: Any) -> bool:
    """Something queued or pending: the next ``prepare_next_batch`` schedules a batch."""
    try:
        q = bp.input_queue
        return (q is not None and not q.empty()) or bool(bp.scheduler.has_pending_requests())
    except Exception:
        return True


MECHANISMS = (GilContention, DelayedAdmission, SchedulerStall, LoopStall)
