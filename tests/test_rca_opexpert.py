"""The operator expert (:mod:`teller.rca.opexpert`): trees on each family slot's times against the
reference, beside its unit's other slots and layer mix, whose probability is mixed with the family
head's at a weight chosen on the val part. Hand-computed mixing, the slot features checked column
by column on real units, a save/load round trip with its refusals, and a tiny model that fits the
expert at the end of training and names the families the mix ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rca_slice import (
    broken_expert_files,
    iteration_units,
    need_rca,
    prepared_units,
    refused_without,
    tiny_family_model,
)

torch = need_rca()
pytest.importorskip("xgboost")

from teller.errors import TellerError  # noqa: E402
from teller.rca.opexpert import (  # noqa: E402
    LAYERS,
    OP_EXPERT_FILE,
    OP_WEIGHTS,
    OperatorExpert,
    fuse_logits,
    slot_features,
)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_fuse_logits_mixes_probabilities_around_the_threshold():
    logits = np.array([2.0, -1.0, -np.inf, np.nan])
    expert = np.array([0.1, 0.9, 0.6, 0.2])
    t = 1.0
    out = fuse_logits(logits, expert, 0.5, t)
    # s = 0.5 σ(l − 1) + 0.5 p: 0.5·0.7311 + 0.05, 0.5·0.1192 + 0.45, 0 + 0.3, 0 + 0.1
    s = np.array([0.5 * _sig(1.0) + 0.05, 0.5 * _sig(-2.0) + 0.45, 0.3, 0.1])
    assert _sig(out - t) == pytest.approx(s)
    assert (out > t).tolist() == [False, True, False, False]  # 0.4155, 0.5096, 0.3, 0.1
    assert np.argsort(-out).tolist() == [1, 0, 2, 3]
    # weight 0: the head at its threshold (finite logits unchanged); weight 1: the expert alone
    assert fuse_logits(logits[:2], expert[:2], 0.0, t) == pytest.approx(logits[:2])
    assert _sig(fuse_logits(logits, expert, 1.0, t) - t) == pytest.approx(expert)


@pytest.fixture(scope="module")
def ds():
    return iteration_units()


@pytest.fixture(scope="module")
def trained(ds, tmp_path_factory):
    return tiny_family_model(ds, tmp_path_factory.mktemp("opx") / "m")


_prep = prepared_units


def test_slot_features_column_by_column(ds, trained):
    from teller.rca import load

    m = load(trained)
    prep = _prep(ds, m)
    X = slot_features(prep, m.ref).astype(np.float64)
    sl, inp = prep.slots, prep.inputs
    F = prep.slot_feat.shape[1]  # 6: time, count and span, each with its z
    assert F == 6 and X.shape == (len(sl.family), F + 3 * 2 + len(LAYERS) + 1 + 1 + 1 + prep.unit_feat.shape[1])
    assert np.allclose(X[:, :F], prep.slot_feat)
    for i in range(len(inp)):
        s = sl.slots(i)
        if s.stop == s.start:
            continue
        rows = X[s]
        for k, c in enumerate(range(1, F, 2)):
            z = prep.slot_feat[s, c].astype(np.float64)
            gap, rank = rows[:, F + 2 * k], rows[:, F + 2 * k + 1]
            assert gap == pytest.approx(z - z.max(), abs=1e-5)
            assert sorted(rank.tolist()) == list(range(len(z)))  # a rank per slot, 0 the largest z
            assert z[int(np.argmin(rank))] == pytest.approx(z.max())
        names = [inp.families[int(f)] for f in sl.family[s]]
        lay = rows[:, F + 6:F + 6 + len(LAYERS) + 1]
        want = [LAYERS.index(n.split(" ", 1)[0]) if n.split(" ", 1)[0] in LAYERS else len(LAYERS) for n in names]
        assert lay.sum(1).tolist() == [1.0] * len(names) and lay.argmax(1).tolist() == want
        row = rows[:, F + 6 + len(LAYERS) + 1]
        assert row.tolist() == [float(m.ref.family_names.index(n)) if n in m.ref.family_names else -1.0 for n in names]
        assert rows[:, F + 6 + len(LAYERS) + 2].tolist() == [float(len(names))] * len(names)
        assert np.allclose(rows[:, F + 6 + len(LAYERS) + 3:], prep.unit_feat[i][None])


def test_expert_round_trip_and_refusals(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(0, 1, (200, 5))
    y = (X[:, 0] + 0.3 * rng.normal(0, 1, 200) > 0.5).astype(int)
    ex = OperatorExpert.fit(X, y, seed=0)
    p = ex.proba(X)
    assert p.shape == (200,) and ((p >= 0) & (p <= 1)).all()
    assert p[y == 1].mean() > p[y == 0].mean() + 0.5  # it learned the slot's first feature
    ex.save(tmp_path)
    again = OperatorExpert.load(tmp_path)
    assert again.n_features == 5 and np.allclose(again.proba(X), p)
    with pytest.raises(TellerError, match="5 features"):
        again.proba(X[:, :4])
    with pytest.raises(TellerError, match="labelled and unlabelled"):
        OperatorExpert.fit(X, np.zeros(200, int))
    broken_expert_files(OperatorExpert, tmp_path, OP_EXPERT_FILE)


def test_a_model_fits_its_operator_expert_and_names_by_the_mix(ds, trained, tmp_path):
    from teller.rca import load
    from teller.rca.train import calibrate

    cal = json.loads((trained / "config.json").read_text())["calibration"]
    if "op_weight" not in cal:
        pytest.skip("the slice's abnormal training units hold no slot of one kind")
    assert (trained / OP_EXPERT_FILE).is_file() and cal["op_weight"] in OP_WEIGHTS
    block = cal["op_expert"]
    assert [r["weight"] for r in block["grid"]] == list(OP_WEIGHTS) and block["chosen"] == cal["op_weight"]
    assert 0 < block["labelled_slots"] < block["train_slots"]
    m = load(trained)
    assert m.op_expert is not None and m.op_weight == cal["op_weight"]
    prep = _prep(ds, m)
    p_ex = m.op_expert.proba(slot_features(prep, m.ref))
    # the families predict() names are those the mix ranks, worked out here from its parts
    m.meta["calibration"]["op_weight"] = 1.0
    m.meta["calibration"]["abnormal_cut"] = 1e-6  # every unit flagged: each names its families
    t = m.op_threshold
    heads = m.operator_logits(prep)
    pred = m.predict(prep, explain=False)
    flagged = 0
    for i, (p, (_ft, sc)) in enumerate(zip(pred, heads, strict=True)):
        if not p["abnormal"]:
            assert p["evidence_operators"] == []
            continue
        flagged += 1
        s = prep.slots.slots(i)
        assert np.allclose(sc.expert, p_ex[s])
        mix = _sig(fuse_logits(sc.families, p_ex[s], 1.0, t) - t)
        assert mix == pytest.approx(p_ex[s], abs=1e-6)
        order = np.argsort(-mix, kind="stable")
        picked = [int(k) for k in order if mix[k] > 0.5] or [int(order[0])]
        names = [prep.inputs.families[int(prep.slots.family[s.start + k])] for k in picked[:m.cfg.max_ops]]
        assert p["evidence_operators"] == list(dict.fromkeys(names))
    assert flagged == len(pred)
    # weight 0 names what the head alone names (scores without the expert's column)
    from teller.rca.api import FamilyScores

    m.meta["calibration"]["op_weight"] = 0.0
    alone = m.predict(prep, explain=False)
    for i, (p, (ft, sc)) in enumerate(zip(alone, heads, strict=True)):
        want = m.evidence_families(prep, i, ft, FamilyScores(sc.tokens, sc.families), t, op_weight=1.0) if ft else []
        assert p["evidence_operators"] == want
    # recalibrating keeps the expert's weight; a directory without the expert's file is refused
    assert calibrate(load(trained), ds, "request", "val")["op_weight"] == cal["op_weight"]
    refused_without(trained, OP_EXPERT_FILE, tmp_path)


def test_no_op_expert_and_a_token_head_fit_none(ds, tmp_path):
    from teller.rca import load
    from teller.rca.train import fit_op_expert, train

    plain = tmp_path / "plain"
    train(ds, plain, variant="mot", split="request", config="tiny", epochs=1, max_steps=2, seed=0, progress=False,
          log=lambda m: None, unit="iteration", op_unit="family", unit_stats=True, op_expert=False, type_expert=False)
    m = load(plain)
    assert not (plain / OP_EXPERT_FILE).exists() and m.op_expert is None and m.op_weight == 0.0
    tok = tmp_path / "tok"
    train(ds, tok, variant="mot", split="request", config="tiny", epochs=1, max_steps=2, seed=0, progress=False,
          log=lambda m: None, unit="iteration", op_unit="token", unit_stats=True, type_expert=False)
    assert not (tok / OP_EXPERT_FILE).exists()
    with pytest.raises(TellerError, match="--op-unit family"):
        fit_op_expert(load(tok), ds, "request")


def test_training_records_the_workload_shapes_it_learnt_from(trained, ds):
    """config.json names the workload shapes of the training part's runs (`teller diagnose` lets the
    model read every step of runs of these shapes only); the slice's two runs are both 2-layer."""
    import json

    from teller.rca.data import training_workloads

    tr = json.loads((trained / "config.json").read_text())["training"]
    assert tr["workloads"] == ["2 layers, hidden 1024"]
    assert training_workloads(ds, ds.units.part("request", "train")) == tr["workloads"]
    assert training_workloads(ds, np.zeros(0, np.int64)) == []
