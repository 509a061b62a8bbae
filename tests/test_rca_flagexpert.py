"""The flag expert (:mod:`teller.rca.flagexpert`): trees on the unit's shape-free context (or its
layer mix) whose abnormal probability is mixed with the fault head's by a weight chosen with the
abnormal cut on the val part; the types keep the head's shares. Hand-computed mixing, a save/load
round trip with its refusals, and a tiny model that fits the expert at the end of training and
flags by the mix."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rca_slice import broken_expert_files, iteration_units, need_rca, refused_without

torch = need_rca()
pytest.importorskip("xgboost")

from teller.errors import InputError, TellerError  # noqa: E402
from teller.rca.flagexpert import FLAG_EXPERT_FILE, FLAG_WEIGHTS, FlagExpert, fuse, mix  # noqa: E402


def test_fuse_mixes_the_abnormal_mass_and_keeps_the_heads_type_shares():
    probs = np.array([[0.2, 0.4, 0.4, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    px = np.array([0.0, 0.6, 1.0])
    half = fuse(probs, px, 0.5)
    # row 0: mass 0.8 and 0.0 → 0.4, shared (0.5, 0.5) as the head shares it
    assert half[0] == pytest.approx([0.6, 0.2, 0.2, 0.0, 0.0, 0.0])
    # row 1: the head gives the types nothing, the expert 0.6 → 0.3 shared uniformly
    assert half[1] == pytest.approx([0.7] + [0.06] * 5)
    assert half[2] == pytest.approx([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    assert np.allclose(half.sum(1), 1.0)
    assert np.array_equal(fuse(probs, px, 0.0), probs)
    assert fuse(probs, px, 1.0)[:, 0] == pytest.approx(1.0 - px)
    assert mix(np.array([0.2, 1.0]), np.array([0.6, 0.0]), 0.25) == pytest.approx([0.3, 0.75])


def test_expert_fits_both_kinds_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    X = np.r_[rng.normal(0, 1, (80, 5)), rng.normal(3, 1, (40, 5))]
    y = np.r_[np.zeros(80, bool), np.ones(40, bool)]
    ex = FlagExpert.fit(X, y, seed=0)
    p = ex.proba(np.array([[0.0] * 5, [3.0] * 5]))
    assert p.shape == (2,) and p[0] < 0.2 and p[1] > 0.8
    assert ex.proba(np.zeros((0, 5))).shape == (0,)
    ex.save(tmp_path)
    back = FlagExpert.load(tmp_path)
    assert np.allclose(back.proba(X), ex.proba(X)) and back.reads == ex.reads == "stats"
    FlagExpert.fit(X, y, reads="context").save(tmp_path)
    assert FlagExpert.load(tmp_path).reads == "context"
    with pytest.raises(TellerError, match="context"):
        FlagExpert.fit(X, y, reads="layers")
    ex.booster.set_attr(teller_reads="layers")  # an expert of a later version
    ex.save(tmp_path)
    ex.booster.set_attr(teller_reads="layers")
    ex.booster.save_model(str(tmp_path / FLAG_EXPERT_FILE))
    with pytest.raises(InputError, match="reads 'layers'"):
        FlagExpert.load(tmp_path)
    with pytest.raises(TellerError, match="normal and abnormal"):
        FlagExpert.fit(X, np.zeros(120, bool))
    with pytest.raises(TellerError, match="120 labels"):
        FlagExpert.fit(X[:10], y)
    broken_expert_files(FlagExpert, tmp_path, FLAG_EXPERT_FILE)


@pytest.fixture(scope="module")
def ds():
    return iteration_units()


def test_a_model_fits_its_flag_expert_and_flags_by_the_mix(ds, tmp_path):
    from teller.rca import load
    from teller.rca.data import encode_units
    from teller.rca.train import (
        abnormal_block,
        calibrate,
        fit_flag_expert,
        part_units,
        train,
        unit_features,
    )

    u = ds.units
    va = u.part("request", "val")
    if u.is_anomaly[va].all() or not u.is_anomaly[va].any():
        pytest.skip("the slice's val part holds one kind of unit")
    out = tmp_path / "m"
    train(ds, out, variant="mot", split="request", config="tiny", epochs=1, max_steps=4, seed=0, progress=False,
          log=lambda m: None, unit="iteration", unit_stats=True)
    cal = json.loads((out / "config.json").read_text())["calibration"]
    assert (out / FLAG_EXPERT_FILE).is_file() and cal["flag_weight"] in FLAG_WEIGHTS
    block = cal["flag_expert"]
    assert [r["weight"] for r in block["grid"]] == list(FLAG_WEIGHTS) and block["chosen"] == cal["flag_weight"]
    tr = u.part("request", "train")
    assert block["train_units"] == int((u.view[tr] == "vertical").sum()) and block["views"] == ["vertical"]
    m = load(out)
    assert m.flag_expert is not None and m.flag_weight == cal["flag_weight"]
    # training fits the expert on the shape-free context; it reads every shape, where the
    # context is given
    assert m.flag_expert.reads == block["reads"] == "context"
    m.meta.setdefault("training", {})["workloads"] = ["2 layers, hidden 1024"]
    assert m.use_flag_expert("8 layers, hidden 4096") and m.flag_weight == cal["flag_weight"]
    assert not m.use_flag_expert("2 layers, hidden 1024", context=False) and m.flag_weight == 0.0
    assert m.abnormal_cut == next(r["cut"] for r in block["grid"] if r["weight"] == 0.0)
    # the same, with the expert on the layer mix (`--reads stats`), which the checks below follow
    m.use_flag_expert(None)
    block = fit_flag_expert(m, ds, "request", seed=0, reads="stats")["flag_expert"]
    cal = m.meta["calibration"]
    assert m.flag_expert.reads == block["reads"] == "stats" and cal["flag_expert"] is block
    # the grid, recomputed from the head and the expert on the val part: each weight's cut is the
    # one calibrate_abnormal picks on the mix, and the chosen weight has the best of them (the
    # lowest weight on a tie); the model's cut is the chosen weight's
    _, vprep = part_units(m, ds, "request", "val")
    head, px = m.abnormal_probs(vprep, flag=False), m.flag_expert.proba(vprep.unit_feat)
    assert np.allclose(px, m.flag_expert.proba(unit_features(m, ds, va)))
    truth = u.is_anomaly[va].astype(bool)
    on = (u.view[va] == "vertical").astype(float)  # the expert reads vertical units; the others keep the head's
    for r in block["grid"]:
        b = abnormal_block(mix(head, px, r["weight"] * on), truth, 0.1)
        assert (r["cut"], r["f1_at_prior"]) == (b["abnormal_cut"], b["f1_at_prior"])
    best = max(r["f1_at_prior"] for r in block["grid"])
    assert cal["flag_weight"] == min(r["weight"] for r in block["grid"] if r["f1_at_prior"] == best)
    assert m.abnormal_cut == next(r["cut"] for r in block["grid"] if r["weight"] == cal["flag_weight"])
    # predict() flags by the mix, worked out here from its parts, with the expert alone on the
    # vertical units (the horizontal ones keep the head's probability)
    idx = np.r_[np.flatnonzero(u.view == "vertical")[:16], np.flatnonzero(u.view == "horizontal")[:16]]
    inp = encode_units(ds.forest, m.trace_tok, u.run_id[idx].tolist(), [u.step_ids[i] for i in idx.tolist()],
                       [u.log_text[i] for i in idx.tolist()], m.cfg.max_trace_tokens, u.view[idx].tolist())
    prep = m.prepare(inp)
    raw = m.fault_probs(prep, flag=False)
    m.meta["calibration"]["flag_weight"] = 1.0
    pred = m.predict(prep, explain=False)
    vertical = u.view[idx] == "vertical"
    assert vertical.any() and (~vertical).any()
    alone = np.where(vertical, m.flag_expert.proba(prep.unit_feat), 1.0 - raw[:, 0])
    assert [p["abnormal_prob"] for p in pred] == pytest.approx(alone.tolist(), abs=1e-6)
    assert [p["abnormal"] for p in pred] == (alone >= m.abnormal_cut).tolist()
    assert np.allclose(m.abnormal_probs(prep), alone) and np.allclose(m.abnormal_probs(prep, flag=False), 1.0 - raw[:, 0])
    # a run of a workload shape the model was not trained on is read by the head alone, against
    # the cut chosen for the head alone (the grid's row of weight 0)
    m.meta["calibration"]["flag_weight"] = cal["flag_weight"]
    m.meta.setdefault("training", {})["workloads"] = ["2 layers, hidden 1024"]
    assert m.use_flag_expert("2 layers, hidden 1024") and m.flag_weight == cal["flag_weight"]
    assert m.abnormal_cut == cal["abnormal_cut"]
    assert not m.use_flag_expert("8 layers, hidden 4096") and m.flag_weight == 0.0
    assert m.abnormal_cut == next(r["cut"] for r in block["grid"] if r["weight"] == 0.0)
    assert np.allclose(m.abnormal_probs(prep), 1.0 - raw[:, 0])
    assert [p["abnormal"] for p in m.predict(prep, explain=False)] == ((1.0 - raw[:, 0]) >= m.abnormal_cut).tolist()
    assert not m.use_flag_expert(None)  # a run whose shape is not recorded
    m.meta["training"]["workloads"] = []  # a model that records no shapes keeps its expert
    assert m.use_flag_expert("8 layers, hidden 4096") and m.flag_weight == cal["flag_weight"]
    # prepared inputs carry the context a context expert reads: iterations unknown without
    # them (NaN), the layer mix against the given units of the same run
    from teller.rca.context import CONTEXT_COLUMNS, CONTEXT_ITER

    assert prep.unit_ctx.shape == (len(idx), len(CONTEXT_COLUMNS)) and np.isnan(prep.unit_ctx[:, :len(CONTEXT_ITER)]).all()
    given = np.ones((len(idx), 14))
    assert (m.prepare(inp, iterations=given).unit_ctx[:, 0] == np.float32(np.log1p(1e-3))).all()
    # recalibrating keeps the expert's weight; a directory without the expert's file is refused
    saved = json.loads((out / "config.json").read_text())["calibration"]
    assert calibrate(load(out), ds, "request", "val")["flag_weight"] == saved["flag_weight"]
    refused_without(out, FLAG_EXPERT_FILE, tmp_path)
    plain = tmp_path / "plain"
    train(ds, plain, variant="mot", split="request", config="tiny", epochs=1, max_steps=2, seed=0, progress=False,
          log=lambda m: None, unit="iteration", unit_stats=True, flag_expert=False)
    assert not (plain / FLAG_EXPERT_FILE).exists() and load(plain).flag_weight == 0.0


def test_the_cli_fits_a_flag_expert_for_a_trained_model(tmp_path):
    from rca_slice import small_dataset

    from teller.cli import main
    from teller.rca import load

    small = small_dataset(tmp_path / "ds", 120)
    model = tmp_path / "m"
    assert main(["rca", "train", str(small), "-o", str(model), "--variant", "mot", "--split", "request", "--config", "tiny",
                 "--epochs", "1", "--max-steps", "2", "--no-flag-expert", "--no-type-expert", "--no-op-expert"]) == 0
    before = json.loads((model / "config.json").read_text())["calibration"]
    assert "flag_weight" not in before and not (model / FLAG_EXPERT_FILE).exists()
    if main(["rca", "flagexpert", str(model), str(small), "--seed", "1"]) != 0:
        pytest.skip("the slice's request split lacks normal or abnormal units in its train or val part")
    cal = json.loads((model / "config.json").read_text())["calibration"]
    m = load(model)
    assert m.flag_expert is not None and cal["flag_weight"] in FLAG_WEIGHTS and cal["flag_expert"]["seed"] == 1
    assert m.abnormal_cut == next(r["cut"] for r in cal["flag_expert"]["grid"] if r["weight"] == cal["flag_weight"])
    # the operator threshold chosen in training stays
    assert cal["op_threshold"] == before["op_threshold"]


def test_normal_units_in_a_fault_window_weigh_more_where_asked(tmp_path, monkeypatch):
    """`--in-window-weight W`: a normal training unit a fault window overlaps (a record of it in a
    window, read from records.parquet) weighs W in the trees' loss, every other unit 1; the
    weight is kept with the expert's block, and a weight at or under 0 is refused."""
    import numpy as np
    import pyarrow.parquet as pq
    from rca_slice import RUNS, small_dataset

    from teller.cli import main
    from teller.rca import flagexpert as fx
    from teller.rca.data import load_dataset

    small = small_dataset(tmp_path / "ds", 150, run=RUNS[1])  # the straggler run: normal steps in its window
    model = tmp_path / "m"
    assert main(["rca", "train", str(small), "-o", str(model), "--variant", "mot", "--split", "request", "--config", "tiny",
                 "--epochs", "1", "--max-steps", "2", "--no-flag-expert", "--no-type-expert", "--no-op-expert"]) == 0
    ds = load_dataset(small, unit="iteration")
    # by hand: a unit is in a window when one of its records is
    rec = pq.read_table(small / "records.parquet", columns=["run_id", "view", "step_ids", "in_window"]).to_pylist()
    inw = {}
    for r in rec:
        k = (r["run_id"], r["view"], tuple(r["step_ids"]))
        inw[k] = inw.get(k, False) or bool(r["in_window"])
    u = ds.units
    want = [inw[(u.run_id[i], u.view[i], tuple(u.step_ids[i].tolist()))] for i in range(len(u))]
    assert u.in_window.tolist() == want and any(want) and not all(want)
    seen = []
    real = fx.FlagExpert.fit.__func__

    def spy(cls, X, abnormal, seed=0, threads=2, reads="stats", weight=None):
        seen.append((np.asarray(abnormal, bool), None if weight is None else np.asarray(weight)))
        return real(cls, X, abnormal, seed=seed, threads=threads, reads=reads, weight=weight)

    monkeypatch.setattr(fx.FlagExpert, "fit", classmethod(spy))
    if main(["rca", "flagexpert", str(model), str(small), "--in-window-weight", "4"]) != 0:
        pytest.skip("the slice's request split lacks normal or abnormal units in its train or val part")
    y, w = seen[-1]
    tr = u.part("request", "train")
    tr = tr[u.view[tr] == "vertical"]
    assert y.tolist() == u.is_anomaly[tr].astype(bool).tolist()
    hn = ~y & u.in_window[tr]
    assert hn.any() and w.tolist() == np.where(hn, 4.0, 1.0).tolist()
    block = json.loads((model / "config.json").read_text())["calibration"]["flag_expert"]
    assert block["in_window_weight"] == 4.0 and block["train_in_window_normal"] == int(hn.sum())
    assert main(["rca", "flagexpert", str(model), str(small)]) == 0
    assert seen[-1][1] is None
    assert json.loads((model / "config.json").read_text())["calibration"]["flag_expert"]["in_window_weight"] == 1.0
    assert main(["rca", "flagexpert", str(model), str(small), "--in-window-weight", "0"]) != 0
