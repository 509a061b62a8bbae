"""The novelty (:mod:`teller.rca.novelty`): hand-checked distances and cut, views apart, unknown
values, the file round trip and its refusals, and on real units of data/h200_v2 the faults of a
mechanism it was not fitted on against held-out faults of the one it was."""

from __future__ import annotations

import numpy as np
import pytest
from rca_slice import RUNS, iteration_units

from teller.errors import InputError, TellerError
from teller.rca.novelty import NOVELTY_FILE, Novelty, ViewReference


def test_the_kth_distance_and_the_cut_by_hand():
    # one column, training faults at 0..9 (median 4.5, IQR 4.5): scaled (x - 4.5) / 4.5
    X = np.arange(10.0)[:, None]
    train = np.ones(10, bool)
    nov = Novelty.fit(X, ["vertical"] * 10, train, np.zeros(10, bool), k=2, quantile=1.0)
    ref = nov.views["vertical"]
    assert ref.center[0] == pytest.approx(4.5) and ref.scale[0] == pytest.approx(4.5)
    # fewer than 20 held-out faults: the cut is read on the training faults, each without itself:
    # the 2nd nearest other fault is 2 apart (1 apart for none), the largest 2 / 4.5
    assert ref.cut == pytest.approx(2.0 / 4.5)
    got = nov.ratio(np.array([[4.0], [30.0]]))
    # 4.0: nearest 4 and 5 (or 3): the 2nd nearest is 1 away; 30: the 2nd nearest is 8, 22 away
    assert got[0] == pytest.approx((1.0 / 4.5) / (2.0 / 4.5))
    assert got[1] == pytest.approx((22.0 / 4.5) / (2.0 / 4.5))
    assert got[0] < 1.0 < got[1]


def test_views_apart_unknown_values_at_the_median_and_a_view_without_faults():
    rng = np.random.default_rng(0)
    v = rng.normal(0.0, 1.0, (200, 3))
    h = rng.normal(10.0, 1.0, (200, 3))
    v[:, 2] = np.nan  # a column nobody knows in the vertical view
    X = np.r_[v, h]
    view = ["vertical"] * 200 + ["horizontal"] * 200
    train = np.r_[np.arange(200) < 150, np.arange(200) < 150]
    val = ~train
    nov = Novelty.fit(X, view, train, val)
    assert set(nov.views) == {"vertical", "horizontal"}
    # the cut is the 99th percentile of the held-out faults' distances: about 1 in 100 lies above
    held = nov.ratio(X[val], np.asarray(view, dtype=object)[val])
    assert 0.0 <= np.mean(held > 1.0) <= 0.02
    # a horizontal-like unit read as vertical is far; read as horizontal, at home
    probe = np.array([[10.0, 10.0, np.nan]])
    assert nov.ratio(probe, ["vertical"])[0] > 3.0 and nov.ratio(probe, ["horizontal"])[0] < 1.0
    # an unknown value sits at the median: a vertical unit with its third column unknown is at home
    assert nov.ratio(np.array([[0.0, 0.0, np.nan]]), ["vertical"])[0] < 1.0
    assert nov.ratio(np.array([[0.0, 0.0, 0.0]]), None)[0] < 1.0  # no view: vertical
    assert np.isnan(nov.ratio(np.zeros((1, 3)), ["sideways"])[0])
    with pytest.raises(TellerError, match="training units"):
        Novelty.fit(X[:3], ["vertical"] * 3, np.ones(3, bool), np.zeros(3, bool))


def test_saved_and_loaded_it_reads_the_same_and_refuses_broken_files(tmp_path):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(60, 4))
    nov = Novelty.fit(X, ["vertical"] * 40 + ["horizontal"] * 20, np.ones(60, bool), np.zeros(60, bool))
    path = nov.save(tmp_path)
    assert path.name == NOVELTY_FILE
    back = Novelty.load(tmp_path)
    q = rng.normal(size=(7, 4)) * 3
    for v in ("vertical", "horizontal"):
        assert np.allclose(back.ratio(q, [v] * 7), nov.ratio(q, [v] * 7))
    assert back.describe() == nov.describe()
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(InputError, match="missing"):
        Novelty.load(bad)
    (bad / NOVELTY_FILE).write_bytes(path.read_bytes()[:100])
    with pytest.raises(InputError, match="not a readable safetensors file"):
        Novelty.load(bad)
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, np.float32)}, str(bad / NOVELTY_FILE), metadata={"teller": "flag"})
    with pytest.raises(InputError, match="not a novelty reference"):
        Novelty.load(bad)


def test_a_view_reference_scales_clips_and_skips_itself():
    ref = ViewReference(np.zeros(2), np.ones(2), np.array([[0.0, 0.0], [3.0, 4.0]], np.float32), 1.0)
    assert np.array_equal(ref.scaled(np.array([[1e9, np.nan]])), np.array([[20.0, 0.0]], np.float32))
    assert ref.kth(ref.refs, 1, skip_self=True) == pytest.approx([5.0, 5.0])
    assert ref.kth(np.array([[0.0, 0.0]], np.float32), 1) == pytest.approx([0.0])


def test_on_real_units_another_mechanisms_faults_read_as_more_novel():
    """Fitted on the faults of one run of data/h200_v2 (a delayed operator), the faults of a
    straggler rank in a tensor-parallel run lie further from them than the delayed operator's own
    faults held out (half of its faults fitted, the other half read)."""
    from teller.rca.context import dataset_context_features
    from teller.rca.novelty import split_novelty
    from teller.tpe.tokenizer import TraceTokenizer

    ds = iteration_units(max_units=400, seed=2)
    u = ds.units
    from teller.rca import DEFAULT_MODEL

    tok = TraceTokenizer.load(DEFAULT_MODEL / "trace_tokenizer")  # the statistics count every node, whatever the tokenizer
    X = dataset_context_features(ds, np.arange(len(u)), tok)
    view = np.asarray(u.view, dtype=object)
    fault = np.asarray(u.is_anomaly, bool) & (view == "vertical")
    own = fault & (u.run_id == RUNS[0])
    other = fault & (u.run_id == RUNS[1])
    assert own.sum() >= 20 and other.sum() >= 8, (own.sum(), other.sum())
    at = np.flatnonzero(own)
    train = np.zeros(len(u), bool)
    train[at[::2]] = True
    held = own & ~train
    nov = Novelty.fit(X, view, train, np.zeros(len(u), bool))
    r_held = nov.ratio(X[held], view[held])
    r_other = nov.ratio(X[other], view[other])
    assert np.median(r_other) > 3.0 * np.median(r_held)  # measured: 4.6 against 0.49
    assert np.mean(r_other > 1.0) >= 0.8 and np.mean(r_held > 1.0) <= 0.3
    # the split's own parts: the training units (a sample of at most max_refs per view), the cut
    # read on the val units
    got = split_novelty(ds, "request", tok, max_refs=40)
    train = np.asarray(u.splits["request"] == "train")
    for v, ref in got.views.items():
        assert len(ref.refs) == min(40, int((train & (view == v)).sum())) and ref.cut > 0
    assert split_novelty(ds, "request", tok, max_refs=40).describe() == got.describe()  # the sample is seeded


def test_training_keeps_the_novelty_and_the_cli_fits_it_again(tmp_path):
    """`teller rca train` keeps the novelty of the split's training units with a MoT that reads
    the unit statistics; `teller rca novelty` fits the same one for a trained model; the model
    loads it, gives each prepared unit its novelty, and is refused without the file."""
    import json

    from rca_slice import need_rca, refused_without, small_dataset

    need_rca()
    from teller.cli import main
    from teller.rca import load
    from teller.rca.data import load_dataset

    small = small_dataset(tmp_path / "ds", 120, iterations=True)
    model = tmp_path / "m"
    assert main(["rca", "train", str(small), "-o", str(model), "--variant", "mot", "--split", "request", "--config", "tiny",
                 "--unit", "iteration", "--epochs", "1", "--max-steps", "2", "--no-flag-expert", "--no-type-expert",
                 "--no-op-expert"]) == 0
    cal = json.loads((model / "config.json").read_text())["calibration"]
    if "novelty" not in cal:
        pytest.skip("the slice's request split holds no abnormal training unit")
    kept = cal["novelty"]
    assert kept["split"] == "request" and kept["k"] == 5 and kept["quantile"] == 0.99
    assert (model / NOVELTY_FILE).is_file()
    m = load(model)
    ds = load_dataset(small, unit="iteration")
    train = np.asarray(ds.units.splits["request"] == "train")
    for v, r in kept["views"].items():
        assert r["units"] == int((train & (ds.units.view == v)).sum()) and r["cut"] > 0
    # fitted again by the CLI (the file and the block removed first): the same reference
    (model / NOVELTY_FILE).unlink()
    del cal["novelty"]
    meta = json.loads((model / "config.json").read_text())
    meta["calibration"] = cal
    (model / "config.json").write_text(json.dumps(meta))
    assert load(model).novelty is None
    assert main(["rca", "novelty", str(model), str(small)]) == 0
    again = load(model)
    assert json.loads((model / "config.json").read_text())["calibration"]["novelty"] == kept
    idx = np.arange(min(12, len(ds.units)))
    u = ds.units
    inp = again.inputs(ds.forest, [u.step_ids[i] for i in idx], run_ids=u.run_id[idx].tolist(), views=u.view[idx].tolist())
    prep = again.prepare(inp)
    got = again.unit_novelty(prep)
    assert got is not None and got.shape == (len(idx),) and np.isfinite(got).all() and (got >= 0).all()
    assert np.allclose(got, m.unit_novelty(prep))
    refused_without(model, NOVELTY_FILE, tmp_path)
