"""SGLang (0.4 and later): STEP ranges per scheduler batch, FE hooks, COMM.

Written against SGLang's hook points (DESIGN.md §13) and tested against a fake module tree
with the same module, class and method names (``tests/test_instrument_engines.py``). It has NOT
been run against a real SGLang: it does not install on the CPU machine this was developed on.

Hook points:

- ``sglang.srt.managers.scheduler.Scheduler.run_batch(batch)``: one STEP,
  ``STEP id=<n> reqs=<rid>,...`` with ``batch.reqs[i].rid``.
- ``sglang.srt.model_executor.model_runner.ModelRunner.load_model``: FE hooks on ``self.model``;
  ``ModelRunner.sample``: ``FE Sampling``.
- ``sglang.srt.distributed.parallel_state.GroupCoordinator`` collectives: COMM ranges.
"""

from __future__ import annotations

from typing import Any

from teller.record import runtime as rt
from teller.record.instrument import Instrumentor


class SGLangInstrumentor(Instrumentor):
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
            self.wrap(module, "ModelRunner.load_model", self._load_model)
            if "sample" in vars(getattr(module, "ModelRunner", object)):
                self.wrap(module, "ModelRunner.sample", self._sample)
        elif name == "sglang.srt.distributed.parallel_state":
            from teller.record.instrument import torch_ops

            torch_ops.wrap_group_coordinator(self, module)

    def uninstrument(self) -> None:
        from teller.record.instrument import torch_ops

        super().uninstrument()
        torch_ops.detach_module_ranges()

    def _run_batch(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        tls = self.tls
        if getattr(tls, "in_step", False) or rt.is_compiling():
            return wrapped(*args, **kwargs)
        opened = False
        try:
            batch = args[0] if args else kwargs.get("batch")
            ids = ",".join(str(r.rid) for r in (getattr(batch, "reqs", None) or ()))
            rt.push_step(f"STEP id={rt.next_step_id()} reqs={ids}")
            opened = tls.in_step = True
        except Exception as e:
            self.failed("STEP begin", e)
        try:
            return wrapped(*args, **kwargs)
        finally:
            if opened:
                tls.in_step = False
                try:
                    rt.pop_step()
                except Exception as e:
                    self.failed("STEP end", e)

    def _load_model(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        out = wrapped(*args, **kwargs)
        try:
            from teller.record.instrument import torch_ops

            torch_ops.attach_module_ranges(getattr(instance, "model", None))
            rt.note_model(getattr(instance, "model", None))
        except Exception as e:
            self.failed("FE module hooks", e)
        return out

    def _sample(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        rt.push("FE Sampling")
        try:
            return wrapped(*args, **kwargs)
        finally:
            rt.pop()
