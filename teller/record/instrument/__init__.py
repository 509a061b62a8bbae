"""Instrumentors: one file per engine, patching it from post-import hooks (docs/design.md §13).

Each instrumentor follows the OpenTelemetry pattern: ``instrument(runtime)`` receives the
recording runtime (the handle it records through, :class:`~.base.RecordingRuntime`) and
registers post-import hooks on the modules it needs (``targets``); when such a module is
imported, the instrumentor checks the engine's version and wraps the hook points with
:mod:`wrapt` wrappers that open and close ranges through that runtime. ``uninstrument()``
restores every original.

When the version is outside the supported range, or a hook point is missing, the instrumentor
logs one ``[teller]`` line and does nothing (the engine runs as if TELLER were not there). A
hook that raises is logged once and swallowed; the engine's own exceptions pass through
untouched. Adding an engine means adding one file and one line to :data:`ENGINES`.

Layout, imports flowing one way: :mod:`.base` (the instrumentor base class, post-import hooks)
← :mod:`.torch_ops` (FE/BE/COMM hooks on torch) ← :mod:`.engine` (what engine instrumentors
share) ← one module per engine; this package holds the registry. None of them imports the
runtime: the runtime imports them.

This package is imported from ``sitecustomize``: it must stay light (no torch, no engine).
"""

from __future__ import annotations

import importlib
from typing import Callable

from teller.record.instrument.base import (
    Instrumentor,
    RecordingRuntime,
    installed_version,
    parse_version,
    register_post_import,
)
from teller.record.instrument.engine import EngineInstrumentor

__all__ = ["ENGINES", "ENGINE_CHOICES", "EngineInstrumentor", "Instrumentor",
           "RecordingRuntime", "installed_version", "instrumentors_for", "load_instrumentor",
           "parse_version", "register_post_import"]

#: engine name → "module:Class" of its instrumentor (imported only when that engine is asked for)
ENGINES: dict[str, str] = {
    "transformers": "teller.record.instrument.transformers_cb:TransformersCBInstrumentor",
    "vllm": "teller.record.instrument.vllm:VLLMInstrumentor",
    "sglang": "teller.record.instrument.sglang:SGLangInstrumentor",
}
ENGINE_CHOICES = ("auto", *ENGINES, "generic")


def load_instrumentor(engine: str) -> Instrumentor:
    mod_name, cls_name = ENGINES[engine].split(":")
    return getattr(importlib.import_module(mod_name), cls_name)()


def instrumentors_for(engine: str, hooks_file: str | None, log: Callable[[str], None]) -> list[Instrumentor]:
    """The instrumentors to install for ``--engine`` (auto = every engine, each lazily);
    a request that installs nothing is said through ``log``."""
    engine = (engine or "auto").lower()
    names = list(ENGINES) if engine == "auto" else [engine] if engine in ENGINES else []
    out = [load_instrumentor(n) for n in names]
    if hooks_file:
        # only with --hooks: keeps tomllib and the hooks-file parser out of every process's start
        from teller.record.instrument.generic import GenericInstrumentor

        out.append(GenericInstrumentor.from_file(hooks_file))
    elif engine == "generic":
        log("--engine generic without --hooks FILE: no hooks to install")
    elif engine not in ENGINE_CHOICES:
        log(f"unknown engine {engine!r} (expected one of {', '.join(ENGINE_CHOICES)}); no engine hooks")
    return out
