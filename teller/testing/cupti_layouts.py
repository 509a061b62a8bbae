"""Synthetic CUPTI activity record layouts (packed the way CUPTI packs them, 8-byte aligned
structs with the field names and offsets a CUPTI header would give), for the collector's tests
and benchmarks, which build raw activity buffers without a GPU."""

from __future__ import annotations

import ctypes

import numpy as np

#: C strings referenced by pointer from packed records (kept alive for the process)
_KEEP: list = []


def struct(spec: list[tuple[str, str, int]], itemsize: int) -> np.dtype:
    """A numpy struct of (name, format, offset) fields and ``itemsize`` bytes."""
    return np.dtype({"names": [n for n, _, _ in spec], "formats": [f for _, f, _ in spec],
                     "offsets": [o for _, _, o in spec], "itemsize": itemsize})


def c_string(text: str) -> int:
    """Address of a NUL-terminated copy of ``text`` (0 for ""), valid for the process's life."""
    if not text:
        return 0
    b = ctypes.create_string_buffer(text.encode())
    _KEEP.append(b)
    return ctypes.addressof(b)


def layouts(kernel_bytes: int = 92, camel_api: bool = False) -> dict[str, np.dtype]:
    """Record layouts per record group: API 40 bytes, KERNEL ``max(88, kernel_bytes)`` (the
    real CUpti_ActivityKernel is larger; padding it makes copies cost what they do), MEMCPY 48,
    MEMSET 56, SYNC 40, MARKER 56. ``camel_api``: the API record's fields spelled as CUPTI's
    header does (``processId``), which the decoder's layout lookup accepts beside snake case."""
    pid, tid, corr, ret = (("processId", "threadId", "correlationId", "returnValue") if camel_api
                           else ("process_id", "thread_id", "correlation_id", "return_value"))
    return {
        "API": struct([("kind", "<u4", 0), ("cbid", "<u4", 4), ("start", "<u8", 8), ("end", "<u8", 16),
                       (pid, "<u4", 24), (tid, "<u4", 28), (corr, "<u4", 32), (ret, "<u4", 36)], 40),
        "KERNEL": struct([("kind", "<u4", 0), ("start", "<u8", 8), ("end", "<u8", 16), ("device_id", "<u4", 24),
                          ("stream_id", "<u4", 28), ("correlation_id", "<u4", 32), ("graph_id", "<u4", 36),
                          ("grid_x", "<i4", 40), ("grid_y", "<i4", 44), ("grid_z", "<i4", 48),
                          ("block_x", "<i4", 52), ("block_y", "<i4", 56), ("block_z", "<i4", 60),
                          ("registers_per_thread", "<u2", 64), ("static_shared_memory", "<i4", 68),
                          ("dynamic_shared_memory", "<i4", 72), ("name", "<u8", 80)], max(88, kernel_bytes)),
        "MEMCPY": struct([("kind", "<u4", 0), ("copy_kind", "u1", 4), ("src_kind", "u1", 5), ("dst_kind", "u1", 6),
                          ("bytes", "<u8", 8), ("start", "<u8", 16), ("end", "<u8", 24), ("device_id", "<u4", 32),
                          ("stream_id", "<u4", 36), ("correlation_id", "<u4", 40), ("graph_id", "<u4", 44)], 48),
        "MEMSET": struct([("kind", "<u4", 0), ("value", "<u4", 4), ("bytes", "<u8", 8), ("start", "<u8", 16),
                          ("end", "<u8", 24), ("device_id", "<u4", 32), ("stream_id", "<u4", 36),
                          ("correlation_id", "<u4", 40), ("graph_id", "<u4", 44), ("memory_kind", "<u2", 48)], 56),
        "SYNC": struct([("kind", "<u4", 0), ("type", "<u4", 4), ("start", "<u8", 8), ("end", "<u8", 16),
                        ("correlation_id", "<u4", 24), ("stream_id", "<u4", 28), ("cuda_event_id", "<u4", 32)], 40),
        "MARKER": struct([("kind", "<u4", 0), ("flags", "<u4", 4), ("timestamp", "<u8", 8), ("id", "<u4", 16),
                          ("object_kind", "<u4", 20), ("object_id", "V12", 24), ("name", "<u8", 40),
                          ("domain", "<u8", 48)], 56),
    }
