"""The fault-type expert (:mod:`teller.rca.typer`): trees on the unit's layer mix whose type
probabilities are mixed with the fault head's by a weight chosen on the val part; the abnormal
probability stays the head's. Hand-computed mixing, a save/load round trip with its refusals, and a
tiny model that fits the expert at the end of training and types its units by the mix."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rca_slice import broken_expert_files, iteration_units, need_rca, refused_without

torch = need_rca()
pytest.importorskip("xgboost")

from teller.errors import TellerError  # noqa: E402
from teller.rca.typer import TYPE_EXPERT_FILE, TYPE_WEIGHTS, TypeExpert, fuse  # noqa: E402


def test_fuse_shares_the_abnormal_mass_by_the_weight():
    probs = np.array([[0.2, 0.4, 0.4, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    expert = np.array([[0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0, 2.0]])  # rows normalised
    half = fuse(probs, expert, 0.5)
    # head over the types (0.5, 0.5, 0, 0, 0), expert (0, 1, 0, 0, 0): mix (0.25, 0.75, ...) of 0.8
    assert half[0] == pytest.approx([0.2, 0.2, 0.6, 0.0, 0.0, 0.0])
    assert fuse(probs, expert, 0.0)[0] == pytest.approx(probs[0])
    assert fuse(probs, expert, 1.0)[0] == pytest.approx([0.2, 0.0, 0.8, 0.0, 0.0, 0.0])
    # no abnormal mass: nothing to share, the normal class keeps it all
    assert half[1] == pytest.approx([1.0, 0, 0, 0, 0, 0])
    assert np.allclose(half.sum(1), 1.0)


def test_expert_fits_types_it_saw_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    X = np.r_[rng.normal(0, 1, (60, 6)), rng.normal(3, 1, (60, 6))]
    y = np.r_[np.full(60, 1), np.full(60, 3)]  # "memory" and "runtime" of the five
    ex = TypeExpert.fit(X, y, seed=0)
    p = ex.proba(np.array([[0.0] * 6, [3.0] * 6]))
    assert p.shape == (2, 5) and np.allclose(p.sum(1), 1.0)
    assert p[:, [0, 2, 4]].max() == 0.0 and p[0].argmax() == 1 and p[1].argmax() == 3
    ex.save(tmp_path)
    again = TypeExpert.load(tmp_path)
    assert again.classes == [1, 3] and np.allclose(again.proba(X), ex.proba(X))
    with pytest.raises(TellerError, match="two fault types"):
        TypeExpert.fit(X, np.full(120, 2))
    broken_expert_files(TypeExpert, tmp_path, TYPE_EXPERT_FILE)


@pytest.fixture(scope="module")
def ds():
    return iteration_units()


def test_a_model_fits_its_type_expert_and_types_by_the_mix(ds, tmp_path):
    from teller.rca import load
    from teller.rca.data import encode_units
    from teller.rca.train import train

    types = {int(f) for f, a in zip(ds.units.fault, ds.units.is_anomaly, strict=True) if a}
    if len(types) < 2:
        pytest.skip("the slice's abnormal units hold one fault type")
    out = tmp_path / "m"
    train(ds, out, variant="mot", split="request", config="tiny", epochs=1, max_steps=4, seed=0, progress=False,
          log=lambda m: None, unit="iteration", unit_stats=True)
    cal = json.loads((out / "config.json").read_text())["calibration"]
    assert (out / TYPE_EXPERT_FILE).is_file() and cal["type_weight"] in TYPE_WEIGHTS
    block = cal["type_expert"]
    assert [r["weight"] for r in block["grid"]] == list(TYPE_WEIGHTS) and block["chosen"] == cal["type_weight"]
    m = load(out)
    assert m.type_expert is not None and m.type_weight == cal["type_weight"]
    # the grid is the fault-type macro-F1 `teller evaluate` reports (every type in the truth or
    # the answers), recomputed here from the val part's abnormal units
    from teller.rca.metrics import macro_f1
    from teller.rca.train import prepare_units
    from teller.rca.typer import TYPES

    va = ds.units.part("request", "val")
    va = va[ds.units.is_anomaly[va].astype(bool)]
    vprep, _ = prepare_units(ds, va, m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
    vhead, vex = m.fault_probs(vprep), m.type_expert.proba(vprep.unit_feat)
    truth = [TYPES[int(f) - 1] for f in ds.units.fault[va]]
    for r in block["grid"]:
        ans = [TYPES[k] for k in fuse(vhead, vex, r["weight"])[:, 1:].argmax(1).tolist()]
        assert r["macro_f1"] == pytest.approx(macro_f1(truth, ans, TYPES)["macro_f1"], abs=1e-6)
    # the types predict() names are the argmax of the mix, worked out here from its parts
    u = ds.units
    idx = np.arange(min(32, len(u)))
    inp = encode_units(ds.forest, m.trace_tok, u.run_id[idx].tolist(), [u.step_ids[i] for i in idx.tolist()],
                       [u.log_text[i] for i in idx.tolist()], m.cfg.max_trace_tokens, u.view[idx].tolist())
    prep = m.prepare(inp)
    head = m.fault_probs(prep)
    mixed = fuse(head, m.type_expert.proba(prep.unit_feat), 1.0)  # the expert alone
    m.meta["calibration"]["type_weight"] = 1.0
    pred = m.predict(prep, explain=False)
    from teller.rca.data import FAULT_TYPES

    assert [p["fault_type_best"] for p in pred] == [FAULT_TYPES[1 + int(k)] for k in mixed[:, 1:].argmax(1)]
    assert [p["abnormal_prob"] for p in pred] == pytest.approx((1.0 - head[:, 0]).tolist(), abs=1e-6)
    assert np.allclose(m.fault_probs(prep, expert=True), mixed)
    # recalibrating keeps the expert's weight; a directory without the expert's file is refused
    from teller.rca.train import calibrate

    assert calibrate(load(out), ds, "request", "val")["type_weight"] == cal["type_weight"]
    refused_without(out, TYPE_EXPERT_FILE, tmp_path)
    plain = tmp_path / "plain"
    train(ds, plain, variant="mot", split="request", config="tiny", epochs=1, max_steps=2, seed=0, progress=False,
          log=lambda m: None, unit="iteration", unit_stats=True, type_expert=False)
    assert not (plain / TYPE_EXPERT_FILE).exists() and load(plain).type_weight == 0.0
