"""The collector interface every collector (CPU, CUPTI, Kineto) implements.

A collector runs inside the recorded process. It is created by the recording runtime once the
engine imports torch (never at interpreter start-up), receives an :class:`~teller.record.sink.EventSink`
and appends canonical event columns to it, already on the run's time base τ
(see :mod:`teller.record.clock`). It must never raise into the engine: failures are reported in
``info()["errors"]`` and the collector degrades to doing nothing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from teller.record.sink import EventSink


@runtime_checkable
class Collector(Protocol):
    #: short name written to run.json ("cpu", "cupti", "kineto")
    name: str

    def start(self, sink: EventSink) -> None:
        """Begin collecting; called once per process."""

    def flush(self) -> None:
        """Move whatever is pending into the sink (called periodically and at exit)."""

    def stop(self) -> None:
        """Stop collecting and flush; idempotent; safe from signal handlers and atexit."""

    def info(self) -> dict[str, Any]:
        """Settings, clock anchors, dropped-record counts and errors, for run.json."""
