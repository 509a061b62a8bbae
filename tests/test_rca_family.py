"""The MoT's family operator head (``RCAConfig.op_unit`` "family"): the family slots of a unit, their
reference statistics, and a tiny model that trains, names only its units' families and reloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rca_slice import iteration_units, need_rca, saved_and_broken

torch = need_rca()

from teller.rca.data import ReferenceStats, StepInputs, family_slots  # noqa: E402

FAMS = ["BE aten::add", "BE aten::mm", "COMM all_reduce", "FE TPAttention", "FE TPDecoderLayer", "STEP"]


def _two_units() -> StepInputs:
    """Unit 0: STEP > DecoderLayer > Attention > mm, add; tokens [STEP] [DecoderLayer+Attention]
    [mm+add]. Unit 1: STEP > DecoderLayer, DecoderLayer > all_reduce; tokens [STEP] [DecoderLayer]
    [DecoderLayer] [all_reduce]."""
    f = {n: i for i, n in enumerate(FAMS)}
    node_family = np.array([f["STEP"], f["FE TPDecoderLayer"], f["FE TPAttention"], f["BE aten::mm"], f["BE aten::add"],
                            f["STEP"], f["FE TPDecoderLayer"], f["FE TPDecoderLayer"], f["COMM all_reduce"]], np.int32)
    node_duration = np.array([100, 40, 30, 20, 10, 200, 50, 70, 25], np.int64)
    return StepInputs(
        input_ids=np.array([5, 6, 7, 5, 8, 8, 9], np.int32), parent_idx=np.array([-1, 0, 1, -1, 0, 0, 2], np.int32),
        depth=np.array([0, 1, 2, 0, 1, 1, 2], np.int32), duration=np.array([100, 70, 30, 200, 50, 70, 25]),
        anchor=np.array([0, 1, 3, 0, 1, 2, 3]),
        family=np.array([f["STEP"], f["FE TPDecoderLayer"], f["BE aten::mm"], f["STEP"], f["FE TPDecoderLayer"],
                         f["FE TPDecoderLayer"], f["COMM all_reduce"]], np.int32),
        offsets=np.array([0, 3, 7]), node_id=np.arange(9), node_family=node_family, node_offsets=np.array([0, 5, 9]),
        families=FAMS, log_text=["", ""], first_node=np.array([0, 1, 3, 0, 1, 2, 3]), span=np.array([1, 2, 2, 1, 1, 1, 1]),
        node_duration=node_duration,
        # spans: a parent's span covers its children's (unit 0: STEP 200 > DecoderLayer 100 > Attention 60)
        node_span=np.array([200, 100, 60, 20, 10, 345, 50, 95, 25], np.int64))


def test_slots_are_the_label_layer_families_with_their_summed_time_and_tokens():
    inp = _two_units()
    sl = family_slots(inp)
    names = [[FAMS[int(f)] for f in sl.family[sl.slots(i)]] for i in range(2)]
    assert names == [["FE TPAttention", "FE TPDecoderLayer", "STEP"], ["COMM all_reduce", "FE TPDecoderLayer", "STEP"]]
    assert sl.duration.tolist() == [30, 40, 100, 25, 120, 200] and sl.count.tolist() == [1, 1, 1, 1, 2, 1]
    assert sl.span.tolist() == [60, 100, 200, 25, 145, 345]  # summed whole time, as the labels sum it per family
    members = [sorted(zip(sl.member_tok[sl.members(i)].tolist(), sl.member_slot[sl.members(i)].tolist(), strict=True)) for i in range(2)]
    # unit 0: the merged token stands for both modules, the BE token for no slot
    assert members[0] == [(0, 2), (1, 0), (1, 1)]
    assert members[1] == [(0, 2), (1, 1), (2, 1), (3, 0)]
    # a selection keeps the node times: the slots of a unit alone are the same
    one = family_slots(inp.select(np.array([1])))
    assert one.duration.tolist() == [25, 120, 200] and one.member_slot.tolist() == sl.member_slot[sl.members(1)].tolist()


def test_family_reference_scores_slots_against_their_own_family_and_round_trips(tmp_path):
    inp = _two_units()
    sl = family_slots(inp)
    ref = ReferenceStats.fit(inp.input_ids, inp.duration, 16)
    ref.fit_families(sl, inp.families, min_count=1)
    assert sorted(ref.family_names) == ["COMM all_reduce", "FE TPAttention", "FE TPDecoderLayer", "STEP"]
    feat = ref.family_features(sl, inp.families)
    assert feat.shape == (6, 4) and feat.dtype == np.float32
    dl = [i for i in range(6) if FAMS[int(sl.family[i])] == "FE TPDecoderLayer"]
    # two slots of one family: z of opposite signs around their median; a lone slot: z 0
    assert feat[dl[0], 1] < 0 < feat[dl[1], 1]
    assert feat[0, 1] == pytest.approx(0.0) and feat[0, 0] == pytest.approx(np.log1p(30 / 1e3) / 8, rel=1e-6)
    ref.save(tmp_path / "reference.json")
    back = ReferenceStats.load(tmp_path / "reference.json")
    assert back.family_names == ref.family_names and np.allclose(back.family_features(sl, inp.families), feat, atol=1e-5)
    # a family the reference never saw takes the pooled statistics
    other = ref.family_features(sl, ["BE aten::add", "BE aten::mm", "COMM other", "FE TPAttention", "FE TPDecoderLayer", "STEP"])
    assert other[3, 1] != pytest.approx(feat[3, 1])
    bad = json.loads((tmp_path / "reference.json").read_text())
    bad["families"]["names"] = bad["families"]["names"][:1]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    from teller.errors import InputError

    with pytest.raises(InputError, match="families"):
        ReferenceStats.load(tmp_path / "bad.json")


def test_family_reference_with_spans_has_six_columns_and_checks_them(tmp_path):
    from teller.errors import InputError, TellerError

    inp = _two_units()
    sl = family_slots(inp)
    ref = ReferenceStats.fit(inp.input_ids, inp.duration, 16).fit_families(sl, inp.families, min_count=1, span=True)
    assert ref.family_span and ref.family_stats.shape == (4, 6) and len(ref.family_pooled) == 6
    feat = ref.family_features(sl, inp.families)
    plain = ReferenceStats.fit(inp.input_ids, inp.duration, 16).fit_families(sl, inp.families, min_count=1)
    assert feat.shape == (6, 6) and np.allclose(feat[:, :4], plain.family_features(sl, inp.families))
    # the two DecoderLayer slots: spans 100 and 145 around their median, z of opposite signs
    dl = [i for i in range(6) if FAMS[int(sl.family[i])] == "FE TPDecoderLayer"]
    assert feat[dl[0], 5] < 0 < feat[dl[1], 5] and feat[0, 4] == pytest.approx(np.log1p(60 / 1e3) / 8, rel=1e-6)
    back, bad = saved_and_broken(ref, tmp_path, lambda d: d["families"].update(stats=[r[:4] for r in d["families"]["stats"]]))
    assert back.family_span and np.allclose(back.family_features(sl, inp.families), feat, atol=1e-5)
    with pytest.raises(InputError, match="shape"):
        ReferenceStats.load(bad)
    no_span = _two_units()
    no_span.node_span = np.zeros(0, np.int64)
    with pytest.raises(TellerError, match="spans"):
        ref.family_features(family_slots(no_span), inp.families)


@pytest.fixture(scope="module")
def ds():
    return iteration_units()


def test_a_family_head_trains_names_its_units_families_and_reloads(ds, tmp_path):
    from teller.rca import load
    from teller.rca.api import FamilyScores
    from teller.rca.train import evaluate, prepare_units, train

    out = tmp_path / "fam"
    s = train(ds, out, variant="mot", split="request", config="tiny", epochs=6, max_steps=50, seed=0, progress=False,
              log=lambda m: None, unit="iteration", op_unit="family")
    fam_loss = [c["fam"] for c in s["curve"]]
    assert len(fam_loss) >= 4 and np.mean(fam_loss[-2:]) < fam_loss[0]
    m = load(out)
    assert m.cfg.op_unit == "family" and m.ref.family_names and "calibration" in m.meta
    idx = ds.units.part("request", "test")
    prep, _ = prepare_units(ds, idx, m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
    heads = m.operator_logits(prep)
    assert all(isinstance(sc, FamilyScores) and len(sc.families) == prep.slots.offsets[i + 1] - prep.slots.offsets[i]
               for i, (_, sc) in enumerate(heads))
    for i, (_, sc) in enumerate(heads):
        slot_fams = {prep.inputs.families[int(f)] for f in prep.slots.family[prep.slots.slots(i)]}
        one = m.evidence_families(prep, i, "kernel", sc, 1e9)
        many = m.evidence_families(prep, i, "kernel", sc, -1e9)
        assert len(one) == 1 and one[0] == many[0] and set(many) <= slot_fams
        assert len(many) == min(len(slot_fams), m.cfg.max_ops)
        assert m.evidence_families(prep, i, "", sc, -1e9) == []
    pred, _, _ = evaluate(m, ds, "request", "test", explain=False)
    again, _, _ = evaluate(load(out), ds, "request", "test", explain=False)
    assert [(p["abnormal"], p["fault_type"], p["evidence_operators"]) for p in pred] == \
        [(p["abnormal"], p["fault_type"], p["evidence_operators"]) for p in again]


def test_real_slot_spans_cover_their_self_time_and_a_span_head_trains_and_reloads(ds, tmp_path):
    from teller.errors import InputError
    from teller.rca import load
    from teller.rca.data import encode_units
    from teller.rca.train import train

    u = ds.units
    out = tmp_path / "span"
    train(ds, out, variant="mot", split="request", config="tiny", epochs=2, max_steps=12, seed=0, progress=False,
          log=lambda m: None, unit="iteration", op_unit="family", fam_span=True)
    m = load(out)
    assert m.cfg.fam_span and m.ref.family_span and m.net.fam_feat[0].in_features == 6
    idx = np.arange(min(20, len(u)))
    inp = encode_units(ds.forest, m.trace_tok, u.run_id[idx].tolist(), [u.step_ids[i] for i in idx.tolist()],
                       [u.log_text[i] for i in idx.tolist()], m.cfg.max_trace_tokens)
    sl = family_slots(inp)
    fam = np.asarray(inp.families)[sl.family]
    assert (sl.span >= sl.duration).all()  # a node's span holds its self time
    # STEP and COMM slots hold their children's time (kernels, the collective's calls)
    for name in ("STEP", "COMM all_reduce"):
        k = fam == name
        assert k.any() and (sl.span[k] > sl.duration[k]).any()
    pred = m.predict(m.prepare(inp), explain=False)
    assert len(pred) == len(idx)
    cfg = json.loads((out / "config.json").read_text())
    cfg["config"]["fam_span"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="fam_span"):
        load(out)


def test_the_evaluate_rows_take_the_model_of_their_operator_head(tmp_path):
    from teller.baselines.base import make

    for name, op in (("token_m", "token"), ("family_m", "family")):
        d = tmp_path / name
        d.mkdir()
        cfg = {"variant": "mot", "inputs": "trace+log", "unit": "iteration"}
        if op == "family":
            cfg["op_unit"] = "family"
        (d / "config.json").write_text(json.dumps({"config": cfg, "training": {"split": "run", "seed": 0}}))
    assert make("teller_mot", 0)._find(tmp_path, "run").name == "token_m"
    assert make("teller_mot_family", 0)._find(tmp_path, "run").name == "family_m"
    assert make("teller_mot_family", 0)._find(tmp_path, "request") is None


def test_the_fused_family_rows_fuse_the_family_model():
    from teller.baselines.base import make

    for name, plain in (("teller_confirm_deploy_family", "teller_confirm_deploy"),
                        ("teller_screened_deploy_family", "teller_screened_deploy"),
                        ("teller_episodes_family", "teller_episodes")):
        fam, tok = make(name, 0), make(plain, 0)
        assert fam.mot == "teller_mot_family" and tok.mot == "teller_mot"
        assert (fam.rule, fam.tau, fam.stage) == (tok.rule, tok.tau, tok.stage) and isinstance(fam, type(tok))
