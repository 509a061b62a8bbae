"""Measured effect of each applied fault window: step latency, step GPU time, targeted time, in vs. out.

Used by the tests of the mechanisms and by ``benchmarks/fault_effects.py`` and
``benchmarks/gpu_fault_effects.py`` (the effect-size tables of docs/faults.md). A window's steps
are those :func:`teller.inject.labels.window_cover` assigns to it (the labeller's rule); its
baseline is either the run's own steps outside every window in the same scope, less the warm-up
steps (as in the labeller's reference), or a fault-free reference run (``reference``), which is
what whole-run mechanisms (``kv_cache_pressure``) need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from teller.inject.labels import StepMeasures, window_cover
from teller.inject.mechanisms import registry


def _q(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) / 1e6 if len(x) else float("nan")


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    return {f"{prefix}_n": int(len(x)), f"{prefix}_p50_ms": _q(x, 50), f"{prefix}_p99_ms": _q(x, 99),
            f"{prefix}_mean_ms": float(np.mean(x)) / 1e6 if len(x) else float("nan")}


def window_effects(run: str | Path, reference: str | Path | None = None) -> list[dict[str, Any]]:
    """One dict per applied window of a labelled run: step latency (p50/p99/mean, ms) and step GPU
    time (p50/p99, ms) inside the window vs. the baseline, the targeted families' summed host and
    GPU time per step, per-rank COMM time, and the families whose host / GPU time grew most.

    The baseline is the run's own steps outside every window (same scope as the window, warm-up
    steps left out: :func:`teller.inject.labels.warmup_steps`) unless
    ``reference`` (a fault-free run directory) is given or the window spans the whole run.
    """
    reg = registry()
    labels = json.loads((Path(run) / "labels.json").read_text())
    sm = StepMeasures(run)
    wins = [w for w in labels.get("windows", []) if w.get("start_tau_ns") is not None]
    plan = {p["id"]: p for p in labels.get("plan", [])}
    covers = [window_cover(sm, w, reg) for w in wins]
    in_any = np.any(covers, axis=0) if covers else np.zeros(len(sm.step_id), bool)
    ref = StepMeasures(reference) if reference is not None else None
    out = []
    for w, c in zip(wins, covers, strict=True):
        m = reg.get(w["mechanism"])
        scope = np.ones(len(c), bool) if m is None or window_scope_all(m) else sm.pid == int(w.get("pid", -1))
        base_src, base = (ref, ~ref.warmup) if ref is not None else (sm, scope & ~in_any & ~sm.warmup)
        p = plan.get(w["id"], {})
        row: dict[str, Any] = {"run_id": labels.get("run_id"), "window": w["id"], "mechanism": w["mechanism"],
                               "category": w.get("category"), "magnitude": w.get("magnitude"),
                               "implementation": w.get("implementation") or p.get("implementation"),
                               "injections": w.get("injections", 0), "targets_hit": w.get("targets_hit", []),
                               "baseline": "reference run" if ref is not None else "own steps outside the windows"}
        row.update(_stats("in", sm.duration[c].astype(float)))
        row.update(_stats("out", base_src.duration[base].astype(float)))
        for side, x in (("in", sm.gpu[c]), ("out", base_src.gpu[base])):
            row[f"gpu_{side}_p50_ms"], row[f"gpu_{side}_p99_ms"] = _q(x, 50), _q(x, 99)
        fams = sm.families_matching(list(w.get("targets_hit") or []) + list(w.get("targets") or (m.targets if m else ())))
        if fams:
            row["target_families"] = fams
            row["target_in_p50_ms"] = _q(sm.family_columns(fams)[c], 50)
            row["target_out_p50_ms"] = _q(base_src.family_columns(fams)[base], 50)
            row["target_gpu_in_p50_ms"] = _q(sm.family_columns(fams, device=True)[c], 50)
            row["target_gpu_out_p50_ms"] = _q(base_src.family_columns(fams, device=True)[base], 50)
        for rk in sorted(set(sm.rank[c].tolist())) if sm.comm.any() else []:
            ci, bi = c & (sm.rank == rk), base & (base_src.rank == rk)
            row[f"comm_in_p50_ms_rank{rk}"] = _q(sm.comm[ci], 50)
            row[f"comm_out_p50_ms_rank{rk}"] = _q(base_src.comm[bi], 50)
        row["affected_layers"] = layer_excess(sm, c, base_src, base)
        row["affected_layers_gpu"] = layer_excess(sm, c, base_src, base, device=True)
        out.append(row)
    return out


def window_scope_all(m: Any) -> bool:
    """Whether a mechanism's window covers every process of the run (not only the agent's)."""
    return m.where in ("co_located", "workload") or m.evidence == "comm"


def layer_excess(sm: StepMeasures, c: np.ndarray, src: StepMeasures, base: np.ndarray, top: int = 3,
                 device: bool = False) -> list[str]:
    """Families whose median per-step time grew most inside the window (ms of growth, largest
    first); with ``device`` the GPU time of their subtrees instead of their host time."""
    if not c.any() or not base.any() or not len(sm.families):
        return []
    m, ms = (sm.fam_gpu, src.fam_gpu) if device else (sm.fam_time, src.fam_time)
    fin = np.median(m[c], axis=0)
    j = np.array([src.fam_index.get(f, -1) for f in sm.families.astype(str)], dtype=np.int64)
    fout = np.where(j >= 0, np.median(ms[base], axis=0)[np.maximum(j, 0)], 0.0) if ms.shape[1] else np.zeros(len(j))
    grow = fin - fout
    order = np.argsort(-grow)[:top]
    return [f"{sm.families[i]} +{grow[i] / 1e6:.2f} ms" for i in order if grow[i] > 0]
