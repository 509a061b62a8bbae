"""The fault type the numeric stage's evidence points to (teller.localize.faulttype)."""

from __future__ import annotations

import numpy as np
import pytest

from teller.localize.faulttype import TYPES, TypeCall, feature_type, unseen_type
from teller.localize.features import FEATURES


@pytest.mark.parametrize("layer, feature, others, want", [
    ("COMM", "dur_ns", set(), "communication"),  # any excess of a collective
    ("COMM", "rt_ns", set(), "communication"),
    ("STEP", "comm_ns", set(), "communication"),  # a step's collectives together
    ("FE", "k_ns", set(), "kernel"),  # the GPU work of a module
    ("STEP", "iter.gpu_busy", set(), "kernel"),
    ("BE", "sync_ns", set(), "runtime"),
    ("OTHER", "memcpy_sync_ns", set(), "runtime"),
    ("STEP", "alloc_n", set(), "runtime"),
    ("BE", "mem_bytes", set(), "runtime"),  # more bytes copied: the software copies more
    ("BE", "mem_ns", {"mem_ns", "mem_bytes"}, "runtime"),
    ("BE", "mem_ns", {"mem_ns"}, "memory"),  # the same bytes, slower: bandwidth
    ("STEP", "batch.kv_frac", set(), "memory"),
    ("STEP", "batch.preempted", set(), "memory"),
    ("BE", "dur_ns", set(), "memory"),  # a host operator's own CPU work slower: CPU contention
    ("FE", "self_ns", set(), "memory"),
    ("STEP", "iter.per_kernel", set(), "memory"),
    ("STEP", "self_ns", set(), "scheduling"),  # time in the step outside every recorded child
    ("OTHER", "dur_ns", set(), "scheduling"),
    ("GAP", "dur_ns", set(), "scheduling"),
    ("STEP", "iter.gap", set(), "scheduling"),
    ("STEP", "iter.admit_delay", set(), "scheduling"),
    ("STEP", "batch.n_requests", set(), None),  # the batch's size says nothing of a cause
    ("FE", "family", set(), None),
])
def test_feature_type_table(layer, feature, others, want):
    assert feature_type(layer, feature, others) == want
    assert want is None or want in TYPES


def _row(**kv: float) -> np.ndarray:
    x = np.zeros(len(FEATURES))
    for k, v in kv.items():
        x[FEATURES.index(k)] = v
    return x


def test_unseen_family_is_typed_by_its_own_time():
    # a forced read-back (aten::_local_scalar_dense): copy and synchronisation in runtime calls
    assert unseen_type("BE", _row(dur_ns=213e3, self_ns=13e3, rt_ns=200e3, sync_ns=190e3, mem_ns=1.5e3)) == "runtime"
    assert unseen_type("BE", _row(dur_ns=50e3, rt_ns=5e3, k_ns=40e3)) == "kernel"
    assert unseen_type("FE", _row(dur_ns=50e3, comm_ns=45e3, rt_ns=1e3)) == "communication"
    assert unseen_type("COMM", _row(dur_ns=5e3)) == "communication"
    # host work only (aten::split before chunked collectives) decides nothing
    assert unseen_type("BE", _row(dur_ns=38e3, self_ns=38e3)) is None
    x = _row(dur_ns=10e3)
    x[FEATURES.index("k_ns")] = np.nan  # a step recorded without detail
    assert unseen_type("BE", x) is None


def test_type_call_reason_names_the_evidence():
    assert TypeCall("runtime", "BE aten::item", "family").reason().startswith(
        "runtime: BE aten::item (a family not in the reference)")
    assert "CUDA runtime" in TypeCall("runtime", "BE aten::item", "family").reason()
    assert TypeCall("kernel", "FE LlamaMLP", "k_ns").reason().startswith("kernel: FE LlamaMLP (k_ns)")
    assert TypeCall(None).reason() == "no candidate's evidence points to a fault type"
