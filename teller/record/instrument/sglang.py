"""SGLang (0.4 and later): STEP ranges per scheduler batch, FE hooks, COMM.

Written against SGLang's hook points (docs/design.md §13) and tested against a fake module tree
with the same module, class and method names (``tests/test_instrument_engines.py``). It has NOT
been run against a real SGLang: it does not install on the CPU machine this was developed on.

Hook points:

- ``sglang.srt.managers.scheduler.Scheduler.run_batch(batch)``: one STEP,
  ``STEP id=<n> reqs=<rid>,...`` with ``batch.reqs[i].rid``, then the batch context
  (:func:`sglang_batch_fields`, each field read on its own, left out when missing): an extend
  (prefill) batch gives ``prefill`` = ``batch.extend_num_tokens``, a decode batch ``decode`` =
  one token per request (``batch.forward_mode.is_extend()`` / ``is_decode()``); ``waiting`` =
  ``len(scheduler.waiting_queue)``; KV in tokens (SGLang's pool is token-granular):
  ``kv_total`` = ``scheduler.max_total_num_tokens``, ``kv_used`` = that less
  ``scheduler.token_to_kv_pool_allocator.available_size()``. No ``preempted``.
- ``sglang.srt.model_executor.model_runner.ModelRunner.load_model``: FE hooks on ``self.model``;
  ``ModelRunner.sample``: ``FE Sampling``.
- ``sglang.srt.distributed.parallel_state.GroupCoordinator`` collectives: COMM ranges.
"""

from __future__ import annotations

from typing import Any

from teller.record.instrument import torch_ops
from teller.record.instrument.engine import EngineInstrumentor


class SGLangInstrumentor(EngineInstrumentor):
    name = "sglang"
    dist = "sglang"
    module = "sglang"
    min_version = (0, 4)
    max_version = (2,)
    targets = (
        "sglang.srt.managers.scheduler",
        "sglang.srt.model_executor.model_runner",
        "sglang.srt.distributed.parallel_state",
    )

    def patch(self, module: Any) -> None:
        name = module.__name__
        if name == "sglang.srt.managers.scheduler":
            self.wrap(module, "Scheduler.run_batch", self._run_batch)
        elif name == "sglang.srt.model_executor.model_runner":
            self.wrap(module, "ModelRunner.load_model", self.attach_model)
            if "sample" in vars(getattr(module, "ModelRunner", object)):
                self.wrap(module, "ModelRunner.sample", self.ranged("FE Sampling"))
        elif name == "sglang.srt.distributed.parallel_state":
            torch_ops.wrap_group_coordinator(self, module)

    def _run_batch(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        return self.step_scope(wrapped, instance, args, kwargs,
                               ids=lambda: ",".join(str(r.rid) for r in (getattr(batch, "reqs", None) or ())),
                               fields=lambda: sglang_batch_fields(instance, batch))


def sglang_batch_fields(scheduler: Any, batch: Any) -> dict[str, int]:
    """The batch context of one ``Scheduler.run_batch(batch)`` (see the module docstring)."""
    f: dict[str, int] = {}
    try:
        mode = batch.forward_mode
        if mode.is_extend():
            f["prefill"], f["decode"] = int(batch.extend_num_tokens), 0
        elif mode.is_decode():
            f["prefill"], f["decode"] = 0, len(batch.reqs)
    except Exception:
        pass
    try:
        f["waiting"] = len(scheduler.waiting_queue)
    except Exception:
        pass
    try:
        total = int(scheduler.max_total_num_tokens)
        avail = int(scheduler.token_to_kv_pool_allocator.available_size())
        f["kv_used"], f["kv_total"] = max(0, total - avail), total
    except Exception:
        pass
    return f
