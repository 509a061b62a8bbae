"""What every instrumentor shares: the runtime handle, post-import hooks, version gate, wrapping.

An instrumentor is handed the recording runtime when it is installed
(``inst.instrument(runtime)``), as an OpenTelemetry instrumentor is handed its tracer provider:
it records through that handle and never imports the runtime itself, so the runtime can import
the instrumentors without an import circle, and a test can hand them a stand-in. The handle is
:mod:`teller.record.runtime` in a recorded process; :class:`RecordingRuntime` lists what an
instrumentor may use of it.

Imported from ``sitecustomize`` (through the runtime): the standard library and :mod:`wrapt` only.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Protocol

import wrapt


class RecordingRuntime(Protocol):
    """The part of :mod:`teller.record.runtime` that hooks use (read at call time: ``push`` and
    ``pop`` follow the current range backend, ``push_step`` what wraps it)."""

    push: Callable[[str], None]
    pop: Callable[[], None]
    push_step: Callable[[str], None]
    pop_step: Callable[[], None]

    def next_step_id(self) -> int: ...
    def is_compiling(self) -> bool: ...
    def log(self, msg: str, key: str | None = None) -> None: ...
    def hook_failed(self, where: str, exc: BaseException) -> None: ...
    def ensure_started(self) -> None: ...
    def note_model(self, model: Any) -> None: ...


def register_post_import(module_name: str, hook: Callable[[Any], None],
                         on_error: Callable[[str, BaseException], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (now, if it already is).

    An exception from ``hook`` goes to ``on_error(where, exc)`` (e.g. ``runtime.hook_failed``)
    and never fails the import.
    """

    def safe(module: Any) -> None:
        try:
            hook(module)
        except Exception as e:  # an import must never fail because of TELLER
            on_error(f"post-import {module_name}", e)

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
        from importlib.metadata import version  # reads installed metadata: only when needed

        return version(dist)
    except Exception:
        return None


#: the batch-context fields a STEP message may carry after its request list, in this order
BATCH_FIELDS = ("prefill", "decode", "waiting", "kv_used", "kv_total", "preempted")


def batch_text(fields: dict[str, Any] | None) -> str:
    """`` prefill=12 decode=3 ...`` for the known fields of ``fields`` with an int value (in
    :data:`BATCH_FIELDS` order; others left out); ``""`` when none."""
    if not fields:
        return ""
    out = []
    for k in BATCH_FIELDS:
        v = fields.get(k)
        if v is not None and not isinstance(v, bool):
            try:
                out.append(f" {k}={int(v)}")
            except (TypeError, ValueError):
                continue
    return "".join(out)


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
        self.rt: RecordingRuntime | None = None
        self._undo: list[tuple[Any, str, Any]] = []
        self._undo_fns: list[Callable[[], None]] = []
        self._version_ok: bool | None = None
        self._lock = threading.Lock()
        self.tls = threading.local()

    # ---- public API -------------------------------------------------------------------------
    def instrument(self, runtime: RecordingRuntime) -> None:
        """Record through ``runtime``; patch the targets when (or if already) imported."""
        if self.active:
            return
        self.rt = runtime
        self.active = True
        self.status = "waiting"
        for target in self.targets:
            register_post_import(target, self._on_import, runtime.hook_failed)

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
        self.rt.hook_failed(f"{self.name}.{where}", exc)

    def log(self, msg: str) -> None:
        self.rt.log(f"{self.name}: {msg}", key=f"{self.name}:{msg}")

    # ---- internals --------------------------------------------------------------------------
    def _on_import(self, module: Any) -> None:
        if not self.active or not self.check_version():
            return
        self.rt.ensure_started()
        try:
            self.patch(module)
            self.status = "patched"
        except Exception as e:
            self.status = "failed"
            self.reason = f"{type(e).__name__}: {e}"
            self.log(f"patching {module.__name__} failed ({self.reason}); its hooks stay off")


def _range_text(lo: tuple[int, ...], hi: tuple[int, ...]) -> str:
    parts = []
    if lo:
        parts.append(">=" + ".".join(map(str, lo)))
    if hi:
        parts.append("<" + ".".join(map(str, hi)))
    return ",".join(parts) or "any version"
