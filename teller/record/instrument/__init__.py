"""Instrumentors: one file per engine, patching it from post-import hooks (DESIGN.md §13).

Each instrumentor follows the OpenTelemetry pattern: ``instrument()`` registers post-import
hooks on the modules it needs (``targets``); when such a module is imported, the instrumentor
checks the engine's version and wraps the hook points with :mod:`wrapt` wrappers that open and
close ranges through :mod:`teller.record.runtime`. ``uninstrument()`` restores every original.

When the version is outside the supported range, or a hook point is missing, the instrumentor
logs one ``[teller]`` line and does nothing (the engine runs as if TELLER were not there). A
hook that raises is logged once and swallowed; the engine's own exceptions pass through
untouched. Adding an engine means adding one file and one line to :data:`ENGINES`.

This package is imported from ``sitecustomize``: it must stay light (no torch, no engine).
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Callable

#: engine name → "module:Class" of its instrumentor
ENGINES: dict[str, str] = {
    "transformers": "teller.record.instrument.transformers_cb:TransformersCBInstrumentor",
    "vllm": "teller.record.instrument.vllm:VLLMInstrumentor",
    "sglang": "teller.record.instrument.sglang:SGLangInstrumentor",
}
ENGINE_CHOICES = ("auto", *ENGINES, "generic")


def register_post_import(module_name: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (now, if it already is)."""
    import wrapt

    def safe(module: Any) -> None:
        try:
            hook(module)
        except Exception as e:  # an import must never fail because of TELLER
            from teller.record import runtime

            runtime.hook_failed(f"post-import {module_name}", e)

    wrapt.register_post_import_hook(safe, module_name)


def parse_version(v: str | None) -> tuple[int, ...]:
    """'5.24.0.dev0' → (5, 24, 0); unparsable parts end the tuple."""
    out: list[int] = []
    for part in str(v or "").split("+")[0].split("."):
        digits = ""
        for ch in part:
            if ch.isdigit():
                digits += ch
            else:
                break
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def installed_version(dist: str, module_name: str | None = None) -> str | None:
    """The engine's version: ``module.__version__`` when imported, else the distribution's."""
    mod = sys.modules.get(module_name or dist)
    v = getattr(mod, "__version__", None) if mod is not None else None
    if v:
        return str(v)
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


class Instrumentor:
    """Base class: version gate, post-import registration, wrapping with undo, error hygiene."""

    #: engine name (also the key in run.json)
    name = "base"
    #: distribution and top-level module whose version is checked
    dist = ""
    module = ""
    #: supported versions: min inclusive, max exclusive (tuples of ints; empty = unbounded)
    min_version: tuple[int, ...] = ()
    max_version: tuple[int, ...] = ()
    #: modules whose import triggers :meth:`patch`
    targets: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.active = False
        self.status = "idle"  # idle | waiting | patched | version-mismatch | failed | removed
        self.version: str | None = None
        self.reason: str | None = None
        self.patched: list[str] = []
        self.missing: list[str] = []
        self._undo: list[tuple[Any, str, Any]] = []
        self._undo_fns: list[Callable[[], None]] = []
        self._version_ok: bool | None = None
        self._lock = threading.Lock()
        self.tls = threading.local()

    # ---- public API -------------------------------------------------------------------------
    def instrument(self) -> None:
        """Patch the targets when (or if already) imported."""
        if self.active:
            return
        self.active = True
        self.status = "waiting"
        for target in self.targets:
            register_post_import(target, self._on_import)

    def uninstrument(self) -> None:
        """Restore every wrapped attribute and remove module hooks."""
        self.active = False
        with self._lock:
            undo, self._undo = self._undo, []
            fns, self._undo_fns = self._undo_fns, []
        for parent, attr, original in reversed(undo):
            try:
                setattr(parent, attr, original)
            except Exception:
                pass
        for fn in reversed(fns):
            try:
                fn()
            except Exception:
                pass
        self.patched = []
        self.status = "removed"

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "version": self.version,
                "reason": self.reason, "patched": list(self.patched), "missing": list(self.missing)}

    # ---- for subclasses ---------------------------------------------------------------------
    def patch(self, module: Any) -> None:
        """Wrap the hook points of ``module`` (one of :attr:`targets`)."""

    def check_version(self) -> bool:
        if self._version_ok is not None:
            return self._version_ok
        self.version = installed_version(self.dist, self.module or self.dist)
        v = parse_version(self.version)
        ok = bool(v) and (not self.min_version or v >= self.min_version) and (
            not self.max_version or v < self.max_version)
        if not ok:
            want = _range_text(self.min_version, self.max_version)
            self.reason = f"{self.dist} {self.version or 'of unknown version'} is not supported (needs {want})"
            self.status = "version-mismatch"
            self.log(f"{self.reason}; the {self.name} hooks stay off and the engine runs unrecorded by them")
        self._version_ok = ok
        return ok

    def wrap(self, owner: Any, path: str, wrapper: Callable) -> bool:
        """Wrap ``owner.<path>`` (e.g. ``"Scheduler.run_batch"``) with a wrapt wrapper; False if missing."""
        import wrapt

        try:
            parent, attr, original = wrapt.resolve_path(owner, path)
        except (AttributeError, ImportError):
            where = f"{getattr(owner, '__name__', owner)}:{path}"
            self.missing.append(where)
            self.log(f"hook point {where} not found in {self.dist} {self.version}; that hook stays off")
            return False
        raw = parent.__dict__.get(attr, original) if isinstance(parent, type) else original
        if getattr(raw, "_self_teller", False):
            return True  # already ours
        fw = wrapt.FunctionWrapper(raw, wrapper)
        fw._self_teller = True
        setattr(parent, attr, fw)
        with self._lock:
            self._undo.append((parent, attr, raw))
        self.patched.append(f"{getattr(owner, '__name__', owner)}:{path}")
        return True

    def on_undo(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._undo_fns.append(fn)

    def failed(self, where: str, exc: BaseException) -> None:
        """A hook of this instrumentor raised: log once, count, carry on."""
        from teller.record import runtime

        runtime.hook_failed(f"{self.name}.{where}", exc)

    def log(self, msg: str) -> None:
        from teller.record import runtime

        runtime.log(f"{self.name}: {msg}", key=f"{self.name}:{msg}")

    # ---- internals --------------------------------------------------------------------------
    def _on_import(self, module: Any) -> None:
        if not self.active or not self.check_version():
            return
        from teller.record import runtime

        runtime.ensure_started()
        try:
            self.patch(module)
            self.status = "patched"
        except Exception as e:
            self.status = "failed"
            self.reason = f"{type(e).__name__}: {e}"
            self.log(f"patching {module.__name__} failed ({self.reason}); its hooks stay off")


class EngineInstrumentor(Instrumentor):
    """What every engine instrumentor shares: the STEP scope, plain ranges, FE hooks on the model.

    An engine step is bounded by one call (the *scope*: a loop body, ``EngineCore.step``,
    ``Scheduler.run_batch``); the STEP opens inside it once the batch's request ids are known
    (:meth:`open_step`, or at once with ``step_scope(..., ids=...)``) and closes when the scope
    returns or raises.
    """

    def uninstrument(self) -> None:
        from teller.record.instrument import torch_ops

        super().uninstrument()
        torch_ops.detach_module_ranges()

    def step_scope(self, wrapped: Any, instance: Any, args: Any, kwargs: Any,
                   ids: Callable[[], str] | None = None) -> Any:
        """wrapt wrapper for the scope call; with ``ids`` the STEP opens right away."""
        from teller.record import runtime as rt

        tls = self.tls
        if getattr(tls, "in_scope", False) or rt.is_compiling():
            return wrapped(*args, **kwargs)
        tls.in_scope, tls.step_open = True, False
        try:
            if ids is not None:
                self.open_step(ids)
            return wrapped(*args, **kwargs)
        finally:
            tls.in_scope = False
            if tls.step_open:
                tls.step_open = False
                try:
                    rt.pop_step()
                except Exception as e:
                    self.failed("STEP end", e)

    def open_step(self, ids: Callable[[], str]) -> None:
        """Open the current scope's STEP (once) as ``STEP id=<n> reqs=<ids()>``."""
        from teller.record import runtime as rt

        tls = self.tls
        if not getattr(tls, "in_scope", False) or tls.step_open:
            return
        try:
            rt.push_step(f"STEP id={rt.next_step_id()} reqs={ids()}")
            tls.step_open = True
        except Exception as e:
            self.failed("STEP begin", e)

    @staticmethod
    def ranged(msg: str) -> Callable:
        """A wrapt wrapper recording the call as one range named ``msg`` (e.g. ``"FE Sampling"``)."""
        from teller.record import runtime as rt

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
            from teller.record import runtime as rt
            from teller.record.instrument import torch_ops

            torch_ops.attach_module_ranges(getattr(instance, "model", None))
            rt.note_model(getattr(instance, "model", None))
        except Exception as e:
            self.failed("FE module hooks", e)
        return out


def _range_text(lo: tuple[int, ...], hi: tuple[int, ...]) -> str:
    parts = []
    if lo:
        parts.append(">=" + ".".join(map(str, lo)))
    if hi:
        parts.append("<" + ".".join(map(str, hi)))
    return ",".join(parts) or "any version"


def load_instrumentor(engine: str) -> Instrumentor:
    mod_name, cls_name = ENGINES[engine].split(":")
    return getattr(importlib.import_module(mod_name), cls_name)()


def instrumentors_for(engine: str, hooks_file: str | None = None) -> list[Instrumentor]:
    """The instrumentors to install for ``--engine`` (auto = every engine, each lazily)."""
    engine = (engine or "auto").lower()
    names = list(ENGINES) if engine == "auto" else [engine] if engine in ENGINES else []
    out = [load_instrumentor(n) for n in names]
    if hooks_file:
        from teller.record.instrument.generic import GenericInstrumentor

        out.append(GenericInstrumentor.from_file(hooks_file))
    elif engine == "generic":
        from teller.record import runtime

        runtime.log("--engine generic without --hooks FILE: no hooks to install")
    elif engine not in ENGINE_CHOICES:
        from teller.record import runtime

        runtime.log(f"unknown engine {engine!r} (expected one of {', '.join(ENGINE_CHOICES)}); no engine hooks")
    return out
