"""RCA units that are whole engine iterations (``RCAConfig.unit = "iteration"``), on the slice of
data/h200_v2 that tests/test_rca.py reads: what a unit holds, that it stays a tree, that a tiny
model trains on it and keeps its unit through save/load and the CLI."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from rca_slice import DATA, RUNS, check_schema, need_rca, small_dataset

torch = need_rca()

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from teller.errors import TellerError  # noqa: E402
from teller.rca.data import load_dataset, read_steps, step_forest  # noqa: E402

ITERATION_FAMILIES = {"OTHER schedule", "GAP untraced"}


@pytest.fixture(scope="module")
def both():
    torch.set_num_threads(1)
    if not (DATA / "records.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    return (load_dataset(DATA, runs=RUNS, max_units=90, seed=1),
            load_dataset(DATA, runs=RUNS, max_units=90, seed=1, unit="iteration"))


@pytest.fixture(scope="module")
def table():
    return read_steps(DATA, RUNS)


def _rows(sf, i):
    return sf.seqs.node_id[sf.seqs.offsets[i]:sf.seqs.offsets[i + 1]]


def test_an_iteration_is_its_step_subtree_and_the_iteration_rows_beside_it(both, table):
    step, it = both
    assert step.unit == "step" and it.unit == "iteration"
    assert np.array_equal(step.forest.key, it.forest.key)  # steps are found by (run, STEP node id) alike
    sub = it.forest
    # the expected rows, straight from the table: the STEP block, and the rows of the run with the
    # STEP row's step_idx outside every STEP subtree
    run = np.asarray(table.column("run_id").cast(pa.string()).to_pylist(), dtype=object)
    nid = table.column("node_id").to_numpy()
    sid = table.column("step_id").to_numpy()
    six = table.column("step_idx").to_numpy()
    start = table.column("start_ns").to_numpy()
    row_of = {(r, int(n)): j for j, (r, n) in enumerate(zip(run.tolist(), nid.tolist(), strict=True))}
    checked = with_outside = 0
    for u in range(len(step.units)):
        for s in step.units.step_ids[u].tolist():
            r = step.units.run_id[u]
            i = int(step.forest.find([r], np.array([s]))[0])
            assert i == int(sub.find([r], np.array([s]))[0]) and i >= 0
            a_nodes = {(sub.runs[step.forest.key[i] >> 40], int(x)) for x in step.forest.node_id[_rows(step.forest, i)]}
            b_rows = _rows(sub, i)
            b_nodes = {(sub.runs[sub.key[i] >> 40], int(x)) for x in sub.node_id[b_rows]}
            j = row_of[(r, s)]
            want_out = {(r, int(x)) for x in nid[(run == r) & (sid < 0) & (six == six[j])]}
            assert b_nodes == a_nodes | want_out and not (a_nodes & want_out)
            assert len(b_rows) == len(b_nodes)  # no node twice
            # roots in start-time order, the STEP among them
            seq = sub.seqs
            roots = sub.node_id[b_rows[seq.parent[seq.offsets[i]:seq.offsets[i + 1]] < 0]]
            root_rows = np.asarray([row_of[(r, int(x))] for x in roots.tolist()])
            assert np.all(np.diff(start[root_rows]) >= 0) and (sid[root_rows] == nid[root_rows]).sum() == 1
            checked += 1
            with_outside += bool(want_out)
    assert checked > 90 and with_outside == checked  # every step of these runs has iteration rows


def test_outside_rows_keep_their_parents(table):
    """The iteration rows have subtrees (a schedule range's runtime calls and their kernels): every
    outside row with a parent keeps it, and schedule ranges stay roots."""
    a, b = step_forest(table), step_forest(table, unit="iteration")
    sid = table.column("step_id").to_numpy()
    par = table.column("parent_id").to_numpy()
    linked = int(((sid < 0) & (par >= 0)).sum())
    assert linked > 0
    assert int((b.seqs.parent >= 0).sum()) - int((a.seqs.parent >= 0).sum()) == linked
    fam = np.asarray(b.families)[b.node_family[b.seqs.node_id]]
    sched = fam == "OTHER schedule"
    assert sched.any() and (b.seqs.parent[sched] == -1).all() and (b.seqs.depth[sched] == 0).all()
    assert b.seqs.depth.max() >= 2 and b.seqs.checked


def test_candidates_name_schedule_and_gap_families_only_for_iterations(both):
    from teller.rca.model import RCAConfig
    from teller.rca.train import fit_tokenizers, prepare_units

    step, it = both
    idx = np.arange(len(step.units))
    seen_step, seen_it = set(), 0
    for ds in (step, it):
        cfg = RCAConfig.preset("tiny", unit=ds.unit, max_trace_tokens=100000)
        text_tok, trace_tok = fit_tokenizers(ds, ds.units.part("request", "train"), cfg)
        prep, _ = prepare_units(ds, idx, cfg, text_tok, trace_tok, None, labels=False)
        inp = prep.inputs
        for i in range(len(inp)):
            cands = set(inp.candidates(i))
            nodes = inp.node_family[inp.node_offsets[i]:inp.node_offsets[i + 1]]
            present = {inp.families[f] for f in np.unique(nodes).tolist()} & ITERATION_FAMILIES
            if ds.unit == "step":
                seen_step |= cands & ITERATION_FAMILIES
                assert not present
            else:
                assert present and present <= cands  # nothing truncated: every such node anchors a token
                seen_it += 1
    assert not seen_step and seen_it == len(idx)


def test_truncated_iterations_stay_trees(both):
    from teller.rca.model import RCAConfig
    from teller.rca.train import fit_tokenizers, prepare_units

    _, it = both
    cfg = RCAConfig.preset("tiny", unit="iteration")
    text_tok, trace_tok = fit_tokenizers(it, it.units.part("request", "train"), cfg)
    prep, _ = prepare_units(it, np.arange(len(it.units)), cfg, text_tok, trace_tok, None, labels=False)
    inp = prep.inputs
    assert inp.truncated.any() and np.diff(inp.offsets).max() <= cfg.max_trace_tokens
    step_code = inp.families.index("STEP")
    for i in range(len(inp)):
        assert step_code in inp.family[inp.tokens(i)]  # the STEP root always stays
        s = inp.tokens(i)
        par = inp.parent_idx[s]
        pos = np.arange(len(par))
        assert ((par == -1) | ((par >= 0) & (par < pos))).all()  # parents before children
        assert ((par < 0) | (inp.depth[s] == inp.depth[s][np.maximum(par, 0)] + 1)).all()
        n_nodes = inp.node_offsets[i + 1] - inp.node_offsets[i]
        assert (inp.anchor[s] >= 0).all() and (inp.anchor[s] < n_nodes).all()


def test_truncation_ranks_the_rows_beside_the_step_one_level_deeper():
    from teller.rca.data import truncate_order

    depth = np.array([0, 1, 1, 0, 0, 1])  # STEP, two children, a schedule root, a GAP root, a schedule child
    dur = np.array([100, 50, 5, 20, 30, 1])
    out = np.array([False, False, False, True, True, True])
    # the roots beside the STEP compete with its children (by duration), their children come after
    assert truncate_order(depth, dur, 3, out).tolist() == [0, 1, 4]
    assert truncate_order(depth, dur, 5, out).tolist() == [0, 1, 2, 3, 4]
    assert truncate_order(depth, dur, 3).tolist() == [0, 3, 4]  # without it: every root first
    assert truncate_order(depth, dur, 3, np.zeros(6, bool)).tolist() == truncate_order(depth, dur, 3).tolist()


def test_step_sequences_ignore_the_rows_beside_them(table):
    """The "step" unit reads only STEP blocks: dropping every other row, or step_idx, changes
    nothing; without step_idx an "iteration" unit is the STEP subtree."""
    a = step_forest(table)
    only = step_forest(table.filter(pc.greater_equal(table.column("step_id"), 0)))
    no_idx = step_forest(table.drop_columns(["step_idx"]), unit="iteration")
    for b in (only, no_idx):
        assert np.array_equal(a.key, b.key) and np.array_equal(a.seqs.offsets, b.seqs.offsets)
        for f in ("parent", "depth", "duration"):
            assert np.array_equal(getattr(a.seqs, f), getattr(b.seqs, f))
        assert np.array_equal(a.node_id[a.seqs.node_id], b.node_id[b.seqs.node_id])
    assert no_idx.unit == "iteration" and a.seqs.n_nodes < step_forest(table, unit="iteration").seqs.n_nodes


def test_iteration_model_trains_predicts_and_keeps_its_unit(both, tmp_path):
    from teller.rca import load
    from teller.rca.model import RCAConfig
    from teller.rca.train import evaluate, train

    step, it = both
    out = tmp_path / "it"
    s = train(it, out, variant="mot", split="request", config="tiny", epochs=5, max_steps=40, seed=0, progress=False,
              log=lambda m: None, unit="iteration")
    curve = [c["loss"] for c in s["curve"]]
    assert len(curve) >= 3 and curve[-1] < 0.8 * curve[0]
    assert json.loads((out / "config.json").read_text())["config"]["unit"] == "iteration"
    m = load(out)
    assert m.cfg.unit == "iteration"
    m.cfg.max_expl_tokens = 8
    pred, res, idx = evaluate(m, it, "request", "train")
    assert res["all"]["units"] == len(idx) == len(pred)
    inp = m.inputs(read_steps(DATA, RUNS), [it.units.step_ids[i] for i in idx.tolist()],
                   [it.units.log_text[i] for i in idx.tolist()], it.units.run_id[idx].tolist())
    check_schema(pred, inp, m.cfg.max_explanation_chars)
    # a model of one unit refuses a dataset serialized as the other
    with pytest.raises(TellerError, match="unit"):
        evaluate(m, step, "request", "train")
    with pytest.raises(TellerError, match="unit"):
        m.inputs(step.forest, [step.units.step_ids[0]])
    with pytest.raises(TellerError, match="unit"):
        train(step, tmp_path / "bad", config="tiny", max_steps=1, progress=False, log=lambda m: None, unit="iteration")
    # a config.json of before the unit existed reads as "step"
    old = tmp_path / "old"
    shutil.copytree(out, old, ignore=shutil.ignore_patterns("checkpoint"))
    meta = json.loads((old / "config.json").read_text())
    del meta["config"]["unit"]
    (old / "config.json").write_text(json.dumps(meta))
    assert load(old).cfg.unit == "step" and RCAConfig.from_json({}).unit == "step"
    with pytest.raises(TellerError, match="--unit"):
        RCAConfig.preset("tiny", unit="bogus")


def test_cli_trains_an_iteration_model(tmp_path):
    import pyarrow.parquet as pq

    from teller.cli import main

    small = small_dataset(tmp_path / "ds", 20, iterations=True)
    model = tmp_path / "m"
    assert main(["rca", "train", str(small), "-o", str(model), "--config", "tiny", "--epochs", "1", "--max-steps", "3",
                 "--unit", "iteration", "--pool-drop", "0.25"]) == 0
    cfg = json.loads((model / "config.json").read_text())["config"]
    assert cfg["pool_drop"] == 0.25
    assert cfg["unit"] == "iteration" and cfg["op_unit"] == "family" and cfg["fam_span"] is True  # the CLI's defaults
    assert cfg["unit_stats"] is True
    ref = json.loads((model / "reference.json").read_text())
    assert len(ref["families"]["pooled"]) == 6 and len(ref["units"]["stats"]) == len(ref["units"]["columns"]) == 45
    plain = tmp_path / "plain"
    assert main(["rca", "train", str(small), "-o", str(plain), "--config", "tiny", "--epochs", "1", "--max-steps", "2",
                 "--unit", "iteration", "--no-fam-span", "--no-unit-stats"]) == 0
    pcfg = json.loads((plain / "config.json").read_text())["config"]
    assert pcfg["fam_span"] is False and pcfg["unit_stats"] is False and pcfg["pool_drop"] == 0.0
    assert main(["rca", "train", str(small), "-o", str(tmp_path / "y"), "--config", "tiny", "--unit", "iteration",
                 "--no-unit-stats", "--pool-drop", "0.3"]) == 2
    assert "units" not in json.loads((plain / "reference.json").read_text())
    out = tmp_path / "pred.parquet"
    assert main(["rca", "predict", str(model), str(small), "--split-part", "train", "-o", str(out)]) == 0
    assert pq.read_table(out).num_rows > 0
    assert main(["rca", "train", str(small), "-o", str(tmp_path / "x"), "--config", "tiny", "--unit", "bogus"]) == 2


def test_the_steps_read_with_the_columns_they_need_serialize_as_with_all(table):
    """`load_dataset` decodes only :data:`STEP_COLUMNS` of the subtrees (a smaller peak): the
    steps, families, spans and self times serialize exactly as from every column, in both units
    (a column step_forest starts to read and the list lacks would show here)."""
    from teller.rca.data import STEP_COLUMNS

    some = read_steps(DATA, RUNS, columns=STEP_COLUMNS)
    assert some.column_names == [c for c in STEP_COLUMNS if c in table.column_names]
    assert some.num_rows == table.num_rows and len(some.column_names) < len(table.column_names)
    for unit in ("step", "iteration"):
        a, b = step_forest(table, unit=unit), step_forest(some, unit=unit)
        for name in ("key", "node_family", "node_priority", "node_id", "node_in_step", "node_span"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (unit, name)
        assert a.families == b.families and a.runs == b.runs
        for name in ("codes", "parent", "depth", "duration", "offsets", "node_id"):
            assert np.array_equal(getattr(a.seqs, name), getattr(b.seqs, name)), (unit, name)
        assert list(a.seqs.symbols) == list(b.seqs.symbols)
