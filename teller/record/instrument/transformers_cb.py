"""transformers continuous batching (5.17–5.x): STEP, FE, BE ranges on the generation thread.

Hook points (read in the 5.17 and 5.24 sources; docs/design.md §13), all on the background thread
that runs ``ContinuousBatchingManager._run_generation_loop``:

- ``ContinuousBatchingManager._generation_loop_body(batch_processor, bootstrapping)``: one loop
  iteration. It is the STEP's scope: the range opened inside it is closed when it returns (or
  raises), so a STEP covers the forward pass, sampling and ``update_batch``.
- ``ContinuousBatchProcessor.prepare_next_batch()``: scheduling, recorded as
  ``OTHER schedule`` (not when idle: nothing queued, nothing pending). When it returns True the batch is known, and the STEP opens right there:
  ``STEP id=<n> reqs=<request_id>,...`` with the ids of
  ``inputs_and_outputs.requests_in_batch[i].state.request_id`` (n counts steps in the process).
- ``ContinuousBatchProcessor.update_batch()``: ``OTHER update_batch``.
- ``ContinuousBatchingManager.__init__``: the model is known; FE hooks are attached to it
  (:func:`~teller.record.instrument.torch_ops.attach_module_ranges`).
- ``ModelRunner._sample``: ``FE Sampling``.

BE aten ops are recorded for the STEP's duration by the runtime (``--be-depth``). Async batching
and CUDA graphs hide per-op work from any host-side hook: turn them off for full traces (the
shipped workload does).
"""

from __future__ import annotations

from typing import Any

from teller.record.instrument.engine import EngineInstrumentor

CB = "transformers.generation.continuous_batching"


class TransformersCBInstrumentor(EngineInstrumentor):
    name = "transformers"
    dist = "transformers"
    module = "transformers"
    min_version = (5, 17)
    max_version = (6,)
    targets = (f"{CB}.continuous_api", f"{CB}.model_runner")

    def patch(self, module: Any) -> None:
        if module.__name__.endswith(".continuous_api"):
            self.wrap(module, "ContinuousBatchingManager._generation_loop_body", self.step_scope)
            self.wrap(module, "ContinuousBatchProcessor.prepare_next_batch", self._prepare)
            self.wrap(module, "ContinuousBatchProcessor.update_batch", self.ranged("OTHER update_batch"))
            self.wrap(module, "ContinuousBatchingManager.__init__", self.attach_model)
        elif module.__name__.endswith(".model_runner"):
            self.wrap(module, "ModelRunner._sample", self.ranged("FE Sampling"))

    def _prepare(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if _idle(instance):  # the loop polls every 0.1 s when idle: no range for empty polls
            return wrapped(*args, **kwargs)
        self.rt.push("OTHER schedule")
        try:
            ready = wrapped(*args, **kwargs)
        finally:
            self.rt.pop()
        if ready:  # the ids are read inside open_step, which never lets an error reach the engine
            self.open_step(lambda: ",".join(
                str(fs.state.request_id) for fs in instance.inputs_and_outputs.requests_in_batch))
        return ready


def _idle(bp: Any) -> bool:
    """Nothing queued and nothing scheduled: ``prepare_next_batch`` will find no work."""
    try:
        q = bp.input_queue
        return (q is None or q.empty()) and not bp.scheduler.has_pending_requests()
    except Exception:
        return False
