"""The model's own floor for the numeric stage's lasting departures (`teller rca floor`): per view,
a quantile of its abnormal probability over its val part's normal units, warm-up left out; read
by `teller diagnose` and the `teller_diagnose*` / `teller_sustained*` rows of `teller evaluate`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from rca_slice import DATA, RUNS


def test_episode_floor_is_the_models_own_where_it_keeps_one():
    from teller.rca import EPISODE_FLOOR, episode_floor

    meta = {"calibration": {"episode_floor": {"quantile": 0.85, "views": {"vertical": {"floor": 0.0042, "units": 9}}}}}
    assert episode_floor(meta, "vertical") == 0.0042
    assert episode_floor(meta, "horizontal") == EPISODE_FLOOR  # no normal unit of that view: the absolute one
    assert episode_floor({}, "vertical") == EPISODE_FLOOR
    assert episode_floor({"calibration": {"abnormal_cut": 0.6}}, "vertical") == EPISODE_FLOOR


def _small_with_iterations(dest: Path) -> Path:
    """The model tests' slice with the run's iteration rows (warm-up column) kept beside it."""
    from rca_slice import small_dataset

    small = small_dataset(dest, 120, iterations=True)
    it = pq.read_table(DATA / "iterations.parquet", filters=[("run_id", "=", RUNS[0])])
    pq.write_table(it, small / "iterations.parquet")
    return small


def _warm_by_hand(ds) -> np.ndarray:
    """Per unit: whether one of its steps is a warm-up iteration, read row by row."""
    it = pq.read_table(Path(ds.path) / "iterations.parquet", columns=["run_id", "step_id", "warmup"]).to_pylist()
    warm = {(r["run_id"], int(r["step_id"])) for r in it if r["warmup"]}
    rec = {int(r["record_id"]): r for r in pq.read_table(Path(ds.path) / "records.parquet",
                                                         columns=["record_id", "step_id", "step_ids"]).to_pylist()}
    out = []
    for run, rid in zip(ds.units.run_id.tolist(), ds.units.record_id.tolist(), strict=True):
        r = rec[int(rid)]
        steps = r["step_ids"] or [r["step_id"]]
        out.append(any((run, int(s)) in warm for s in steps))
    return np.asarray(out, bool)


def test_units_warmup_is_their_iterations(tmp_path):
    from rca_slice import need_rca

    need_rca()
    if not (DATA / "iterations.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    from teller.rca.context import dataset_unit_warmup
    from teller.rca.data import load_dataset

    small = _small_with_iterations(tmp_path / "ds")
    ds = load_dataset(small, unit="iteration")
    got = dataset_unit_warmup(ds)
    assert got.tolist() == _warm_by_hand(ds).tolist()
    assert got.any() and not got.all()  # the run's first iterations warm up, the rest do not
    (small / "iterations.parquet").unlink()
    assert not dataset_unit_warmup(load_dataset(small, unit="iteration")).any()


def test_training_keeps_the_episode_floor_and_the_cli_measures_it_again(tmp_path):
    """`teller rca train` keeps, per view, the 0.85 quantile of the model's abnormal probability
    over the val part's normal units that do not warm up; `teller rca floor` measures the same
    again, at another quantile on request; `teller rca calibrate` leaves it (and the novelty) in
    place."""
    from rca_slice import need_rca

    need_rca()
    if not (DATA / "iterations.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    from teller.cli import main
    from teller.rca import episode_floor, load
    from teller.rca.data import load_dataset
    from teller.rca.train import part_units

    small = _small_with_iterations(tmp_path / "ds")
    model = tmp_path / "m"
    assert main(["rca", "train", str(small), "-o", str(model), "--variant", "mot", "--split", "request", "--config", "tiny",
                 "--unit", "iteration", "--epochs", "1", "--max-steps", "2", "--no-flag-expert", "--no-type-expert",
                 "--no-op-expert"]) == 0
    meta = json.loads((model / "config.json").read_text())
    kept = meta["calibration"]["episode_floor"]
    assert kept["split"] == "request" and kept["part"] == "val" and kept["quantile"] == 0.85 and kept["views"]
    m = load(model)
    ds = load_dataset(small, unit="iteration")
    idx, prep = part_units(m, ds, "request", "val")
    p = m.abnormal_probs(prep)
    u = ds.units.select(idx)
    ok = ~u.is_anomaly.astype(bool) & ~_warm_by_hand(ds)[idx]
    for v, r in kept["views"].items():
        sel = ok & (np.asarray(u.view) == v)
        assert r["units"] == int(sel.sum()) > 0
        assert r["floor"] == pytest.approx(float(np.quantile(p[sel], 0.85)), rel=1e-5, abs=1e-9)
        assert episode_floor(m.meta, v) == r["floor"]
    # measured again by the CLI (the block removed first), then at another quantile
    del meta["calibration"]["episode_floor"]
    (model / "config.json").write_text(json.dumps(meta))
    assert main(["rca", "floor", str(model), str(small)]) == 0
    again = json.loads((model / "config.json").read_text())["calibration"]["episode_floor"]
    assert again["views"].keys() == kept["views"].keys()
    for v in kept["views"]:
        assert again["views"][v]["floor"] == pytest.approx(kept["views"][v]["floor"], rel=1e-5, abs=1e-9)
    assert main(["rca", "floor", str(model), str(small), "--quantile", "0.5"]) == 0
    half = json.loads((model / "config.json").read_text())["calibration"]["episode_floor"]
    for v, r in half["views"].items():
        assert half["quantile"] == 0.5 and r["floor"] <= again["views"][v]["floor"]
    before = json.loads((model / "config.json").read_text())["calibration"]
    assert main(["rca", "calibrate", str(model), str(small)]) == 0
    after = json.loads((model / "config.json").read_text())["calibration"]
    assert after["episode_floor"] == before["episode_floor"] and after.get("novelty") == before.get("novelty")
    assert main(["rca", "floor", str(model), str(small), "--quantile", "1.5"]) != 0
    assert json.loads((model / "config.json").read_text())["calibration"]["episode_floor"] == half  # left as it was


def _model_dir(folder: Path, split: str, dataset: str, seed: int, floors: dict | None) -> Path:
    """A model folder whose config.json alone says what the rows read (recipe, split, dataset,
    seed, floor)."""
    d = folder / f"{split}_{seed}"
    d.mkdir(parents=True)
    cal = {"abnormal_cut": 0.5}
    if floors is not None:
        cal["episode_floor"] = {"quantile": 0.85, "views": {v: {"floor": f, "units": 10} for v, f in floors.items()}}
    meta = {"config": {"variant": "mot", "inputs": "trace+log", "unit": "iteration", "op_unit": "family"},
            "training": {"split": split, "seed": seed, "dataset": f"/somewhere/{dataset}"}, "calibration": cal}
    (d / "config.json").write_text(json.dumps(meta))
    return d


def test_the_rows_read_the_floor_of_the_model_of_the_split(tmp_path):
    """`teller_sustained_family` and `teller_diagnose_family` rule out a lasting departure under the
    floor of the model they read (found under --models by recipe, split and seed, its config.json
    read without its weights), and fall back on the absolute floor for a model of another split or
    dataset, or one that keeps none."""
    from teller.baselines import make
    from teller.rca import EPISODE_FLOOR

    models = tmp_path / "models"
    _model_dir(models, "mechanism", "h200_v2_all", 1, {"vertical": 0.0075, "horizontal": 0.002})
    _model_dir(models, "mechanism", "h200_v2_all", 2, None)
    _model_dir(models, "run", "other_dataset", 1, {"vertical": 0.3})

    def steps(split, view="vertical", dataset="/data/h200_v2_all"):
        return SimpleNamespace(extra={"split": split, "rca_models": str(models)}, dataset=dataset, view=view)

    for name in ("teller_sustained_family", "teller_diagnose_family"):
        for seed, split, view, dataset, want, why in (
                (1, "mechanism", "vertical", "/data/h200_v2_all", 0.0075, "the model's"),
                (1, "mechanism", "horizontal", "/data/h200_v2_all", 0.002, "the model's"),
                (2, "mechanism", "vertical", "/data/h200_v2_all", EPISODE_FLOOR, "keeps none"),
                (1, "run", "vertical", "/data/h200_v2_all", EPISODE_FLOOR, "not of this split and dataset")):
            for fitted in (True, False):  # a row read over time fitted here, or its answers reused (no model row under it)
                row = make(name, seed=seed)
                mot = make(row.mot, seed=seed)
                if hasattr(mot, "base") and fitted:
                    mot.part_ = make(mot.base, seed=seed)
                row.parts_ = {row.mot: mot}
                floor = row.model_floor(steps(split, view, dataset))
                assert floor.value == want and why in floor.source, (name, seed, split, view, fitted, floor)
                assert floor.own == (why == "the model's"), floor
    # no model of the split under --models: the shipped one is of another split, so the absolute floor
    row = make("teller_sustained_family", seed=7)
    row.parts_ = {row.mot: make(row.mot, seed=7)}
    floor = row.model_floor(steps("workload"))
    assert floor.value == EPISODE_FLOOR and not floor.own and floor.source.startswith("absolute")


def test_the_shipped_model_keeps_its_floor():
    """The shipped model keeps the floor measured on its val part (its training split's), per
    view, and the rows and `teller diagnose` read it rather than the absolute one."""
    from teller.rca import DEFAULT_MODEL, EPISODE_FLOOR, episode_floor

    meta = json.loads((DEFAULT_MODEL / "config.json").read_text())
    block = meta["calibration"]["episode_floor"]
    assert block["split"] == meta["training"]["split"] and block["part"] == "val" and block["quantile"] == 0.85
    assert set(block["views"]) == {"vertical", "horizontal"}
    for v, r in block["views"].items():
        assert 0.0 < r["floor"] < 0.5 and r["units"] > 100 and r["median"] <= r["floor"]
        assert episode_floor(meta, v) == r["floor"] != EPISODE_FLOOR
