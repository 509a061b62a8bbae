"""Several trainings read as one model (:mod:`teller.rca.ensemble`): two copies of one model answer
as the model does; two different members answer by the averages worked out here from their heads;
members that encode units differently are refused; the folder round trip, its refusals, the
command and the evaluate row."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rca_slice import iteration_units, need_rca, prepared_units, tiny_family_model

torch = need_rca()
pytest.importorskip("xgboost")

from teller.errors import InputError, TellerError  # noqa: E402
from teller.rca.ensemble import ENSEMBLE_FILE, Ensemble, load  # noqa: E402


def _sig(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _logit(p):
    p = np.clip(np.asarray(p, np.float64), 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


@pytest.fixture(scope="module")
def ds():
    return iteration_units()


@pytest.fixture(scope="module")
def trained(ds, tmp_path_factory):
    return tiny_family_model(ds, tmp_path_factory.mktemp("ens") / "m")


@pytest.fixture(scope="module")
def prep(ds, trained):
    return prepared_units(ds, load(trained))


def _member(trained, cut: float, threshold: float | None = None, noise: float = 0.0, seed: int = 0):
    m = load(trained)
    cal = m.meta.setdefault("calibration", {})
    cal["abnormal_cut"] = cut
    if threshold is not None:
        cal["op_threshold"] = threshold
    if noise:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.net.parameters():
                p.add_(noise * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def _middle_cut(m, prep) -> float:
    """A cut that flags about half of the units (the tiny model's probabilities sit close together)."""
    return float(np.median(m.abnormal_probs(prep)))


def test_two_copies_of_a_model_answer_as_the_model(trained, prep):
    one = load(trained)
    cut = _middle_cut(one, prep)
    one.meta["calibration"]["abnormal_cut"] = cut
    ens = Ensemble([_member(trained, cut), _member(trained, cut)])
    assert ens.abnormal_cut == pytest.approx(cut)
    want = one.predict(prep, explain=True, explain_tokens=6)
    got = ens.predict(prep, explain=True, explain_tokens=6)
    assert 0 < sum(p["abnormal"] for p in want) < len(want)
    for a, b in zip(want, got, strict=True):
        assert b["abnormal_prob"] == pytest.approx(a["abnormal_prob"], abs=1e-6)
        assert b["fault_type_prob"] == pytest.approx(a["fault_type_prob"], abs=1e-6)
        for k in ("abnormal", "fault_type", "fault_type_best", "evidence_nodes", "evidence_node_ids",
                  "evidence_operators", "explanation"):
            assert b[k] == a[k], k


def test_different_members_answer_by_the_averages(trained, prep):
    a = _member(trained, 0.4, threshold=0.5)
    b = _member(trained, 0.7, threshold=-0.5, noise=0.05, seed=3)
    ens = Ensemble([a, b], ["a", "b"])
    cuts = np.array([0.4, 0.7])
    assert ens.abnormal_cut == pytest.approx(_sig(_logit(cuts).mean()))
    idx = np.arange(len(prep))
    parts = [m.head_scores(prep, idx) for m in (a, b)]
    p_ab = _sig(np.mean([_logit(1 - pr[:, 0]) for _, pr, _ in parts], 0))
    assert ens.abnormal_probs(prep, batch_size=16) == pytest.approx(p_ab, abs=1e-5)  # other batches: other padding
    types = np.mean([pr[:, 1:] / pr[:, 1:].sum(1, keepdims=True) for _, pr, _ in parts], 0)
    # the members disagree somewhere, so the average is not either member's answer
    assert not np.allclose(parts[0][1], parts[1][1])
    # a cut between the two members' medians flags some units and not others
    ens.members[0].meta["calibration"]["abnormal_cut"] = ens.members[1].meta["calibration"]["abnormal_cut"] = float(np.median(p_ab))
    cut = ens.abnormal_cut
    assert cut == pytest.approx(float(np.median(p_ab)))
    pred = ens.predict(prep, explain=False)
    from teller.rca.data import FAULT_TYPES

    flagged = 0
    for i, p in enumerate(pred):
        assert p["abnormal_prob"] == pytest.approx(p_ab[i], abs=1e-9)
        assert p["abnormal"] == bool(p_ab[i] >= cut)
        assert p["fault_type_best"] == FAULT_TYPES[1 + int(np.argmax(types[i]))]
        assert p["fault_type"] == (p["fault_type_best"] if p["abnormal"] else "")
        if not p["abnormal"]:
            assert p["evidence_operators"] == []
            continue
        flagged += 1
        s = prep.slots.slots(i)
        # each member's probability of naming a slot: σ(its mixed logit − its threshold)
        each = []
        for m, (_, _, sc) in zip((a, b), parts, strict=True):
            head = _sig(np.asarray(sc[i].families, float) - m.op_threshold)
            w = m.op_weight if sc[i].expert is not None else 0.0
            each.append((1 - w) * head + (w * sc[i].expert if w else 0.0))
            assert m.operator_probs(sc[i]) == pytest.approx(each[-1])
        mix = np.mean(each, 0)
        order = np.argsort(-mix, kind="stable")
        picked = [int(k) for k in order if mix[k] > 0.5] or [int(order[0])]
        names = [prep.inputs.families[int(prep.slots.family[s.start + k])] for k in picked[:a.cfg.max_ops]]
        assert p["evidence_operators"] == list(dict.fromkeys(names))
    assert 0 < flagged < len(pred)


def test_members_that_encode_units_differently_are_refused(trained):
    with pytest.raises(TellerError, match="at least two"):
        Ensemble([load(trained)])
    b = load(trained)
    b.cfg.max_trace_tokens = b.cfg.max_trace_tokens // 2
    with pytest.raises(TellerError, match="max_trace_tokens"):
        Ensemble([load(trained), b], ["a", "b"])
    c = load(trained)
    c.ref.median = c.ref.median + 0.5
    with pytest.raises(TellerError, match="reference"):
        Ensemble([load(trained), c], ["a", "c"])


def test_the_folder_round_trip_and_its_refusals(trained, prep, tmp_path):
    out = tmp_path / "ens"
    ens = Ensemble([load(trained), load(trained)], ["a", "b"])
    ens.save(out, [trained, trained])
    doc = json.loads((out / ENSEMBLE_FILE).read_text())
    assert doc["members"] == [str(trained.resolve())] * 2 and doc["abnormal_cut"] == pytest.approx(ens.abnormal_cut, abs=1e-6)
    again = load(out)
    assert isinstance(again, Ensemble) and len(again.members) == 2
    assert [p["evidence_operators"] for p in again.predict(prep, explain=False)] == \
           [p["evidence_operators"] for p in load(trained).predict(prep, explain=False)]
    # a member below the folder is named relative to it
    import shutil

    shutil.copytree(trained, out / "m1")
    Ensemble([load(out / "m1"), load(trained)]).save(out, [out / "m1", trained])
    assert json.loads((out / ENSEMBLE_FILE).read_text())["members"][0] == "m1"
    shutil.rmtree(out / "m1")
    with pytest.raises(InputError, match="member 'm1'"):
        load(out)
    (out / ENSEMBLE_FILE).write_text("{not json")
    with pytest.raises(InputError, match=ENSEMBLE_FILE):
        load(out)
    (out / ENSEMBLE_FILE).write_text(json.dumps({"format": "something else", "members": []}))
    with pytest.raises(InputError, match="not an ensemble"):
        load(out)


def test_the_command_writes_an_ensemble_that_predict_reads_and_calibrate_refuses(trained, tmp_path):
    from rca_slice import DATA
    from typer.testing import CliRunner

    from teller.cli import app

    out = tmp_path / "ens"
    r = CliRunner().invoke(app, ["rca", "ensemble", str(trained), str(trained), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "2 models" in r.output and (out / ENSEMBLE_FILE).is_file()
    pq = tmp_path / "pred.parquet"
    r = CliRunner().invoke(app, ["rca", "predict", str(out), str(DATA), "-o", str(pq), "--max-units", "60"])
    assert r.exit_code == 0, r.output
    import pyarrow.parquet as pa_pq

    assert pa_pq.read_table(pq).num_rows > 0
    r = CliRunner().invoke(app, ["rca", "calibrate", str(out), str(DATA)])
    assert r.exit_code != 0 and "is an ensemble" in str(r.exception)
    # a part that holds no unit of those read is named, not a numpy error
    r = CliRunner().invoke(app, ["rca", "predict", str(out), str(DATA), "-o", str(pq), "--max-units", "3"])
    assert r.exit_code != 0 and "holds none of the 3 units" in str(r.exception)


def test_the_evaluate_row_takes_every_seed_of_its_split(tmp_path):
    from teller.baselines.base import make

    for name, split, seed, op in (("f0", "run", 0, "family"), ("f1", "run", 1, "family"), ("t0", "run", 0, "token"),
                                  ("r0", "request", 0, "family")):
        d = tmp_path / name
        d.mkdir()
        cfg = {"variant": "mot", "inputs": "trace+log", "unit": "iteration", "op_unit": op}
        (d / "config.json").write_text(json.dumps({"config": cfg, "training": {"split": split, "seed": seed}}))
    row = make("teller_mot_family_ensemble", 5)
    assert [(p.name, seed) for p, seed in row._models(tmp_path, "run")] == [("f0", 0), ("f1", 1)]
    assert [p.name for p, _ in row._models(tmp_path, "request")] == ["r0"]

    class Steps:
        extra = {"split": "request", "rca_models": str(tmp_path)}
        dataset = "data/x"

    with pytest.raises(ValueError, match="1 mot models.*two or more"):
        row.fit(Steps(), np.arange(3))
