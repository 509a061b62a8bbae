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


@pytest.mark.parametrize("call, alt", [
    # a host operator's own time: CPU contention (memory) or a thread holding the GIL (scheduling)
    (TypeCall("memory", "BE aten::mm", "self_ns"), "scheduling"),
    (TypeCall("memory", "FE LlamaAttention", "dur_ns"), "scheduling"),
    (TypeCall("memory", "STEP", "iter.per_kernel"), "scheduling"),
    (TypeCall("memory", "STEP", "iter.host_busy"), "scheduling"),
    # copy bandwidth and a full KV cache are memory whatever runs on the host
    (TypeCall("memory", "BE aten::copy_", "mem_ns"), None),
    (TypeCall("memory", "STEP", "batch.kv_frac"), None),
    (TypeCall("memory", "RT cudaLaunchKernel", "dur_ns"), None),  # only what was measured: FE/BE operators
    # the engine's own time and other types have none
    (TypeCall("scheduling", "STEP", "self_ns"), None),
    (TypeCall("scheduling", "GAP", "dur_ns"), None),
    (TypeCall("kernel", "FE LlamaMLP", "k_ns"), None),
    (TypeCall("communication", "COMM all_reduce", "dur_ns"), None),
    (TypeCall(None), None),
])
def test_type_call_alternative(call, alt):
    assert call.alternative == alt
    if alt is None:
        assert "; or " not in call.reason()
    else:
        assert call.reason().startswith(f"memory: {call.family} ({call.feature}): ")
        assert call.reason().endswith("; or scheduling: a thread of the engine's process holding the GIL slows host "
                                      "operators the same way")


def test_step_count_p99_hand_case():
    from teller.localize.gmm import step_count_p99

    # family 0: 2 instances in each of steps 0-2 and 5 in step 3; family 1: once in step 0; family 2: none
    fam = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])
    step = np.array([0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 3, 0])
    got = step_count_p99(fam, step, 3)
    # the lower 99th-percentile order statistic of (2, 2, 2, 5) is the third: 2
    assert got[0] == 2 and got[1] == 1 and np.isnan(got[2])
    # 99 steps of 2 instances and one of 50: one odd step in a hundred does not raise it
    step100 = np.r_[np.repeat(np.arange(99), 2), np.full(50, 99)]
    assert step_count_p99(np.zeros(len(step100), np.int64), step100, 1)[0] == 2
    assert np.isnan(step_count_p99(fam, None, 3)).all()  # no steps: unknown
    steps_out = np.full(len(fam), -1)
    assert np.isnan(step_count_p99(fam, steps_out, 3)).all()


class _Est:
    """The two things comm_count_steps reads of a fitted localizer."""

    def __init__(self, families, p99):
        self.families_ = np.asarray(families)
        self.count_p99_ = np.asarray(p99, float)

    def family_codes(self, names):
        pos = {f: i for i, f in enumerate(self.families_.tolist())}
        return np.asarray([pos.get(str(n), -1) for n in names])


def _instances(families, family, step):
    from teller.localize.features import Instances

    n = len(family)
    return Instances(rows=np.arange(n), family=np.asarray(family, np.int32), families=list(families),
                     step=np.asarray(step), X=np.zeros((n, len(FEATURES))), parent=np.full(n, -1), layers=("FE", "BE", "COMM"))


def test_a_step_running_a_collective_many_more_times_is_a_communication_fault():
    from teller.localize.faulttype import COUNT_SLACK, comm_count_steps

    fams = ["COMM all_reduce", "FE LlamaMLP", "COMM send"]
    est = _Est(["COMM all_reduce", "FE LlamaMLP"], [8, 2])  # the reference: 8 all_reduce, 2 MLP a step
    bound = 8 * COUNT_SLACK + 0.5
    n_over = int(bound) + 1
    family = [0] * 8 + [0] * n_over + [1] * 40 + [2] * 50
    step = [0] * 8 + [1] * n_over + [2] * 40 + [3] * 50
    inst = _instances(fams, family, step)
    got = comm_count_steps(est, inst)
    # step 0 runs as many as the reference; step 1 more than the bound; an FE module run 20 times
    # more (step 2) is no collective; a collective the reference never had (step 3) has no count
    assert got == {1: "COMM all_reduce"}
    assert comm_count_steps(est, inst, np.array([0, 2])) == {}
    fewer = _instances(fams, [0] * int(bound), [5] * int(bound))  # at the bound: not over
    assert comm_count_steps(est, fewer) == {}
    assert comm_count_steps(_Est(["COMM all_reduce"], [np.nan]), inst) == {}  # an artefact without counts
    assert TypeCall("communication", "COMM all_reduce", "count").reason().startswith(
        "communication: COMM all_reduce (more instances in the step than the reference's steps had)")
