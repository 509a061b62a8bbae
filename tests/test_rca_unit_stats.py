"""The MoT's unit statistics (``RCAConfig.unit_stats``): per layer the mean self time and span of a unit's
nodes and the layer's shares of its nodes and self time, against the normal units' spread; a tiny model that reads them
trains, reloads and is refused when its reference lacks them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rca_slice import iteration_units, need_rca, saved_and_broken

torch = need_rca()

from teller.rca.data import (  # noqa: E402
    UNIT_STAT_COLUMNS,
    UNIT_STAT_LAYERS,
    ReferenceStats,
    StepInputs,
    unit_statistics,
)

FAMS = ["BE aten::mm", "COMM all_reduce", "FE TPAttention", "K gemm", "STEP"]


def _units() -> StepInputs:
    """Unit 0 (one rank): STEP 200 > Attention 60 > mm 20 > gemm 15. Unit 1 (two ranks): per rank
    STEP > all_reduce; STEP self times 100 and 300, spans 400 and 800."""
    f = {n: i for i, n in enumerate(FAMS)}
    fam = [f["STEP"], f["FE TPAttention"], f["BE aten::mm"], f["K gemm"],
           f["STEP"], f["COMM all_reduce"], f["STEP"], f["COMM all_reduce"]]
    return StepInputs(
        input_ids=np.array([1, 2, 1, 1], np.int32), parent_idx=np.array([-1, 0, -1, -1], np.int32),
        depth=np.zeros(4, np.int32), duration=np.array([200, 60, 400, 800]), anchor=np.array([0, 1, 0, 2]),
        family=np.array([f["STEP"], f["FE TPAttention"], f["STEP"], f["STEP"]], np.int32),
        offsets=np.array([0, 2, 4]), node_id=np.arange(8), node_family=np.array(fam, np.int32),
        node_offsets=np.array([0, 4, 8]), families=FAMS, log_text=["", ""], step_ids=[[0], [10, 20]],
        node_duration=np.array([140, 40, 5, 15, 100, 300, 300, 500], np.int64),
        node_span=np.array([200, 60, 20, 15, 400, 300, 800, 500], np.int64))


def test_unit_statistics_are_each_layers_means_and_shares():
    x = unit_statistics(_units())
    assert x.shape == (2, len(UNIT_STAT_COLUMNS)) == (2, 4 * len(UNIT_STAT_LAYERS) + 1)
    col = {c: k for k, c in enumerate(UNIT_STAT_COLUMNS)}

    def v(i: int, name: str) -> float:
        return float(np.expm1(x[i, col[name]]))

    # unit 0: one node per layer; self times 140 + 40 + 5 + 15 = 200 ns
    assert v(0, "self_mean_FE") == pytest.approx(0.040) and v(0, "span_mean_FE") == pytest.approx(0.060)  # µs
    assert v(0, "span_mean_STEP") == pytest.approx(0.200) and v(0, "self_mean_COMM") == 0
    assert x[0, col["n_share_K"]] == pytest.approx(0.25) and x[0, col["self_share_STEP"]] == pytest.approx(0.7)
    assert x[0, col["n_share_COMM"]] == 0 and v(0, "ranks") == pytest.approx(1)
    # unit 1, two ranks: means over both ranks' nodes, shares of both (1,200 ns of self time)
    assert v(1, "self_mean_STEP") == pytest.approx(0.200) and v(1, "span_mean_STEP") == pytest.approx(0.600)
    assert v(1, "self_mean_COMM") == pytest.approx(0.400) and x[1, col["n_share_COMM"]] == pytest.approx(0.5)
    assert x[1, col["self_share_COMM"]] == pytest.approx(800 / 1200) and v(1, "ranks") == pytest.approx(2)
    # a unit alone gives the same row
    assert np.allclose(unit_statistics(_units().select(np.array([1]))), x[1:])
    # twice the decoder layers, same times per node: the same statistics (the workload split's shapes)
    two = _units()
    node = np.array([0, 1, 2, 3, 1, 2, 3])
    two = StepInputs(two.input_ids[:2], two.parent_idx[:2], two.depth[:2], two.duration[:2], two.anchor[:2],
                     two.family[:2], np.array([0, 2]), np.arange(7), two.node_family[node], np.array([0, 7]), FAMS, [""],
                     step_ids=[[0]], node_duration=np.array([280, 40, 5, 15, 40, 5, 15]),
                     node_span=np.array([400, 60, 20, 15, 60, 20, 15]))
    y = unit_statistics(two)[0]
    means = [k for k, c in enumerate(UNIT_STAT_COLUMNS) if "_mean_" in c and not c.endswith("_STEP")]
    assert np.allclose(y[means], x[0, means])
    # the layers that repeat per decoder layer keep their proportions among each other
    share = [col[f"n_share_{lay}"] for lay in ("FE", "BE", "K")]
    assert np.allclose(y[share] / y[share].sum(), x[0, share] / x[0, share].sum())


def test_unit_reference_scores_against_the_normal_spread_and_round_trips(tmp_path):
    from teller.errors import InputError, TellerError

    inp = _units()
    x = unit_statistics(inp)
    ref = ReferenceStats.fit(inp.input_ids, inp.duration, 8)
    with pytest.raises(TellerError, match="unit statistics"):
        ref.unit_features(x)
    normal = np.repeat(x[:1], 5, 0)
    normal[:, 0] += np.linspace(-0.2, 0.2, 5)  # self_mean_STEP spread about x[0, 0]
    ref.fit_units(normal)
    feat = ref.unit_features(x)
    assert feat.shape == (2, 2 * len(UNIT_STAT_COLUMNS))
    assert feat[0, 0] == pytest.approx(x[0, 0] / 8) and feat[0, 1] == pytest.approx(0.0, abs=1e-6)
    # the other columns have no spread: the scale floor 0.05 applies, and unit 1's longer STEP reads high
    k = UNIT_STAT_COLUMNS.index("span_mean_STEP")
    assert feat[1, 2 * k + 1] == pytest.approx(np.clip((x[1, k] - x[0, k]) / 0.05, -20, 20) / 4, rel=1e-5) and feat[1, 2 * k + 1] > 0
    back, bad = saved_and_broken(ref, tmp_path, lambda d: d["units"]["columns"].pop())
    assert np.allclose(back.unit_features(x), feat, atol=1e-5)
    with pytest.raises(InputError, match="units"):
        ReferenceStats.load(bad)
    no_times = _units()
    no_times.node_span = np.zeros(0, np.int64)
    with pytest.raises(TellerError, match="node times"):
        unit_statistics(no_times)


def test_only_the_mot_reads_unit_statistics():
    from teller.errors import TellerError
    from teller.rca.model import RCAConfig

    assert RCAConfig.preset("tiny", unit_stats=1).unit_stats is True
    with pytest.raises(TellerError, match="mot"):
        RCAConfig.preset("tiny", variant="single", unit_stats=True)
    assert RCAConfig.preset("tiny", unit_stats=True, pool_drop=0.3).pool_drop == 0.3
    with pytest.raises(TellerError, match="--unit-stats"):
        RCAConfig.preset("tiny", pool_drop=0.3)
    with pytest.raises(TellerError, match=r"\[0, 1\)"):
        RCAConfig.preset("tiny", unit_stats=True, pool_drop=1.0)


def test_pool_drop_leaves_the_fault_head_the_statistics_alone_in_training_only(ds, tmp_path):
    """With ``pool_drop`` a training unit's fault head reads the layer mix without the pooled trace
    state: its logits are then those of ``fault_head(u)``; in eval mode every unit reads both."""
    from teller.rca import load
    from teller.rca.batch import prompt_batch, target_batch, trace_batch
    from teller.rca.data import encode_units
    from teller.rca.train import train

    out = tmp_path / "m"
    train(ds, out, variant="mot", split="request", config="tiny", epochs=1, max_steps=4, seed=0, progress=False,
          log=lambda m: None, unit="iteration", unit_stats=True, pool_drop=0.5)
    m = load(out)
    assert m.cfg.pool_drop == 0.5
    u = ds.units
    idx = np.arange(min(16, len(u)))
    inp = encode_units(ds.forest, m.trace_tok, u.run_id[idx].tolist(), [u.step_ids[i] for i in idx.tolist()],
                       [u.log_text[i] for i in idx.tolist()], m.cfg.max_trace_tokens, u.view[idx].tolist())
    prep = m.prepare(inp)
    dev = torch.device("cpu")
    b = np.arange(len(idx))
    p, pv = prompt_batch(prep, b, dev)
    tr = trace_batch(prep, b, dev)
    t, tv = target_batch([np.array([1], np.int64)] * len(b), dev)
    net = m.net
    with torch.no_grad():
        net.eval()
        full = net(p, pv, tr, t, tv)["fault"]
        alone = net.fault_head(net.unit_feat(tr["unit_feat"])).float()
        net.train()
        torch.manual_seed(1)
        drawn = net(p, pv, tr, t, tv)["fault"]
        net.eval()
    is_alone = torch.isclose(drawn, alone, atol=1e-5).all(1)
    is_full = torch.isclose(drawn, full, atol=1e-5).all(1)
    assert bool((is_alone | is_full).all()) and 0 < int(is_alone.sum()) < len(b)
    assert not bool((is_alone & is_full).any())


@pytest.fixture(scope="module")
def ds():
    return iteration_units()


def test_a_model_with_unit_statistics_trains_reads_them_and_reloads(ds, tmp_path):
    from teller.errors import InputError
    from teller.rca import load
    from teller.rca.batch import prompt_batch, target_batch, trace_batch
    from teller.rca.train import evaluate, train

    out = tmp_path / "m"
    train(ds, out, variant="mot", split="request", config="tiny", epochs=2, max_steps=12, seed=0, progress=False,
          log=lambda m: None, unit="iteration", op_unit="family", fam_span=True, unit_stats=True)
    m = load(out)
    assert m.cfg.unit_stats and m.ref.unit_stats.shape == (len(UNIT_STAT_COLUMNS), 2)
    # the reference is the normal training units' spread: their median z is near 0 in the columns that vary
    u = ds.units
    idx = np.arange(min(24, len(u)))
    from teller.rca.data import encode_units

    inp = encode_units(ds.forest, m.trace_tok, u.run_id[idx].tolist(), [u.step_ids[i] for i in idx.tolist()],
                       [u.log_text[i] for i in idx.tolist()], m.cfg.max_trace_tokens, u.view[idx].tolist())
    prep = m.prepare(inp)
    assert prep.unit_feat is not None and prep.unit_feat.shape == (len(idx), 2 * len(UNIT_STAT_COLUMNS))
    assert np.isfinite(prep.unit_feat).all()
    # the fault head reads them: other statistics, other fault logits
    dev = torch.device("cpu")
    b = np.arange(4)
    p, pv = prompt_batch(prep, b, dev)
    tr = trace_batch(prep, b, dev)
    t, tv = target_batch([np.array([1], np.int64)] * len(b), dev)
    with torch.no_grad():
        a = m.net(p, pv, tr, t, tv)["fault"]
        tr["unit_feat"] = tr["unit_feat"] + 1.0
        c = m.net(p, pv, tr, t, tv)["fault"]
    assert not torch.allclose(a, c)
    pred, _, _ = evaluate(m, ds, "request", "test", explain=False)
    again, _, _ = evaluate(load(out), ds, "request", "test", explain=False)
    assert [(p["abnormal"], p["fault_type"]) for p in pred] == [(p["abnormal"], p["fault_type"]) for p in again]
    ref = json.loads((out / "reference.json").read_text())
    del ref["units"]
    (out / "reference.json").write_text(json.dumps(ref))
    with pytest.raises(InputError, match="unit statistics"):
        load(out)
