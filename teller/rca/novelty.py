"""How unlike a unit is to every step the model was trained on (docs/design.md §9, "Novelty").

The fault head names one of the five types it learnt from the training faults. On a fault of a
kind it never saw (the mechanism split's held-out mechanisms) it still flags many of the steps,
but the type it names is the closest it knows, and mostly wrong: on the union's mechanism split
a host synchronisation hidden in the forward pass read as a memory fault, a throttled link
between ranks as a scheduling one (docs/results.md). The numeric stage's evidence points to a
type from the operator that departs (:mod:`teller.localize.faulttype`), with no training faults
behind it, and there it was mostly right.

This module says when the model is on such ground. A unit's shape-free context
(:mod:`teller.rca.context`: the engine iteration around it and its layer mix against its own run)
is scaled robustly against the training units of its view, faults and normal steps (median and
interquartile range per column, clipped to ±:data:`CLIP`, unknown values at the median); its
**novelty** is the distance to its :data:`NOVELTY_K`-th nearest training unit, divided by the
:data:`NOVELTY_QUANTILE` quantile of that distance over the val part's units (steps of the
kinds trained on, held out). Above 1 the unit is further from every training step than 99 in
100 held-out steps are. A fault of a new kind is unlike both the faults and the normal steps
trained on; a normal step that the stage flags against a reference unlike it is mostly near the
normal training steps. `teller diagnose` takes the type the stage's evidence points to for a
step the model flags where novel steps the stage flags last (an episode of
:data:`teller.localize.episodes.MIN_EPISODE` or more): a new kind of fault lasts, a stray step
unlike the training mostly does not.

Saved as ``novelty.safetensors`` beside the weights (per view: the scaled training units, at
most :data:`MAX_REFS`, the centre and scale; the cut in the metadata); ``config.json``'s
``calibration`` holds the block it was fitted from (:func:`teller.rca.train.fit_novelty`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from teller.errors import InputError, TellerError

#: the file in a model directory
NOVELTY_FILE = "novelty.safetensors"
#: the neighbour whose distance is a unit's novelty (the k-th nearest training unit)
NOVELTY_K = 5
#: the quantile of the val part's units' distances that a novel unit exceeds
NOVELTY_QUANTILE = 0.99
#: scaled values are clipped to ±CLIP (one column cannot decide the distance alone)
CLIP = 20.0
#: training units kept per view (a sample beyond it)
MAX_REFS = 6000
#: query rows per block of the distance computation
_BLOCK = 2048


@dataclass
class ViewReference:
    """The training units of one view, scaled (float32, (m, d)), with the scaling and the cut."""

    center: np.ndarray
    scale: np.ndarray
    refs: np.ndarray
    cut: float

    def scaled(self, X: np.ndarray) -> np.ndarray:
        z = (np.asarray(X, np.float64) - self.center) / self.scale
        return np.clip(np.nan_to_num(z, nan=0.0, posinf=CLIP, neginf=-CLIP), -CLIP, CLIP).astype(np.float32)

    def kth(self, Z: np.ndarray, k: int, skip_self: bool = False) -> np.ndarray:
        """(n,) distance of each row of ``Z`` (scaled) to its ``k``-th nearest reference
        (``skip_self``: ``Z`` are the references themselves, their own row left out)."""
        Z = np.asarray(Z, np.float32)
        R = self.refs
        kk = min(k + int(skip_self), len(R)) - 1
        rr = np.einsum("ij,ij->i", R, R, dtype=np.float64)
        out = np.empty(len(Z), np.float64)
        for s in range(0, len(Z), _BLOCK):
            q = Z[s:s + _BLOCK]
            d2 = np.einsum("ij,ij->i", q, q, dtype=np.float64)[:, None] + rr[None, :] - 2.0 * (q.astype(np.float64) @ R.T.astype(np.float64))
            out[s:s + _BLOCK] = np.sqrt(np.maximum(np.partition(d2, kk, axis=1)[:, kk], 0.0))
        return out


class Novelty:
    """Per view, the training units' context and the cut of :meth:`ratio`."""

    def __init__(self, views: dict[str, ViewReference], k: int = NOVELTY_K, quantile: float = NOVELTY_QUANTILE):
        self.views, self.k, self.quantile = dict(views), int(k), float(quantile)

    @classmethod
    def fit(cls, X: np.ndarray, view: Sequence[str], train: np.ndarray, val: np.ndarray, k: int = NOVELTY_K,
            quantile: float = NOVELTY_QUANTILE) -> "Novelty":
        """``X``: the units' context (rows); ``view``: each unit's view; ``train`` / ``val``: masks
        of the reference units and of the held-out units the cut is read on (a view with fewer
        than 20 of those: the reference units' own distances, each without itself)."""
        X = np.asarray(X, np.float64)
        view = np.asarray([str(v) for v in view], dtype=object)
        train, val = np.asarray(train, bool), np.asarray(val, bool)
        if not (len(X) == len(view) == len(train) == len(val)):
            raise TellerError(f"novelty: {len(X)} rows, {len(view)} views, {len(train)} and {len(val)} mask entries")
        if not 0.0 < quantile <= 1.0 or k < 1:
            raise TellerError(f"novelty: k {k} and quantile {quantile}: expected k >= 1 and a quantile in (0, 1]")
        out: dict[str, ViewReference] = {}
        for v in sorted(set(view[train].tolist())):
            tr = train & (view == v)
            if tr.sum() <= k:
                continue
            with np.errstate(all="ignore"):
                xs = X[tr]
                known = np.isfinite(xs).any(0)
                xk = np.where(known, xs, 0.0)  # a column nobody knows: 0, so the NaN statistics stay quiet
                center = np.where(known, np.nanmedian(xk, 0), 0.0)
                q75 = np.where(known, np.nanpercentile(xk, 75, 0), 1.0)
                q25 = np.where(known, np.nanpercentile(xk, 25, 0), 0.0)
            scale = np.where(np.isfinite(q75 - q25) & (q75 - q25 > 1e-9), q75 - q25, 1.0)
            ref = ViewReference(center.astype(np.float64), scale.astype(np.float64), np.zeros((0, X.shape[1]), np.float32), 1.0)
            ref.refs = ref.scaled(xs)
            va = val & (view == v)
            d = ref.kth(ref.scaled(X[va]), k) if va.sum() >= 20 else ref.kth(ref.refs, k, skip_self=True)
            ref.cut = float(max(np.quantile(d, quantile), 1e-9))
            out[v] = ref
        if not out:
            raise TellerError(f"novelty: no view has more than {k} training units ({int(train.sum())} in all)")
        return cls(out, k, quantile)

    def ratio(self, X: np.ndarray, view: Sequence[str] | None = None) -> np.ndarray:
        """(n,) each unit's novelty: its distance to the ``k``-th nearest training unit of its view
        over the view's cut (above 1: novel); NaN for a unit of a view without training units.
        ``view``: each unit's view (None or empty: vertical, one rank's step)."""
        X = np.asarray(X, np.float64)
        vs = np.asarray([str(v) if v else "vertical" for v in (view if view is not None and len(view) else ["vertical"] * len(X))],
                        dtype=object)
        out = np.full(len(X), np.nan)
        for v, ref in self.views.items():
            at = np.flatnonzero(vs == v)
            if len(at):
                out[at] = ref.kth(ref.scaled(X[at]), self.k) / ref.cut
        return out

    def describe(self) -> dict[str, Any]:
        return {"k": self.k, "quantile": self.quantile,
                "views": {v: {"units": int(len(r.refs)), "cut": round(r.cut, 6)} for v, r in self.views.items()}}

    def save(self, directory: str | Path) -> Path:
        from safetensors.numpy import save_file

        path = Path(directory) / NOVELTY_FILE
        tensors: dict[str, np.ndarray] = {}
        for v, r in self.views.items():
            tensors[f"{v}.refs"] = np.ascontiguousarray(r.refs, np.float32)
            tensors[f"{v}.center"] = np.ascontiguousarray(r.center, np.float64)
            tensors[f"{v}.scale"] = np.ascontiguousarray(r.scale, np.float64)
        meta = {"teller": "novelty", "k": str(self.k), "quantile": repr(self.quantile),
                "cuts": json.dumps({v: r.cut for v, r in self.views.items()})}
        save_file(tensors, str(path), metadata=meta)
        path.chmod(0o644)  # readable as the model's other files are
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "Novelty":
        from safetensors import safe_open

        path = Path(directory) / NOVELTY_FILE
        fix = "run `teller rca novelty MODEL DATASET` again"
        if not path.is_file():
            raise InputError(path, "missing, though config.json's calibration has a novelty block", fix)
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                arrays = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # a truncated or foreign file
            raise InputError(path, f"not a readable safetensors file ({e})", fix) from e
        if meta.get("teller") != "novelty":
            raise InputError(path, f"not a novelty reference (metadata {meta.get('teller')!r})", fix)
        try:
            cuts = {str(v): float(c) for v, c in json.loads(meta["cuts"]).items()}
            views = {v: ViewReference(arrays[f"{v}.center"], arrays[f"{v}.scale"], arrays[f"{v}.refs"], cuts[v]) for v in cuts}
            k, q = int(meta["k"]), float(meta["quantile"])
        except (KeyError, ValueError, TypeError) as e:
            raise InputError(path, f"its metadata or tensors are incomplete ({e!r})", fix) from e
        return cls(views, k, q)


def split_novelty(ds: Any, split: str, trace_tok: Any, views: Sequence[str] | None = None,
                  max_refs: int = MAX_REFS, seed: int = 0) -> Novelty:
    """The novelty of a model trained on ``split`` of the dataset ``ds`` (:class:`teller.rca.data.Dataset`):
    the training part's units, its faults and its normal steps (each view apart, ``views``: those
    only; at most ``max_refs`` of a view, a sample drawn with ``seed``), and the cut from the val
    part's. ``trace_tok``: a trace tokenizer to serialize the units for their statistics (they
    count every node of a unit, whatever the tokenizer)."""
    from teller.rca.context import dataset_context_features

    u = ds.units
    allv = np.asarray([str(v) for v in u.view.tolist()], dtype=object)
    keep = np.isin(allv, list(views)) if views else np.ones(len(u), bool)
    tr = np.zeros(len(u), bool)
    va = np.zeros(len(u), bool)
    tr[u.part(split, "train")] = True
    va[u.part(split, "val")] = True
    tr &= keep
    va &= keep
    if not (tr & np.asarray(u.is_anomaly, bool)).any():
        raise TellerError(f"{ds.path}: the {split} split's training part holds no abnormal units: no model was trained on it")
    rng = np.random.default_rng(seed)
    for v in sorted(set(allv[tr].tolist())):  # a sample of a large view's training units
        at = np.flatnonzero(tr & (allv == v))
        if len(at) > max_refs:
            tr[np.setdiff1d(at, rng.choice(at, max_refs, replace=False))] = False
    at = np.flatnonzero(tr | va)
    X = dataset_context_features(ds, at, trace_tok)
    return Novelty.fit(X, allv[at], tr[at], va[at])
