"""vLLM V1 (0.8 and later): STEP ranges per engine step and per worker step, FE, COMM.

Written against the hook points of the vLLM V1 sources (docs/design.md §13) and tested against a
fake module tree that mimics their module, class and method names
(``tests/test_instrument_engines.py``). It has NOT been run against a real vLLM: vLLM does not
install on the CPU machine this was developed on. The version gate and the one-line
"hook point not found" messages are the safety net when a release moves things.

Hook points:

- ``vllm.v1.engine.core.EngineCore.step`` and ``.step_with_batch_queue``: the STEP's scope.
  Which one runs is bound at ``EngineCore.__init__`` (``self.step_fn``), after this module's
  post-import hook has wrapped both, so either is covered.
- ``vllm.v1.core.sched.scheduler.Scheduler.schedule``: inside a step's scope, the STEP opens
  when it returns: ``STEP id=<n> reqs=<ids>`` with the keys of
  ``SchedulerOutput.num_scheduled_tokens`` (vLLM's internal ids: the external id plus ``-`` and
  8 random characters). A batch-queue step that schedules nothing opens no STEP.
  The batch context follows (:func:`vllm_batch_fields`, each field read on its own and left
  out when this version lacks it): ``prefill``/``decode`` from ``num_scheduled_tokens`` (a
  request in ``scheduled_new_reqs`` or given more than one token counts as prefill, the others
  as one decode token each; speculative decoding's multi-token decodes count as prefill),
  ``waiting`` = ``len(scheduler.waiting)``, ``kv_total``/``kv_used`` from
  ``scheduler.kv_cache_manager.block_pool`` (``num_gpu_blocks``, ``get_num_free_blocks()``),
  ``preempted`` = ``len(SchedulerOutput.preempted_req_ids)`` where the output has it. Worker
  STEPs carry the ids only.
- ``vllm.v1.worker.gpu_worker.Worker.execute_model(scheduler_output)``: in worker processes (or
  worker threads) a STEP of its own with the same request ids, unless a STEP is already open
  on the thread (uni-process executor on the engine thread). When it returns None, sampling
  follows in ``Worker.sample_tokens`` (``FE Sampling``) and the STEP ends after it.
- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.load_model``: FE hooks on ``self.model``.
- ``vllm.distributed.parallel_state.GroupCoordinator`` collectives: COMM ranges, group =
  ``unique_name`` (e.g. ``tp:0``); the torch.distributed calls underneath are not recorded twice.

vLLM runs the engine core and the workers in processes it spawns; they inherit the environment
and therefore the bootstrap, so each is recorded into its own events files.
"""

from __future__ import annotations

from typing import Any

from teller.record.instrument import torch_ops
from teller.record.instrument.engine import EngineInstrumentor


def _scheduled_ids(scheduler_output: Any) -> str:
    return ",".join(str(k) for k in getattr(scheduler_output, "num_scheduled_tokens", {}) or {})


def vllm_batch_fields(scheduler: Any, out: Any) -> dict[str, int]:
    """The batch context of one ``Scheduler.schedule()`` (O(batch); see the module docstring)."""
    f: dict[str, int] = {}
    try:
        new = {str(getattr(r, "req_id", "")) for r in (getattr(out, "scheduled_new_reqs", None) or ())}
        prefill = decode = 0
        for rid, n in (getattr(out, "num_scheduled_tokens", None) or {}).items():
            if str(rid) in new or int(n) > 1:
                prefill += int(n)
            else:
                decode += int(n)
        f["prefill"], f["decode"] = prefill, decode
    except Exception:
        pass
    try:
        f["waiting"] = len(scheduler.waiting)
    except Exception:
        pass
    try:
        pool = scheduler.kv_cache_manager.block_pool
        total = int(pool.num_gpu_blocks)
        f["kv_used"], f["kv_total"] = max(0, total - int(pool.get_num_free_blocks())), total
    except Exception:
        pass
    pre = getattr(out, "preempted_req_ids", None)
    if pre is not None:
        try:
            f["preempted"] = len(pre)
        except Exception:
            pass
    return f


class VLLMInstrumentor(EngineInstrumentor):
    name = "vllm"
    dist = "vllm"
    module = "vllm"
    min_version = (0, 8)
    max_version = (2,)
    targets = (
        "vllm.v1.engine.core",
        "vllm.v1.core.sched.scheduler",
        "vllm.v1.worker.gpu_worker",
        "vllm.v1.worker.gpu_model_runner",
        "vllm.distributed.parallel_state",
    )

    def patch(self, module: Any) -> None:
        name = module.__name__
        if name == "vllm.v1.engine.core":
            self.wrap(module, "EngineCore.step", self.step_scope)
            self.wrap(module, "EngineCore.step_with_batch_queue", self.step_scope)
        elif name == "vllm.v1.core.sched.scheduler":
            self.wrap(module, "Scheduler.schedule", self._schedule)
        elif name == "vllm.v1.worker.gpu_worker":
            self.wrap(module, "Worker.execute_model", self._execute_model)
            if "sample_tokens" in vars(getattr(module, "Worker", object)):
                self.wrap(module, "Worker.sample_tokens", self._sample_tokens)
        elif name == "vllm.v1.worker.gpu_model_runner":
            self.wrap(module, "GPUModelRunner.load_model", self.attach_model)
        elif name == "vllm.distributed.parallel_state":
            torch_ops.wrap_group_coordinator(self, module)

    # ---- engine core -------------------------------------------------------------------------
    def _schedule(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        self.rt.push("OTHER schedule")
        try:
            out = wrapped(*args, **kwargs)
        finally:
            self.rt.pop()
        if getattr(out, "total_num_scheduled_tokens", 1):
            self.open_step(lambda: _scheduled_ids(out), lambda: vllm_batch_fields(instance, out))
        return out

    # ---- worker --------------------------------------------------------------------------------
    def _execute_model(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        tls, rt = self.tls, self.rt
        if getattr(tls, "worker_step", False):
            self._end_worker_step()  # the previous step's sampling never came
        if getattr(tls, "step_open", False) or rt.is_compiling():
            return wrapped(*args, **kwargs)
        try:
            so = args[0] if args else kwargs.get("scheduler_output")
            rt.push_step(f"STEP id={rt.next_step_id()} reqs={_scheduled_ids(so)}")
            tls.worker_step = True
        except Exception as e:
            self.failed("worker STEP begin", e)
        out = None
        try:
            out = wrapped(*args, **kwargs)
            return out
        finally:
            # newer V1 workers return None here and sample in sample_tokens: the STEP spans both;
            # older ones (no sample_tokens) return None on non-driver ranks: the STEP ends here
            if out is not None or not hasattr(type(instance), "sample_tokens"):
                self._end_worker_step()

    def _end_worker_step(self) -> None:
        tls = self.tls
        if getattr(tls, "worker_step", False):
            tls.worker_step = False
            try:
                self.rt.pop_step()
            except Exception as e:
                self.failed("worker STEP end", e)

    def _sample_tokens(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        self.rt.push("FE Sampling")
        try:
            return wrapped(*args, **kwargs)
        finally:
            self.rt.pop()
            self._end_worker_step()
