"""`teller rca experts`: what `teller rca train` fits after its epochs (flag expert, calibration,
type and operator experts, novelty, floor), fitted for a model trained without them; the result
is the one training would have kept."""

from __future__ import annotations

import json

import pytest
from rca_slice import DATA, need_rca


def _cal(model) -> dict:
    return json.loads((model / "config.json").read_text())["calibration"]


def _same(a, b, where=""):
    """Equal dicts / lists, floats to 1e-6."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b) if isinstance(b, dict) else b)
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9), where
    else:
        assert a == b, where


def test_experts_fit_for_a_bare_model_what_training_fits(tmp_path):
    need_rca()
    pytest.importorskip("xgboost")
    if not (DATA / "iterations.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    from test_rca_floor import _small_with_iterations

    from teller.cli import main
    from teller.rca import load

    small = _small_with_iterations(tmp_path / "ds")
    train = ["--variant", "mot", "--split", "request", "--config", "tiny", "--unit", "iteration", "--epochs", "1",
             "--max-steps", "2", "--seed", "3"]
    whole, bare = tmp_path / "whole", tmp_path / "bare"
    assert main(["rca", "train", str(small), "-o", str(whole), *train]) == 0
    assert main(["rca", "train", str(small), "-o", str(bare), *train, "--no-flag-expert", "--no-type-expert",
                 "--no-op-expert"]) == 0
    full = _cal(whole)
    assert "episode_floor" in full and "novelty" in full
    fitted = [k for k in ("flag_expert", "type_expert", "op_expert") if k in full]
    if not fitted:
        pytest.skip("the slice's request split fits no expert (one kind of unit or fault type in a part)")
    assert not any(k in _cal(bare) for k in fitted)
    assert main(["rca", "experts", str(bare), str(small)]) == 0  # the training's seed (3) by default
    again = _cal(bare)
    _same(full, again, "calibration")
    files = sorted(p.name for p in whole.iterdir() if p.suffix in (".ubj", ".safetensors") and not p.name.startswith("model"))
    assert files == sorted(p.name for p in bare.iterdir() if p.suffix in (".ubj", ".safetensors")
                           and not p.name.startswith("model"))
    m = load(bare)
    assert m.abnormal_cut == full["abnormal_cut"] and m.op_threshold == full["op_threshold"]
    assert (m.flag_expert is not None) == ("flag_expert" in full) and (m.type_expert is not None) == ("type_expert" in full)
    # fitted again on a model that has them: the earlier experts do not read into the new fit
    assert main(["rca", "experts", str(whole), str(small)]) == 0
    _same(full, _cal(whole), "calibration fitted again")
    # an expert left out this time is gone from the config and the folder (the model would not read it)
    if "op_expert" in full:
        assert main(["rca", "experts", str(whole), str(small), "--no-op-expert"]) == 0
        assert "op_weight" not in _cal(whole) and not (whole / "operator_expert.ubj").exists() and load(whole).op_expert is None
    # a failure part-way leaves the folder as it was (the experts are written once all are fitted)
    import teller.rca.train as T
    from teller.rca.data import load_dataset

    before = {p.name: p.read_bytes() for p in bare.iterdir() if p.is_file()}

    def broken(*a, **k):
        raise RuntimeError("the novelty broke")

    orig, T.fit_novelty = T.fit_novelty, broken
    try:
        with pytest.raises(RuntimeError, match="novelty broke"):
            T.fit_experts(load(bare), load_dataset(small, unit="iteration"), "request", seed=9, out=bare)
    finally:
        T.fit_novelty = orig
    assert {p.name: p.read_bytes() for p in bare.iterdir() if p.is_file()} == before
    # another seed: the trees change, the block says which
    if "flag_expert" in full:
        assert main(["rca", "experts", str(bare), str(small), "--seed", "5"]) == 0
        assert _cal(bare)["flag_expert"]["seed"] == 5


def test_experts_refuse_a_model_without_the_trace(tmp_path):
    need_rca()
    from rca_slice import small_dataset

    from teller.cli import main

    small = small_dataset(tmp_path / "ds", 60)
    model = tmp_path / "m"
    assert main(["rca", "train", str(small), "-o", str(model), "--variant", "single", "--split", "request", "--config",
                 "tiny", "--epochs", "1", "--max-steps", "1"]) == 0
    before = (model / "config.json").read_text()
    assert main(["rca", "experts", str(model), str(small)]) != 0
    assert (model / "config.json").read_text() == before
