"""The CPU collector: the hooks' ranges, recorded without a GPU or a profiler.

It moves what :mod:`teller.record.ranges` has buffered into the sink. On a machine without a
GPU this is the whole recording (STEP/FE/BE/COMM ranges on the host threads); with the CUPTI
or Kineto collector the runtime keeps one of these running beside it, so the hook ranges are
recorded whichever backend the GPU collector chooses, unless that collector takes the ranges
over (``runtime.set_range_backend``).
"""

from __future__ import annotations

from typing import Any

from teller.record.ranges import RECORDER, RangeRecorder
from teller.record.sink import EventSink


class CpuCollector:
    """Collector of the CPU range recorder's buffers (see :class:`~teller.record.collectors.base.Collector`)."""

    name = "cpu"

    def __init__(self, recorder: RangeRecorder | None = None):
        self.recorder = recorder or RECORDER
        self.sink: EventSink | None = None
        self.errors: list[str] = []
        self._stopped = False

    def start(self, sink: EventSink) -> None:
        self.sink = sink
        self._stopped = False

    def flush(self, final: bool = False) -> None:
        if self.sink is None:
            return
        try:
            cols = self.recorder.drain(final=final)
            if cols is not None:
                self.sink.append(cols)
        except Exception as e:  # never into the engine
            if len(self.errors) < 20:
                self.errors.append(f"flush: {type(e).__name__}: {e}")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.flush(final=True)

    def info(self) -> dict[str, Any]:
        d = {"name": self.name, **self.recorder.info(), "errors": list(self.errors)}
        d["dropped_records"] = 0  # ranges are never dropped here; sink write failures count in the sink
        return d
