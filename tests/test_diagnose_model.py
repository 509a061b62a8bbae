"""`teller diagnose` with the root-cause model shipped in the package: the bundled H200 op-delay
recording, diagnosed against the two bundled fault-free recordings of the same workload, gets a
fault type, evidence operators of its own tree and a one-sentence explanation per flagged step."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from teller.inject import CATEGORY_TITLES  # noqa: E402
from teller.rca import EPISODE_FLOOR, SCREEN_FLOOR  # noqa: E402
from teller.rca.api import SHARD_BYTES, weight_files  # noqa: E402
from teller.rca.data import FAULT_TYPES  # noqa: E402
from teller.report.diagnose import DEFAULT_MODEL, _ground, diagnose  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"


@pytest.fixture(scope="module")
def diag(tmp_path_factory):
    """The bundled op-delay run diagnosed as `teller diagnose` does by default: the model reads every step."""
    d = tmp_path_factory.mktemp("dm")
    for n in ("h200_faulty_op_delay", "h200_normal_a", "h200_normal_b"):
        shutil.copytree(EX / n, d / n)
    return diagnose(d / "h200_faulty_op_delay", reference=[d / "h200_normal_a", d / "h200_normal_b"]), d


@pytest.fixture(scope="module")
def flagged_diag(diag, tmp_path_factory):
    """The same run with ``--model-reads flagged``: the model screens the stage's flags."""
    _, d = diag
    return diagnose(d / "h200_faulty_op_delay", reference=[d / "h200_normal_a", d / "h200_normal_b"],
                    out=tmp_path_factory.mktemp("flagged"), model_reads="flagged"), d


def _in_window(steps, d):
    """(the steps overlapping the run's op-delay window, those inside it) (labels.json)."""
    labels = json.loads((d / "h200_faulty_op_delay" / "labels.json").read_text())
    (win,) = [w for w in labels["windows"] if w["mechanism"] == "targeted_op_delay"]
    over = [s for s in steps if s["start_ns"] < win["end_tau_ns"] and s["end_ns"] > win["start_tau_ns"]]
    return over, [s for s in over if s["start_ns"] >= win["start_tau_ns"] and s["end_ns"] <= win["end_tau_ns"]]


def _own_nodes(res, d):
    """Every evidence node is a node of its step's own iteration (its tree, schedule, gap)."""
    forest = pq.read_table(d / "h200_faulty_op_delay" / "forest.parquet", columns=["node_id", "step_id", "step_idx"])
    step_of = dict(zip(forest.column("node_id").to_pylist(), forest.column("step_id").to_pylist(), strict=True))
    idx_of = dict(zip(forest.column("node_id").to_pylist(), forest.column("step_idx").to_pylist(), strict=True))
    for s in res["steps"]:
        assert s.get("fault_type") in (*FAULT_TYPES, None)
        for op in s.get("evidence_operators", []):
            n = op["node_id"]
            assert step_of[n] == s["node_id"] or (idx_of[n] is not None and idx_of[n] == idx_of[s["node_id"]])


def test_the_model_reads_every_step_over_time(diag):
    """By default the model reads every step and is read over time: a step is abnormal when the
    model flags it (its cut), when it sits at even odds next to an episode of 5+ of its flags,
    or when the stage flags it inside an episode of 4+ stage flags the model gives at least its floor (a lasting departure it
    does not recognise); the stage's other flags are read as normal. The op-delay window's steps
    are typed kernel at the MLP, with explanations; steps only the model flags get suspects."""
    from teller.localize.episodes import SUSTAIN_FLOOR, over_time
    from teller.rca import DEFAULT_MODEL, episode_floor
    from teller.report.diagnose import OWN_FLOOR_EPISODE_MIN, verdict_line

    res, d = diag
    m = res["model"]
    assert m["reads"] == "every" and m["split"] == "request"
    # the shipped model's own floor (its val part's normal units, the view of one rank's step)
    floor = episode_floor(json.loads((DEFAULT_MODEL / "config.json").read_text()), "vertical")
    assert m["episode_floor"] == floor != EPISODE_FLOOR and m["episode_min"] == OWN_FLOOR_EPISODE_MIN == 4
    steps = res["steps"]
    assert m["steps_read"] == len(steps) and all(s["abnormal_probability"] is not None for s in steps)
    cut = m["abnormal_cut"]
    p = np.array([s["abnormal_probability"] for s in steps])
    rank = np.array([s["rank"] for s in steps])
    num = np.array([s["step_num"] for s in steps])
    again = over_time(rank, num, p >= cut, p)["flag"]  # the same reading from what diagnosis.json holds
    by_model = np.array(["model" in (s.get("flagged_by") or ()) for s in steps])
    assert np.array_equal(again, by_model) and by_model.any()
    verdicts = [s for s in steps if s["flag"] and not s.get("model_says_normal")]
    for s in verdicts:
        if "model" in s["flagged_by"]:
            assert s["abnormal_probability"] >= cut or (s.get("sustained") and s["abnormal_probability"] >= SUSTAIN_FLOOR)
            assert s["fault_type"] and s["evidence_families"]
        else:  # the stage's lasting departure, which the model does not rule out
            assert s["unknown_fault"] and s["stage_episode_length"] >= m["episode_min"] and s["fault_type"] is None
            assert s["abnormal_probability"] >= floor
    for s in steps:
        if s.get("model_says_normal"):
            assert s["stage_flag"] and s["flagged_by"] == ["stage"] and s["abnormal_probability"] < cut
            assert int(s.get("stage_episode_length") or 0) < m["episode_min"] or s["abnormal_probability"] < floor
    # the shipped model keeps its training steps' context: every step it read has its novelty; the
    # delayed operator is a kind it was trained on, so no step takes the evidence's type for it
    assert all(np.isfinite(s["novelty"]) and s["novelty"] >= 0 for s in steps)
    assert m["novel_retyped"] == sum(1 for s in steps if s.get("fault_type_model")) == 0
    # the stage's flags are those of the stage alone: the model's flags only add steps
    alone = diagnose(d / "h200_faulty_op_delay", reference=[d / "h200_normal_a", d / "h200_normal_b"], model=False,
                     out=d / "alone")
    assert [s["flag"] for s in alone["steps"]] == [bool(s.get("stage_flag")) for s in steps]
    assert res["summary"]["stage_flagged"] == alone["summary"]["steps_flagged"]
    assert res["summary"]["steps_flagged"] == sum(s["flag"] for s in steps)
    for s in steps:  # a step only the model flags is localized like the stage's: candidates, suspects, slice
        if s.get("flagged_by") == ["model"] and s["instances"]:
            assert "candidates" in s and "suspects" in s and "slice" in s
    typed = [s for s in verdicts if s.get("fault_type")]
    over, inside = _in_window(typed, d)
    assert len(inside) >= 5 and {s["fault_type"] for s in over} == {"kernel"}
    assert 2 * len([s for s in typed if s not in over]) < len(over)
    _own_nodes(res, d)
    explained = [s for s in typed if s.get("explanation")]
    assert len(explained) == m["explained"] == len(typed)  # fewer than the bound: every one explained
    for s in explained:
        e = s["explanation"]
        assert e.endswith(".") and len(e) < 600 and e.startswith(f"{CATEGORY_TITLES[s['fault_type']]} fault")
        assert f"in step {s['step_num']} on rank {s['rank']}: evidence" in e
        line = verdict_line(s)
        assert "the model is unsure" not in line and e in line
    # the delayed operator is named in most of the window's steps (in its two longest, 0.66 s and
    # 0.75 s, the shipped model names the attention instead)
    assert all(s["explanation"].startswith("CUDA/kernel fault") for s in inside)
    assert 4 * sum("LlamaMLP" in " ".join(s["evidence_families"]) for s in inside) >= 3 * len(inside)
    json.dumps(res)


def test_the_shipped_model_names_kernel_and_the_mlp(flagged_diag):
    res, d = flagged_diag
    parts = weight_files(DEFAULT_MODEL / "model.safetensors")
    assert parts and all(f.stat().st_size <= SHARD_BYTES + (1 << 20) for f in parts)  # no file over the repo's bound
    assert res["model"]["variant"] in ("mot", "single") and res["model"]["reads"] == "flagged"
    assert res["model"]["split"] == "request"  # what it learnt from
    flagged = [s for s in res["steps"] if s["flag"]]
    assert flagged
    typed = [s for s in flagged if s.get("fault_type") and not s.get("model_says_normal")]
    # the model screens the stage's flags: typed from its floor up, read as normal below it
    assert res["model"]["abnormal_floor"] == SCREEN_FLOOR
    read = [s for s in flagged if "abnormal_probability" in s]
    assert read and all((s in typed) == (s["abnormal_probability"] >= SCREEN_FLOOR) for s in read)
    # the fault window of this run is a targeted op delay on the MLP (labels.json)
    in_window, inside = _in_window(typed, d)
    outside = [s for s in typed if s not in in_window]
    # the steps the delay slowed are typed kernel; few typed steps lie outside the window
    assert len(inside) >= 5 and {s["fault_type"] for s in in_window} == {"kernel"}
    # the stage's evidence points there too with no model: the MLP's GPU work grew
    ev_types = [s.get("evidence_type", {}).get("fault_type") for s in inside]
    assert ev_types.count("kernel") >= 0.8 * len(inside), ev_types
    assert 2 * len(outside) < len(in_window)
    _own_nodes(res, d)
    from teller.report.diagnose import verdict_line

    for s in typed:
        # the console line says whether the model is sure of a fault, or kept the stage's flag under its cut
        assert ("the model is unsure" in verdict_line(s)) == (s["abnormal_probability"] < res["model"]["abnormal_cut"])
        # the evidence's type is said beside the model's only where the two differ
        et = s.get("evidence_type")
        assert ("the numeric evidence points to" in verdict_line(s)) == bool(et and et["fault_type"] != s["fault_type"])
        assert s["evidence_families"]
        assert 0.2 <= s["fault_probability"] <= 1 and s["abnormal_probability"] >= SCREEN_FLOOR
        e = s["explanation"]
        assert e.endswith(".") and len(e) < 600 and e.startswith(f"{CATEGORY_TITLES[s['fault_type']]} fault")
        assert f"in step {s['step_num']} on rank {s['rank']}: evidence" in e
        assert "measured:" in e or "the numeric stage's top suspect is" in e  # whose numbers, said
    named = [s for s in inside if "LlamaMLP" in " ".join(s["evidence_families"])]
    assert 4 * len(named) >= 3 * len(inside)  # the delayed operator, in most of the window's steps
    for s in inside:  # a step the window opens in the middle of may be slow for other reasons too
        assert s["explanation"].startswith("CUDA/kernel fault")
    for s in named:
        assert "measured: FE LlamaMLP" in s["explanation"]  # the numbers are those of the named operator
    json.dumps(res)  # JSON-safe


def test_a_workload_the_model_never_saw_is_marked_low_confidence(diag, tmp_path):
    """A training trace (a foreign Kineto file) diagnosed against the bundled serving run: the
    model's vocabulary knows almost none of its operators, so its verdicts are marked off the
    training distribution, on the console and in the report; the bundled run's are not."""
    from rich.console import Console

    from teller.ingest import ingest
    from teller.report.diagnose import OFF_DISTRIBUTION, print_verdicts

    res, d = diag
    typed = [s for s in res["steps"] if s["flag"] and s.get("fault_type")]
    assert typed and all(s["model_unknown_share"] < OFF_DISTRIBUTION and not s.get("model_off_distribution") for s in typed)
    run = tmp_path / "train"
    ingest(Path(__file__).parent / "data" / "external" / "kineto" / "hta_nccl_data_rank0.json.gz", run)
    other = diagnose(run, reference=[d / "h200_normal_a"], out=tmp_path / "o", html=True)
    flagged = [s for s in other["steps"] if s["flag"] and "model_unknown_share" in s]
    assert flagged and all(s["model_unknown_share"] > 0.5 and s["model_off_distribution"] for s in flagged)
    con = Console(record=True, width=400)
    print_verdicts(other, con)
    text = con.export_text()  # every verdict on these steps, typed or normal, is marked
    verdicts = [line for line in text.splitlines() if line.strip().startswith("step ")]
    assert len(verdicts) == len(flagged) and all("low confidence" in line for line in verdicts)
    assert "low confidence" in (tmp_path / "o" / "report.html").read_text()


def test_no_model_leaves_the_numeric_stage(diag, tmp_path):
    _, d = diag
    res = diagnose(d / "h200_faulty_op_delay", reference=[d / "h200_normal_a"], model=False, out=tmp_path)
    assert "model" not in res and not any("fault_type" in s for s in res["steps"])


def test_a_tree_the_model_cannot_read_leaves_the_numeric_verdict(diag, tmp_path, monkeypatch):
    """When the model's input encoding refuses the run's trees (a TellerError from TPE), the
    diagnosis is still written: the numeric stage's verdict, the model marked skipped with why."""
    from teller.errors import TellerError
    from teller.rca.api import RCA

    def refuse(self, *a, **k):
        raise TellerError("subtrees: sequence 0 node 1 breaks the depth-first order TPE needs")

    monkeypatch.setattr(RCA, "inputs", refuse)
    _, d = diag
    notes = []
    res = diagnose(d / "h200_faulty_op_delay", reference=[d / "h200_normal_a"], out=tmp_path, note=notes.append)
    assert "depth-first order" in res["model"]["skipped"] and any("model skipped" in n for n in notes)
    assert any(s["flag"] for s in res["steps"]) and not any("fault_type" in s for s in res["steps"])
    assert json.loads((tmp_path / "diagnosis.json").read_text())["model"]["skipped"] == res["model"]["skipped"]


def test_grounding_keeps_the_mechanism_and_fills_the_rest_from_the_answer():
    st = {"step_num": 7, "rank": 1, "fault_type": "kernel", "evidence_families": ["FE LlamaMLP"],
          "suspects": [{"family": "FE LlamaMLP", "evidence": [
              {"feature": "k_ns", "value": 1.52e6, "reference": 2.27e4, "ratio": 67.0, "z": 24.5}]}]}
    t = ("CUDA/kernel fault (targeted_op_delay) in step54 on rank 0: evidence COMM all_reduce; the kernels took "
         "1.25 ms against a p99 of 0.06 ms. Cause: extra work targetedcuda._ matmuls")
    g = _ground(t, st)
    assert g.startswith("CUDA/kernel fault (targeted_op_delay) in step 7 on rank 1: evidence FE LlamaMLP; measured:")
    assert "1.25" not in g and "1.52 ms" in g and "all_reduce" not in g and "targetedcuda" not in g
    assert "Cause: " in g and g.endswith(".")
    # a mechanism of another type than the fault head's is dropped; a normal step has no sentence
    g2 = _ground("Communication/network fault (straggler_rank) in step 3", st)
    assert "straggler_rank" not in g2 and g2.startswith("CUDA/kernel fault in step 7 on rank 1")
    assert _ground(t, {**st, "fault_type": None}) == ""
    assert re.fullmatch(r"CUDA/kernel fault in step 7 on rank 1: evidence FE LlamaMLP\. "
                        r"Next: check the named operator's kernels against a fault-free run\.",
                        _ground("", {**st, "suspects": []}))
    # numbers of an operator the model does not name are the numeric stage's, and said to be
    other = _ground("", {**st, "evidence_families": ["OTHER update_batch"]})
    assert "evidence OTHER update_batch; the numeric stage's top suspect is FE LlamaMLP: k_ns 1.52 ms" in other
    assert "measured:" not in other
    # a suspect inside a named module gives that module's numbers
    nested = {**st, "evidence_families": ["FE LlamaMLP"], "suspects": [
        {"family": "BE aten::mm", "module": {"family": "FE LlamaAttention"}, "evidence": [
            {"feature": "dur_ns", "value": 9e5, "reference": 1e5, "ratio": 9.0, "z": 9.0}]},
        {"family": "BE aten::mul", "module": {"family": "FE LlamaMLP"}, "evidence": [
            {"feature": "dur_ns", "value": 5e5, "reference": 1e5, "ratio": 5.0, "z": 5.0}]}]}
    assert "measured: BE aten::mul in FE LlamaMLP dur_ns" in _ground("", nested)


def test_grounded_explanations_end_with_a_next_step_of_their_cause():
    """The sentence ends with the kept mechanism's action (else the fault type's), and passes the
    programmatic checks an operator-facing explanation must (anomaly and type stated, actionable,
    one complete sentence)."""
    from teller.evaluate.scores import explanation_checks
    from teller.inject import CATEGORIES, CATEGORY_ACTIONS, CATEGORY_TITLES
    from teller.inject.mechanisms import registry

    reg = registry()
    assert set(CATEGORY_ACTIONS) == set(CATEGORIES) and all(m.action for m in reg.values())
    texts, types = [], []
    for name, m in sorted(reg.items()):
        st = {"step_num": 4, "rank": 0, "fault_type": m.category, "evidence_families": ["FE LlamaMLP"], "suspects": []}
        g = _ground(f"{CATEGORY_TITLES[m.category]} fault ({name}) in step 9", st)
        assert f"({name})" in g and g.endswith(f" Next: {m.action}.")
        texts.append(g)
        types.append(m.category)
    for c in CATEGORIES:  # no mechanism named: the type's next step
        g = _ground("", {"step_num": 4, "rank": 0, "fault_type": c, "evidence_families": [], "suspects": []})
        assert g.endswith(f" Next: {CATEGORY_ACTIONS[c]}.")
        texts.append(g)
        types.append(c)
    res = explanation_checks(texts, types, [["FE LlamaMLP"]] * len(texts), [{"FE LlamaMLP"}] * len(texts))
    for k in ("anomaly_correct", "type_correct", "causal_consistent", "actionable", "complete"):
        ok = res["per_step"][k][:len(reg)] if k == "causal_consistent" else res["per_step"][k]  # a cause needs a mechanism
        assert all(ok), (k, [t for t, o in zip(texts, ok, strict=False) if not o])


def test_an_ensemble_folder_is_read_as_the_model(diag, tmp_path):
    """`--model` may name an ensemble (`teller rca ensemble`): two copies of the shipped model
    give the model's own verdicts, and the report says which seeds answered."""
    from teller.rca.api import load
    from teller.rca.ensemble import Ensemble

    res, d = diag
    ens = tmp_path / "ens"
    Ensemble([load(DEFAULT_MODEL), load(DEFAULT_MODEL)]).save(ens, [DEFAULT_MODEL, DEFAULT_MODEL])
    other = diagnose(d / "h200_faulty_op_delay", reference=[d / "h200_normal_a", d / "h200_normal_b"], model=ens,
                     out=tmp_path / "o")
    assert other["model"]["path"] == str(ens) and other["model"]["variant"] == "mot"
    read = [(a, b) for a, b in zip(res["steps"], other["steps"], strict=True) if "abnormal_probability" in a]
    assert read and all("abnormal_probability" in b for _, b in read)
    for a, b in read:
        assert b["abnormal_probability"] == pytest.approx(a["abnormal_probability"], abs=1e-4)
        assert (b.get("fault_type"), b.get("evidence_families")) == (a.get("fault_type"), a.get("evidence_families"))


def _shipped_copy(tmp_path, workloads):
    """A copy of the shipped model whose config.json names ``workloads`` as those it was trained on
    (None: names none, as a model trained before they were recorded)."""
    m = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, m)
    cfg = json.loads((m / "config.json").read_text())
    if workloads is None:
        cfg["training"].pop("workloads", None)
    else:
        cfg["training"]["workloads"] = workloads
    (m / "config.json").write_text(json.dumps(cfg))
    return m


def test_a_step_read_either_way_gets_one_abnormal_probability(diag, flagged_diag):
    """The shipped model's flag expert and its novelty read the shape-free context: a step's
    iteration and its layer mix against every step of the run. So a step the stage flags gets the
    same abnormal probability and novelty whether the model reads every step or only the flagged
    ones."""
    every = {s["index"]: s.get("abnormal_probability") for s in diag[0]["steps"]}
    read = [(s["index"], s["abnormal_probability"]) for s in flagged_diag[0]["steps"]
            if s.get("abnormal_probability") is not None]
    assert read and flagged_diag[0]["model"]["flag_weight"] > 0
    for i, p in read:
        assert every[i] == pytest.approx(p, abs=2e-3), i
    # and the same novelty (the context against every step of the run either way)
    nov = {s["index"]: s.get("novelty") for s in diag[0]["steps"]}
    got = [(s["index"], s["novelty"]) for s in flagged_diag[0]["steps"] if s.get("abnormal_probability") is not None]
    assert len(got) == len(read) and "novel_retyped" in flagged_diag[0]["model"]
    for i, v in got:
        assert nov[i] == pytest.approx(v, rel=1e-3, abs=1e-3), i


def test_a_workload_shape_the_model_was_not_trained_on_is_screened(diag, flagged_diag, tmp_path):
    """The model reads every step only of runs of a workload shape it was trained on (config.json's
    training.workloads); on another it screens the stage's flags, as ``--model-reads flagged``,
    and the diagnosis and the console say why."""
    res, d = diag
    shipped = json.loads((DEFAULT_MODEL / "config.json").read_text())["training"]["workloads"]
    assert "2 layers, hidden 1024" in shipped and res["model"]["reads"] == "every"  # the bundled run's shape
    notes = []
    other = diagnose(d / "h200_faulty_op_delay", reference=[d / "h200_normal_a", d / "h200_normal_b"],
                     model=_shipped_copy(tmp_path, ["4 layers, hidden 1024"]), out=tmp_path / "o", note=notes.append)
    m = other["model"]
    assert m["reads"] == "flagged" and "2 layers, hidden 1024" in m["every_refused"]
    assert any("not one the model was trained on" in n for n in notes)
    # the screen reads as --model-reads flagged would with that model: its flag expert reads the
    # shape-free context (the run's iterations, the steps' layer mix against the run's own), so
    # it stays on a shape the model was not trained on
    assert m["flag_weight"] == flagged_diag[0]["model"]["flag_weight"] > 0
    screened = diagnose(d / "h200_faulty_op_delay", reference=[d / "h200_normal_a", d / "h200_normal_b"],
                        model=tmp_path / "model", out=tmp_path / "f", model_reads="flagged")
    assert screened["model"]["flag_weight"] == m["flag_weight"]
    assert [(s["flag"], s.get("fault_type"), s.get("model_says_normal")) for s in other["steps"]] == \
        [(s["flag"], s.get("fault_type"), s.get("model_says_normal")) for s in screened["steps"]]
    # the stage flags the same steps either way; the model's screen alone moves with its expert
    assert [s["flag"] or bool(s.get("model_says_normal")) for s in other["steps"]] == \
        [s["flag"] or bool(s.get("model_says_normal")) for s in flagged_diag[0]["steps"]]


def test_steps_off_the_models_distribution_keep_the_stages_verdict(tmp_path):
    """Reading every step of a training trace (a foreign Kineto file: operators the model's
    vocabulary does not know), the model flags none of them: off its training distribution its
    verdict is a guess, so the stage's flags stand, each marked low confidence, none read as normal."""
    from teller.ingest import ingest

    run = tmp_path / "train"
    ingest(Path(__file__).parent / "data" / "external" / "kineto" / "hta_nccl_data_rank0.json.gz", run)
    res = diagnose(run, reference=[run], model=_shipped_copy(tmp_path, None), out=tmp_path / "o")
    m = res["model"]
    assert m["reads"] == "every" and m["steps_read"] > 0 and m["off_distribution"] == m["steps_read"]
    assert m["model_flagged"] == 0 and not any("model" in (s.get("flagged_by") or ()) for s in res["steps"])
    stage = [s for s in res["steps"] if s.get("stage_flag")]
    assert stage and all(s["flag"] and s["model_off_distribution"] and not s.get("model_says_normal") for s in stage)
    # their type is the one the stage's evidence points to where it points to one; the model's guess is kept apart
    assert all(s.get("fault_type") is None and "fault_type_guess" in s for s in stage)


def test_without_a_reference_the_model_finds_the_same_fault(diag, tmp_path):
    """The op-delay run diagnosed alone (its own steps as the stage's reference): the model reads
    every step as it does with the fault-free references, so its verdicts are the same steps with
    the same types, and the stage's lasting departures there stay verdicts."""
    res, d = diag
    alone = diagnose(d / "h200_faulty_op_delay", out=tmp_path)
    assert alone["reference"].startswith("the run's own steps")

    def verdicts(r):
        return {(s["step_num"], s.get("fault_type")) for s in r["steps"] if s["flag"] and not s.get("model_says_normal")}

    assert verdicts(alone) == verdicts(res)
    typed = [s for s in alone["steps"] if s["flag"] and s.get("fault_type") and not s.get("model_says_normal")]
    over, inside = _in_window(typed, d)
    assert len(inside) >= 5 and {s["fault_type"] for s in over} == {"kernel"}
