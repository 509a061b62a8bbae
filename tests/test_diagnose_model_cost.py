"""What bounds the root-cause model's cost in `teller diagnose`, and that it changes no verdict:
explanations stopped once the mechanism the diagnosis keeps is written (the same grounded
explanation as decoding to the end), decoding that goes on from the heads' key/value cache (the
same tokens as recomputing the sequence), the flagged steps' trees encoded from their own rows
(the same inputs as from the whole forest), and the bound on the steps the model reads (the
highest-scored, stated in diagnosis.json and on the console)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from teller.rca import DEFAULT_MODEL  # noqa: E402
from teller.rca.api import weight_files  # noqa: E402
from teller.report.diagnose import (  # noqa: E402
    _step_blocks,
    apply_model,
    diagnose,
    mechanism_written,
    print_verdicts,
)

EX = Path(__file__).resolve().parents[1] / "examples"
RUN = "h200_faulty_op_delay"

if not weight_files(DEFAULT_MODEL / "model.safetensors"):
    pytest.skip("the package has no default model", allow_module_level=True)


@pytest.fixture(scope="module")
def numeric(tmp_path_factory):
    """The bundled op-delay run diagnosed by the numeric stage alone (against the two normal runs)."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("dmc")
    for n in (RUN, "h200_normal_a", "h200_normal_b"):
        shutil.copytree(EX / n, d / n)
    diag = diagnose(d / RUN, reference=[d / "h200_normal_a", d / "h200_normal_b"], model=False, out=d / "o")
    diag.pop("paths")
    return diag, d


def _read(diag):
    return {x["node_id"]: x for x in diag["steps"] if "model_unknown_share" in x}


def _count_tokens(monkeypatch):
    from teller.rca.api import RCA

    calls = [0]
    free = RCA._free_token

    def counted(self, *a, **k):
        calls[0] += 1
        return free(self, *a, **k)

    monkeypatch.setattr(RCA, "_free_token", counted)
    return calls


def test_stopped_explanations_keep_what_the_diagnosis_uses(numeric, monkeypatch):
    diag, d = numeric
    runs, tokens = {}, {}
    for mode in ("full", "mechanism"):
        calls = _count_tokens(monkeypatch)
        x = copy.deepcopy(diag)
        info = apply_model(x, d / RUN, explain=mode)
        assert info["explanations"] == mode
        runs[mode], tokens[mode] = _read(x), calls[0]
    full, stopped = runs["full"], runs["mechanism"]
    assert full.keys() == stopped.keys() and full
    keys = ("fault_type", "fault_probability", "abnormal_probability", "model_says_normal", "evidence_operators",
            "evidence_families", "explanation")
    for n in full:
        assert {k: full[n].get(k) for k in keys} == {k: stopped[n].get(k) for k in keys}, n
    with_mech = [n for n in full if "(targeted_op_delay)" in (full[n].get("explanation") or "")]
    assert len(with_mech) >= 5  # the op delay's steps: the mechanism is named, from far shorter text
    for n in with_mech:
        a, b = full[n]["explanation_model"], stopped[n]["explanation_model"]
        assert len(b) < len(a) and a.startswith(b.rstrip(".")) and b.rstrip(".").endswith("(targeted_op_delay)")
    assert tokens["mechanism"] * 3 < tokens["full"]


def test_mechanism_written_is_the_mechanism_grounding_keeps():
    assert mechanism_written("CUDA/kernel fault (targeted_op_delay) in", "kernel")
    assert not mechanism_written("CUDA/kernel fault (targeted_op_delay", "kernel")  # not closed yet
    assert not mechanism_written("CUDA/kernel fault (targeted_op_delay) in", "memory")  # another type's
    assert not mechanism_written("CUDA/kernel fault (slow_thing) in", "kernel")  # not a registered one
    # after a sentence end the projection may still drop it: decoding goes on
    assert not mechanism_written("CUDA/kernel fault. In step 3 (targeted_op_delay)", "kernel")
    assert not mechanism_written("x " * 130 + "(targeted_op_delay)", "kernel")  # far into the text
    assert mechanism_written("CUDA/kernel fault (  x) (targeted_op_delay)", "kernel")  # the first registered one


def test_the_model_reads_the_highest_scored_steps_up_to_the_bound(numeric):
    diag, d = numeric
    whole = copy.deepcopy(diag)
    apply_model(whole, d / RUN, max_steps=None)
    flagged = [x for x in diag["steps"] if x["flag"]]
    assert len(flagged) > 3 and whole["model"]["steps_read"] == len(flagged) and whole["model"]["max_steps"] is None
    x = copy.deepcopy(diag)
    info = apply_model(x, d / RUN, max_steps=3)
    assert (info["steps_eligible"], info["steps_read"], info["max_steps"]) == (len(flagged), 3, 3)
    read = _read(x)
    # the highest scores; among equal ones (scores saturate at 1) the largest suspect distances
    top = sorted(flagged, key=lambda s: (-s["score"], -max((x["distance"] for x in s["suspects"]), default=-1.0),
                                           s["start_ns"]))[:3]
    assert set(read) == {s["node_id"] for s in top}
    assert sum(s["score"] == 1.0 for s in flagged) > 3  # the tie-break decides here
    for s in x["steps"]:
        assert bool(s.get("model_not_read")) == (s["flag"] and s["node_id"] not in read)
    full_read = _read(whole)
    for n, s in read.items():  # the same verdict as when the model reads every step
        assert s["fault_type"] == full_read[n]["fault_type"] and s["explanation"] == full_read[n]["explanation"]
        assert s["abnormal_probability"] == pytest.approx(full_read[n]["abnormal_probability"], abs=1e-3)
    from rich.console import Console

    con = Console(record=True, width=300)
    print_verdicts(x, con, top=50)
    text = con.export_text()
    assert f"the model read the 3 highest-scored of {len(flagged)} flagged steps" in text
    assert text.count("not read by the model") == len(flagged) - 3


def test_cli_model_steps(numeric, tmp_path):
    from teller.cli import main
    from teller.report.diagnose import MODEL_STEPS

    _, d = numeric
    runs = {}
    for name, extra in (("default", []), ("two", ["--model-steps", "2", "--full-explanation", "--html"]),
                        ("flagged", ["--model-reads", "flagged"]),
                        ("flagged_two", ["--model-reads", "flagged", "--model-steps", "2", "--full-explanation", "--html"])):
        out = tmp_path / name
        assert main(["diagnose", str(d / RUN), "-r", str(d / "h200_normal_a"), "-o", str(out), "-q", *extra]) == 0
        runs[name] = json.loads((out / "diagnosis.json").read_text())
    # by default the model reads every step; the bound is on the explanations, the most probable first
    a, b = runs["default"]["model"], runs["two"]["model"]
    assert (a["reads"], a["max_steps"], a["explanations"]) == ("every", MODEL_STEPS, "mechanism")
    n_steps = len(runs["default"]["steps"])
    assert a["steps_read"] == a["steps_eligible"] == n_steps and a["explained"] < MODEL_STEPS
    assert (b["steps_read"], b["explained"], b["max_steps"], b["explanations"]) == (n_steps, 2, 2, "full")
    res = runs["two"]
    mine = [s for s in res["steps"] if "model" in (s.get("flagged_by") or ())]
    assert len(mine) > 2 and sum(bool(s.get("explanation")) for s in mine) == 2
    told = sorted(s["abnormal_probability"] for s in mine if s.get("explanation"))
    assert told[0] >= max(s["abnormal_probability"] for s in mine if s.get("model_not_explained"))
    assert sum(bool(s.get("model_not_explained")) for s in res["steps"]) == len(mine) - 2
    page = (tmp_path / "two" / "report.html").read_text()
    assert "the 2 most probable have an explanation" in page
    # the headline counts the abnormal verdicts: the stage's flags the model reads as normal are not among them
    verdicts = sum(1 for s in res["steps"] if s["flag"] and not s.get("model_says_normal"))
    assert any(s.get("model_says_normal") for s in res["steps"])
    assert f"<b>{verdicts:,}</b> of {n_steps:,} steps are abnormal" in page
    # --model-reads flagged: the model reads the stage's flags, the highest-scored up to the bound
    a, b = runs["flagged"]["model"], runs["flagged_two"]["model"]
    assert a["reads"] == "flagged" and a["steps_read"] == a["steps_eligible"] < MODEL_STEPS
    assert (b["steps_read"], b["max_steps"], b["explanations"]) == (2, 2, "full")
    res = runs["flagged_two"]
    assert sum("model_unknown_share" in s for s in res["steps"]) == 2
    assert sum(bool(s.get("model_not_read")) for s in res["steps"]) == b["steps_eligible"] - 2
    page = (tmp_path / "flagged_two" / "report.html").read_text()  # the report says what the model did not read
    assert f"it read the 2 highest-scored of {b['steps_eligible']} flagged steps" in page


def test_the_steps_own_rows_encode_as_the_whole_forest(numeric):
    from teller.forest import Forest
    from teller.rca import load

    diag, d = numeric
    m = load(DEFAULT_MODEL)
    m.cfg.unit = "step"  # a model of STEP subtrees (the shipped one reads iterations: the next test)
    table = Forest.read(d / RUN).table
    ids = [x["node_id"] for x in diag["steps"] if x["flag"]]
    size, sub = _step_blocks(table, ids)
    assert sub.num_rows == int(size.sum()) < table.num_rows
    a, b = m.inputs(table, [[i] for i in ids]), m.inputs(sub, [[i] for i in ids])
    for k in ("input_ids", "offsets", "depth", "parent_idx", "duration", "anchor", "node_id", "node_offsets"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    assert [a.families[f] for f in a.node_family] == [b.families[f] for f in b.node_family]
    assert [a.candidates(i) for i in range(len(a))] == [b.candidates(i) for i in range(len(b))]
    # a table that is not a run's depth-first forest (node ids not the rows) is used whole
    other = table.slice(1)
    assert _step_blocks(other, ids[:1])[1] is other


def test_iteration_rows_beside_the_steps_encode_as_the_whole_forest(numeric):
    """A model whose unit is the engine iteration gets, beside each flagged STEP subtree, the
    iteration's schedule/update ranges and GAP rows: the same inputs as from the whole forest."""
    from teller.forest import Forest
    from teller.rca import load

    diag, d = numeric
    m = load(DEFAULT_MODEL)
    assert m.cfg.unit == "iteration"  # the shipped model
    table = Forest.read(d / RUN).table
    ids = [x["node_id"] for x in diag["steps"] if x["flag"]]
    size, sub = _step_blocks(table, ids, iteration=True)
    assert int(size.sum()) < sub.num_rows < table.num_rows  # more than the STEP blocks, less than the run
    a, b = m.inputs(table, [[i] for i in ids]), m.inputs(sub, [[i] for i in ids])
    for k in ("input_ids", "offsets", "depth", "parent_idx", "duration", "anchor", "node_id", "node_offsets"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    cands = [b.candidates(i) for i in range(len(b))]
    assert cands == [a.candidates(i) for i in range(len(a))]
    assert any("OTHER schedule" in c for c in cands) and any("GAP untraced" in c for c in cands)
    m.cfg.unit = "step"
    assert not any("GAP untraced" in c for c in (m.inputs(sub, [[i] for i in ids]).candidates(i) for i in range(len(ids))))


def _tiny(monkeypatch):
    """A tiny random MoT model with the shipped tokenizers; its fault head types every other step."""
    from teller.rca import api, load
    from teller.rca.model import RCAConfig, build_model

    shipped = load(DEFAULT_MODEL)
    torch.manual_seed(0)
    cfg = RCAConfig.preset("tiny", max_expl_tokens=24)
    net = build_model(cfg, shipped.text_tok.get_vocab_size(), len(shipped.trace_tok)).eval()
    pf = api.project_fault
    calls = [0]

    def typed(probs, floor=0.5):  # every other step typed (its best type), the others normal
        calls[0] += 1
        p_ab, ft, tp = pf(probs, floor)
        if calls[0] % 2:
            return 0.1, "", tp
        return max(p_ab, 0.5), ft or api.FAULT_TYPES[1 + int(np.argmax(probs[1:]))], tp

    monkeypatch.setattr(api, "project_fault", typed)
    monkeypatch.setattr(api, "project_explanation", lambda text, *a: text)  # the decoded text as it is
    return api.RCA(cfg, net, shipped.text_tok, shipped.trace_tok, shipped.ref)


def test_decoding_from_the_heads_cache_gives_the_tokens_of_recomputing(numeric, monkeypatch):
    """Explanations decoded from the key/value cache the heads' pass filled (batches where only
    some rows are decoded) equal greedy decoding that recomputes the whole sequence per token;
    ``explain_tokens`` and ``explain_done`` cut them where asked, leaving the heads as they were."""
    from teller.forest import Forest
    from teller.rca.text import EOS, EXPL, SPECIALS

    diag, d = numeric
    m = _tiny(monkeypatch)
    ids = [x["node_id"] for x in diag["steps"] if x["flag"]][:6]
    prep = m.prepare(m.inputs(Forest.read(d / RUN).table, [[i] for i in ids]))
    full = m.predict(prep, batch_size=4)
    typed = [k for k, p in enumerate(full) if p["fault_type"]]
    assert typed == [1, 3, 5] and all(full[k]["explanation"] == "" for k in (0, 2, 4))
    # the reference: the whole sequence recomputed for every token (RCA._decode)
    idx = np.asarray(typed)
    tg = [[EXPL] for _ in idx]

    def choose(r, logits):
        t = m._free_token(logits, tg[r][1:])
        return None if t == EOS else [t]

    with torch.no_grad():
        m._decode(prep, idx, tg, choose)
    texts = [m.text_tok.decode([t for t in x[1:] if t >= len(SPECIALS)]) for x in tg]
    assert [full[k]["explanation"] for k in typed] == texts and any(len(x) > 5 for x in tg)
    short = m.predict(prep, batch_size=4, explain_tokens=3)
    done = m.predict(prep, batch_size=4, explain_done=lambda text, ft: len(text) >= 12)
    for j, x in zip(typed, tg, strict=True):
        f, s, e = full[j], short[j], done[j]
        assert {k: f[k] for k in f if k != "explanation"} == {k: s[k] for k in s if k != "explanation"}
        assert s["explanation"] == m.text_tok.decode([t for t in x[1:4] if t >= len(SPECIALS)])
        assert f["explanation"].startswith(e["explanation"])
        assert len(e["explanation"]) >= 12 or e["explanation"] == f["explanation"]


def test_steps_recorded_without_detail_are_left_to_the_numeric_stage(numeric):
    """Flagged steps whose STEP message says ``detail=0`` (``teller record --detail-every``) hold no
    aten ops or GPU activity: the model does not read them, says how many it left, and reads the
    others as before."""
    diag, d = numeric
    x = copy.deepcopy(diag)
    flagged = [s for s in x["steps"] if s["flag"]]
    bare = {s["node_id"] for s in flagged[::2]}
    for s in x["steps"]:
        if s["node_id"] in bare:
            s["name"] = s["name"] + " detail=0"
    info = apply_model(x, d / RUN, max_steps=None)
    assert info["steps_without_detail"] == len(bare) and info["steps_read"] == len(flagged) - len(bare)
    read = _read(x)
    assert read and not (set(read) & bare)
    for s in x["steps"]:
        assert bool(s.get("model_no_detail")) == (s["node_id"] in bare)
    from rich.console import Console

    con = Console(record=True, width=400)
    print_verdicts(x, con, top=100)
    lines = [ln for ln in con.export_text().splitlines() if ln.strip().startswith("step ")]
    assert sum("recorded without detail" in ln for ln in lines) == len(bare)


def test_reading_every_step_leaves_steps_without_detail_to_the_stage(numeric):
    """Reading every step, the model skips those whose STEP message says ``detail=0`` as it does
    reading the flagged ones: it reads the rest, counts the skipped, and only they are marked."""
    from teller.localize.features import run_features
    from teller.report.diagnose import read_every

    _, d = numeric
    rf = run_features(d / RUN)
    names = list(rf.steps.names)
    bare = set(range(0, len(names), 3))
    rf.steps.names = [n + " detail=0" if i in bare else n for i, n in enumerate(names)]
    r = read_every(d / RUN, rf)
    assert set(r["no_detail"].tolist()) == bare and not (set(r["index"].tolist()) & bare)
    assert r["info"]["steps_without_detail"] == len(bare) and r["info"]["steps_read"] == len(names) - len(bare)
    assert len(r["preds"]) == len(r["index"]) == len(r["over"]["flag"])
