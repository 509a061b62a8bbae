"""The reference's deployment against the run's: `teller diagnose` says when they differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from teller.localize.deployment import deployment_mismatch, deployment_shape, merge_shapes

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"


def test_shape_counts_fe_and_comm_instances_per_step():
    families = ["FE Layer", "COMM all_reduce", "BE aten::mm", "FE Head"]
    # step 0: 2 layers, 1 head, 4 mm; step 1: 2 layers, 1 head; step 2 (warm-up): 5 layers; -1: no step
    family = np.array([0, 0, 3, 2, 2, 2, 2, 0, 0, 3, 0, 0, 0, 0, 0, 1])
    step = np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, -1])
    rank = np.array([0, 0, 0])
    s = deployment_shape(families, family, step, rank, use=np.array([True, True, False]))
    assert s == {"steps": 2, "ranks": 1, "per_step": {"FE Layer": 2.0, "FE Head": 1.0}}  # BE never counts
    assert deployment_shape(families, family, step, rank)["per_step"]["FE Layer"] == 2.0  # median of 2, 2, 5
    two = deployment_shape(families, family, step, np.array([0, 1, 1]))
    assert two["ranks"] == 2


def test_mismatch_lines_ranks_counts_and_tolerance():
    ref = merge_shapes([{"steps": 10, "ranks": 1, "per_step": {"FE Layer": 2.0, "FE Head": 1.0}},
                        {"steps": 12, "ranks": 1, "per_step": {"FE Layer": 2.0}}])
    assert ref == {"runs": 2, "ranks": [1], "per_step": {"FE Head": [0.0, 1.0], "FE Layer": [2.0, 2.0]}}
    same = {"steps": 5, "ranks": 1, "per_step": {"FE Layer": 2.0, "FE Head": 1.0}}
    assert deployment_mismatch(ref, same) == []
    assert deployment_mismatch(ref, {**same, "per_step": {"FE Layer": 3.0}}) == []  # within 2 * 1.25 + 0.5
    deeper = deployment_mismatch(ref, {**same, "per_step": {"FE Layer": 4.0, "FE Head": 1.0}})
    assert len(deeper) == 2 and "FE Layer 4 a step here, 2 in the reference" in deeper[0]
    assert "--reference" in deeper[-1]
    tp = deployment_mismatch(ref, {"steps": 5, "ranks": 2, "per_step": {"FE Layer": 2.0, "COMM all_reduce": 4.0}})
    assert tp[0] == "the run's steps come from 2 rank(s), the reference's from 1"
    assert "COMM all_reduce 4 a step here, 0 in the reference" in tp[1]
    # nothing to compare: a reference without a shape (older localizer), a run without steps
    assert deployment_mismatch(None, same) == [] and deployment_mismatch(ref, {"steps": 0, "ranks": 1, "per_step": {}}) == []


@pytest.mark.parametrize("run, same", [("h200_normal_b", True), ("h200_llama8l_cupti", False), ("h200_tp_straggler", False)])
def test_diagnose_says_when_the_reference_is_another_deployment(tmp_path, run, same):
    """Real H200 recordings: a 2-layer fault-free reference against another 2-layer run (the same
    deployment), the 8-layer model, and a two-rank tensor-parallel run; a saved localizer keeps
    the reference's shape."""
    from teller.localize import fit_localizer
    from teller.report.diagnose import diagnose

    ref, target = tmp_path / "ref", tmp_path / run
    shutil.copytree(EX / "h200_normal_a", ref)
    shutil.copytree(EX / run, target)
    d = diagnose(target, reference=[ref], model=False)
    m = d["reference_match"]
    assert m["same_deployment"] is same
    assert m["reference"]["per_step"]["FE LlamaDecoderLayer"] == [2.0, 2.0] and m["reference"]["ranks"] == [1]
    lines = [x for x in d["health"]["lines"] if x.startswith("reference: ")]
    assert len(lines) == len(m["lines"]) and bool(lines) is not same
    if run == "h200_llama8l_cupti":
        assert m["run"]["per_step"]["FE LlamaDecoderLayer"] == 8.0
        assert "FE LlamaDecoderLayer 8 a step here, 2 in the reference" in m["lines"][0]
    if run == "h200_tp_straggler":
        assert m["run"]["ranks"] == 2 and m["lines"][0].startswith("the run's steps come from 2 rank(s)")
    assert json.loads((target / "diagnosis.json").read_text())["reference_match"]["lines"] == m["lines"]
    if run == "h200_llama8l_cupti":  # the same through a saved localizer
        est = fit_localizer([ref])
        est.save(tmp_path / "loc.npz")
        d2 = diagnose(target, localizer=tmp_path / "loc.npz", model=False, out=tmp_path / "again")
        assert d2["reference_match"]["lines"] == m["lines"]


def test_episodes_and_the_steps_the_model_rules_out():
    """Episodes group a rank's flagged steps (warm-up left out); a step the model rules out is a
    fault of an unknown kind when it lies in an episode of 5+ (4+ with the model's own floor)
    against a reference of the run's deployment and the model gives it at least its floor, else a
    numeric outlier the model reads as normal."""
    from teller.report.diagnose import EPISODE_MIN, mark_episodes, ruled_out

    def step(i, num, rank, flag, warm=False):
        return {"index": i, "step_num": num, "rank": rank, "flag": flag, "warmup": warm,
                "start_ns": num * 10 + rank, "end_ns": num * 10 + rank + 5}

    flags = {0: [0, 1, 3, 4, 5, 6, 7, 12], 1: [2, 4]}  # rank 0: 0 is warm-up; 1, 3–7 one episode; 12 alone
    diag = {"steps": [step(i, n, r, n in flags[r], warm=n == 0) for i, (r, n) in enumerate((r, n) for r in (0, 1) for n in range(14))]}
    mark_episodes(diag)
    by = {(d["rank"], d["step_num"]): d for d in diag["steps"]}
    assert [(e["rank"], e["first_step"], e["last_step"], e["steps"]) for e in diag["episodes"]] == [
        (0, 1, 7, 6), (1, 2, 4, 2), (0, 12, 12, 1)]
    assert "episode" not in by[(0, 0)] and by[(0, 5)]["episode_length"] == 6 and by[(1, 4)]["episode_length"] == 2
    assert EPISODE_MIN == 5
    for key, same, unknown in (((0, 5), True, True), ((0, 5), False, False), ((0, 12), True, False), ((1, 2), True, False)):
        d = dict(by[key], fault_type="scheduling")
        ruled_out(d, same)
        assert bool(d.get("unknown_fault")) is unknown and bool(d.get("model_says_normal")) is not unknown
        assert (d["fault_type"], d.get("fault_type_guess")) == ((None, "scheduling") if unknown else ("scheduling", None))
    warm = dict(by[(0, 0)], fault_type="kernel", episode_length=9)  # a warm-up step never is one
    ruled_out(warm, True)
    assert warm.get("model_says_normal") and not warm.get("unknown_fault")
    # the model's rule-out floor: in a lasting episode, a step it gives under 1% stays normal
    from teller.rca import EPISODE_FLOOR

    for p, unknown in ((EPISODE_FLOOR / 2, False), (EPISODE_FLOOR, True), (0.05, True), (None, True)):
        d = dict(by[(0, 5)], fault_type="memory", abnormal_probability=p)
        ruled_out(d, True)
        assert bool(d.get("unknown_fault")) is unknown and bool(d.get("model_says_normal")) is not unknown, p
    # the model's own floor where it keeps one: the same probabilities against 0.1
    for p, unknown in ((0.05, False), (0.1, True), (None, True)):
        d = dict(by[(0, 5)], fault_type="memory", abnormal_probability=p)
        ruled_out(d, True, floor=0.1)
        assert bool(d.get("unknown_fault")) is unknown and bool(d.get("model_says_normal")) is not unknown, p
    # an episode of exactly four flags: rank 0's steps 20-23
    four = [step(100 + n, n, 0, True) for n in (20, 21, 22, 23)]
    d4 = {"steps": four}
    mark_episodes(d4)
    assert four[0]["episode_length"] == 4
    ruled_out(four[0], True)
    assert four[0].get("model_says_normal") and not four[0].get("unknown_fault")  # the absolute floor's length: 5
    four[0].pop("model_says_normal")
    ruled_out(four[0], True, floor=0.001, min_length=4)  # a model's own floor, and the length chosen with it
    assert four[0].get("unknown_fault")
    # the step's novelty: at or under LASTING_NOVELTY it is like the training steps and stays
    # normal (near_training); above it, or unknown, the departure stays
    from teller.rca import LASTING_NOVELTY

    assert 0 < LASTING_NOVELTY < 1
    for nov, unknown in ((LASTING_NOVELTY / 2, False), (LASTING_NOVELTY, False), (LASTING_NOVELTY + 0.01, True),
                         (3.0, True), (None, True), (float("nan"), True)):
        d = dict(by[(0, 5)], fault_type="memory", abnormal_probability=0.05)
        ruled_out(d, True, novelty=nov)
        assert bool(d.get("unknown_fault")) is unknown and bool(d.get("model_says_normal")) is not unknown, nov
        assert bool(d.get("near_training")) is (not unknown), nov
    d = dict(by[(0, 12)], fault_type="memory", abnormal_probability=0.05)  # not lasting: normal, but not for its novelty
    ruled_out(d, True, novelty=0.1)
    assert d.get("model_says_normal") and not d.get("near_training")
    d = dict(by[(0, 5)], fault_type="memory", abnormal_probability=0.05)
    ruled_out(d, True, novelty=0.4, min_novelty=0.5)
    assert d.get("near_training") and d.get("model_says_normal")


def test_lasting_novel_steps_take_the_type_the_evidence_points_to():
    """A step the model flags with a type, unlike every training fault (novelty above 1), in an
    episode of 5+ such steps the stage flags with an evidence type, takes the evidence's type (the
    model's kept beside it); 4 in a row, a warm-up step, a step without evidence type, a step the
    model reads as normal and a step of known kind keep theirs."""
    from teller.report.diagnose import novel_types

    def step(i, num, rank, nov, ft="memory", et="runtime", **kw):
        d = {"index": i, "step_num": num, "rank": rank, "flag": True, "stage_flag": True, "fault_type": ft,
             "evidence_type": {"fault_type": et, "family": "BE aten::item", "feature": "self_ns"} if et else None, **kw}
        return d, nov

    rows = [step(k, 10 + k, 0, 2.0) for k in range(6)]  # rank 0: six novel steps, one episode
    rows += [step(10 + k, 10 + k, 1, 1.5) for k in range(4)]  # rank 1: four, too few
    rows += [step(20, 40, 0, 0.5)]  # known kind
    rows += [step(21, 60 + k, 2, 3.0, et=None if k == 2 else "runtime") for k in range(5)]  # rank 2: one without evidence type
    rows += [step(30 + k, 80 + k, 3, 2.5, model_says_normal=k == 0, warmup=k == 4) for k in range(6)]
    rows += [step(40, 90, 4, float("nan"))]
    for k, (d, _) in enumerate(rows):
        d["index"] = k
    steps = [d for d, _ in rows]
    ratio = {d["index"]: r for d, r in rows}
    changed = novel_types(steps, ratio)
    got = {(d["rank"], d["step_num"]): (d["fault_type"], d.get("fault_type_model"), bool(d.get("novel_fault"))) for d in steps}
    assert all(got[(0, 10 + k)] == ("runtime", "memory", True) for k in range(6))
    assert all(got[(1, 10 + k)] == ("memory", None, False) for k in range(4))
    assert got[(0, 40)] == ("memory", None, False)
    assert all(got[(2, 60 + k)][0] == "memory" for k in range(5))  # the step without a type breaks the episode: 2 + 2
    # rank 3: six novel stage flags, the warm-up one out: five in one episode (one step apart at most);
    # the one the model reads as normal keeps its answer
    assert got[(3, 80)] == ("memory", None, False) and all(got[(3, 80 + k)][0] == "runtime" for k in (1, 2, 3, 5))
    assert got[(3, 84)] == ("memory", None, False)  # warm-up
    assert changed == 6 + 4
    assert steps[-1].get("novelty") is None and steps[0]["novelty"] == 2.0
    assert novel_types(steps, {}) == 0


def test_an_episode_takes_the_type_most_of_its_steps_are_given():
    """type_episodes: an episode's type is its steps' majority: the model's type where it keeps the
    step, the evidence's where the model did not read it or takes it for an unknown kind of fault,
    nothing from a step it rules out; ties to the larger summed score."""
    from teller.report.diagnose import mark_episodes, step_type, type_episodes

    ev = {"fault_type": "memory", "family": "FE:x", "feature": "mem_ns", "reason": "r"}

    def step(i, num, rank, **kw):
        return {"index": i, "step_num": num, "rank": rank, "flag": True, "start_ns": num * 10 + rank,
                "end_ns": num * 10 + rank + 5, "score": 0.9, **kw}

    steps = [step(0, 1, 0, fault_type="kernel", evidence_type=ev),
             step(1, 2, 0, fault_type="kernel"),
             step(2, 3, 0, evidence_type=ev),  # not read by the model: the evidence's type
             step(3, 4, 0, fault_type=None, unknown_fault=True, fault_type_guess="kernel", evidence_type=ev),
             step(4, 5, 0, fault_type="kernel", model_says_normal=True, evidence_type=ev),  # no vote
             step(5, 1, 1, fault_type="runtime", score=0.6),
             step(6, 2, 1, evidence_type=dict(ev, fault_type="scheduling"), score=0.7),
             step(7, 9, 1)]  # names no type
    assert [step_type(d) for d in steps] == ["kernel", "kernel", "memory", "memory", None, "runtime", "scheduling", None]
    diag = {"steps": steps}
    mark_episodes(diag)
    type_episodes(diag)
    got = {(e["rank"], e["first_step"]): (e["fault_type"], e["type_votes"]) for e in diag["episodes"]}
    # rank 0: kernel 2 and memory 2 tie, the same score each: the smaller name; rank 1: scheduling outweighs runtime
    assert got == {(0, 1): ("kernel", {"kernel": 2, "memory": 2}), (1, 1): ("scheduling", {"runtime": 1, "scheduling": 1}),
                   (1, 9): (None, {})}
    from teller.report.html import episode_words

    assert [episode_words(e) for e in diag["episodes"]] == [
        "steps 1–5 on rank 0 (5 flagged; kernel, 2 of them)", "steps 1–2 on rank 1 (2 flagged; scheduling, 1 of them)",
        "step 9 on rank 1 (1 flagged)"]
    steps[2]["score"] = steps[3]["score"] = 0.95
    type_episodes(diag)
    assert diag["episodes"][0]["fault_type"] == "memory"
    type_episodes({"steps": [], "episodes": []})  # nothing flagged: nothing to do


def test_report_names_faults_of_an_unknown_kind():
    from report_sample import sample_diagnosis

    from teller.report.diagnose import verdict_line
    from teller.report.html import render_html

    d = sample_diagnosis()
    x = next(s for s in d["steps"] if s.get("model_says_normal"))
    x.pop("model_says_normal")
    x.update(unknown_fault=True, fault_type_guess=x.get("fault_type"), fault_type=None, episode_length=7, explanation=None)
    page = render_html(d)
    assert "Fault of a kind the root-cause model was not trained on" in page and "up to 7 flagged steps in a row" in page
    assert "kept as faults of a kind it was not trained on" in page
    line = verdict_line(x)
    assert "fault of a kind the model was not trained on" in line and "7 flagged steps in a row" in line
