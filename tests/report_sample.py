"""A diagnosis dict shaped as diagnosis.json (docs/design.md §15), built by hand so the report
tests run without the pipeline: two ranks, steps flagged with and without a root-cause model
verdict, operator names holding ``<``, ``>``, ``&`` and quotes."""

from __future__ import annotations

from typing import Any

NASTY = 'aten::<lambda>&"x"'
NASTY_MODULE = "FE Mod<&>"


def _slice(step_start: int, suspect_id: int, name: str) -> dict[str, Any]:
    nodes = [
        {"id": suspect_id - 3, "parent": -1, "layer": "STEP", "name": "STEP id=3", "start_ns": step_start,
         "dur_ns": 9_000_000, "reference_dur_ns": 4_000_000.0, "relevance": 0.0, "suspect": False},
        {"id": suspect_id - 2, "parent": suspect_id - 3, "layer": "FE", "name": NASTY_MODULE, "start_ns": step_start + 10,
         "dur_ns": 6_000_000, "reference_dur_ns": 1_000_000.0, "relevance": 0.0, "suspect": False},
        {"id": suspect_id, "parent": suspect_id - 2, "layer": "BE", "name": name, "start_ns": step_start + 20,
         "dur_ns": 5_000_000, "reference_dur_ns": 100_000.0, "relevance": 1.8, "suspect": True},
        {"id": suspect_id + 1, "parent": suspect_id, "layer": "RT", "name": "cudaLaunchKernel", "start_ns": step_start + 30,
         "dur_ns": 6_000, "reference_dur_ns": None, "relevance": 0.64, "suspect": False},
        {"id": suspect_id + 2, "parent": suspect_id + 1, "layer": "K", "name": "void gemm<float, 128>(…)",
         "start_ns": step_start + 40, "dur_ns": 4_900_000, "reference_dur_ns": None, "relevance": 0.51, "suspect": False},
    ]
    return {"nodes": nodes, "edges": {"p": [], "t": [], "c": []}, "dropped": 0, "info": {}}


def sample_diagnosis(n_steps: int = 40, flagged: tuple[int, ...] = (3, 17, 18, 30), model: bool = True,
                     ranks: int = 2) -> dict[str, Any]:
    """``n_steps`` steps per rank, 10 ms apart; the steps numbered in ``flagged`` flagged on rank 0:
    with ``model`` the first two get a kernel fault, the third is read as normal, the others get
    a scheduling fault; without, all carry the numeric stage's evidence only."""
    steps = []
    idx = 0
    for num in range(n_steps):
        for r in range(ranks):
            start = num * 10_000_000 + r * 1000
            s: dict[str, Any] = {
                "index": idx, "step_num": num, "rank": r, "node_id": 1000 * idx, "name": f"STEP id={num}",
                "start_ns": start, "end_ns": start + 4_000_000, "instances": 12,
                "score": None if num == 5 else round(0.02 + 0.9 * (num % 7 == 0) * 0.3, 4),
                "flag": False, "top_family": "FE LlamaMLP", "warmup": False,
            }
            if num in flagged and r == 0:
                k = flagged.index(num)
                sid = 1000 * idx + 10
                s.update({
                    "flag": True, "score": 0.99 - 0.01 * k, "end_ns": start + 9_000_000,
                    "requests": [f"req_{i}" for i in range(3)],
                    "candidates": [{"family": f"BE {NASTY}", "suspiciousness": 0.97, "shift": 3.0, "instances": 2,
                                    "max_a": 1.0, "unseen": False}],
                    "suspects": [{"node_id": sid, "family": f"BE {NASTY}", "layer": "BE", "name": NASTY,
                                  "start_ns": start + 20, "dur_ns": 5_000_000, "a": 1.0, "distance": 400.0,
                                  "collective": False,
                                  "evidence": [{"feature": "dur_ns", "value": 5_000_000.0, "reference": 100_000.0,
                                                "ratio": 50.0, "z": 24.5},
                                               {"feature": "k_ns", "value": 4_900_000.0, "reference": 90_000.0,
                                                "ratio": 54.4, "z": 20.1}],
                                  "module": {"node_id": sid - 2, "family": NASTY_MODULE}}],
                    "modules": [NASTY_MODULE], "explained": [],
                    "slice": _slice(start, sid, NASTY),
                })
                if model:
                    if k < 2:
                        s.update({"abnormal_probability": 0.98, "fault_type": "kernel", "fault_probability": 0.91 + 0.04 * k,
                                  "evidence_operators": [{"node_id": sid - 2, "name": NASTY_MODULE}],
                                  "evidence_families": [NASTY_MODULE],
                                  "explanation": f"CUDA/kernel fault in step {num} on rank 0: evidence {NASTY_MODULE}; "
                                                 "measured: duration 5.00 ms vs 100.0 µs. Cause: <slow> & late."})
                    elif k == 2:
                        s.update({"abnormal_probability": 0.06, "fault_type": "kernel", "fault_probability": None,
                                  "model_says_normal": True, "evidence_operators": [], "evidence_families": [],
                                  "explanation": None})
                    else:
                        s.update({"abnormal_probability": 0.9, "fault_type": "scheduling", "fault_probability": 0.7,
                                  "evidence_operators": [{"node_id": sid - 3, "name": "STEP id=3"}],
                                  "evidence_families": ["STEP"],
                                  "explanation": f"scheduling/software fault in step {num} on rank 0: evidence STEP."})
            steps.append(s)
            idx += 1
    nf = sum(1 for s in steps if s["flag"])
    diag: dict[str, Any] = {
        "format": "teller.diagnosis", "version": 1, "tool_version": "0", "run": "runs/<bad>&run",
        "reference": "reference runs/normal", "steps_rule": {"rule": "STEP ranges", "detail": ""},
        "instance_layers": ["FE", "BE", "COMM"], "features": ["dur_ns", "k_ns"],
        "summary": {"steps": len(steps), "steps_scored": len(steps) - ranks, "steps_flagged": nf,
                    "unseen_families": []},
        "steps": steps,
    }
    if model:
        diag["model"] = {"path": "teller/rca/default", "variant": "mot", "dataset": "data/h200_v1", "split": "request"}
    return diag
