"""The engine instrumentor: what every engine's (transformers, vLLM, SGLang) instrumentor shares.

An engine step is bounded by one call (the *scope*: a loop body, ``EngineCore.step``,
``Scheduler.run_batch``); the STEP opens inside it once the batch's request ids are known
(:meth:`EngineInstrumentor.open_step`, or at once with ``step_scope(..., ids=...)``) and closes
when the scope returns or raises. FE ranges come from hooks on the served model
(:func:`~teller.record.instrument.torch_ops.attach_module_ranges`).
"""

from __future__ import annotations

from typing import Any, Callable

from teller.record.instrument import torch_ops
from teller.record.instrument.base import Instrumentor, batch_text


class EngineInstrumentor(Instrumentor):
    """What every engine instrumentor shares: the STEP scope, plain ranges, FE hooks on the model."""

    def uninstrument(self) -> None:
        super().uninstrument()
        torch_ops.detach_module_ranges()

    def step_scope(self, wrapped: Any, instance: Any, args: Any, kwargs: Any,
                   ids: Callable[[], str] | None = None,
                   fields: Callable[[], dict[str, Any]] | None = None) -> Any:
        """wrapt wrapper for the scope call; with ``ids`` the STEP opens right away (with the
        batch context ``fields`` returns)."""
        rt = self.rt
        tls = self.tls
        if getattr(tls, "in_scope", False) or rt.is_compiling():
            return wrapped(*args, **kwargs)
        tls.in_scope, tls.step_open = True, False
        try:
            if ids is not None:
                self.open_step(ids, fields)
            return wrapped(*args, **kwargs)
        finally:
            tls.in_scope = False
            if tls.step_open:
                tls.step_open = False
                try:
                    rt.pop_step()
                except Exception as e:
                    self.failed("STEP end", e)

    def open_step(self, ids: Callable[[], str], fields: Callable[[], dict[str, Any]] | None = None) -> None:
        """Open the current scope's STEP (once) as ``STEP id=<n> reqs=<ids()>``, followed by the
        batch context ``fields()`` returns (``prefill=.. decode=.. waiting=.. kv_used=.. kv_total=..
        preempted=..``, any subset; :func:`~teller.record.instrument.base.batch_text`). A failing
        ``fields`` leaves them out; the STEP still opens."""
        rt = self.rt
        tls = self.tls
        if not getattr(tls, "in_scope", False) or tls.step_open:
            return
        extra = ""
        if fields is not None:
            try:
                extra = batch_text(fields())
            except Exception as e:
                self.failed("STEP batch fields", e)
        try:
            rt.push_step(f"STEP id={rt.next_step_id()} reqs={ids()}{extra}")
            tls.step_open = True
        except Exception as e:
            self.failed("STEP begin", e)

    def ranged(self, msg: str) -> Callable:
        """A wrapt wrapper recording the call as one range named ``msg`` (e.g. ``"FE Sampling"``)."""
        rt = self.rt

        def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            if rt.is_compiling():
                return wrapped(*args, **kwargs)
            rt.push(msg)
            try:
                return wrapped(*args, **kwargs)
            finally:
                rt.pop()

        return wrapper

    def attach_model(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        """wrapt wrapper for the call after which ``instance.model`` exists: FE hooks on it."""
        out = wrapped(*args, **kwargs)
        try:
            torch_ops.attach_served_model(self.rt, getattr(instance, "model", None))
        except Exception as e:
            self.failed("FE module hooks", e)
        return out
