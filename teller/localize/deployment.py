"""Whether a reference was recorded on the deployment it is used for.

The numeric stage judges a run family by family against its reference. A reference of another
deployment (another model shape, another number of ranks) makes the run's steps differ from it
everywhere, fault or not: fitted on one model shape and applied to another, the stage flagged 347
of 3,894 normal steps where a reference of the run's own shape flags a few percent (docs/results.md,
the workload split and `teller_numeric_deploy`). So the fitted reference keeps its *shape* and
`teller diagnose` compares the run's with it:

- the number of ranks whose steps the run holds;
- per FE and COMM family (the model's modules and its collectives, which follow its layers and
  its parallelism), the median number of its instances in a step.

Warm-up steps are left out on both sides, as the reference leaves them out. A family whose median
count in the run lies outside what the reference runs showed (by more than a quarter and half an
instance), a family the run has every step and the reference never, and a number of ranks the
reference never had each make a line of :func:`deployment_mismatch`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: layers whose per-step instance counts describe the deployment
SHAPE_LAYERS = ("FE", "COMM")
#: tolerance on a family's median count per step: outside [lo / SLACK - 0.5, hi * SLACK + 0.5]
SLACK = 1.25
#: families a mismatch line names (the most different first)
MAX_FAMILIES = 3


def deployment_shape(families: list[str], family: np.ndarray, step: np.ndarray, rank: np.ndarray,
                     use: np.ndarray | None = None) -> dict[str, Any]:
    """The shape of one run from its instances (``families``: names; ``family``: each instance's
    code into them; ``step``: its step, -1 none) and its steps' ``rank``; ``use``: the steps to
    read (default all). Returns ``{"steps", "ranks", "per_step": {family: median count}}``, the
    families with a median of at least one instance."""
    n = len(rank)
    considered = np.ones(n, bool) if use is None else np.asarray(use, bool)
    idx = np.flatnonzero(considered)
    ranks = np.unique(np.asarray(rank)[idx]) if len(idx) else np.zeros(0)
    codes = np.flatnonzero(np.asarray([str(f).split(" ", 1)[0] in SHAPE_LAYERS for f in families], bool))
    k = len(codes)
    remap = np.full(len(families) + 1, -1, np.int64)
    remap[codes] = np.arange(k)
    fam = remap[np.asarray(family, np.int64)] if len(family) else np.zeros(0, np.int64)
    st = np.asarray(step, np.int64)
    pos = np.full(n + 1, -1, np.int64)
    pos[idx] = np.arange(len(idx))
    at = pos[np.where(st >= 0, st, n)]
    sel = (fam >= 0) & (at >= 0)
    per_step: dict[str, float] = {}
    if len(idx) and k:
        counts = np.bincount(at[sel] * k + fam[sel], minlength=len(idx) * k).reshape(len(idx), k)
        med = np.median(counts, axis=0)
        per_step = {str(families[c]): float(m) for c, m in zip(codes.tolist(), med.tolist(), strict=True) if m >= 1}
    return {"steps": int(len(idx)), "ranks": int(max(len(ranks), 1)), "per_step": per_step}


def merge_shapes(shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """The reference's shape from its runs' (:func:`deployment_shape`): the numbers of ranks seen
    and, per family, the lowest and highest median count of a run (0 where a run lacks it)."""
    shapes = [s for s in shapes if s.get("steps")]
    fams = sorted(set().union(*(s["per_step"] for s in shapes))) if shapes else []
    return {"runs": len(shapes), "ranks": sorted({int(s["ranks"]) for s in shapes}),
            "per_step": {f: [min(s["per_step"].get(f, 0.0) for s in shapes), max(s["per_step"].get(f, 0.0) for s in shapes)]
                         for f in fams}}


def deployment_mismatch(ref: dict[str, Any] | None, run: dict[str, Any] | None) -> list[str]:
    """Lines saying how the run's deployment differs from its reference's (none: the same, or
    nothing to compare: a reference fitted before shapes were kept, a run without steps)."""
    if not ref or not ref.get("runs") or not run or not run.get("steps"):
        return []
    lines: list[str] = []
    if run["ranks"] not in ref["ranks"]:
        lines.append(f"the run's steps come from {run['ranks']} rank(s), the reference's from "
                     f"{' or '.join(str(r) for r in ref['ranks'])}")
    diffs = []
    for f in sorted(set(ref["per_step"]) | set(run["per_step"])):
        lo, hi = ref["per_step"].get(f, [0.0, 0.0])
        v = float(run["per_step"].get(f, 0.0))
        if v < lo / SLACK - 0.5 or v > hi * SLACK + 0.5:
            far = max(v, hi) / max(min(v, lo), 0.5)
            diffs.append((far, f, v, lo, hi))
    if diffs:
        diffs.sort(key=lambda x: (-x[0], x[1]))
        named = "; ".join(f"{f} {v:g} a step here, {lo:g}" + (f"–{hi:g}" if hi != lo else "") + " in the reference"
                          for _, f, v, lo, hi in diffs[:MAX_FAMILIES])
        more = f" (and {len(diffs) - MAX_FAMILIES} more)" if len(diffs) > MAX_FAMILIES else ""
        lines.append(f"{len(diffs)} operator famil{'y runs' if len(diffs) == 1 else 'ies run'} a different number of "
                     f"times per step than in the reference: {named}{more}")
    if lines:
        lines.append("the reference is not of this run's deployment (model shape, ranks): its flags then measure the "
                     "difference between deployments as well as faults; record a fault-free run of this deployment "
                     "(`teller record -o REF -- CMD`) and pass it with --reference")
    return lines
