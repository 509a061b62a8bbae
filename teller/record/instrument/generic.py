"""Generic hooks from a TOML file: any engine's methods as STEP/FE/BE/COMM/OTHER ranges.

The file maps ``"module:Qualname.method"`` to a layer tag, at the top level or under
``[hooks]``; an optional ``[requests]`` table gives, for a hooked method, where the request ids
of a call are found (see ``examples/hooks_example.toml``)::

    "myengine.server:Engine.step" = "STEP"
    "myengine.model:Block.forward" = "FE"

    [requests]
    "myengine.server:Engine.step" = "args[0].batch[*].rid"

A request path starts at ``args`` (the call's positional arguments, without ``self``),
``kwargs`` or ``self`` and continues with ``.name``, ``[0]``, ``['key']`` and ``[*]`` (every
element; the keys of a mapping). It is walked with ``getattr``/``[]`` only, never evaluated, and
dunder names are refused. The result may be one id, a list of ids or a mapping (its keys).

An optional ``[batch]`` table gives, for a STEP hook, a path (same syntax) to a mapping of
batch-context fields read when the STEP opens (``prefill``, ``decode``, ``waiting``,
``kv_used``, ``kv_total``, ``preempted``; ints, any subset; others ignored)::

    [batch]
    "myengine.server:Engine.step" = "self.batch_stats"

An optional ``[models]`` table gives, for a hooked method, a path (same syntax) to the served
``torch.nn.Module``: when the method is called, its decoder layers, attention and MLP blocks,
embeddings and LM head get FE ranges and its shape goes into run.json's ``model_config``, as the
built-in engine instrumentors do (once per model;
:func:`teller.record.instrument.torch_ops.attach_served_model`)::

    [models]
    "myengine.server:Engine.add_request" = "self.model"

Messages: ``STEP id=<n> reqs=<ids>[ prefill=.. decode=.. ...]`` for STEP hooks (n counts steps
in the process), else ``<TAG> <Qualname.method>`` (plus `` reqs=<ids>`` when a request path is
given).
"""

from __future__ import annotations

import re
import tomllib
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from teller.errors import InputError
from teller.record.instrument import torch_ops
from teller.record.instrument.base import Instrumentor, batch_text

TAGS = ("STEP", "FE", "BE", "COMM", "OTHER")
_TARGET_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_ROOT_RE = re.compile(r"^(args|kwargs|self)")
_STEP_RE = re.compile(r"""\.([A-Za-z_]\w*)|\[(-?\d+)\]|\[(['"])(.*?)\3\]|\[\*\]""")


@dataclass
class RequestPath:
    """A parsed request-id path such as ``args[0].reqs[*].rid``."""

    text: str
    root: str
    steps: list[tuple[str, Any]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> "RequestPath":
        s = text.strip()
        m = _ROOT_RE.match(s)
        if not m:
            raise ValueError("must start with args, kwargs or self")
        pos, steps = m.end(), []
        while pos < len(s):
            m = _STEP_RE.match(s, pos)
            if not m:
                raise ValueError(f"cannot read {s[pos:]!r} (use .name, [0], ['key'] or [*])")
            if m.group(1) is not None:
                if m.group(1).startswith("__"):
                    raise ValueError(f"dunder attribute {m.group(1)!r} not allowed")
                steps.append(("attr", m.group(1)))
            elif m.group(2) is not None:
                steps.append(("item", int(m.group(2))))
            elif m.group(3) is not None:
                steps.append(("item", m.group(4)))
            else:
                steps.append(("all", None))
            pos = m.end()
        return cls(text, m_root(text), steps)

    def values(self, instance: Any, args: tuple, kwargs: dict) -> list[Any]:
        """Walk the path for one call; returns what it reaches (one value per ``[*]`` element)."""
        vals = [{"args": args, "kwargs": kwargs, "self": instance}[self.root]]
        for kind, key in self.steps:
            if kind == "attr":
                vals = [getattr(v, key) for v in vals]
            elif kind == "item":
                vals = [v[key] for v in vals]
            else:
                vals = [x for v in vals for x in (v.keys() if isinstance(v, dict) else v)]
        return vals

    def ids(self, instance: Any, args: tuple, kwargs: dict) -> list[str]:
        """Walk the path for one call; returns the ids as strings."""
        out: list[str] = []
        for v in self.values(instance, args, kwargs):
            if isinstance(v, dict):
                out.extend(str(k) for k in v)
            elif isinstance(v, (list, tuple, set, frozenset)):
                out.extend(str(x) for x in v)
            elif v is not None:
                out.append(str(v))
        return out


def m_root(text: str) -> str:
    return _ROOT_RE.match(text.strip()).group(1)


@dataclass
class HookSpec:
    """The parsed hooks file: target → tag, target → request path."""

    path: str
    hooks: dict[str, str]
    requests: dict[str, RequestPath]
    batch: dict[str, RequestPath] = field(default_factory=dict)
    models: dict[str, RequestPath] = field(default_factory=dict)

    def modules(self) -> list[str]:
        return sorted({t.split(":", 1)[0] for t in self.hooks})


def load_hooks(path: str | Path) -> HookSpec:
    """Read and check a hooks file; bad content raises :class:`InputError` naming the entry."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(p, "hooks file not found", "check the --hooks path") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(p, f"not valid TOML ({e})", 'write entries as "module:Class.method" = "TAG"') from e
    table = dict(data.get("hooks", {}))
    table.update({k: v for k, v in data.items() if k not in ("hooks", "requests", "batch", "models")})
    if not table:
        raise InputError(p, "no hooks", 'add entries such as "mypkg.engine:Engine.step" = "STEP"')
    hooks: dict[str, str] = {}
    for target, tag in table.items():
        if not _TARGET_RE.match(target):
            raise InputError(p, f"entry {target!r}: not of the form module:Qualname.method",
                             'write e.g. "mypkg.engine:Engine.step" = "STEP"')
        if not isinstance(tag, str) or tag.upper() not in TAGS:
            raise InputError(p, f"entry {target!r}: tag {tag!r} is not one of {', '.join(TAGS)}",
                             "use one of those tags")
        hooks[target] = tag.upper()
    requests = _path_table(p, data, "requests", hooks, step_only=False, example="args[0].reqs[*].rid")
    batch = _path_table(p, data, "batch", hooks, step_only=True, example="self.batch_stats")
    models = _path_table(p, data, "models", hooks, step_only=False, example="self.model")
    return HookSpec(str(p), hooks, requests, batch, models)



def _path_table(p: Path, data: dict, table: str, hooks: dict[str, str], step_only: bool,
                example: str) -> dict[str, RequestPath]:
    """The ``[table]`` of a hooks file: hooked method → attribute path (``[requests]``: any
    hooked method; ``[batch]``: STEP hooks only)."""
    out: dict[str, RequestPath] = {}
    for target, expr in dict(data.get(table, {})).items():
        if (hooks.get(target) != "STEP") if step_only else (target not in hooks):
            raise InputError(p, f"[{table}] entry {target!r} names a method that is not "
                             + ("a STEP hook" if step_only else "hooked"),
                             f'add "{target}" = "STEP" above, or remove the entry')
        if not isinstance(expr, str):
            raise InputError(p, f"[{table}] entry {target!r}: expected a string path", f'e.g. "{example}"')
        try:
            out[target] = RequestPath.parse(expr)
        except ValueError as e:
            raise InputError(p, f"[{table}] entry {target!r}: path {expr!r} {e}", f'e.g. "{example}"') from e
    return out

class GenericInstrumentor(Instrumentor):
    """Wraps the methods a hooks file names, whatever the engine."""

    name = "generic"

    def __init__(self, spec: HookSpec):
        super().__init__()
        self.spec = spec
        self._models: weakref.WeakSet = weakref.WeakSet()  # the served models given FE ranges
        self.targets = tuple(spec.modules())

    @classmethod
    def from_file(cls, path: str | Path) -> "GenericInstrumentor":
        return cls(load_hooks(path))

    def check_version(self) -> bool:
        return True

    def patch(self, module: Any) -> None:
        for target, tag in self.spec.hooks.items():
            mod, qual = target.split(":", 1)
            if mod == module.__name__:
                self.wrap(module, qual, self._wrapper(tag, qual, self.spec.requests.get(target),
                                                      self.spec.batch.get(target),
                                                      self.spec.models.get(target)))

    def uninstrument(self) -> None:
        super().uninstrument()
        for model in list(self._models):  # only the models these hooks attached to
            torch_ops.detach_module_ranges(model)
        self._models.clear()

    def _wrapper(self, tag: str, qual: str, req: RequestPath | None,
                 batch: RequestPath | None = None, model: RequestPath | None = None) -> Callable:
        inst, label, rt = self, f"{tag} {qual}", self.rt
        is_step = tag == "STEP"
        attached = [model is None]  # FE hooks on the served model: once, at the first call that reaches it

        def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            if rt.is_compiling():
                return wrapped(*args, **kwargs)
            if not attached[0]:
                try:
                    vals = model.values(instance, args, kwargs)
                    if len(vals) == 1 and vals[0] is not None:
                        torch_ops.attach_served_model(rt, vals[0])
                        inst._models.add(vals[0])  # weakly: the engine owns its model
                        attached[0] = True
                except Exception as e:
                    attached[0] = True
                    inst.failed(f"{qual} model", e)
            opened = False
            try:
                reqs = ",".join(req.ids(instance, args, kwargs)) if req is not None else None
                if is_step:
                    extra = ""
                    if batch is not None:
                        try:
                            vals = batch.values(instance, args, kwargs)
                            extra = batch_text(vals[0]) if len(vals) == 1 and isinstance(vals[0], dict) else ""
                        except Exception as e:
                            inst.failed(f"{qual} batch fields", e)
                    rt.push_step(f"STEP id={rt.next_step_id()} reqs={reqs or ''}{extra}")
                else:
                    rt.push(label if reqs is None else f"{label} reqs={reqs}")
                opened = True
            except Exception as e:
                inst.failed(qual, e)
            try:
                return wrapped(*args, **kwargs)
            finally:
                if opened:
                    try:
                        rt.pop_step() if is_step else rt.pop()
                    except Exception as e:
                        inst.failed(qual, e)

        return wrapper
