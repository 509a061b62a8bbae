"""transformers continuous batching (5.17–5.x): STEP, FE, BE ranges on the generation thread.

Hook points (read in the 5.17 and 5.24 sources; docs/design.md §13), all on the background thread
that runs ``ContinuousBatchingManager._run_generation_loop``:

- ``ContinuousBatchingManager._generation_loop_body(batch_processor, bootstrapping)``: one loop
  iteration. It is the STEP's scope: the range opened inside it is closed when it returns (or
  raises), so a STEP covers the forward pass, sampling and ``update_batch``.
- ``ContinuousBatchProcessor.prepare_next_batch()``: scheduling, recorded as
  ``OTHER schedule`` (not when idle: nothing queued, nothing pending). When it returns True the
  batch is known, and the STEP opens right there:
  ``STEP id=<n> reqs=<request_id>,... prefill=<t> decode=<t> waiting=<r> kv_used=<b> kv_total=<b> preempted=<r>``
  with the ids of ``inputs_and_outputs.requests_in_batch[i].state.request_id`` (n counts steps
  in the process) and the batch context (:func:`batch_fields`; a field that cannot be read is
  left out). When it returns False the loop body waits for work
  (``_wake_up_loop.wait(timeout=0.1)``, woken by ``add_request``): that wait, to the end of the
  loop body, is recorded as ``OTHER idle``.
- ``OffloadingManager.offload_requests()`` (5.24 has it; where a version does not, STEPs carry
  no ``preempted``): the requests it takes out of the active set (offloaded to the CPU or soft
  reset) are counted toward the next STEP's ``preempted``.
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
    targets = (f"{CB}.continuous_api", f"{CB}.model_runner", f"{CB}.offloading_manager")
    #: whether ``OffloadingManager.offload_requests`` is hooked (then STEPs carry ``preempted``)
    counts_preemptions = False

    def patch(self, module: Any) -> None:
        if module.__name__.endswith(".continuous_api"):
            self.wrap(module, "ContinuousBatchingManager._generation_loop_body", self._loop_body)
            self.wrap(module, "ContinuousBatchProcessor.prepare_next_batch", self._prepare)
            self.wrap(module, "ContinuousBatchProcessor.update_batch", self.ranged("OTHER update_batch"))
            self.wrap(module, "ContinuousBatchingManager.__init__", self.attach_model)
        elif module.__name__.endswith(".model_runner"):
            self.wrap(module, "ModelRunner._sample", self.ranged("FE Sampling"))
        elif module.__name__.endswith(".offloading_manager"):
            self.counts_preemptions = self.wrap(module, "OffloadingManager.offload_requests", self._offload)

    def _loop_body(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        """The STEP scope; an ``OTHER idle`` range opened by :meth:`_prepare` ends with it."""
        try:
            return self.step_scope(wrapped, instance, args, kwargs)
        finally:
            if getattr(self.tls, "idle_open", False):
                self.tls.idle_open = False
                try:
                    self.rt.pop()
                except Exception as e:
                    self.failed("OTHER idle end", e)

    def _prepare(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        rt, tls = self.rt, self.tls
        if rt.is_compiling():
            return wrapped(*args, **kwargs)
        if _idle(instance):  # the loop polls every 0.1 s when idle: no schedule range for empty polls
            ready = wrapped(*args, **kwargs)
        else:
            rt.push("OTHER schedule")
            try:
                ready = wrapped(*args, **kwargs)
            finally:
                rt.pop()
        if ready:  # the ids are read inside open_step, which never lets an error reach the engine
            self.open_step(lambda: ",".join(
                str(fs.state.request_id) for fs in instance.inputs_and_outputs.requests_in_batch),
                lambda: batch_fields(instance, tls if self.counts_preemptions else None))
        elif getattr(tls, "in_scope", False) and not getattr(tls, "idle_open", False):
            try:  # the loop body now waits for work: OTHER idle until it returns
                rt.push("OTHER idle")
                tls.idle_open = True
            except Exception as e:
                self.failed("OTHER idle begin", e)
        return ready

    def _offload(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        """Count the requests an offload takes out of the active set (for the STEP's ``preempted``)."""
        before = _n_active(instance)
        out = wrapped(*args, **kwargs)
        after = _n_active(instance)
        if before is not None and after is not None and before > after:
            self.tls.preempted = getattr(self.tls, "preempted", 0) + before - after
        return out


def _n_active(om: Any) -> int | None:
    try:
        return len(om.scheduler.active_requests)
    except Exception:
        return None


def batch_fields(bp: Any, tls: Any = None) -> dict[str, int]:
    """The batch context of the batch ``bp.prepare_next_batch()`` just scheduled (O(batch)).

    - ``prefill`` / ``decode``: tokens the batch processes for requests that have generated no
      token yet (prompt, or a prompt re-prefilled after a soft reset) / that have (one per
      request in decode); a request's tokens are its ``query_length`` (5.24) or
      ``len(state.tokens_to_process)``;
    - ``waiting``: requests in ``scheduler.waiting_requests`` plus those still in the input queue;
    - ``kv_total``: ``cache.num_blocks``; ``kv_used``: ``kv_total`` less the free blocks
      (``cache.get_num_free_blocks()`` in the block-manager caches of earlier 5.x, else from the
      sector pool's ``cache.compute_free_capacity()`` in 5.24);
    - ``preempted``: requests the offloading manager took out of the active set since the last
      STEP (``tls.preempted``, reset here; only with ``tls``, i.e. when the offload hook is on).

    Each field is read on its own; one that this version does not have is left out.
    """
    out: dict[str, int] = {}
    try:
        prefill = decode = 0
        for fs in bp.inputs_and_outputs.requests_in_batch:
            st = fs.state
            q = getattr(fs, "query_length", None)
            if q is None:
                q = len(st.tokens_to_process)
            if len(st.generated_tokens):
                decode += int(q)
            else:
                prefill += int(q)
        out["prefill"], out["decode"] = prefill, decode
    except Exception:
        pass
    try:
        w = len(bp.scheduler.waiting_requests)
        q = getattr(bp, "input_queue", None)
        out["waiting"] = w + (q.qsize() if q is not None else 0)
    except Exception:
        pass
    try:
        cache = bp.cache
        total = int(cache.num_blocks)
        if hasattr(cache, "get_num_free_blocks"):
            free = int(cache.get_num_free_blocks())
        else:
            free = int(round(total * float(cache.compute_free_capacity(relative=True))))
        out["kv_used"], out["kv_total"] = max(0, min(total, total - free)), total
    except Exception:
        pass
    if tls is not None:
        out["preempted"] = getattr(tls, "preempted", 0)
        tls.preempted = 0
    return out


def _idle(bp: Any) -> bool:
    """Nothing queued and nothing scheduled: ``prepare_next_batch`` will find no work."""
    try:
        q = bp.input_queue
        return (q is None or q.empty()) and not bp.scheduler.has_pending_requests()
    except Exception:
        return False
