"""The RCA models on a slice of data/h200_v2 (tiny config, CPU): inputs, training, schema
projection, save/load, the CLI round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rca_slice import DATA, RUNS, check_schema, need_rca, small_dataset

torch = need_rca()

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from teller.rca.data import FAULT_TYPES, ReferenceStats, load_dataset, truncate_order  # noqa: E402
from teller.rca.schema import NameTrie, project_explanation, project_fault, project_operators  # noqa: E402


@pytest.fixture(scope="module")
def ds():
    torch.set_num_threads(1)
    if not (DATA / "records.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    return load_dataset(DATA, runs=RUNS, max_units=90, seed=1)


@pytest.fixture(scope="module")
def trained(ds, tmp_path_factory):
    from teller.rca.train import train

    out = tmp_path_factory.mktemp("rca") / "mot"
    s = train(ds, out, variant="mot", split="request", config="tiny", epochs=5, max_steps=40, seed=0, progress=False,
              log=lambda m: None)
    return out, s


def test_units_are_steps_with_constant_labels_and_inputs_are_trees(ds):
    u = ds.units
    assert len(u) == 90 and set(u.view.tolist()) == {"vertical", "horizontal"}
    # a horizontal unit joins its ranks' steps; vertical units one step
    assert all(len(s) == 1 for s, v in zip(u.step_ids, u.view, strict=True) if v == "vertical")
    assert any(len(s) == 2 for s, v in zip(u.step_ids, u.view, strict=True) if v == "horizontal")
    assert (u.n_records >= 1).all() and u.fault[~u.is_anomaly].max() == 0 and (u.fault[u.is_anomaly] > 0).all()
    # parts are disjoint and cover every unit
    assert sum(len(u.part("request", p)) for p in ("train", "val", "test")) == len(u)
    from teller.rca.model import RCAConfig
    from teller.rca.train import fit_tokenizers, prepare_units

    cfg = RCAConfig.preset("tiny")
    tr = u.part("request", "train")
    text_tok, trace_tok = fit_tokenizers(ds, tr, cfg)
    prep, ref = prepare_units(ds, np.arange(len(u)), cfg, text_tok, trace_tok, None)
    inp = prep.inputs
    lens = np.diff(inp.offsets)
    assert lens.max() <= cfg.max_trace_tokens and inp.truncated.any()
    for i in range(len(inp)):
        s = inp.tokens(i)
        par = inp.parent_idx[s]
        pos = np.arange(len(par))
        assert ((par == -1) | ((par >= 0) & (par < pos))).all()  # still a tree after truncation
        assert ((par < 0) | (inp.depth[s] > inp.depth[s][np.maximum(par, 0)])).all()
        n_nodes = inp.node_offsets[i + 1] - inp.node_offsets[i]
        assert (inp.anchor[s] < n_nodes).all() and (inp.anchor[s] >= 0).all()
        # each token covers a run of the unit's nodes holding its anchor; untruncated, the runs
        # tile the nodes
        f0, sp = inp.first_node[s], inp.span[s]
        assert (sp >= 1).all() and (f0 <= inp.anchor[s]).all() and (inp.anchor[s] < f0 + sp).all()
        if not inp.truncated[i]:
            o = np.argsort(f0)
            assert f0[o][0] == 0 and (f0[o][1:] == (f0 + sp)[o][:-1]).all() and sp.sum() == n_nodes
        for t in range(len(sp)):
            cov = inp.covered(i, t)
            fams = [inp.families[int(inp.node_family[inp.node_offsets[i] + n])] for n in cov]
            assert cov[0] == inp.anchor[s][t] and all(f0[t] <= n < f0[t] + sp[t] for n in cov)
            assert len({f.split(" ", 1)[0] for f in fams}) == 1  # the anchor's layer only
            assert len(cov) == 1 or fams[0].split(" ", 1)[0] in ("FE", "COMM", "OTHER")
    # z against the reference: normal training units centre on 0
    assert abs(float(np.median(ref.z(inp.input_ids, inp.duration)))) < 1.5


def test_truncation_keeps_shallow_and_long_tokens():
    depth = np.array([0, 1, 2, 2, 1, 2])
    dur = np.array([9, 5, 1, 7, 3, 8])
    assert truncate_order(depth, dur, 4).tolist() == [0, 1, 4, 5]  # depths 0, 1, then the longest at 2
    assert truncate_order(depth, dur, 10).tolist() == list(range(6))


def test_reference_stats_round_trip(tmp_path):
    ids = np.array([5, 5, 5, 5, 5, 7])
    dur = np.array([1000, 2000, 3000, 4000, 5000, 10])
    ref = ReferenceStats.fit(ids, dur, 10, min_count=5)
    assert ref.median[5] == pytest.approx(np.log1p(3.0)) and ref.median[7] == pytest.approx(ref.pooled[0])
    ref.save(tmp_path / "r.json")
    back = ReferenceStats.load(tmp_path / "r.json")
    assert np.allclose(back.z(ids, dur), ref.z(ids, dur), atol=1e-5)


def test_tiny_model_loss_falls(trained):
    _, s = trained
    curve = [c["loss"] for c in s["curve"]]
    assert len(curve) >= 3 and curve[-1] < 0.8 * curve[0]


def test_single_stream_trains_and_decodes_within_the_schema(ds, tmp_path):
    from teller.rca import load
    from teller.rca.train import evaluate, train

    s = train(ds, tmp_path / "single", variant="single", split="request", config="tiny", epochs=4, max_steps=30,
              progress=False, log=lambda m: None)
    assert s["curve"][-1]["loss"] < s["curve"][0]["loss"]
    m = load(tmp_path / "single")
    m.cfg.max_expl_tokens = 8  # keep decoding short
    pred, res, idx = evaluate(m, ds, "request", "train")
    _check_schema(pred, m, ds, idx)
    assert res["all"]["units"] == len(idx)


def _check_schema(pred, model, ds, idx):
    prep_inp = model.inputs(ds.forest, [ds.units.step_ids[i] for i in idx.tolist()],
                            [ds.units.log_text[i] for i in idx.tolist()], ds.units.run_id[idx].tolist())
    check_schema(pred, prep_inp, model.cfg.max_explanation_chars)


def test_save_load_gives_identical_predictions(trained, ds):
    from teller.rca import load
    from teller.rca.train import evaluate

    out, _ = trained
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "reference.json", "trace_tokenizer", "checkpoint"} <= files
    assert json.loads((out / "config.json").read_text())["format"] == "teller-rca"
    a, b = load(out), load(out)
    a.cfg.max_expl_tokens = b.cfg.max_expl_tokens = 12
    pa_, ra, _ = evaluate(a, ds, "request", "train")
    pb, rb, idx = evaluate(b, ds, "request", "train")
    assert pa_ == pb and ra == rb
    _check_schema(pa_, a, ds, idx)
    # the checkpoint resumes: two more steps continue the step counter
    from teller.rca.train import train

    s = train(ds, out, variant="mot", split="request", config="tiny", epochs=5, max_steps=42, resume=True,
              progress=False, log=lambda m: None)
    assert s["steps"] == 42


def test_load_refuses_foreign_files(tmp_path):
    from teller.errors import TellerError
    from teller.rca import load

    with pytest.raises(TellerError, match="config.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(TellerError, match="not an RCA model"):
        load(tmp_path)


@settings(max_examples=200, deadline=None)
@given(probs=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=6, max_size=6),
       scores=st.lists(st.floats(allow_nan=True, allow_infinity=False, width=32), min_size=1, max_size=40),
       max_ops=st.integers(0, 10), text=st.text(max_size=600), data=st.data())
def test_projection_never_leaves_the_schema(probs, scores, max_ops, text, data):
    p_ab, ftype, tp = project_fault(np.asarray(probs))
    assert ftype in FAULT_TYPES[1:] or ftype == ""
    assert 0.0 <= p_ab <= 1.0 and 0.0 <= tp <= 1.0 and (ftype != "") == (p_ab >= 0.5)
    anchors = np.asarray(data.draw(st.lists(st.integers(0, 500), min_size=len(scores), max_size=len(scores))))
    nodes = project_operators(np.asarray(scores), anchors, bool(ftype), max_ops)
    assert set(nodes) <= set(anchors.tolist()) and len(nodes) <= max(max_ops, 0) and len(set(nodes)) == len(nodes)
    if not ftype:
        assert nodes == []
    expl = project_explanation(text, ftype, ["FE LlamaMLP"], 480)
    if ftype:
        assert 0 < len(expl) <= 480 and expl.endswith((".", "!", "?"))
    else:
        assert expl == ""


@settings(max_examples=100, deadline=None)
@given(names=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6, unique=True), data=st.data())
def test_name_trie_walks_only_to_given_names(names, data):
    ids = [[ord(c) for c in n] for n in names]
    trie = NameTrie(names, ids)
    node, got = trie.root, []
    for _ in range(64):  # a random walk: each step one of the allowed tokens, or a stop when complete
        allowed = NameTrie.allowed(node)
        if NameTrie.complete(node) is not None and (not allowed or data.draw(st.booleans())):
            got.append(NameTrie.complete(node))
            break
        node = trie.step(node, data.draw(st.sampled_from(allowed)))
    assert got and got[0] in names


def test_cli_train_predict_round_trip(tmp_path, ds):
    import pyarrow.parquet as pq

    from teller.cli import main

    small = small_dataset(tmp_path / "ds", 30)  # the CLI reads dataset folders
    model = tmp_path / "m"
    assert main(["rca", "train", str(small), "-o", str(model), "--variant", "mot", "--split", "request",
                 "--config", "tiny", "--epochs", "1", "--max-steps", "3", "--seed", "1"]) == 0
    assert (model / "model.safetensors").is_file()
    out = tmp_path / "pred.parquet"
    assert main(["rca", "predict", str(model), str(small), "--split-part", "train", "-o", str(out),
                 "--metrics", str(tmp_path / "m.json")]) == 0
    t = pq.read_table(out)
    assert t.num_rows > 0 and {"abnormal_prob", "fault_type", "evidence_node_ids", "explanation"} <= set(t.column_names)
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["all"]["units"] == t.num_rows and "macro_plus_f1" in m["all"]["operator"]
    # calibrate again on another part: config.json's calibration is rewritten, the weights are not
    weights = (model / "model.safetensors").read_bytes()
    assert main(["rca", "calibrate", str(model), str(small), "--split-part", "train"]) == 0
    cal = json.loads((model / "config.json").read_text())["calibration"]
    assert cal["part"] == "train" and cal["split"] == "request" and len(cal["grid"]) > 3
    assert (model / "model.safetensors").read_bytes() == weights
    assert main(["rca", "train", str(small), "-o", str(model), "--variant", "bogus", "--config", "tiny"]) == 2


def test_weights_above_the_part_size_are_written_in_parts(tmp_path, monkeypatch):
    """No weight file over SHARD_BYTES (the shipped model lives in the repository); the parts load
    back to the same tensors, and a later single-file save removes the old parts."""
    import torch

    from teller.rca import api

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    monkeypatch.setattr(api, "SHARD_BYTES", 20_000)
    p = tmp_path / "model.safetensors"
    api.save_weights(net, p, "float32")
    parts = api.weight_files(p)
    assert len(parts) == 2 and not p.exists() and parts[0].name == "model-00001-of-00002.safetensors"
    other = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    api.load_weights(other, p)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), other.state_dict().values(), strict=True))
    monkeypatch.setattr(api, "SHARD_BYTES", 1 << 30)
    api.save_weights(net, p, "float32")
    assert api.weight_files(p) == [p]


@pytest.mark.parametrize("variant,inputs", [("mot", "log"), ("mot", "trace"), ("single", "summary+log"), ("single", "log")])
def test_ablated_inputs_train_and_stay_within_what_they_read(ds, tmp_path, variant, inputs):
    """Modality ablations and the prompt-style baseline: a model that does not read the tree names
    no operator (log only) or only the families its text summary names; a trace-only model reads
    no log token."""
    from teller.rca import load
    from teller.rca.batch import step_summary
    from teller.rca.train import evaluate, prepare_units, train

    out = tmp_path / f"{variant}-{inputs.replace('+', '_')}"
    s = train(ds, out, variant=variant, split="request", config="tiny", epochs=4, max_steps=25, progress=False,
              log=lambda m: None, inputs=inputs)
    assert s["curve"][-1]["loss"] < s["curve"][0]["loss"]
    m = load(out)
    assert m.cfg.inputs == inputs
    m.cfg.max_expl_tokens = 6
    pred, res, idx = evaluate(m, ds, "request", "train")
    _check_schema(pred, m, ds, idx)
    prep, _ = prepare_units(ds, idx, m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
    logs_nonempty = [k for k, i in enumerate(idx.tolist()) if ds.units.log_text[i]]
    assert logs_nonempty
    if inputs == "trace":  # <bos> <log> <trace>: no log token
        assert all(len(p) == 3 for p in prep.prompt)
    else:
        assert max(len(prep.prompt[k]) for k in logs_nonempty) > 3
    for k, p in enumerate(pred):
        if inputs == "log":
            assert p["evidence_operators"] == [] and p["evidence_nodes"] == []
        if inputs == "summary+log":
            assert set(p["evidence_operators"]) <= set(step_summary(prep.inputs, k)[1])


def test_step_summary_names_the_longest_families(ds):
    from teller.rca.batch import step_summary
    from teller.rca.model import RCAConfig
    from teller.rca.train import fit_tokenizers, prepare_units

    cfg = RCAConfig.preset("tiny")
    text_tok, trace_tok = fit_tokenizers(ds, ds.units.part("request", "train"), cfg)
    prep, _ = prepare_units(ds, np.arange(len(ds.units)), cfg, text_tok, trace_tok, None, labels=False)
    inp = prep.inputs
    i = int(np.argmax(np.diff(inp.offsets)))
    text, fams = step_summary(inp, i, top=3)
    s = inp.tokens(i)
    tot = {f: float(inp.duration[s][inp.family[s] == inp.families.index(f)].sum()) for f in inp.candidates(i)}
    assert fams == sorted(tot, key=lambda f: -tot[f])[:3]
    assert text.startswith(f"step: {int(inp.node_offsets[i + 1] - inp.node_offsets[i])} nodes") and all(f in text for f in fams)


def test_no_merges_gives_one_token_per_node(ds):
    from teller.rca.model import RCAConfig
    from teller.rca.train import fit_tokenizers, prepare_units

    idx = np.arange(len(ds.units))
    sizes = {}
    for v in (0, 400):
        cfg = RCAConfig.preset("tiny", trace_vocab=v, max_trace_tokens=100000)
        text_tok, trace_tok = fit_tokenizers(ds, ds.units.part("request", "train"), cfg)
        prep, _ = prepare_units(ds, idx, cfg, text_tok, trace_tok, None, labels=False)
        inp = prep.inputs
        nodes = np.diff(inp.node_offsets)
        assert (inp.full_tokens == np.diff(inp.offsets)).all() and not inp.truncated.any()
        sizes[v] = (int(inp.full_tokens.sum()), int(nodes.sum()))
    assert sizes[0][0] == sizes[0][1]  # no merges: a token per node
    assert sizes[400][0] < 0.8 * sizes[400][1]  # merges compress the same steps


def test_f1_at_prior_is_the_low_prior_samples_f1():
    from teller.evaluate.scores import low_prior_scores
    from teller.rca.train import f1_at_prior

    # 50 abnormal of which 45 flagged (R 0.9), 1,000 normal of which 20 flagged (FPR 0.02); at a
    # 10% prior: P = 0.09 / (0.09 + 0.018) = 0.8333, F1 = 2·0.8333·0.9 / 1.7333 = 0.8654
    assert f1_at_prior(0.9, 0.02, 0.1) == pytest.approx(0.865385, abs=1e-6)
    assert f1_at_prior(0.9, 0.0, 0.1) == pytest.approx(2 * 0.9 / 1.9)
    assert f1_at_prior(0.0, 0.0, 0.1) == 0.0
    truth = np.r_[np.ones(200, bool), np.zeros(1000, bool)]
    flag = np.r_[np.arange(200) < 180, np.arange(1000) < 20]
    lp = low_prior_scores(truth, flag, flag.astype(float), priors=(0.1,), seed=0)["0.1"]
    assert lp["f1_mean"] == pytest.approx(f1_at_prior(0.9, 0.02, 0.1), abs=0.02)


def test_abnormal_cut_is_chosen_on_held_out_units_for_a_low_prior(trained, ds, tmp_path):
    """The cut maximises the step F1 expected at the prior from each cut's recall and false-positive
    rate (recomputed here from predict()'s own flags at each cut); predict() flags from it, a floor
    above it is refused, and a prior of 0 leaves 0.5."""
    from teller.rca import load
    from teller.rca.train import (
        ABNORMAL_CUTS,
        calibrate,
        calibrate_abnormal,
        f1_at_prior,
        prepare_units,
    )

    out, _ = trained
    m = load(out)
    assert [r["cut"] for r in calibrate_abnormal(m, ds, "request", "train")["grid"]] == list(ABNORMAL_CUTS)
    idx = ds.units.part("request", "train")
    truth = ds.units.select(idx).is_anomaly.astype(bool)
    prep, _ = prepare_units(ds, idx, m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
    # the tiny model's probabilities sit in a narrow band: a grid of their own quantiles
    p_ab = m.abnormal_probs(prep)
    assert p_ab.shape == (len(idx),)
    grid = tuple(float(q) for q in np.unique(np.round(np.quantile(p_ab, [0.1, 0.3, 0.5, 0.7, 0.9]), 6)))
    ab = calibrate_abnormal(m, ds, "request", "train", prior=0.1, grid=grid)
    assert [r["cut"] for r in ab["grid"]] == list(grid) and ab["prior"] == 0.1 and len(grid) > 2
    assert truth.any() and (~truth).any() and ab["abnormal_units"] == int(truth.sum())
    for r in ab["grid"]:
        m.meta["calibration"] = {"abnormal_cut": r["cut"]}
        assert m.abnormal_cut == r["cut"]
        flag = np.array([p["abnormal"] for p in m.predict(prep, explain=False)])
        rec, fpr = flag[truth].mean(), flag[~truth].mean()
        assert r["recall"] == pytest.approx(rec, abs=1e-6) and r["false_positive_rate"] == pytest.approx(fpr, abs=1e-6)
        assert r["f1_at_prior"] == pytest.approx(f1_at_prior(rec, fpr, 0.1), abs=1e-6)
    best = max(r["f1_at_prior"] for r in ab["grid"])
    assert ab["abnormal_cut"] == min(r["cut"] for r in ab["grid"] if r["f1_at_prior"] == best)
    m.meta["calibration"] = {"abnormal_cut": 0.7}
    assert m.abnormal_cut == 0.7
    with pytest.raises(ValueError, match="0.7"):
        m.predict(prep, explain=False, abnormal_floor=0.8)
    assert len(m.predict(prep, explain=False, abnormal_floor=0.1)) == len(idx)
    assert len({(r["recall"], r["false_positive_rate"]) for r in ab["grid"]}) > 1  # the cuts tell units apart
    none = calibrate(load(out), ds, "request", "val", prior=0.0)
    assert "abnormal" not in none and "abnormal_cut" not in none and "op_threshold" in none
    with pytest.raises(Exception, match="prior"):
        calibrate_abnormal(m, ds, "request", "val", prior=1.5)


def test_operator_threshold_is_the_one_nearest_0_within_the_tolerance_of_the_best():
    from teller.rca.train import OP_TOLERANCE, pick_threshold

    # a flat grid rising by 0.001 per step to the far end (a run-split val part): the best row is
    # noise, the rows within the tolerance reach down to 1.5
    flat = [{"threshold": t, "macro_plus_f1": f} for t, f in
            [(-2.0, 0.8729), (0.0, 0.8838), (1.0, 0.8876), (1.5, 0.8915), (2.0, 0.8922), (4.0, 0.8938), (6.0, 0.8946)]]
    assert OP_TOLERANCE == 0.005 and pick_threshold(flat)["threshold"] == 1.5
    assert pick_threshold(flat, tolerance=0.0)["threshold"] == 6.0
    # a peaked grid keeps its peak; a tie at equal distance from 0 takes the lower threshold
    peak = [{"threshold": t, "macro_plus_f1": f} for t, f in [(-1.0, 0.80), (0.0, 0.84), (1.0, 0.86), (2.0, 0.84)]]
    assert pick_threshold(peak)["threshold"] == 1.0
    tie = [{"threshold": t, "macro_plus_f1": 0.9} for t in (-0.5, 0.5, 1.0)]
    assert pick_threshold(tie)["threshold"] == -0.5


def test_operator_threshold_is_chosen_on_held_out_units_and_moves_only_the_operators(trained, ds, tmp_path):
    """Training ends by choosing the operator head's threshold on the val part (the grid's best
    Macro₊ there, recomputed here by hand); predictions use it, and changing it changes which
    operators a flagged step names, never its flag or type."""
    import shutil

    from teller.rca import load
    from teller.rca.metrics import operator_metrics
    from teller.rca.train import OP_THRESHOLDS, OP_TOLERANCE, calibrate, evaluate, prepare_units

    out, _ = trained
    m = load(out)
    cal = m.meta["calibration"]  # written by train()
    assert cal["part"] == "val" and cal["split"] == "request" and cal["op_threshold"] in OP_THRESHOLDS
    assert [r["threshold"] for r in cal["grid"]] == list(OP_THRESHOLDS) and m.op_threshold == cal["op_threshold"]
    idx = ds.units.part("request", "val")
    u = ds.units.select(idx)
    truth = [set(o) if a else set() for o, a in zip(u.operator_labels, u.is_anomaly, strict=True)]
    prep, _ = prepare_units(ds, idx, m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
    for r in cal["grid"]:  # each row is the Macro₊ of predict()'s own operator sets at that threshold
        m.meta["calibration"] = {"op_threshold": r["threshold"], "abnormal_cut": cal["abnormal_cut"]}
        pred = m.predict(prep, explain=False)
        got = operator_metrics(truth, [set(p["evidence_operators"]) if p["abnormal"] else set() for p in pred])
        assert got["macro_plus_f1"] == pytest.approx(r["macro_plus_f1"], abs=1e-6)
    top = max(r["macro_plus_f1"] for r in cal["grid"])
    near = [r["threshold"] for r in cal["grid"] if r["macro_plus_f1"] >= top - OP_TOLERANCE]
    assert cal["macro_plus_f1_best"] == top and cal["op_threshold"] == min(near, key=lambda t: (abs(t), t))
    assert calibrate(load(out), ds, "request", "val") == cal  # deterministic
    # thresholds above / below every logit (saved, read back): flags and types unchanged
    base, _, _ = evaluate(load(out), ds, "request", "train", explain=False)
    for name, t in (("high", 1e9), ("low", -1e9)):
        copy = tmp_path / name
        shutil.copytree(out, copy)
        load(copy).save_config(copy, {"calibration": {**cal, "op_threshold": t}})
        assert load(copy).op_threshold == t
        got, _, _ = evaluate(load(copy), ds, "request", "train", explain=False)
        assert [(p["abnormal"], p["fault_type"]) for p in got] == [(p["abnormal"], p["fault_type"]) for p in base]
    # a unit typed abnormal names its best token's family above every logit, up to max_ops below
    heads = m.operator_logits(prep)
    one = [m.evidence_families(prep, i, "kernel", sc, 1e9) for i, (_, sc) in enumerate(heads)]
    many = [m.evidence_families(prep, i, "kernel", sc, -1e9) for i, (_, sc) in enumerate(heads)]
    assert all(len(f) == 1 for f in one) and all(1 <= len(f) <= m.cfg.max_ops for f in many)
    assert any(len(f) > 1 for f in many) and all(a[0] in b for a, b in zip(one, many, strict=True))
    assert all(m.evidence_families(prep, i, "", sc, -1e9) == [] for i, (_, sc) in enumerate(heads))  # normal: none


def test_a_token_names_the_label_layer_nodes_it_covers():
    """A TPE token merged from a module and its child module (one token, two FE nodes) names
    both as evidence and as candidates; a BE token covering several ops names its anchor only."""
    from teller.rca.data import StepInputs

    fams = ["STEP", "FE TPDecoderLayer", "FE TPAttention", "BE aten::mm", "BE aten::add"]
    # nodes: STEP, FE TPDecoderLayer, FE TPAttention, BE aten::mm, BE aten::add
    # tokens: [STEP], [DecoderLayer + Attention], [mm + add]
    inp = StepInputs(np.array([5, 6, 7], np.int32), np.array([-1, 0, 1], np.int32), np.array([0, 1, 2], np.int32),
                     np.array([10, 8, 3]), np.array([0, 1, 3]), np.array([0, 1, 3], np.int32), np.array([0, 3]),
                     np.arange(5), np.arange(5, dtype=np.int32), np.array([0, 5]), fams, [""],
                     first_node=np.array([0, 1, 3]), span=np.array([1, 2, 2]))
    assert inp.covered(0, 0) == [0] and inp.covered(0, 1) == [1, 2] and inp.covered(0, 2) == [3]
    assert inp.candidates(0) == ["BE aten::mm", "FE TPAttention", "FE TPDecoderLayer", "STEP"]
    scores = np.array([-5.0, 4.0, 1.0])
    nodes = project_operators(scores, inp.anchor, True, 5, 0.0, lambda t: inp.covered(0, t))
    assert nodes == [1, 2, 3]
    assert project_operators(scores, inp.anchor, True, 5, 0.0) == [1, 3]  # anchors only
    assert project_operators(scores, inp.anchor, True, 1, 0.0, lambda t: inp.covered(0, t)) == [1]  # max_ops bounds nodes
    # without spans (inputs built before they existed) a token names its anchor
    old = StepInputs(inp.input_ids, inp.parent_idx, inp.depth, inp.duration, inp.anchor, inp.family, inp.offsets,
                     inp.node_id, inp.node_family, inp.node_offsets, fams, [""])
    assert old.covered(0, 1) == [1] and "FE TPAttention" not in old.candidates(0)
