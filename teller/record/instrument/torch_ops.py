"""Framework-level hooks shared by the engine instrumentors: FE modules, BE aten ops, COMM.

- **FE**: :func:`attach_module_ranges` registers forward pre/post hooks on the modules of a loaded
  model that matter for diagnosis (decoder layers, attention, MLP/MoE, input embedding, LM head).
  Per-instance hooks were chosen over patching ``forward`` of model classes: they use PyTorch's
  own mechanism (``always_call=True`` closes the range when forward raises), touch only the
  model the engine serves, work for any architecture by class-name rules, and leave
  ``forward``'s identity and signature alone (transformers inspects them).
- **BE**: :func:`be_enter` / :func:`be_exit` push a ``TorchDispatchMode`` on the calling thread
  for the duration of a STEP. Every aten op reaching the dispatcher becomes a range
  ``BE aten::mm``. Depth 1 records the ops the framework calls; depth N > 1 also runs ops that
  have a CompositeImplicitAutograd decomposition through it with the mode active, recording the
  ops they are made of as children (the same kernels run either way). Depth 0 turns it off.
  Cost measured on the CPU machine (torch 2.13): about 4–6 µs per aten op on top of ~2 µs for
  a small op. This is the ``dispatch`` BE backend, the default; the ``profiler`` backend
  (:mod:`teller.record.instrument.torch_profiler_ops`) records the ops from PyTorch's C++
  RecordFunction callbacks instead (``teller record --be-backend``; docs/overhead.md).
- **COMM**: :class:`TorchDistributedInstrumentor` wraps the ``torch.distributed`` collectives and
  point-to-point calls; each call is a range ``COMM all_reduce bytes=8192 group=tp seq=17`` with
  a per-group sequence number (per direction for send/recv), so the same collective can be
  matched across ranks. Functional collectives (``_c10d_functional``) seen by the BE mode get
  the same COMM message. Nested COMM (an engine wrapper calling torch.distributed) records once.

Every hook records through the runtime handle it is given (``rt``, the
:class:`~teller.record.instrument.base.RecordingRuntime` its instrumentor received), never by
importing the runtime. Imports torch only inside functions: the module itself loads from
``sitecustomize``.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from typing import Any, Callable

from teller.record.instrument.base import Instrumentor, RecordingRuntime

_tls = threading.local()

# ---------------------------------------------------------------------------------------------
# FE: module forward hooks

_FE_SUFFIXES = {
    "layer": ("DecoderLayer", "EncoderLayer"),
    "attention": ("Attention",),
    "mlp": ("MLP", "MoE", "MoeBlock", "SparseMoeBlock", "Experts", "FeedForward"),
}
_attached: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def classify_module(name: str, module: Any, in_emb: Any = None, out_emb: Any = None) -> str | None:
    """The FE message for a submodule, or None when it is not recorded."""
    if module is out_emb or name.endswith("lm_head"):
        return "FE LMHead"
    if module is in_emb or name.endswith("embed_tokens"):
        return "FE Embedding"
    cls = type(module).__name__
    if cls.endswith("RotaryEmbedding"):
        return None
    for suffixes in _FE_SUFFIXES.values():
        if cls.endswith(suffixes):
            return f"FE {cls}"
    return None


def attach_module_ranges(rt: RecordingRuntime, model: Any) -> int:
    """Register FE range hooks on ``model``'s interesting submodules (once per model), recording
    through ``rt``."""
    if model is None or model in _attached:
        return 0
    import torch  # the engine has imported it by now (it hands us a model)

    is_compiling = torch.compiler.is_compiling

    def getter(fn_name: str) -> Any:
        try:
            return getattr(model, fn_name)()
        except Exception:
            return None

    in_emb, out_emb = getter("get_input_embeddings"), getter("get_output_embeddings")
    handles = []
    for name, mod in model.named_modules():
        msg = classify_module(name, mod, in_emb, out_emb)
        if msg is None:
            continue
        handles.append(mod.register_forward_pre_hook(_fe_pre(rt, msg, is_compiling)))
        handles.append(mod.register_forward_hook(_fe_post(rt, is_compiling), always_call=True))
    _attached[model] = handles
    return len(handles) // 2


def attach_served_model(rt: RecordingRuntime, model: Any) -> int:
    """What an instrumentor does once it holds the served model: FE ranges on its blocks
    (:func:`attach_module_ranges`) and its shape for run.json (``rt.note_model``)."""
    n = attach_module_ranges(rt, model)
    rt.note_model(model)
    return n


def detach_module_ranges(model: Any = None) -> None:
    """Remove the FE hooks from ``model`` (all models when None)."""
    models = [model] if model is not None else list(_attached.keys())
    for m in models:
        for h in _attached.pop(m, []):
            try:
                h.remove()
            except Exception:
                pass


def _fe_pre(rt: RecordingRuntime, msg: str, is_compiling: Any):
    def pre(module: Any, args: Any) -> None:
        try:
            if not is_compiling():
                rt.push(msg)
        except Exception as e:
            rt.hook_failed("FE forward pre-hook", e)

    return pre


def _fe_post(rt: RecordingRuntime, is_compiling: Any):
    def post(module: Any, args: Any, output: Any) -> None:
        try:
            if not is_compiling():
                rt.pop()
        except Exception as e:
            rt.hook_failed("FE forward hook", e)

    return post


# ---------------------------------------------------------------------------------------------
# BE: aten ops through a TorchDispatchMode

_mode_cls: Any = None
_op_msgs: dict[Any, str] = {}
_FUNCTIONAL_COMM = {"all_reduce", "all_reduce_", "all_gather_into_tensor", "all_gather_into_tensor_out",
                    "reduce_scatter_tensor", "all_to_all_single", "broadcast", "broadcast_",
                    "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
                    "reduce_scatter_tensor_coalesced"}


def _op_message(func: Any) -> str:
    msg = _op_msgs.get(func)
    if msg is None:
        try:
            msg = "BE " + func._schema.name
        except Exception:
            msg = "BE " + str(func)
        _op_msgs[func] = msg
    return msg


def _mode_class() -> Any:
    global _mode_cls
    if _mode_cls is not None:
        return _mode_cls
    from torch.utils._python_dispatch import TorchDispatchMode

    class BEMode(TorchDispatchMode):
        """Records each aten op as a BE range (COMM for functional collectives)."""

        def __init__(self, depth: int, rt: RecordingRuntime):
            super().__init__()
            self.depth = depth
            self.level = 0
            self.rt = rt

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            msg = _op_msgs.get(func) or _op_message(func)
            if msg.startswith("BE _c10d_functional::"):
                msg = _functional_comm_message(func, args, kwargs) or msg
            rt = self.rt
            rt.push(msg)
            try:
                if self.level + 1 < self.depth:
                    self.level += 1
                    try:
                        with self:
                            out = func.decompose(*args, **kwargs)
                    finally:
                        self.level -= 1
                    if out is not NotImplemented:
                        return out
                return func(*args, **kwargs)
            finally:
                rt.pop()

    _mode_cls = BEMode
    return BEMode


def be_enter(rt: RecordingRuntime, depth: int) -> None:
    """Start recording aten ops on this thread through ``rt`` (nested calls stack)."""
    stack = getattr(_tls, "modes", None)
    if stack is None:
        stack = _tls.modes = []
    if depth <= 0 or rt.is_compiling():
        stack.append(None)
        return
    mode = _mode_class()(depth, rt)
    mode.__enter__()
    stack.append(mode)


def be_exit() -> None:
    """Stop what the matching :func:`be_enter` started."""
    stack = getattr(_tls, "modes", None)
    if not stack:
        return
    mode = stack.pop()
    if mode is not None:
        mode.__exit__(None, None, None)


def _functional_comm_message(func: Any, args: Any, kwargs: Any) -> str | None:
    op = func._schema.name.split("::", 1)[1]
    if op not in _FUNCTIONAL_COMM or _comm_depth() > 0:
        return None
    nbytes = _nbytes(args[0] if args else None)
    group = next((a for a in reversed(args) if isinstance(a, str)), "default")
    return f"COMM {op.rstrip('_')} bytes={nbytes} group={group} seq={_next_seq((group,))}"


# ---------------------------------------------------------------------------------------------
# COMM: torch.distributed

_seqs: dict[tuple, Any] = {}
_seq_lock = threading.Lock()


def _next_seq(key: tuple) -> int:
    c = _seqs.get(key)
    if c is None:
        with _seq_lock:
            c = _seqs.setdefault(key, itertools.count())
    return next(c)


def _comm_depth() -> int:
    return getattr(_tls, "comm", 0)


def _nbytes(x: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors; 0 for anything else."""
    if x is None:
        return 0
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    try:
        return int(x.numel()) * int(x.element_size())
    except Exception:
        return 0


def group_label(group: Any) -> str:
    """A readable, rank-independent name of a process group."""
    if group is None:
        return "default"
    if isinstance(group, str):
        return group
    for attr in ("unique_name", "group_desc", "group_name"):
        v = getattr(group, attr, None)
        if isinstance(v, str) and v and v not in ("undefined", "default_pg"):
            return v
    return "default"


class comm_range:
    """``with comm_range(rt, "all_reduce", nbytes, group): ...`` records one COMM range through
    ``rt`` (outermost only)."""

    __slots__ = ("msg", "rt")

    def __init__(self, rt: RecordingRuntime, op: str, nbytes: int, group: str, peer: tuple | None = None):
        self.rt = rt
        if _comm_depth() > 0:
            self.msg = None
            return
        if peer is None:
            self.msg = f"COMM {op} bytes={nbytes} group={group} seq={_next_seq((group,))}"
        else:
            src, dst = peer
            other = dst if op in ("send", "isend") else src
            self.msg = (f"COMM {op} bytes={nbytes} group={group} peer={other} "
                        f"seq={_next_seq((group, 'p2p', src, dst))}")

    def __enter__(self) -> None:
        _tls.comm = _comm_depth() + 1
        if self.msg is not None:
            self.rt.push(self.msg)

    def __exit__(self, *exc: Any) -> None:
        _tls.comm = _comm_depth() - 1
        if self.msg is not None:
            self.rt.pop()


#: torch.distributed function → name of its main tensor argument
DIST_OPS = {
    "all_reduce": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "all_gather": "tensor",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "reduce_scatter": "input_list",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "broadcast": "tensor",
    "reduce": "tensor",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": None,
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
_P2P = {"send", "recv", "isend", "irecv"}


class TorchDistributedInstrumentor(Instrumentor):
    """COMM ranges around ``torch.distributed`` collectives and point-to-point calls."""

    name = "torch.distributed"
    dist = "torch"
    module = "torch"
    min_version = (2, 1)
    targets = ("torch.distributed.distributed_c10d",)

    def patch(self, module: Any) -> None:
        import torch.distributed as dist

        for op, tensor_arg in DIST_OPS.items():
            fn = getattr(module, op, None)
            if fn is None:
                continue
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                sig = None
            if self.wrap(module, op, self._wrapper(op, tensor_arg, sig)):
                new = getattr(module, op)
                if getattr(dist, op, None) is fn:
                    setattr(dist, op, new)
                    self.on_undo(lambda op=op, fn=fn: setattr(dist, op, fn))

    def _wrapper(self, op: str, tensor_arg: str | None, sig: Any):
        def describe(instance: Any, args: Any, kwargs: Any):
            bound = sig.bind_partial(*args, **kwargs).arguments if sig is not None else {}
            nbytes = _nbytes(bound.get(tensor_arg)) if tensor_arg else 0
            peer = _peer(op, bound) if op in _P2P else None
            return nbytes, group_label(bound.get("group")), peer

        return _comm_wrapper(self, op, describe)


def _comm_wrapper(inst: Instrumentor, op: str, describe: Callable[[Any, Any, Any], tuple | None]):
    """A wrapt wrapper recording one COMM range per call; ``describe(instance, args, kwargs)``
    gives (bytes, group, peer), or None for a call not worth a range. Nested collectives (an
    engine's wrapper calling torch.distributed) are recorded once, at the outermost call."""
    rt = inst.rt

    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if _comm_depth() > 0 or rt.is_compiling():
            return wrapped(*args, **kwargs)
        try:
            what = describe(instance, args, kwargs)
            if what is None:
                return wrapped(*args, **kwargs)
            cm = comm_range(rt, op, *what)
        except Exception as e:
            inst.failed(f"COMM {op}", e)
            return wrapped(*args, **kwargs)
        with cm:
            return wrapped(*args, **kwargs)

    return wrapper


def _peer(op: str, bound: dict) -> tuple:
    import torch.distributed as dist

    me = dist.get_rank() if dist.is_initialized() else 0
    if op in ("send", "isend"):
        other = bound.get("dst", bound.get("group_dst"))
        return (me, "any" if other is None else other)
    other = bound.get("src", bound.get("group_src"))
    return ("any" if other is None else other, me)


# ---------------------------------------------------------------------------------------------
# engine-side collective wrappers (vLLM and SGLang GroupCoordinator)

#: GroupCoordinator method → index of its tensor argument (after self)
COORDINATOR_OPS = {
    "all_reduce": 0,
    "all_gather": 0,
    "all_gatherv": 0,
    "reduce_scatter": 0,
    "reduce_scatterv": 0,
    "gather": 0,
    "broadcast": 0,
    "broadcast_object": None,
    "broadcast_tensor_dict": None,
    "send_tensor_dict": None,
    "recv_tensor_dict": None,
    "send": 0,
    "recv": None,
    "barrier": None,
}


def wrap_group_coordinator(inst: Instrumentor, module: Any, cls: str = "GroupCoordinator") -> None:
    """COMM ranges around an engine's ``GroupCoordinator`` methods, group = its ``unique_name``."""
    owner = getattr(module, cls, None)
    if owner is None:
        inst.wrap(module, cls, lambda *a: None)  # logs the missing hook point once
        return
    for op, idx in COORDINATOR_OPS.items():
        if op in vars(owner):
            inst.wrap(module, f"{cls}.{op}", _coordinator_wrapper(inst, op, idx))


def _coordinator_wrapper(inst: Instrumentor, op: str, idx: int | None):
    def describe(instance: Any, args: Any, kwargs: Any):
        if getattr(instance, "world_size", 2) == 1:
            return None  # a no-op collective: nothing to record
        nbytes = _nbytes(args[idx]) if idx is not None and len(args) > idx else 0
        return nbytes, group_label(instance), None

    return _comm_wrapper(inst, op, describe)
