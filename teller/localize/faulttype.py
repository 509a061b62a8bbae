"""The fault type the numeric stage's evidence points to (docs/design.md §6, "Fault type from the evidence").

The five fault types of docs/faults.md are defined by where a fault spends its time, so the
stage can name one without a trained model: the layer of the step's most suspicious family and
the feature by which its most deviating instance departs from the reference decide it.

=======================  ==================================================================  ===============
evidence                 what it means                                                       type
=======================  ==================================================================  ===============
a COMM family, or        the time went to collectives                                        communication
``comm_ns``/``comm_bytes``
``k_ns``, ``k_n``,       the GPU work of the operator grew or ran longer                     kernel
``overlap``, ``iter.gpu_busy``
``rt_*``, ``drv_*``,     the time went to CUDA runtime/driver calls: synchronisations,       runtime
``sync_ns``, the call    copies, allocations; or more bytes were copied (``mem_bytes``)
mix, ``mem_bytes``
``mem_ns`` (bytes        the same copies took longer: memory bandwidth                       memory
unchanged),
``batch.kv_frac``,       the KV cache was full (requests offloaded)                          memory
``batch.preempted``
``dur_ns``/``self_ns``   host operators' own CPU work ran slower: CPU contention              memory
of an FE/BE operator,
``iter.per_kernel``,
``iter.host_busy``
``dur_ns``/``self_ns``   the engine's own host time around the operators: its loop,          scheduling
of STEP/OTHER/GAP,       scheduler, admission
``iter.gap``,
``iter.schedule``,
``iter.post``,
``iter.dur``,
``iter.admit_delay``,
``batch.waiting``
=======================  ==================================================================  ===============

Before any candidate: a collective that a step runs many more times than the reference's
steps ever did (more than ``COUNT_SLACK`` × its 99th percentile of instances per step, plus
half an instance: a collective split in chunks) is a communication fault, whatever else stands
out. The number of times a step runs a collective is fixed by the deployment (its layers and
ranks), so a step running more of them says the collective path changed; for the same reason
the rule reads only a reference of the step's own deployment (``counts`` of
:func:`step_fault_types`).

A family the reference never saw has no deviation to read; its own time decides: CUDA
runtime/driver calls and synchronisation (``rt_ns + drv_ns + sync_ns``), kernels (``k_ns``),
collectives (``comm_ns``). A new family that is host work only (``aten::split`` before chunked
collectives) says nothing of the cause, so the next candidate decides. Where no candidate
decides, the type is ``None``.

Known limits (docs/results.md measures them): GIL contention (scheduling) slows host operators
as CPU contention (memory) does and is typed memory — neither the spread of the slowdown over the
families nor the time per runtime call tells them apart on the labelled runs (docs/results.md,
"GIL or CPU contention: what the evidence can tell"), so a call typed memory by a host
operator's own time names scheduling as its :attr:`TypeCall.alternative`; a co-located GPU
process slows a host-bound engine's host side more than its kernels and is typed by that host
evidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from teller.localize.features import FEATURES, MIX_FEATURES, Instances
from teller.reconstruct._np import cumcount, segment_starts

if TYPE_CHECKING:
    from teller.localize import Localization
    from teller.localize.gmm import GMMLocalizer

__all__ = ["ALTERNATIVES", "TYPES", "TypeCall", "feature_type", "step_fault_types"]

#: The five fault types (docs/faults.md), as the labels name them.
TYPES = ("communication", "kernel", "memory", "runtime", "scheduling")

_HOST_LAYERS = ("STEP", "OTHER", "GAP")
_KERNEL = ("k_ns", "k_n", "overlap", "iter.gpu_busy")
_RUNTIME = ("rt_ns", "rt_n", "drv_ns", "drv_n", "sync_ns", "mem_bytes", *MIX_FEATURES)
_COMM = ("comm_ns", "comm_bytes")
_KV = ("batch.kv_frac", "batch.preempted")
_HOST_PACE = ("iter.per_kernel", "iter.host_busy")
_ENGINE = ("iter.gap", "iter.schedule", "iter.post", "iter.dur", "iter.admit_delay", "batch.waiting")
#: Phrases of the reasons, per type.
WHY = {"communication": "the time went to collectives",
       "kernel": "its GPU work grew or ran longer",
       "runtime": "the time went to CUDA runtime/driver calls (synchronisation, copies, allocation)",
       "memory": "resources ran short (copy bandwidth, KV cache or host CPU)",
       "scheduling": "the engine's own host time around the operators grew"}
#: Types the evidence cannot rule out beside the one it points to: (type, what decided it) →
#: (the other type, why). A host operator's own time grows alike when other processes take its
#: cores (memory) and when a thread of the engine's process holds the GIL (scheduling).
ALTERNATIVES = {("memory", "host"): ("scheduling", "a thread of the engine's process holding the GIL slows host "
                                                   "operators the same way")}
#: Candidates read per step at most.
MAX_CANDIDATES = 3
#: A step's instances of a COMM family beyond this factor of the reference's 99th percentile
#: per step (plus half an instance) decide communication.
COUNT_SLACK = 1.5


@dataclass(frozen=True)
class TypeCall:
    """The type one step's evidence points to, with the family and feature that decided it."""

    fault_type: str | None
    family: str = ""
    feature: str = ""

    def _alternative(self) -> tuple[str, str] | None:
        """This evidence's entry of :data:`ALTERNATIVES` (the other type, why), or None."""
        host = self.feature in _HOST_PACE or (self.feature in ("dur_ns", "self_ns") and _layer(self.family) in ("FE", "BE"))
        return ALTERNATIVES.get((self.fault_type, "host")) if host else None

    @property
    def alternative(self) -> str | None:
        """The other type this evidence cannot rule out (:data:`ALTERNATIVES`), or None."""
        got = self._alternative()
        return got[0] if got else None

    def reason(self) -> str:
        """One line: which evidence decided the type and what it means (and the type it cannot
        rule out, where there is one)."""
        if self.fault_type is None:
            return "no candidate's evidence points to a fault type"
        what = {"family": "a family not in the reference",
                "count": "more instances in the step than the reference's steps had"}.get(self.feature, self.feature)
        out = f"{self.fault_type}: {self.family} ({what}): {WHY[self.fault_type]}"
        alt = self._alternative()
        if alt is not None:
            out += f"; or {alt[0]}: {alt[1]}"
        return out


def feature_type(layer: str, feature: str, features: set[str] = frozenset()) -> str | None:
    """The type a deviating ``feature`` of an instance of ``layer`` points to (the table above);
    ``features``: every feature that instance deviates by (``mem_ns`` reads as runtime when the
    bytes grew too)."""
    if layer == "COMM" or feature in _COMM:
        return "communication"
    if feature in _KERNEL:
        return "kernel"
    if feature == "mem_ns":
        return "runtime" if "mem_bytes" in features else "memory"
    if feature in _RUNTIME:
        return "runtime"
    if feature in _KV:
        return "memory"
    if feature in _ENGINE:
        return "scheduling"
    if feature in _HOST_PACE:
        return "memory"
    if feature in ("dur_ns", "self_ns"):
        return "scheduling" if layer in _HOST_LAYERS else "memory"
    return None


_COL = {f: i for i, f in enumerate(FEATURES)}


def unseen_type(layer: str, x: np.ndarray) -> str | None:
    """The type of a family the reference never saw, from its own time (``x``: its row of
    :data:`FEATURES`): runtime calls, kernels or collectives, whichever is largest; None when it
    is host work only."""
    if layer == "COMM":
        return "communication"
    parts = {"runtime": sum(x[_COL[f]] for f in ("rt_ns", "drv_ns", "sync_ns")),
             "kernel": x[_COL["k_ns"]], "communication": x[_COL["comm_ns"]]}
    parts = {k: float(v) for k, v in parts.items() if np.isfinite(v) and v > 0}
    return max(parts, key=parts.get) if parts else None


def _layer(family: str) -> str:
    return family.partition(" ")[0]


def _pairs(loc: Localization, inst: Instances, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per scored step, its ``k`` most suspicious families and each one's most deviating
    instance: (step, family code, instance) rows, by step then suspiciousness."""
    ss = loc.steps
    o = np.lexsort((-np.nan_to_num(ss.sf_susp, nan=-np.inf), ss.sf_step))
    st, fam = ss.sf_step[o], ss.sf_family[o]
    keep = cumcount(st) < k
    st, fam = st[keep], fam[keep]
    # the most deviating instance of each (step, family)
    nf = len(inst.families) + 1
    ikey = inst.step.astype(np.int64) * nf + inst.family
    ok = inst.step >= 0
    io = np.flatnonzero(ok)
    io = io[np.lexsort((-np.nan_to_num(loc.a[io], nan=-np.inf), ikey[io]))]
    head = segment_starts(ikey[io])
    ik, best = ikey[io][head], io[head]
    pos = np.searchsorted(ik, st.astype(np.int64) * nf + fam)
    pos = np.minimum(pos, max(len(ik) - 1, 0))
    found = (len(ik) > 0) & (ik[pos] == st.astype(np.int64) * nf + fam)
    return st[found], fam[found], best[pos[found]]


def comm_count_steps(est: GMMLocalizer, inst: Instances, steps: np.ndarray | None = None) -> dict[int, str]:
    """Steps (among ``steps``, default all) that run a COMM family more than ``COUNT_SLACK`` × the
    reference's 99th percentile of its instances per step, plus half an instance: step → family
    (the one furthest over). Empty for an estimator without per-step counts."""
    p99 = getattr(est, "count_p99_", None)
    if p99 is None or not np.isfinite(p99).any():
        return {}
    fams = np.asarray(inst.families, dtype=object)
    comm = np.flatnonzero(np.char.startswith(fams.astype(str), "COMM ")) if len(fams) else np.zeros(0, np.int64)
    if not len(comm):
        return {}
    codes = est.family_codes(fams[comm])
    bound = np.full(len(fams), np.inf)
    known = codes >= 0
    bound[comm[known]] = p99[codes[known]] * COUNT_SLACK + 0.5
    sel = (inst.step >= 0) & np.isfinite(bound[inst.family])
    if steps is not None:
        sel &= np.isin(inst.step, steps)
    nf = len(fams) + 1
    keys, counts = np.unique(inst.step[sel].astype(np.int64) * nf + inst.family[sel], return_counts=True)
    st, fam = keys // nf, keys % nf
    over = counts / np.maximum(bound[fam], 1.0)
    hit = counts > bound[fam]
    out: dict[int, str] = {}
    best: dict[int, float] = {}
    for s, f, o in zip(st[hit].tolist(), fam[hit].tolist(), over[hit].tolist(), strict=True):
        if o > best.get(s, 0.0):
            best[s], out[s] = o, str(fams[f])
    return out


def step_fault_types(est: GMMLocalizer, inst: Instances, loc: Localization, k: int = MAX_CANDIDATES,
                     flagged_only: bool = False, counts: bool = True) -> dict[int, TypeCall]:
    """For every step :func:`teller.localize.localize` scored (``flagged_only``: every flagged
    one): the type its evidence points to. ``counts``: whether a step running a collective many
    more times than the reference decides communication (:func:`comm_count_steps`); only with a
    reference of the steps' own deployment (another model shape runs another number of
    collectives a step).

    A flagged step reads its candidate families in order, each through its first suspect; any
    other step its ``k`` most suspicious families, each through its most deviating instance. The
    first candidate whose evidence maps to a type (:func:`feature_type`, :func:`unseen_type`)
    decides."""
    from teller.localize import evidence

    plan: dict[int, list[tuple[int, int]]] = {}
    if not flagged_only:
        st, fam, row = _pairs(loc, inst, k)
        for s, f, r in zip(st.tolist(), fam.tolist(), row.tolist(), strict=True):
            plan.setdefault(s, []).append((f, r))
    for s, res in loc.flagged.items():
        rows = []
        for c in res.candidates[:k]:
            mine = [int(i) for i in res.suspects.tolist() if inst.family[i] == c["code"]]
            if mine:
                rows.append((int(c["code"]), mine[0]))
        if rows or flagged_only:
            plan[int(s)] = rows
    counted = comm_count_steps(est, inst, np.asarray(list(plan), np.int64)) if counts else {}
    # steps the count rule decides need no evidence read
    want = np.asarray(sorted({r for s, rows in plan.items() if s not in counted for _, r in rows}), np.int64)
    ev = dict(zip(want.tolist(), evidence(est, inst, loc, want), strict=True)) if len(want) else {}
    out: dict[int, TypeCall] = {}
    for s, rows in plan.items():
        if s in counted:
            out[s] = TypeCall("communication", counted[s], "count")
            continue
        call = TypeCall(None)
        for f, r in rows:
            family = str(inst.families[f])
            layer = _layer(family)
            items = ev.get(r, [])
            if items and items[0]["feature"] == "family":
                t = unseen_type(layer, inst.X[r])
                if t is not None:
                    call = TypeCall(t, family, "family")
                    break
                continue
            names = {e["feature"] for e in items}
            for e in items:
                t = feature_type(layer, e["feature"], names)
                if t is not None:
                    call = TypeCall(t, family, e["feature"])
                    break
            if call.fault_type is not None:
                break
        out[s] = call
    return out
