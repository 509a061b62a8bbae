"""teller evaluate: metrics against hand-computed cases, every classical method on a slice of
data/h200_v2, and the command's outputs."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from teller.evaluate.scores import (
    auprc,
    auroc,
    bleu_scores,
    fault_type_scores,
    low_prior_scores,
    operator_scores,
    step_scores,
)

DS = Path(__file__).resolve().parent.parent / "data" / "h200_v2"
#: three tensor-parallel runs with a straggler rank (both ranks in this part), a scheduler stall, a delayed operator
PART = DS / "subtrees" / "part-00006.parquet"


# ------------------------------------------------------------------------------------------------
# metrics, by hand


def test_step_scores_hand_case_and_degenerate():
    m = step_scores(np.array([1, 1, 0, 0]), np.array([1, 0, 1, 0]))
    assert (m["accuracy"], m["precision"], m["recall"], m["f1"]) == (0.5, 0.5, 0.5, 0.5)
    m = step_scores(np.array([1, 1, 1, 0]), np.array([1, 1, 0, 0]))
    assert m["precision"] == 1.0 and m["recall"] == pytest.approx(2 / 3) and m["f1"] == pytest.approx(0.8)
    # no positives, nothing flagged: accurate, but precision/recall/F1 are 0 by definition
    m = step_scores(np.zeros(5, bool), np.zeros(5, bool))
    assert m["accuracy"] == 1.0 and m["precision"] == m["recall"] == m["f1"] == 0.0
    # all positives, all flagged
    m = step_scores(np.ones(4, bool), np.ones(4, bool))
    assert m["accuracy"] == m["precision"] == m["recall"] == m["f1"] == 1.0
    # all flagged, none abnormal
    m = step_scores(np.zeros(4, bool), np.ones(4, bool))
    assert m["accuracy"] == 0.0 and m["precision"] == 0.0 and m["fp"] == 4


def test_operator_scores_empty_set_rule_and_macro_plus():
    truth = [["a"], [], ["a", "b"]]
    pred = [["a", "b"], [], ["c"]]
    m = operator_scores(truth, pred)
    # step 1: p 1/2 r 1 f 2/3 j 1/2; step 2 (both empty): p = r = 0, f = j = 1; step 3: all 0
    assert m["precision"] == pytest.approx(0.5 / 3)
    assert m["recall"] == pytest.approx(1 / 3)
    assert m["f1"] == pytest.approx((2 / 3 + 1) / 3)
    assert m["jaccard"] == pytest.approx(0.5)
    # Macro₊: steps 1 and 3 only
    assert m["operator_positive_steps"] == 2
    assert m["macro_plus_precision"] == pytest.approx(0.25)
    assert m["macro_plus_recall"] == pytest.approx(0.5)
    assert m["macro_plus_f1"] == pytest.approx(1 / 3)
    assert m["macro_plus_jaccard"] == pytest.approx(0.25)
    # predicting something where the truth is empty scores 0 on that step
    m = operator_scores([[]], [["x"]])
    assert m["f1"] == 0.0 and m["jaccard"] == 0.0 and m["macro_plus_f1"] == 0.0
    # only empty sets: f = j = 1, Macro₊ has no step (0)
    m = operator_scores([[], []], [[], []])
    assert m["f1"] == 1.0 and m["jaccard"] == 1.0 and m["precision"] == 0.0 and m["operator_positive_steps"] == 0


def test_fault_type_scores_hand_case():
    m = fault_type_scores(["a", "a", "b", "c"], ["a", "b", "b", "a"])
    assert m["accuracy"] == 0.5
    assert m["classes"] == ["a", "b", "c"]
    assert m["confusion"] == [[1, 1, 0], [0, 1, 0], [1, 0, 0]]
    # recall a 1/2, b 1, c 0; precision a 1/2, b 1/2, c 0
    assert m["macro_recall"] == pytest.approx(0.5)
    assert m["macro_f1"] == pytest.approx((0.5 + 2 / 3 + 0) / 3)
    # one class, all right
    m = fault_type_scores(["x", "x"], ["x", "x"])
    assert m["accuracy"] == m["macro_recall"] == m["macro_f1"] == 1.0
    # a predicted class absent from the truth: counted in the confusion matrix, not in the macro average
    m = fault_type_scores(["x", "x"], ["x", "y"])
    assert m["classes"] == ["x", "y"] and m["macro_recall"] == 0.5 and m["macro_f1"] == pytest.approx(2 / 3)
    assert fault_type_scores([], [])["steps"] == 0


def test_auroc_auprc_hand_cases_and_sklearn():
    # pairs (pos, neg): (.9,.1) 1, (.9,.4) 1, (.4,.1) 1, (.4,.4) 1/2
    assert auroc(np.array([1, 0, 1, 0]), np.array([0.9, 0.1, 0.4, 0.4])) == pytest.approx(0.875)
    # ranked T F T F: AP = 1/2 · 1 + 1/2 · 2/3
    assert auprc(np.array([1, 0, 1, 0]), np.array([0.9, 0.8, 0.4, 0.1])) == pytest.approx(0.5 + 1 / 3)
    assert math.isnan(auroc(np.ones(3, bool), np.arange(3.0)))
    assert math.isnan(auprc(np.zeros(3, bool), np.arange(3.0)))
    from sklearn.metrics import average_precision_score, roc_auc_score

    rng = np.random.default_rng(1)
    t = rng.random(300) < 0.3
    s = np.round(rng.random(300) + t * 0.4, 1)  # many ties
    assert auroc(t, s) == pytest.approx(roc_auc_score(t, s))
    assert auprc(t, s) == pytest.approx(average_precision_score(t, s))


def test_low_prior_scores_sizes_and_seeds():
    truth = np.r_[np.zeros(100, bool), np.ones(100, bool)]
    score = truth.astype(float) + 0.01 * np.arange(200)
    lp = low_prior_scores(truth, truth, score, priors=(0.1, 0.05), repeats=50)
    d = lp["0.1"]
    assert (d["abnormal"], d["normal"], d["repeats"]) == (11, 100, 50)
    assert lp["0.05"]["abnormal"] == 5
    assert d["recall_mean"] == d["f1_mean"] == d["auroc_mean"] == d["auprc_mean"] == 1.0 and d["f1_std"] == 0.0
    # a flag that is right half the time on abnormal steps, never on normal ones: recall ≈ 0.5 at any prior
    pred = truth & (np.arange(200) % 2 == 0)
    a = low_prior_scores(truth, pred, score, repeats=50, seed=3)
    b = low_prior_scores(truth, pred, score, repeats=50, seed=3)
    assert a == b  # fixed seeds
    assert 0.3 < a["0.1"]["recall_mean"] < 0.7 and a["0.1"]["recall_std"] > 0
    # too few abnormal steps for the prior: all of them kept, normal ones downsampled
    few = np.r_[np.zeros(10, bool), np.ones(10, bool)]
    d = low_prior_scores(few, few, few.astype(float), priors=(0.1,), repeats=5)["0.1"]
    assert (d["abnormal"], d["normal"]) == (1, 10)
    assert "note" in low_prior_scores(np.zeros(5, bool), np.zeros(5, bool), np.zeros(5), repeats=2)["0.1"]


def test_bleu_hand_case():
    same = bleu_scores(["the kernel ran late"], ["the kernel ran late"])
    assert all(v == pytest.approx(1.0) for v in same.values())
    b = bleu_scores(["a b c d"], ["a b e f"])
    assert b["bleu1"] == pytest.approx(0.5)  # 2 of 4 unigrams, equal lengths
    assert b["bleu2"] == pytest.approx(math.sqrt(0.5 * (1 / 3)))  # 1 of 3 bigrams
    with pytest.raises(ValueError):
        bleu_scores(["x"], [])


# ------------------------------------------------------------------------------------------------
# a slice of data/h200_v2: the steps of one subtree part that lie wholly inside it


@pytest.fixture(scope="module")
def slice_ds(tmp_path_factory) -> Path:
    from teller.dataset.codec import decode, write_subtree_parts

    out = tmp_path_factory.mktemp("h200_slice")
    sub = decode(pq.read_table(PART), str(PART))
    run = np.asarray(sub.column("run_id").cast(pa.string()).to_numpy(zero_copy_only=False), dtype=object).astype(str)
    sid = sub.column("step_id").to_numpy()
    is_step = (sub.column("layer").cast(pa.string()).to_numpy(zero_copy_only=False) == "STEP")
    key = np.char.add(np.char.add(run, "|"), sid.astype(str))
    uk, cnt = np.unique(key, return_counts=True)
    size = dict(zip(key[is_step].tolist(), sub.column("size").to_numpy()[is_step].tolist(), strict=True))
    whole = {k for k, c in zip(uk.tolist(), cnt.tolist(), strict=True) if size.get(k) == c}
    rec = pq.read_table(DS / "records.parquet")
    rkey = np.char.add(np.char.add(np.asarray(rec.column("run_id").to_pylist(), dtype=str), "|"),
                       rec.column("step_id").to_numpy().astype(str))
    ok = np.isin(rkey, sorted(whole))
    # horizontal records need every rank's step
    ids = rec.column("step_ids").to_pylist()
    runs = rec.column("run_id").to_pylist()
    ok &= np.array([all(f"{r}|{i}" in whole for i in lst) for r, lst in zip(runs, ids, strict=True)])
    # keep a sample of the vertical steps per run, every rank of the sampled steps of a TP run
    rng = np.random.default_rng(0)
    tp_runs = set(pc.unique(rec.filter(pc.greater(rec.column("rank"), 0)).column("run_id")).to_pylist())
    vert = np.asarray(rec.column("view").to_pylist()) == "vertical"
    snum = rec.column("step_num").to_numpy()
    ab = rec.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    keep_keys = set()
    for r in sorted(set(np.asarray(runs)[ok & vert].tolist())):
        m = ok & vert & (np.asarray(runs) == r)
        if r in tp_runs:  # a tensor-parallel run: 20 abnormal and 20 other step numbers, every rank of each
            ab_nums = np.unique(snum[m & ab])
            other = np.setdiff1d(np.unique(snum[m]), ab_nums)
            nums = np.r_[rng.choice(ab_nums, min(20, len(ab_nums)), replace=False), rng.choice(other, 20, replace=False)]
            keep_keys |= set(rkey[m & np.isin(snum, nums)].tolist())
        else:
            ks = sorted(set(rkey[m].tolist()))
            keep_keys |= set(rng.choice(ks, min(30, len(ks)), replace=False).tolist())
    sel = ok & np.isin(rkey, sorted(keep_keys))
    rec = rec.filter(pa.array(sel))
    pq.write_table(rec, out / "records.parquet")
    # every row of a kept step's engine iteration: its STEP subtree (step_id) and the schedule,
    # update and GAP rows beside it (step_id -1, the STEP row's step_idx)
    in_step = np.isin(key, sorted(keep_keys))
    sidx = sub.column("step_idx").to_numpy()
    ikey = np.char.add(np.char.add(run, "|"), sidx.astype(str))
    beside = (sid < 0) & np.isin(ikey, sorted(set(ikey[in_step & is_step].tolist())))
    write_subtree_parts(sub.filter(pa.array(in_step | beside)), out / "subtrees")
    logs = pq.read_table(DS / "logs.parquet")
    lk = np.char.add(np.char.add(np.asarray(logs.column("run_id").to_pylist(), dtype=str), "|"),
                     logs.column("step_id").to_numpy().astype(str))
    pq.write_table(logs.filter(pa.array(np.isin(lk, sorted(keep_keys)))), out / "logs.parquet")
    it = pq.read_table(DS / "iterations.parquet")
    ik = np.char.add(np.char.add(np.asarray(it.column("run_id").to_pylist(), dtype=str), "|"),
                     it.column("step_id").to_numpy().astype(str))
    pq.write_table(it.filter(pa.array(np.isin(ik, sorted(keep_keys)))), out / "iterations.parquet")
    (out / "datasheet.json").write_text((DS / "datasheet.json").read_text())
    return out


@pytest.fixture(scope="module")
def vertical(slice_ds):
    from teller.baselines.features import read_dataset_features
    from teller.baselines.numeric import unit_instances
    from teller.baselines.steps import load_steps
    from teller.dataset.codec import read_subtrees

    steps = load_steps(slice_ds, "vertical")
    steps.features = read_dataset_features(slice_ds, steps)
    steps.extra["instances"] = unit_instances(steps, read_subtrees(slice_ds))
    return steps


def test_slice_steps_and_features(vertical, slice_ds):
    from teller.baselines.features import STANDARD

    s = vertical
    assert 100 <= s.n <= 400 and s.is_anomaly.any() and (~s.is_anomaly).any()
    assert len(set(s.fault_type[s.is_anomaly].tolist())) >= 2
    f = s.features
    assert f.std.shape == (s.n, len(STANDARD)) and np.isfinite(f.std).all()
    col = {k: f.std[:, i] for i, k in enumerate(f.std_names)}
    # every step is one STEP node; its wall time is its own duration, GPU busy time fits inside the GPU span
    assert (col["n_STEP"] == 1).all() and (col["wall_ns"] > 0).all()
    assert (col["gpu_busy_ns"] <= col["gpu_span_ns"] + 1).all() and (col["gpu_busy_ns"] <= col["dur_K"] + col["dur_MEM"] + 1).all()
    assert (col["kernel_n"] == col["n_K"]).all()
    assert (col["self_BE"] <= col["dur_BE"]).all()
    # rows per step equal the STEP nodes' subtree sizes in the stored subtrees
    sub = pq.read_table(slice_ds / "records.parquet", columns=["run_id", "step_id", "view"])
    assert int(col["rows"].sum()) == int(f.info["forest_rows"])
    assert sub.num_rows >= s.n
    # requests per step: the records of the step
    assert int(col["n_requests"].sum()) == s.records
    # name features: count of the STEP family is one per step; family counts sum to the rows
    fams = f.families
    assert np.array_equal(f.fam_count[:, fams.index("STEP")].toarray().ravel(), np.ones(s.n))
    assert np.allclose(np.asarray(f.fam_count.sum(1)).ravel(), col["rows"])
    assert np.allclose(f.pair_count.sum(1), col["rows"])


def test_features_read_only_their_columns_and_come_out_as_from_every_column(vertical, slice_ds, monkeypatch):
    """The step features read :data:`FEATURE_COLUMNS` of the subtrees (what the evaluation keeps of
    them after the stage's instances): the same features as from every column but ``args``."""
    import teller.baselines.features as F
    from teller.dataset.codec import read_subtrees

    sub = read_subtrees(slice_ds)
    assert set(F.FEATURE_COLUMNS) < set(sub.column_names)
    some = F.step_features(vertical, sub.select(list(F.FEATURE_COLUMNS)), None)
    with monkeypatch.context() as mp:  # every column kept, as before the projection
        mp.setattr(F, "FEATURE_COLUMNS", tuple(c for c in sub.column_names if c != "args"))
        every = F.step_features(vertical, sub.select(list(F.FEATURE_COLUMNS)), None)
    assert every.std_names == some.std_names and every.families == some.families and every.info == some.info
    assert np.array_equal(every.std, some.std)
    for k in ("fam_count", "fam_dur", "fam_self"):
        assert (getattr(every, k) != getattr(some, k)).nnz == 0
    assert np.array_equal(every.pair_count, some.pair_count) and np.array_equal(every.pair_dur, some.pair_dur)
    from teller.errors import TellerError

    with pytest.raises(TellerError, match="start_ns"):  # a column the features read, missing
        F.step_features(vertical, sub.select([x for x in F.FEATURE_COLUMNS if x != "start_ns"]), None)


def test_split_masks_and_workload_message(vertical):
    from teller.baselines.steps import split_masks
    from teller.errors import TellerError

    train, test, desc = split_masks(vertical, "request")
    assert not (train & test).any() and train.any() and test.any()
    # v2 serves two model shapes: the workload split trains on one and tests on the other
    train, test, _ = split_masks(vertical, "workload")
    assert not (train & test).any() and train.any() and test.any()
    one_shape = copy.copy(vertical)
    one_shape.split = {k: v for k, v in vertical.split.items() if k != "split_workload"}
    with pytest.raises(TellerError, match="one workload shape"):
        split_masks(one_shape, "workload")


def test_split_masks_val_part(vertical):
    from teller.baselines.steps import VAL, split_masks
    from teller.errors import TellerError

    train, test, _ = split_masks(vertical, "request")
    tr, val, desc = split_masks(vertical, "request", "val")
    code = vertical.split["split_request"]
    assert np.array_equal(tr, train) and np.array_equal(val, code == VAL)
    assert val.any() and not (val & test).any() and not (val & train).any() and "val steps" in desc
    with pytest.raises(TellerError, match="--part 'dev'"):
        split_masks(vertical, "request", "dev")


def test_numeric_instances_carry_the_datasets_iteration_context(vertical, slice_ds):
    """teller_numeric's instances are those of teller diagnose: the STEP instances carry the
    iteration columns and batch of iterations.parquet, the admission delay from the logs, and the
    warm-up flag of the iterations; the engine iteration's OTHER ranges count with their step."""
    from teller.localize.features import FEATURES, ITER_FEATURES

    inst = vertical.extra["instances"]
    fam = inst.family_of()
    step = fam == "STEP"
    it = pq.read_table(slice_ds / "iterations.parquet")
    assert step.sum() == len(vertical.unit_key) == it.num_rows
    j = {f: FEATURES.index(f) for f in ("iter.dur", "iter.gap", "batch.n_requests", "iter.admit_delay")}
    assert np.isfinite(inst.X[step][:, j["iter.dur"]]).all() and (inst.X[step][:, j["iter.gap"]] >= 0).all()
    # the STEP instance of a unit has that unit's iteration row
    key = {(r, s): d for r, s, d in zip(it.column("run_id").to_pylist(), it.column("step_id").to_pylist(),
                                        it.column("dur_ns").to_pylist(), strict=True)}
    u = inst.step[step]
    runs = vertical.runs[vertical.unit_key[u] >> 40]
    sids = vertical.unit_key[u] & ((1 << 40) - 1)
    np.testing.assert_array_equal(inst.X[step][:, j["iter.dur"]], [key[(str(r), int(s))] for r, s in zip(runs, sids, strict=True)])
    np.testing.assert_array_equal(inst.batch[step], inst.X[step][:, j["batch.n_requests"]])
    # the slice's delayed-admission steps (if any) carry a positive delay, no other step does
    d = inst.X[step][:, j["iter.admit_delay"]]
    assert np.isfinite(d).any()
    u_da = np.isin(u, np.flatnonzero(np.isin(np.arange(len(vertical.unit_key)), vertical.unit_idx[
        np.concatenate([np.arange(vertical.unit_ptr[i], vertical.unit_ptr[i + 1])
                        for i in np.flatnonzero(vertical.mechanism == "delayed_admission")] or [np.zeros(0, np.int64)])])))
    assert (np.nan_to_num(d[~u_da]) == 0).all()
    assert ITER_FEATURES[-2:] == ("iter.admit_delay", "iter.per_kernel")
    # and the pace of the iterations around them (the run's kept steps, process by process)
    pace = inst.X[step][:, FEATURES.index("iter.per_kernel")]
    assert np.isfinite(pace[inst.X[step][:, FEATURES.index("k_n")] > 0]).all() and (pace > 0).any()
    assert (fam == "OTHER schedule").sum() > 0  # the iteration's ranges are instances of their step
    w = np.asarray(it.column("warmup").to_pylist(), bool)
    assert vertical.extra["unit_warmup"].sum() == w.sum()


@pytest.mark.parametrize("name", ["kmeans", "dbscan", "iforest", "gmm", "svm", "svm_names", "rf", "rf_names",
                                  "xgb", "xgb_names", "teller_numeric", "teller_numeric_ff", "teller_numeric_deploy"])
def test_every_method_fits_and_predicts(vertical, name):
    from teller.baselines import make
    from teller.baselines.steps import split_masks
    from teller.evaluate.run import score_method

    train, test, _ = split_masks(vertical, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    m = make(name, seed=0).fit(vertical, tr)
    p = m.predict(vertical, te)
    assert p.score.shape == (len(te),) and p.flag.dtype == bool and np.isfinite(p.score).all()
    assert p.operators is not None and len(p.operators) == len(te)
    assert all(not ops for ops, f in zip(p.operators, p.flag, strict=True) if not f)  # unflagged: no operators
    if m.kind == "supervised":
        assert p.fault_type is not None and set(p.fault_type.tolist()) <= set(vertical.fault_type[tr].tolist())
        # a supervised model ranks the steps it was fitted on far better than chance
        q = m.predict(vertical, tr)
        assert auroc(vertical.is_anomaly[tr], q.score) > 0.75, (name, auroc(vertical.is_anomaly[tr], q.score))
    elif name.startswith("teller_numeric"):  # the type its evidence points to (teller.localize.faulttype)
        from teller.baselines.steps import CATEGORIES

        assert p.fault_type is not None and set(p.fault_type.tolist()) <= {"", *CATEGORIES}
    else:
        assert p.fault_type is None
    r = score_method(vertical, te, p)
    assert 0.0 <= r["step"]["f1"] <= 1.0 and "0.1" in r["low_prior"]


def test_numeric_stage_names_the_family_its_evidence_was_typed_by(vertical, monkeypatch):
    """A flagged step's operators are the family its evidence's type was decided by (what `teller
    diagnose`'s verdict names first) and its candidate families, at most three; an unflagged step
    names none, and evidence that decided no type adds nothing."""
    import teller.baselines.numeric as numeric
    from teller.baselines import make
    from teller.baselines.steps import split_masks
    from teller.localize.faulttype import TypeCall

    train, test, _ = split_masks(vertical, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    m = make("teller_numeric", seed=0).fit(vertical, tr)
    real = numeric.step_fault_types
    got = m.predict(vertical, te)
    # evidence that decided no type: the candidate families alone
    monkeypatch.setattr(numeric, "step_fault_types", lambda *a, **k: {
        u: TypeCall(None, "COMM evidence_family", "count") for u in real(*a, **k)})
    cand = m.predict(vertical, te)
    assert cand.flag.any() and np.array_equal(cand.flag, got.flag)
    assert all(set(c) <= set(g) and len(set(g) - set(c)) <= 1 for c, g in zip(cand.operators, got.operators, strict=True))
    monkeypatch.setattr(numeric, "step_fault_types", lambda *a, **k: {
        u: TypeCall("communication", "COMM evidence_family", "count") for u in real(*a, **k)})
    p = m.predict(vertical, te)
    assert np.array_equal(p.flag, got.flag)
    for ops, c, f in zip(p.operators, cand.operators, p.flag, strict=True):
        if not f:
            assert ops == []
            continue  # the evidence's family first, then the first candidates: three at most
        assert "COMM evidence_family" in ops and set(ops) - {"COMM evidence_family"} <= set(c)
        assert len(ops) == min(3, len(c) + 1)
    m.max_operators = None  # every candidate and the evidence's family
    every = m.predict(vertical, te)
    monkeypatch.setattr(numeric, "step_fault_types", lambda *a, **k: {
        u: TypeCall(None, "COMM evidence_family", "count") for u in real(*a, **k)})
    cand = m.predict(vertical, te)
    for ops, c, f in zip(every.operators, cand.operators, every.flag, strict=True):
        assert ops == (sorted({*c, "COMM evidence_family"}) if f else [])


def test_numeric_stage_answers_the_type_its_evidence_cannot_rule_out(vertical, monkeypatch):
    """Each step's ``alternative`` is that of the evidence which typed it (its most suspicious
    unit's): scheduling beside memory decided by a framework op's own time, none beside a
    collective's count; "" where the step has no type. Per deployment as in one stage."""
    import teller.baselines.numeric as numeric
    from teller.baselines import make
    from teller.baselines.steps import split_masks
    from teller.localize.faulttype import TypeCall

    train, test, _ = split_masks(vertical, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    real = numeric.step_fault_types
    for name in ("teller_numeric", "teller_numeric_deploy"):
        m = make(name, seed=0).fit(vertical, tr)
        monkeypatch.setattr(numeric, "step_fault_types", lambda *a, **k: {
            u: TypeCall("memory", "BE aten::mm", "self_ns") for u in real(*a, **k)})
        p = m.predict(vertical, te)
        typed = p.fault_type != ""
        assert typed.any() and len(p.alternative) == len(te)
        assert (p.alternative[typed] == "scheduling").all() and (p.alternative[~typed] == "").all()
        monkeypatch.setattr(numeric, "step_fault_types", lambda *a, **k: {
            u: TypeCall("communication", "COMM all_reduce", "count") for u in real(*a, **k)})
        q = m.predict(vertical, te)
        assert (q.fault_type[typed] == "communication").all() and (q.alternative == "").all()
        monkeypatch.setattr(numeric, "step_fault_types", real)


def test_novel_retype_keeps_the_models_type_the_evidence_cannot_rule_out():
    from teller.baselines.rca import novel_retype

    types = np.array(["scheduling", "scheduling", "kernel", "memory", "runtime"], dtype=object)
    novel = np.array([True, True, True, False, True])
    evidence = np.array(["memory", "memory", "memory", "kernel", ""], dtype=object)
    alternative = np.array(["scheduling", "", "scheduling", "", ""], dtype=object)
    # every novel step with an evidence type takes it; a step outside, or without evidence, keeps its own
    got, changed, kept = novel_retype(types, novel, evidence)
    assert list(got) == ["memory", "memory", "memory", "memory", "runtime"] and (changed, kept) == (3, 0)
    # the model's type is the alternative the evidence cannot rule out: it stays (step 0 only)
    got, changed, kept = novel_retype(types, novel, evidence, alternative)
    assert list(got) == ["scheduling", "memory", "memory", "memory", "runtime"] and (changed, kept) == (2, 1)


def test_numeric_stage_reference_every_normal_step_or_the_fault_free_runs(vertical):
    """teller_numeric's reference is every normal train step; teller_numeric_ff takes those of the
    runs without a fault window (as `teller diagnose --reference` reads fault-free recordings),
    and every normal train step when the train part holds no such run."""
    from teller.baselines import make
    from teller.baselines.numeric import fault_free_steps
    from teller.baselines.steps import split_masks

    train, _, _ = split_masks(vertical, "request")
    tr = np.flatnonzero(train)
    normal_tr = tr[~vertical.is_anomaly[tr]]
    assert not fault_free_steps(vertical).any()  # every run of the slice holds a fault window: the fallback
    m = make("teller_numeric_ff").fit(vertical, tr)
    assert m.reference_ == "normal" and m.fitted_steps_ == len(normal_tr)
    # one run made fault-free (its windows and labels cleared): the ablation's reference is its steps alone
    s = copy.copy(vertical)
    codes, counts = np.unique(vertical.run_code[normal_tr], return_counts=True)
    r = codes[np.argmax(counts)]
    s.in_window, s.is_anomaly = vertical.in_window.copy(), vertical.is_anomaly.copy()
    s.in_window[s.run_code == r] = False
    s.is_anomaly[s.run_code == r] = False
    ff = fault_free_steps(s)
    assert (ff == (s.run_code == r)).all()
    m = make("teller_numeric_ff").fit(s, tr)
    assert m.reference_ == "fault_free" and m.fitted_steps_ == int((s.run_code[tr] == r).sum()) < len(normal_tr)
    a = make("teller_numeric").fit(s, tr)
    assert a.reference_ == "normal" and a.fitted_steps_ == int((~s.is_anomaly[tr]).sum())


def test_numeric_stage_per_deployment_reference(vertical, monkeypatch):
    """teller_numeric_deploy scores a step with the stage fitted on the fault-free normal train steps
    of its own deployment (workload shape and ranks); a deployment without a fault-free run falls
    back to every normal train step (teller_numeric)."""
    from teller.baselines import make
    from teller.baselines.numeric import TellerNumeric, deployments
    from teller.baselines.steps import split_masks

    s = copy.copy(vertical)
    s.extra = dict(vertical.extra)
    dep = deployments(s)
    names = s.extra["deployment_names"]
    assert (dep >= 0).all() and len(names) == len(np.unique(dep)) >= 2
    rec = pq.read_table(Path(s.dataset) / "records.parquet", columns=["run_id", "rank"])
    multi = set(pc.unique(rec.filter(pc.greater(rec.column("rank"), 0)).column("run_id")).to_pylist())
    for code, run in zip(dep.tolist(), np.asarray(s.runs)[s.run_code].tolist(), strict=True):
        assert names[code].endswith("/ 2 rank(s)" if run in multi else "/ 1 rank(s)")
    train, test, _ = split_masks(s, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    # one run made fault-free: its deployment's stage is fitted on its normal train steps alone
    normal_tr = tr[~s.is_anomaly[tr]]
    codes, counts = np.unique(s.run_code[normal_tr], return_counts=True)
    r = codes[np.argmax(counts)]
    s.in_window, s.is_anomaly = vertical.in_window.copy(), vertical.is_anomaly.copy()
    s.in_window[s.run_code == r] = False
    s.is_anomaly[s.run_code == r] = False
    d = int(dep[s.run_code == r][0])
    m = make("teller_numeric_deploy").fit(s, tr)
    mine = tr[s.run_code[tr] == r]
    assert set(m.models_) == {d} and m.fitted_ == {names[d]: len(mine)}
    p = m.predict(s, te)
    at = dep[te] == d
    assert at.any() and (~at).any()
    own = TellerNumeric()
    own.model_ = own._fit_on(s, mine)
    q = own.predict(s, te[at])
    assert (p.flag[at] == q.flag).all() and np.allclose(p.score[at], q.score)
    every = make("teller_numeric").fit(s, tr).predict(s, te[~at])  # the others: every normal train step
    assert (p.flag[~at] == every.flag).all() and np.allclose(p.score[~at], every.score)
    assert p.operators[np.flatnonzero(~at)[0]] == every.operators[0]
    assert m.describe()["reference_steps"] == {names[d]: len(mine)}
    # the evidence's count rule reads a reference of the step's own deployment only: the stage of
    # deployment d, not the fallback of every normal train step (nor the plain row's)
    seen = []
    plain = TellerNumeric._read_with

    def spy(self, model, steps, idx, counts=False):
        seen.append((model is m.models_.get(d), counts))
        return plain(self, model, steps, idx, counts)

    monkeypatch.setattr(TellerNumeric, "_read_with", spy)
    m.predict(s, te)
    assert sorted(set(seen)) == [(False, False), (True, True)]
    # the readings the answers come from (what benchmarks/host_slowdown.py reads): one per deployment
    seen.clear()
    got = m.readings(s, te)
    assert sorted(np.concatenate([at for at, _ in got]).tolist()) == list(range(len(te)))
    assert {r.own for _, r in got} == {False, True}
    for at, r in got:
        assert len(np.unique(dep[te[at]])) == 1  # one deployment each
        assert r.own == (int(dep[te[at[0]]]) in m.models_)
        assert r.model is (m.models_[int(dep[te[at[0]]])] if r.own else m.model_)
        assert set(np.unique(r.instances.step).tolist()) <= set(s.unit_idx.tolist())
    seen.clear()
    make("teller_numeric").fit(s, tr).predict(s, te)
    assert {c for _, c in seen} == {False}


def test_unsupervised_flags_follow_the_reference(vertical):
    """One-class detectors fitted on normal steps flag about 5% of those same steps (their quantile)."""
    from teller.baselines import make

    normal = np.flatnonzero(~vertical.is_anomaly)
    for name in ("kmeans", "iforest", "gmm"):
        m = make(name).fit(vertical, normal)
        rate = m.predict(vertical, normal).flag.mean()
        assert 0.0 < rate <= 0.08, (name, rate)


def test_cli_writes_json_markdown_png(slice_ds, tmp_path):
    from teller.cli import main

    out = tmp_path / "res"
    rc = main(["evaluate", str(slice_ds), "--split", "request,workload", "--view", "vertical,horizontal",
               "--methods", "teller_numeric,kmeans,rf_names", "--seed", "1", "-o", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["seed"] == 1 and "teller evaluate" in res["command"]
    blocks = {(b["view"], b["split"]): b for b in res["results"]}
    wl = blocks[("vertical", "workload")]
    assert "skipped" not in wl and [r["method"] for r in wl["methods"]] == ["teller_numeric", "kmeans", "rf_names"]
    done = blocks[("vertical", "request")]
    assert [r["method"] for r in done["methods"]] == ["teller_numeric", "kmeans", "rf_names"]
    assert all("step" in r and "low_prior" in r for r in done["methods"])
    assert done["methods"][2]["fault_type"]["steps"] == done["test_abnormal"]
    md = (out / "results.md").read_text()
    assert "| TELLER numeric stage (`teller_numeric`) |" in md and "split `request`, view `vertical`, seed 1" in md
    assert "split `workload`, view `vertical`, seed 1" in md
    for b in res["results"]:
        for p in b.get("plots", []):
            assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "f1_request_vertical.png").is_file() and (out / "low_prior_request_vertical.png").is_file()
    # only an impossible split (a dataset of one model shape has no split_workload): a clear
    # error, exit code 2, no table
    one = tmp_path / "one_shape"
    shutil.copytree(slice_ds, one)
    rec = pq.read_table(one / "records.parquet")
    pq.write_table(rec.drop_columns(["split_workload"]), one / "records.parquet")
    rc = main(["evaluate", str(one), "--split", "workload", "-o", str(tmp_path / "none")])
    assert rc == 2 and not (tmp_path / "none" / "results.md").exists()
    # beside a possible one, the impossible split is named in the tables and its block skipped
    # (a supervised baseline is registered as a factory, not a class: it must not stop the run)
    rc = main(["evaluate", str(one), "--split", "request,workload", "--view", "vertical", "--methods", "kmeans,rf",
               "-o", str(tmp_path / "mixed")])
    res = json.loads((tmp_path / "mixed" / "results.json").read_text())
    assert rc == 0 and "one workload shape" in {b["split"]: b for b in res["results"]}["workload"]["skipped"]
    assert "not evaluated" in (tmp_path / "mixed" / "results.md").read_text()


def test_cli_scores_the_val_part(slice_ds, tmp_path):
    """``--part val`` scores the split's val steps (a rule's setting chosen there before the test
    part is read): the block says so, its steps are the val ones, and its predictions name the
    split SPLIT/val, so a later test run does not take them for its own and the val run reads
    them back."""
    from teller.baselines.steps import VAL, load_steps
    from teller.cli import main

    out = tmp_path / "val"
    rc = main(["evaluate", str(slice_ds), "--split", "request", "--view", "vertical", "--methods", "kmeans,rf",
               "--part", "val", "-o", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    b = res["results"][0]
    st = load_steps(slice_ds, "vertical")
    assert res["part"] == "val" and b["part"] == "val" and "--part val" in res["command"]
    assert b["test_steps"] == int((st.split["split_request"] == VAL).sum())
    assert "split `request` (val part), view `vertical`" in (out / "results.md").read_text()
    pred = pq.read_table(out / "predictions.parquet")
    assert set(pred.column("split").to_pylist()) == {"request/val"} and pred.num_rows == 2 * b["test_steps"]
    # the test part's run finds nothing of its own in them: it fits its rows
    rc = main(["evaluate", str(slice_ds), "--split", "request", "--view", "vertical", "--methods", "kmeans",
               "--reuse", str(out / "predictions.parquet"), "-o", str(tmp_path / "test")])
    t = json.loads((tmp_path / "test" / "results.json").read_text())["results"][0]
    assert rc == 0 and "predictions_from" not in t["methods"][0] and t["part"] == "test"
    # the val run reads them back: the same figures, not fitted again
    rc = main(["evaluate", str(slice_ds), "--split", "request", "--view", "vertical", "--methods", "rf", "--part", "val",
               "--reuse", str(out / "predictions.parquet"), "-o", str(tmp_path / "again")])
    again = json.loads((tmp_path / "again" / "results.json").read_text())["results"][0]["methods"][0]
    assert rc == 0 and again["predictions_from"] and again["step"] == b["methods"][1]["step"]
    assert main(["evaluate", str(slice_ds), "--part", "dev", "-o", str(tmp_path / "bad")]) == 2


def test_horizontal_view_joins_rank_steps(slice_ds):
    from teller.baselines import make
    from teller.baselines.features import STANDARD, read_dataset_features
    from teller.baselines.steps import load_steps

    h = load_steps(slice_ds, "horizontal")
    assert h.n >= 20 and (np.diff(h.unit_ptr) == 2).all()  # the TP run has two ranks
    h.features = read_dataset_features(slice_ds, h)
    f = h.features
    assert f.std.shape == (h.n, 2 * len(STANDARD)) and f.std_names[len(STANDARD)] == "spread_n_STEP"
    col = {k: f.std[:, i] for i, k in enumerate(f.std_names)}
    assert (col["n_STEP"] == 2).all() and (col["spread_n_STEP"] == 0).all()
    assert (col["comm_n"] > 0).all()  # every step of a TP run runs collectives
    # a family every abnormal train step names is always predicted for a flagged step
    assert h.is_anomaly.any()
    every = set.intersection(*(set(h.labels[i]) for i in np.flatnonzero(h.is_anomaly)))
    idx = np.arange(h.n)
    m = make("rf").fit(h, idx)
    p = m.predict(h, idx)
    assert p.flag.any()
    assert all(every <= set(ops) for ops, fl in zip(p.operators, p.flag, strict=True) if fl)


def test_horizontal_instances_taken_from_the_vertical_views(vertical, slice_ds):
    """The stage's instances of the horizontal view taken from the vertical view's (its rank steps
    are vertical ones) are those built for it, but for the rows outside every unit; a view whose
    units the kept ones do not hold is built anew, and the last view keeps nothing."""
    from teller.baselines.numeric import shared_unit_instances, unit_instances, units_taken
    from teller.baselines.steps import load_steps
    from teller.dataset.codec import read_subtrees

    sub = read_subtrees(slice_ds)
    h = load_steps(slice_ds, "horizontal")
    own = unit_instances(h, sub)
    own = own.subset(np.flatnonzero(own.step >= 0))
    warm = h.extra.pop("unit_warmup")
    v = vertical
    got = units_taken(v.extra["instances"], v.runs, v.unit_key, v.extra["unit_warmup"], h)
    assert got is not None
    inst, w = got
    assert (w == warm).all() and inst.n == own.n > 0
    assert inst.families == own.families and (inst.family == own.family).all() and (inst.step == own.step).all()
    assert np.array_equal(inst.X, own.X, equal_nan=True) and (inst.parent == own.parent).all()
    assert np.array_equal(inst.batch, own.batch, equal_nan=True)
    # the other way round: the vertical view's units are not all horizontal ones
    assert units_taken(inst, h.runs, h.unit_key, w, v) is None
    # through the evaluation's shared dict: kept by the first view, taken and let go by the last
    shared = {"last": False}
    v2 = load_steps(slice_ds, "vertical")
    first = shared_unit_instances(v2, sub, shared)
    assert first.n == v.extra["instances"].n and "unit_instances" in shared
    shared["last"] = True
    h2 = load_steps(slice_ds, "horizontal")
    taken = shared_unit_instances(h2, sub, shared)
    assert "unit_instances" not in shared and taken.n == own.n and (h2.extra["unit_warmup"] == warm).all()
    assert shared_unit_instances(load_steps(slice_ds, "vertical"), sub, None).n == first.n


@pytest.mark.parametrize("name", ["rf", "xgb"])
def test_operator_heads_give_one_column_per_family_even_for_one(name):
    """A training set whose abnormal steps vary in one operator family only still gives one
    probability column per family (a single-output model returns two class columns)."""
    from teller.baselines import make

    rng = np.random.default_rng(0)
    X = rng.random((60, 4))
    for k in (1, 3):
        Y = (X[:, :k] > 0.5).astype(np.int64)
        m = make(name, seed=0)
        P = m._ops_proba(m._fit_ops(X, Y), X)
        assert P.shape == (60, k)
        assert ((P > 0.5) == Y.astype(bool)).mean() > 0.9  # the fitted steps are ranked as labelled


# ------------------------------------------------------------------------------------------------
# log baselines (teller/baselines/logs.py), small budgets so each test stays short

#: fewer updates than the defaults (the slice is small); the models and scores are the same
LOG_SMALL = {"logrobust": {"updates": 150}, "lanobert": {"updates": 40, "batch": 32}, "logs2graphs": {"updates": 100},
             "madgan": {"updates": 150}}


def _log_method(name, seed=0):
    from teller.baselines import REGISTRY

    m = REGISTRY[name](seed=seed, **LOG_SMALL[name])
    m.name = name
    return m


def test_step_logs_follow_the_dataset_lines(vertical, slice_ds):
    from teller.baselines.logs import step_logs
    from teller.baselines.steps import load_steps

    lg = step_logs(vertical)
    logs = pq.read_table(slice_ds / "logs.parquet", columns=["run_id", "step_id", "ts_ns"])
    key = [f"{r}|{s}" for r, s in zip(logs.column("run_id").to_pylist(), logs.column("step_id").to_pylist(), strict=True)]
    want = {k: key.count(k) for k in set(key)}
    got = {f"{vertical.runs[r]}|{s}": int(n) for r, s, n in zip(vertical.run_code, vertical.step_id, lg.lens(), strict=True)}
    assert sum(got.values()) == logs.num_rows and all(got[k] == v for k, v in want.items())
    assert (lg.lens() == 0).any() and (lg.lens() > 0).any()  # some steps have no line
    # a horizontal step holds the lines of all its rank steps
    h = load_steps(slice_ds, "horizontal")
    hl = step_logs(h)
    per_unit = {k: got.get(f"{h.runs[k >> 40]}|{k & ((1 << 40) - 1)}", 0) for k in h.unit_key.tolist()}
    for i in range(h.n):
        units = h.unit_key[h.unit_idx[h.unit_ptr[i]:h.unit_ptr[i + 1]]]
        assert hl.lens()[i] == sum(per_unit[int(u)] for u in units)


@pytest.mark.parametrize("name", ["logrobust", "lanobert", "logs2graphs", "madgan"])
def test_log_methods_fit_predict_and_repeat(vertical, name):
    from teller.baselines.logs import step_logs
    from teller.baselines.steps import split_masks
    from teller.evaluate.run import score_method

    train, test, _ = split_masks(vertical, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    m = _log_method(name).fit(vertical, tr)
    p = m.predict(vertical, te)
    assert p.score.shape == (len(te),) and p.flag.shape == (len(te),) and p.flag.dtype == bool
    assert np.isfinite(p.score).all() and p.fault_type is None and p.operators is None
    empty = step_logs(vertical).lens()[te] == 0
    assert empty.any()
    if name == "lanobert":  # no line, no loss
        assert (p.score[empty] == 0).all()
    # the same seed gives the same scores; the caller's torch threads are left as they were
    import torch

    before = torch.get_num_threads()
    again = _log_method(name).fit(vertical, tr).predict(vertical, te)
    assert np.array_equal(again.score, p.score) and torch.get_num_threads() == before
    r = score_method(vertical, te, p)
    assert 0.0 <= r["step"]["f1"] <= 1.0 and "operator" not in r and "fault_type" not in r
    if m.kind == "unsupervised":  # the threshold is the 95th percentile of held-out normal train steps
        normal = tr[~vertical.is_anomaly[tr]]
        assert 0.0 <= m.predict(vertical, normal).flag.mean() <= 0.25


def _planted(steps):
    """``steps`` whose abnormal steps each end with one extra warning line no normal step has."""
    from teller.baselines.logs import StepLogs, step_logs

    s = copy.copy(steps)
    s.extra = {}
    lg = step_logs(s)
    ab = s.is_anomaly
    lens = lg.lens() + ab
    tmpl, msg = [], []
    for i in range(s.n):
        rows = range(lg.ptr[i], lg.ptr[i + 1])
        tmpl += [int(lg.template[r]) for r in rows]
        msg += [str(lg.message[r]) for r in rows]
        if ab[i]:
            tmpl.append(len(lg.templates))
            msg.append(f"teller.workload: WARNING watchdog: engine step stalled for {100 + i} ms, dumping stacks")
    s.extra["logs"] = StepLogs(ptr=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                               template=np.asarray(tmpl, np.int64),
                               templates=lg.templates + ["teller.workload: WARNING watchdog: engine step stalled for <NUM> "
                                                         "ms, dumping stacks"], message=np.asarray(msg, dtype=str))
    return s


@pytest.mark.parametrize("name", ["logrobust", "lanobert", "logs2graphs", "madgan"])
def test_log_methods_find_a_planted_warning_line(vertical, name):
    """Abnormal steps that carry a warning line no normal step has: the supervised methods learn
    it from the labels, the one-class ones (fitted on normal steps) score the unseen line high."""

    s = _planted(vertical)
    # a random split (the slice's request split puts mostly line-less abnormal steps in train)
    perm = np.random.default_rng(0).permutation(s.n)
    tr, te = np.sort(perm[: s.n // 2]), np.sort(perm[s.n // 2:])
    p = _log_method(name).fit(s, tr).predict(s, te)
    y = s.is_anomaly[te]
    # MAD-GAN sees the new template as one count column among ~16, its residual mixed with the
    # spread of the normal counts (and 1 − D): it ranks the planted steps high, less sharply
    assert auroc(y, p.score) > (0.8 if name == "madgan" else 0.95), (name, auroc(y, p.score))
    assert p.flag[y].mean() > (2 * p.flag[~y].mean() if name == "madgan" else 0.9)
    # the unplanted steps: logs alone say much less
    q = _log_method(name).fit(vertical, tr).predict(vertical, te)
    assert auroc(vertical.is_anomaly[te], q.score) < auroc(s.is_anomaly[te], p.score)


# ------------------------------------------------------------------------------------------------
# the root-cause model as a row


def _tiny_mot(named, out):
    """A tiny MoT reading engine iterations (``teller_mot``'s recipe) trained a few steps on the
    request split of the dataset ``named``."""
    from teller.rca.train import train

    train(named, out, variant="mot", split="request", config="tiny", epochs=1, max_steps=3, progress=False,
          log=lambda m: None, unit="iteration")
    return out


def test_a_model_row_scores_its_own_test_steps_and_the_shipped_model_only_its_dataset(slice_ds, tmp_path):
    """A model row scores the test steps of the split its model was trained on (the evaluation's
    and the model's test steps are one rule's); another split is refused, since its test steps may
    be steps it learnt from. The shipped model (the recipe of ``teller_mot_family``, the only row
    that falls back on it) was trained on the union of dataset v2's parts, whose splits are drawn
    over the whole union: it is refused on this slice of one part, and a row of another recipe
    without a model says how to train one."""
    pytest.importorskip("torch")
    from teller.baselines import make
    from teller.baselines.steps import load_steps, split_masks
    from teller.rca import DEFAULT_MODEL
    from teller.rca.data import FAULT_TYPES, read_units

    named = tmp_path / "h200_v2"
    shutil.copytree(slice_ds, named)
    steps = load_steps(named, "vertical")
    train, test, _ = split_masks(steps, "request")
    te = np.flatnonzero(test)
    # the evaluation's test steps are the model's test units (one rule: teller.dataset.splits)
    u = read_units(named)
    unit_test = {(r, int(s[0])) for r, v, s, p in zip(u.run_id, u.view, u.step_ids, u.splits["request"], strict=True)
                 if v == "vertical" and p == "test"}
    assert {(str(steps.runs[steps.run_code[i]]), int(steps.step_id[i])) for i in te.tolist()} == unit_test
    steps.extra["split"] = "request"
    shipped = json.loads((DEFAULT_MODEL / "config.json").read_text())["training"]["dataset"]
    with pytest.raises(ValueError, match=f"trained on '{shipped}', not"):
        make("teller_mot_family").fit(steps, np.flatnonzero(train))
    with pytest.raises(ValueError, match="no mot model \\(inputs trace\\+log, unit iteration, operator head token.*--models DIR"):
        make("teller_mot").fit(steps, np.flatnonzero(train))
    m = make("teller_mot")
    m.model = _tiny_mot(named, tmp_path / "tiny")
    m.fit(steps, np.flatnonzero(train))
    p = m.predict(steps, te)
    assert p.score.shape == (len(te),) and ((p.score >= 0) & (p.score <= 1)).all()
    assert set(p.fault_type.tolist()) <= set(FAULT_TYPES[1:])
    assert all(bool(ops) <= f for ops, f in zip(p.operators, p.flag, strict=True))  # operators only for flagged steps
    truth = steps.is_anomaly[te]
    assert truth.any() and (~truth).any()
    steps.extra["split"] = "run"
    with pytest.raises(ValueError, match="trained on the 'request' split"):
        m.fit(steps, np.flatnonzero(train))


def test_teller_row_is_the_stage_or_the_model_and_predictions_are_written(slice_ds, tmp_path):
    """``teller``: a step is flagged when the numeric stage or the model flags it, its score is the
    larger, its type and operators the model's where the model flags it and the stage's where
    only the stage does (the type its evidence points to); predictions.parquet holds every row's per-step answer, and the row alone
    (nothing to reuse) gives what it gives beside its two parts."""
    pytest.importorskip("torch")
    from teller.cli import main

    def rows(path, method):
        t = pq.read_table(path).filter(pc.equal(pc.field("method"), method)).to_pylist()
        return {(r["run_id"], r["step_id"]): r for r in t}

    named = tmp_path / "h200_v2"
    shutil.copytree(slice_ds, named)
    models = tmp_path / "models"
    _tiny_mot(named, models / "it")
    mod = ["--models", str(models)]
    out = tmp_path / "res"
    assert main(["evaluate", str(named), "--split", "request", "--methods", "teller_mot,teller_numeric,teller,teller_confirm,teller_screened",
                 "-o", str(out), *mod]) == 0
    blk = json.loads((out / "results.json").read_text())["results"][0]
    mot, num, tel = (rows(out / "predictions.parquet", m) for m in ("teller_mot", "teller_numeric", "teller"))
    conf = rows(out / "predictions.parquet", "teller_confirm")  # as `teller diagnose`: the model confirms the stage's flags
    assert all(c["flag"] == (num[k]["flag"] and mot[k]["score"] >= 0.1) for k, c in conf.items())
    assert all(c["operators"] == (mot[k]["operators"] if mot[k]["flag"] and c["flag"] else num[k]["operators"] if c["flag"] else [])
               for k, c in conf.items())
    scr = rows(out / "predictions.parquet", "teller_screened")  # the stage's flags kept where the model gives >= 0.1
    assert scr.keys() == conf.keys()
    assert all(c["flag"] == (mot[k]["flag"] or (num[k]["flag"] and mot[k]["score"] >= 0.1)) for k, c in scr.items())
    assert len(tel) == len(mot) == len(num) == blk["test_steps"] and tel.keys() == mot.keys() == num.keys()
    for k, t in tel.items():
        m, n = mot[k], num[k]
        assert t["flag"] == (m["flag"] or n["flag"]) and t["score"] == pytest.approx(max(m["score"], n["score"]))
        # the type of the part whose flag stands: the stage's evidence type where only it flags
        assert t["fault_type"] == (n["fault_type"] if n["flag"] and not m["flag"] and n["fault_type"] else m["fault_type"])
        assert t["is_anomaly"] == m["is_anomaly"]
        assert t["operators"] == (m["operators"] if m["flag"] else n["operators"] if n["flag"] else [])
    assert any(n["flag"] and not mot[k]["flag"] for k, n in num.items()) or any(m["flag"] for m in mot.values())
    row = {r["method"]: r for r in blk["methods"]}["teller"]
    assert row["step"]["tp"] == sum(t["flag"] and t["is_anomaly"] for t in tel.values())
    assert row["step"]["fp"] == sum(t["flag"] and not t["is_anomaly"] for t in tel.values())
    assert "| TELLER (numeric stage + MoT root-cause model) (`teller`) |" in (out / "results.md").read_text()
    # the row says which trained model it scored (read after its fit)
    assert Path({r["method"]: r for r in blk["methods"]}["teller_mot"]["model"]) == models / "it"
    # alone: it fits and predicts both parts itself
    out2 = tmp_path / "alone"
    assert main(["evaluate", str(named), "--split", "request", "--methods", "teller", "-o", str(out2), *mod]) == 0
    alone = rows(out2 / "predictions.parquet", "teller")
    assert alone.keys() == tel.keys()
    assert all(alone[k]["flag"] == t["flag"] and alone[k]["score"] == pytest.approx(t["score"], abs=1e-4) for k, t in tel.items())
    # --reuse: the rows the file holds are read, not fitted (the model is not even loaded), and
    # the teller row is built from them; the same answers and metrics
    out3 = tmp_path / "reused"
    src = out / "predictions.parquet"
    assert main(["evaluate", str(named), "--split", "request", "--methods", "teller_mot,kmeans,teller", "--reuse", str(src),
                 "-o", str(out3)]) == 0
    blk3 = {r["method"]: r for r in json.loads((out3 / "results.json").read_text())["results"][0]["methods"]}
    assert blk3["teller_mot"]["predictions_from"] == str(src) and "predictions_from" not in blk3["kmeans"]
    assert blk3["teller"]["predictions_from"] == str(src) and "answers read from" in blk3["teller"]["fit_on"]
    first = {r["method"]: r for r in blk["methods"]}
    for name in ("teller_mot", "teller"):
        assert blk3[name]["step"] == first[name]["step"] and blk3[name]["operator"] == first[name]["operator"]
        assert blk3[name]["fault_type"] == first[name]["fault_type"]
    assert rows(out3 / "predictions.parquet", "teller") == tel
    # a file whose steps are not this split's test steps is refused, naming the file
    t = pq.read_table(src)
    sid = t.column("step_id").to_numpy().copy()
    sid[0] += 10**6
    bad = tmp_path / "bad.parquet"
    pq.write_table(t.set_column(t.column_names.index("step_id"), "step_id", pa.array(sid)), bad)
    assert main(["evaluate", str(named), "--split", "request", "--methods", "teller_mot", "--reuse", str(bad),
                 "-o", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad" / "results.json").exists()
    sid = t.column("step_id").to_numpy().copy()
    first_mot = t.column("method").to_pylist().index("teller_mot")
    sid[first_mot + 1] = sid[first_mot]  # one step twice, another missing: as many rows, not the same steps
    pq.write_table(t.set_column(t.column_names.index("step_id"), "step_id", pa.array(sid)), bad)
    assert main(["evaluate", str(named), "--split", "request", "--methods", "teller_mot", "--reuse", str(bad),
                 "-o", str(tmp_path / "bad2")]) == 2
    # two files: the model's rows from one, the stage's from the other; the same rows twice is refused
    t_mot = pq.read_table(src).filter(pc.equal(pc.field("method"), "teller_mot"))
    t_num = pq.read_table(src).filter(pc.equal(pc.field("method"), "teller_numeric"))
    pq.write_table(t_mot, tmp_path / "mot.parquet")
    pq.write_table(t_num, tmp_path / "num.parquet")
    assert main(["evaluate", str(named), "--split", "request", "--methods", "teller_mot,teller_numeric,teller",
                 "--reuse", str(tmp_path / "mot.parquet"), "--reuse", str(tmp_path / "num.parquet"), "-o", str(tmp_path / "two")]) == 0
    assert rows(tmp_path / "two" / "predictions.parquet", "teller") == tel
    # teller_confirm without the stage's own row: it builds the stage's instances itself
    assert main(["evaluate", str(named), "--split", "request", "--methods", "teller_mot,teller_confirm",
                 "--reuse", str(tmp_path / "mot.parquet"), "-o", str(tmp_path / "confirm")]) == 0
    row = {r["method"]: r for r in json.loads((tmp_path / "confirm" / "results.json").read_text())["results"][0]["methods"]}
    assert "error" not in row["teller_confirm"], row["teller_confirm"].get("error")
    assert rows(tmp_path / "confirm" / "predictions.parquet", "teller_confirm") == conf
    assert main(["evaluate", str(named), "--split", "request", "--methods", "teller_mot",
                 "--reuse", str(tmp_path / "mot.parquet"), "--reuse", str(src), "-o", str(tmp_path / "twice")]) == 2
    # a file that is not a predictions.parquet (cut short; or another table) is named with the fix
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(src.read_bytes()[: len(src.read_bytes()) // 2])
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1]}), other)
    from teller.errors import TellerError
    from teller.evaluate.run import read_predictions

    with pytest.raises(TellerError, match="not a readable predictions.parquet"):
        read_predictions([cut])
    with pytest.raises(TellerError, match="no column .*method"):
        read_predictions([other])


def test_fuse_rules_hand_case():
    from teller.baselines.base import Prediction
    from teller.baselines.rca import fuse

    num = Prediction(score=np.array([0.9, 0.2, 0.7, 0.1]), flag=np.array([1, 0, 1, 0], bool), operators=[["A"], [], ["B"], []])
    mot = Prediction(score=np.array([0.8, 0.9, 0.3, 0.2]), flag=np.array([1, 1, 0, 0], bool),
                     fault_type=np.array(["kernel", "memory", "runtime", "scheduling"], dtype=object),
                     operators=[["X"], ["Y"], [], []])
    o = fuse(num, mot)
    assert o.flag.tolist() == [True, True, True, False] and o.score.tolist() == [0.9, 0.9, 0.7, 0.2]
    assert o.operators == [["X"], ["Y"], ["B"], []] and o.fault_type.tolist() == mot.fault_type.tolist()
    a = fuse(num, mot, "and")
    assert a.flag.tolist() == [True, False, False, False] and a.score.tolist() == [0.8, 0.2, 0.3, 0.1]
    assert a.operators == [["X"], [], [], []]
    # with the stage's evidence types: the stage's where it flags and the model does not (step 2),
    # the model's elsewhere: where it flags (0, 1) and where neither does (3)
    num.fault_type = np.array(["communication", "communication", "communication", "communication"], dtype=object)
    assert fuse(num, mot).fault_type.tolist() == ["kernel", "memory", "communication", "scheduling"]
    assert fuse(num, mot, "and").fault_type.tolist() == ["kernel", "memory", "communication", "scheduling"]
    num.fault_type = np.array(["communication", "", "", ""], dtype=object)  # no evidence type: the model's
    assert fuse(num, mot).fault_type.tolist() == mot.fault_type.tolist()


def test_model_rows_take_the_model_of_their_variant_and_split_from_models(slice_ds, tmp_path):
    """``--models DIR``: ``teller_single`` takes the single-stream model trained on the split
    evaluated; without one it is an error that says how to train it."""
    pytest.importorskip("torch")
    from teller.baselines import make
    from teller.baselines.steps import load_steps, split_masks
    from teller.rca.train import train

    named = tmp_path / "h200_v2"
    shutil.copytree(slice_ds, named)
    steps = load_steps(named, "vertical")
    train_mask, test, _ = split_masks(steps, "request")
    steps.extra["split"] = "request"
    with pytest.raises(ValueError, match="pass `--models DIR`"):
        make("teller_single").fit(steps, np.flatnonzero(train_mask))
    models = tmp_path / "models"
    train(named, models / "a", variant="single", split="request", config="tiny", epochs=1, max_steps=3, progress=False,
          log=lambda m: None)
    train(named, models / "b", variant="single", split="request", config="tiny", epochs=1, max_steps=3, progress=False,
          log=lambda m: None, inputs="log")  # an ablation: not the row's model
    steps.extra["rca_models"] = str(models)
    m = make("teller_single").fit(steps, np.flatnonzero(train_mask))
    assert Path(m.model_path_) == models / "a" and m.model_.cfg.inputs == "trace+log"
    with pytest.raises(ValueError, match="no single model \\(inputs summary\\+log"):
        make("teller_prompt").fit(steps, np.flatnonzero(train_mask))
    p = m.predict(steps, np.flatnonzero(test))
    assert p.score.shape == (int(test.sum()),)
    # a model of the engine iteration reads the dataset serialized as iterations
    train(named, models / "it", variant="mot", split="request", config="tiny", epochs=1, max_steps=3, progress=False,
          log=lambda m: None, unit="iteration")
    with pytest.raises(ValueError, match="no mot model \\(inputs trace\\+log, unit step"):
        make("teller_mot_step").fit(steps, np.flatnonzero(train_mask))  # the unit ablation needs its own model
    train(named, models / "st", variant="mot", split="request", config="tiny", epochs=1, max_steps=3, progress=False,
          log=lambda m: None)
    mi = make("teller_mot").fit(steps, np.flatnonzero(train_mask))  # the iteration model, beside a step one
    assert Path(mi.model_path_) == models / "it" and mi.model_.cfg.unit == "iteration"
    assert mi.predict(steps, np.flatnonzero(test)).score.shape == (int(test.sum()),)
    assert set(steps.extra["rca_datasets"]) == {"step", "iteration"}
    ms = make("teller_mot_step").fit(steps, np.flatnonzero(train_mask))
    assert Path(ms.model_path_) == models / "st" and ms.model_.cfg.unit == "step"
    wrong = make("teller_mot_step")
    wrong.model = models / "it"
    with pytest.raises(ValueError, match="reads iteration units, the row 'teller_mot_step' scores step units"):
        wrong.fit(steps, np.flatnonzero(train_mask))
    steps.extra["split"] = "run"
    with pytest.raises(ValueError, match="no single model"):
        make("teller_single").fit(steps, np.flatnonzero(train_mask))
    steps.extra["split"] = "request"  # a second model that fits the row: refused, not picked by name
    shutil.copytree(models / "a", models / "c")
    with pytest.raises(ValueError, match="2 single models .* a, c"):
        make("teller_single").fit(steps, np.flatnonzero(train_mask))


def test_explanation_checks_hand_cases():
    from teller.evaluate.scores import explanation_checks

    good = ("CUDA/kernel fault (targeted_op_delay) in step 9 on rank 0: evidence FE LlamaMLP (layer FE,K); the GPU work "
            "took 1.65 ms against a fault-free p99 of 0.06 ms. Cause: extra device work inside the targeted operator.")
    wrong_type = good.replace("CUDA/kernel fault", "Memory/resource fault", 1)  # kernel mechanism under another type (capitalised)
    foreign_op = good.replace("evidence FE LlamaMLP", "evidence FE LMHead", 1)  # not in the step's tree
    actionable = good[:-1] + "; check the operator's kernels with `teller show`."
    cut = good[:80]
    texts = [good, wrong_type, foreign_op, actionable, cut, ""]
    tree = {"FE LlamaMLP", "FE LlamaAttention", "STEP"}
    c = explanation_checks(texts, ["kernel"] * 6, [["FE LlamaMLP"]] * 6, [tree] * 6)
    p = c["per_step"]
    assert p["anomaly_correct"] == [True, True, True, True, True, False]  # a cut sentence still states a fault
    assert p["type_correct"] == [True, False, True, True, True, False]
    assert p["locator_valid"] == [True, True, False, True, False, False]
    assert p["causal_consistent"] == [True, False, True, True, False, False]
    assert p["actionable"] == [False, False, False, True, False, False]
    assert p["complete"] == [True, True, True, True, False, False]
    assert c["steps"] == 6 and c["rates"]["type_correct"] == pytest.approx(4 / 6)


def test_fuse_rules_on_hand_computed_steps():
    """The three ways the stage's and the model's answers combine, on five steps: either, both,
    and the screen rule (the model's flags, and the stage's where the model gives at least tau),
    whose score crosses 0.5 exactly where it flags; operators from the model where it flags."""
    from teller.baselines.base import Prediction
    from teller.baselines.rca import TellerConfirm, TellerScreened, fuse

    num = Prediction(score=np.array([0.9, 0.9, 0.2, 0.7, 0.1]), flag=np.array([True, True, False, True, False]),
                     operators=[["FE a"], ["FE b"], [], ["FE d"], []])
    mot = Prediction(score=np.array([0.05, 0.001, 0.8, 0.6, 0.3]), flag=np.array([False, False, True, True, False]),
                     fault_type=np.array(["kernel", "memory", "runtime", "scheduling", "kernel"], dtype=object),
                     operators=[[], [], ["FE c"], ["FE m"], []])
    either, both = fuse(num, mot, "or"), fuse(num, mot, "and")
    assert either.flag.tolist() == [True, True, True, True, False] and both.flag.tolist() == [False, False, False, True, False]
    floored = fuse(num, mot, "and", 0.01)  # as `teller diagnose`: the stage's flags the model does not rule out
    assert floored.flag.tolist() == [True, False, False, True, False]
    assert floored.score.tolist() == pytest.approx([0.9, 0.05, 0.2, 0.7, 0.1]) and ((floored.score >= 0.5) == floored.flag).all()
    scr = fuse(num, mot, "screen", 0.01)
    # step 0: the stage flags and the model gives 0.05 >= 0.01: kept; step 1: 0.001 < 0.01: dropped
    assert scr.flag.tolist() == [True, False, True, True, False]
    assert scr.score.tolist() == pytest.approx([0.9, 0.05, 0.8, 0.7, 0.3])  # max(model, min(stage, model / 2tau))
    assert ((scr.score >= 0.5) == scr.flag).all()
    assert scr.operators == [["FE a"], [], ["FE c"], ["FE m"], []] and list(scr.fault_type) == list(mot.fault_type)
    assert fuse(num, mot, "screen", 0.1).flag.tolist() == [False, False, True, True, False]
    assert TellerScreened.tau == TellerConfirm.tau == 0.1 and TellerScreened.rule == "screen" and TellerConfirm.rule == "and"
    with pytest.raises(ValueError, match="tau 0.6 must lie in"):
        fuse(num, mot, "screen", 0.6)


def test_numeric_stage_against_the_runs_own_steps(vertical):
    """teller_numeric_self reads each test run against its own steps (labels unread): the stage
    fitted on every step of the run, then without the steps that fit flags; a step's answer does
    not depend on the other runs or on which of the run's steps are test steps."""
    from teller.baselines import make
    from teller.baselines.numeric import TellerNumeric, TellerNumericSelf, deployments
    from teller.baselines.steps import split_masks

    train, test, _ = split_masks(vertical, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    m = make("teller_numeric_self").fit(vertical, tr)
    assert set(m.models_) == set(np.unique(deployments(vertical)).tolist())  # every run: its own deployment
    p = m.predict(vertical, te)
    runs = np.unique(vertical.run_code[te])
    assert len(m.runs_) == len(runs) and set(m.left_out_) == {str(vertical.runs[r]) for r in runs.tolist()}
    # one run by hand: the slice's runs are too short to halve, so a fit on all its steps, its
    # flags (warm-up aside) left out, fitted again
    r = int(vertical.run_code[te][np.argmax(np.bincount(vertical.run_code[te]))])
    every = np.flatnonzero(vertical.run_code == r)
    own = TellerNumeric()
    first = own._predict_with(own._fit_on(vertical, every), vertical, every, counts=True)
    info = m.left_out_[str(vertical.runs[r])]
    assert "spans" not in info and info["steps"] <= len(every)
    assert 0 < info["left_out"] <= int(first.flag.sum()) and info["reference_steps"] == info["steps"] - info["left_out"]
    mine = te[vertical.run_code[te] == r]
    again = make("teller_numeric_self").fit(vertical, tr).predict(vertical, mine)  # the run's test steps alone
    at = vertical.run_code[te] == r
    assert (p.flag[at] == again.flag).all() and np.allclose(p.score[at], again.score)
    assert any(first.flag) and p.flag.any() and not p.flag.all()
    d = m.describe()["own_steps"]
    assert d["runs"] == len(runs) and 0 < d["left_out"] < d["steps"] and d["reference_half"] == {"first": 0, "second": 0}
    # halves of 10 steps (diagnose's need 40): a run's reference is the half the other departs from
    # more, and its steps are read against the stage fitted on it
    halved = type("Halved", (TellerNumericSelf,), {"half_steps": 10})().fit(vertical, tr)
    q = halved.predict(vertical, mine)
    info = halved.left_out_[str(vertical.runs[r])]
    sp = info["spans"]
    assert sp["first"] >= 10 and sp["second"] >= 10 and sp["reference"] in ("first", "second")
    usable = ~np.asarray(vertical.extra["unit_warmup"])[vertical.unit_idx[vertical.unit_ptr[every]]]
    half = usable & ((vertical.step_num[every] <= sp["cut_step"]) == (sp["reference"] == "first"))
    flags = own._predict_with(own._fit_on(vertical, every[half]), vertical, every, counts=True).flag & half
    ref = half & ~flags if int((half & ~flags).sum()) >= 20 and flags.any() else half
    by_hand = own._predict_with(own._fit_on(vertical, every[ref]), vertical, mine, counts=True)
    assert info["reference_steps"] == int(ref.sum()) and (q.flag == by_hand.flag).all() and np.allclose(q.score, by_hand.score)


def test_deploy_rows_fuse_the_deployment_stage(vertical):
    """teller_deploy, teller_confirm_deploy and teller_screened_deploy combine the model's answers
    with those of teller_numeric_deploy (not teller_numeric) by the rules of their plain rows."""
    from teller.baselines import make
    from teller.baselines.base import Prediction
    from teller.baselines.rca import fuse

    te = np.arange(5)
    num = Prediction(score=np.array([0.9, 0.9, 0.2, 0.7, 0.1]), flag=np.array([True, True, False, True, False]),
                     operators=[["FE a"], ["FE b"], [], ["FE d"], []])
    dep = Prediction(score=np.array([0.1, 0.9, 0.9, 0.1, 0.8]), flag=np.array([False, True, True, False, True]),
                     operators=[[], ["FE b"], ["FE c"], [], ["FE e"]])
    mot = Prediction(score=np.array([0.05, 0.001, 0.8, 0.6, 0.3]), flag=np.array([False, False, True, True, False]),
                     fault_type=np.array(["kernel", "memory", "runtime", "scheduling", "kernel"], dtype=object),
                     operators=[[], [], ["FE c"], ["FE m"], []])
    s = copy.copy(vertical)
    s.extra = dict(vertical.extra, split="request",
                   predictions={("request", "teller_numeric"): (te, num), ("request", "teller_numeric_deploy"): (te, dep),
                                ("request", "teller_mot"): (te, mot)})
    for plain, rule, tau in (("teller", "or", 0.5), ("teller_confirm", "and", 0.1), ("teller_screened", "screen", 0.1)):
        a = make(plain).fit(s, te).predict(s, te)
        b = make(plain + "_deploy").fit(s, te).predict(s, te)
        want_a, want_b = fuse(num, mot, rule, tau), fuse(dep, mot, rule, tau)
        assert a.flag.tolist() == want_a.flag.tolist() and b.flag.tolist() == want_b.flag.tolist()
        assert b.score.tolist() == pytest.approx(want_b.score.tolist()) and b.operators == want_b.operators
    assert make("teller_deploy").fit(s, te).predict(s, te).flag.tolist() == [False, True, True, True, True]


def test_episode_lengths_hand_case():
    from teller.localize.episodes import episode_lengths

    lane = np.array([0, 0, 0, 0, 0, 1, 1, 0, 1])
    num = np.array([1, 2, 4, 8, 9, 1, 2, 3, 3])
    flag = np.array([1, 1, 1, 1, 1, 1, 0, 0, 1], bool)
    eid, length = episode_lengths(lane, num, flag)
    # lane 0: 1, 2, 4 (gap 2: one episode), then 8, 9; lane 1: 1 and 3 (gap 2), its step 2 unflagged
    assert length.tolist() == [3, 3, 3, 2, 2, 2, 0, 0, 2]
    assert eid[0] == eid[1] == eid[2] != eid[3] == eid[4] and eid[5] == eid[8] and eid[6] == eid[7] == -1
    assert episode_lengths(lane, num, flag, gap=1)[1].tolist() == [2, 2, 1, 2, 2, 1, 0, 0, 1]
    assert episode_lengths(lane, num, np.zeros(9, bool))[1].tolist() == [0] * 9


def test_sustain_and_episode_majority_hand_case():
    from teller.localize.episodes import episode_lengths, episode_majority, sustain

    lane = np.array([0] * 12 + [1, 1])
    num = np.r_[np.arange(12), [3, 4]]
    flag = np.array([0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0], bool)
    weak = np.array([1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1], bool)
    # lane 0: 0..8 is one episode of flag | weak holding 5 flagged steps; 11 lies 3 past 8; lane 1 has no flag
    assert sustain(lane, num, flag, weak).tolist() == [1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert not sustain(lane, num, flag, weak, min_flagged=6).any()
    assert sustain(lane, num, flag, weak | flag).tolist() == sustain(lane, num, flag, weak).tolist()  # flagged never join
    assert not sustain(lane, num, np.zeros(14, bool), weak).any()
    eid = np.array([0, 0, 0, 0, 1, 1, 1, 1, -1, 2, 2])
    code = np.array([3, 1, 1, 3, 2, 0, 2, -1, 4, -1, -1])
    w = np.array([0.9, 0.2, 0.2, 0.1, 0, 0, 0, 0, 0, 0, 0])
    # episode 0: codes 3 and 1 tie at two votes, 3 weighs 1.0 against 0.4; episode 1: 2 twice; episode 2: no vote
    assert episode_majority(eid, code, w).tolist() == [3, 3, 3, 3, 2, 2, 2, 2, -1, -1, -1]
    assert episode_majority(eid, code).tolist()[:4] == [1, 1, 1, 1]  # no weight: the smaller code
    assert episode_majority(eid, np.full(11, -1)).tolist() == [-1] * 11
    e2, _ = episode_lengths(lane, num, flag | sustain(lane, num, flag, weak))
    assert len(set(e2[:9].tolist())) == 1 and (e2[9:] == -1).all()


def test_sustained_row_reads_the_models_answers_over_time(vertical):
    """teller_mot_family_sustained: the model row's answers, a step at even odds next to an episode
    of 5+ of its flags joined to it with the families most of the episode names, and the
    episode's majority type on all its steps; a step of another rank at the same step numbers is
    not part of it."""
    from teller.baselines import make
    from teller.baselines.base import Prediction
    from teller.baselines.numeric import step_lanes

    s = copy.copy(vertical)
    lanes = step_lanes(s)
    codes, counts = np.unique(lanes, return_counts=True)
    a, b = codes[np.argsort(-counts)[:2]]
    ia, ib = np.flatnonzero(lanes == a)[:12], np.flatnonzero(lanes == b)[:3]
    assert len(ia) == 12 and len(ib) == 3
    s.step_num = vertical.step_num.copy()
    s.step_num[ia], s.step_num[ib] = np.arange(12), np.arange(1, 4)
    idx = np.r_[ia, ib]
    score = np.array([0.4, 0.6, 0.97, 0.97, 0.97, 0.97, 0.97, 0.6, 0.6, 0.3, 0.2, 0.6, 0.6, 0.6, 0.6])
    flag = score > 0.9
    ft = np.array(["memory", "memory", "kernel", "kernel", "memory", "kernel", "memory", "memory", "memory",
                   "kernel", "kernel", "scheduling", "runtime", "runtime", "kernel"], dtype=object)
    ops = [[], [], ["FE:a"], ["FE:a", "FE:b"], ["FE:a"], ["FE:b"], ["FE:a"], [], [], [], [], [], [], [], []]
    s.extra = dict(vertical.extra, split="request",
                   predictions={("request", "teller_mot_family"): (idx, Prediction(score, flag, ft, ops))})
    m = make("teller_mot_family_sustained").fit(s, idx)
    p = m.predict(s, idx)
    joined = [1, 7, 8]
    assert np.flatnonzero(p.flag & ~flag).tolist() == joined
    assert [p.operators[i] for i in joined] == [["FE:a"]] * 3 and p.operators[:1] + p.operators[9:] == [[]] * 7
    assert p.operators[2:7] == ops[2:7]
    # episode 1..8: five memory votes against three kernel; outside it every type stays
    assert p.fault_type[1:9].tolist() == ["memory"] * 8 and p.fault_type[[0, 9, 10, 11, 12, 13, 14]].tolist() == ft[
        [0, 9, 10, 11, 12, 13, 14]].tolist()
    assert p.score.tolist() == score.tolist()
    d = m.describe()
    assert d["joined"] == 3 and d["retyped"] == 3 and d["base"] == "teller_mot_family" and d["min_flagged"] == 5
    with pytest.raises(ValueError, match="was not fitted here"):  # answers kept for other steps only
        m.predict(s, idx[:-1])
    s.extra = dict(vertical.extra, split="request")  # no answers kept, no models: the model row's own error
    with pytest.raises(ValueError, match="was trained on 'runs/h200_v2_all', not"):  # the shipped model: another dataset
        make("teller_mot_family_sustained").fit(s, idx)


@pytest.mark.parametrize("k", [1, 5])
def test_episode_row_keeps_the_deployment_stages_sustained_flags(vertical, k):
    """teller_episodes: the screen, plus every stage flag the screen drops that lies in an episode of
    at least k flagged steps of its rank (the stage scoring every step of the test runs) on a
    deployment with a fault-free reference."""
    from teller.baselines import make, register
    from teller.baselines.base import REGISTRY, Prediction
    from teller.baselines.numeric import deployments, step_lanes
    from teller.baselines.rca import TellerEpisodes, fuse
    from teller.localize.episodes import episode_lengths

    name = f"teller_episodes_test_{k}"
    if name not in REGISTRY:
        register(name)(type(f"TE{k}", (TellerEpisodes,), {"min_episode": k}))
    s, tr, te = _fault_free_run_split(vertical)
    score = np.full(len(te), 0.01)  # the model rules every step out: only episodes keep the stage's flags
    mot = Prediction(score=score, flag=np.zeros(len(te), bool), fault_type=np.array(["kernel"] * len(te), dtype=object),
                     operators=[[] for _ in te])
    s.extra = dict(vertical.extra, split="request", predictions={("request", "teller_mot"): (te, mot)})
    m = make(name).fit(s, tr)
    p = m.predict(s, te)
    st = m.parts_["teller_numeric_deploy"]
    every = np.flatnonzero(np.isin(s.run_code, np.unique(s.run_code[te])))
    whole = st.predict(s, every)
    warm = s.extra["unit_warmup"][s.unit_idx[s.unit_ptr[:-1]]]  # vertical: one unit per step
    _, length = episode_lengths(step_lanes(s)[every], s.step_num[every], whole.flag & ~warm[every])
    pos = np.searchsorted(every, te)
    own = np.isin(deployments(s)[te], list(st.models_))
    screen = fuse(Prediction(score=whole.score[pos], flag=whole.flag[pos], operators=[whole.operators[i] for i in pos]),
                  mot, "screen", 0.1)
    kept = whole.flag[pos] & ~screen.flag & (length[pos] >= k) & own
    assert p.flag.tolist() == (screen.flag | kept).tolist()
    assert m.describe()["kept_by_episode"] == int(kept.sum()) and m.describe()["min_episode"] == k
    assert all(p.operators[i] == whole.operators[pos[i]] for i in np.flatnonzero(kept))
    assert ((p.score >= 0.5) == p.flag).all() or not kept.any()
    if k == 1:
        assert kept.any()  # the stage flags steps of the fault-free run's deployment that the model rules out



def _fault_free_run_split(vertical):
    """The slice's request split with its largest normal train run made a fault-free run (no
    window, no abnormal step), so its deployment has a reference of its own: (steps, train, test)."""
    from teller.baselines.steps import split_masks

    s = copy.copy(vertical)
    train, test, _ = split_masks(s, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    codes, counts = np.unique(s.run_code[tr[~s.is_anomaly[tr]]], return_counts=True)
    r = codes[np.argmax(counts)]
    s.in_window, s.is_anomaly = vertical.in_window.copy(), vertical.is_anomaly.copy()
    s.in_window[s.run_code == r] = False
    s.is_anomaly[s.run_code == r] = False
    return s, tr, te


def _memory_answers(score):
    """A model row's answers: flagged above 0.9, typed memory, naming FE:m where flagged."""
    from teller.baselines.base import Prediction

    score = np.asarray(score, float)
    return Prediction(score=score, flag=score > 0.9, fault_type=np.array(["memory"] * len(score), dtype=object),
                      operators=[["FE:m"] if f else [] for f in score > 0.9])


@pytest.mark.parametrize("k", [1, 5])
def test_diagnose_row_is_the_confirm_screen_and_the_episodes_never_a_step_the_stage_missed(vertical, k):
    """teller_diagnose (what `teller diagnose --reference` reports): the stage's flags the model
    keeps, and ruled-out stage flags in episodes of 5+ against the step's deployment; a step only
    the model flags is not flagged (diagnose's model reads the stage's flags alone), where
    teller_episodes flags it."""
    from teller.baselines import make
    from teller.baselines.base import REGISTRY
    from teller.baselines.numeric import deployments, step_lanes
    from teller.localize.episodes import episode_lengths

    s, tr, te = _fault_free_run_split(vertical)
    s.extra = dict(vertical.extra, split="request", predictions={("request", "teller_mot"): (te, _memory_answers(np.zeros(len(te))))})
    from teller.baselines import register
    from teller.baselines.rca import TellerDiagnose

    name = f"teller_diagnose_test_{k}"
    if name not in REGISTRY:
        register(name)(type(f"TD{k}", (TellerDiagnose,), {"min_episode": k}))
    d = make(name).fit(s, tr)
    st = d.parts_["teller_numeric_deploy"]
    every = np.flatnonzero(np.isin(s.run_code, np.unique(s.run_code[te])))
    whole = st.predict(s, every)
    sflag = whole.flag[np.searchsorted(every, te)]
    # the stage's flags alternately ruled out and kept by the model; the others alternately flagged by it alone
    alt = np.cumsum(sflag) % 2 == 0
    score = np.where(sflag, np.where(alt, 0.01, 0.3), np.where(np.arange(len(te)) % 2 == 0, 0.99, 0.01))
    s.extra["predictions"] = {("request", "teller_mot"): (te, _memory_answers(score))}
    p = d.predict(s, te)
    warm = s.extra["unit_warmup"][s.unit_idx[s.unit_ptr[:-1]]]
    _, length = episode_lengths(step_lanes(s)[every], s.step_num[every], whole.flag & ~warm[every])
    pos = np.searchsorted(every, te)
    own = np.isin(deployments(s)[te], list(st.models_))
    confirm = sflag & (score >= 0.1)
    kept = sflag & ~confirm & (length[pos] >= k) & own
    assert p.flag.tolist() == (confirm | kept).tolist() and not (p.flag & ~sflag).any()
    e = make("teller_episodes").fit(s, tr).predict(s, te)
    only_model = (score > 0.9) & ~sflag
    assert only_model.any() and e.flag[only_model].all() and not p.flag[only_model].any()
    assert confirm.any() and (kept.any() or k > 1) and d.describe()["kept_by_episode"] == int(kept.sum())
    assert REGISTRY["teller_diagnose_family"]().mot == "teller_mot_family"


@pytest.mark.parametrize("k", [1, 5])
def test_sustained_row_is_the_model_over_time_and_the_stages_lasting_departures(vertical, k):
    """teller_sustained_family: the model row read over time, plus the deployment stage's flags in
    episodes of k+ on a deployment with a fault-free reference where the model flags nothing (typed
    by the stage's evidence); the stage's other flags are dropped."""
    from teller.baselines import make, register
    from teller.baselines.base import REGISTRY
    from teller.baselines.numeric import deployments, step_lanes
    from teller.baselines.rca import TellerSustained, sustained
    from teller.localize.episodes import episode_lengths
    from teller.rca import EPISODE_FLOOR

    name = f"teller_sustained_test_{k}"
    if name not in REGISTRY:
        register(name)(type(f"TS{k}", (TellerSustained,), {"min_episode": k, "novel_episode": k}))
    s, tr, te = _fault_free_run_split(vertical)
    s.extra = dict(vertical.extra, split="request", predictions={("request", "teller_mot_family"): (te, _memory_answers(np.zeros(len(te))))})
    m = make(name).fit(s, tr)
    st = m.parts_["teller_numeric_deploy"]
    every = np.flatnonzero(np.isin(s.run_code, np.unique(s.run_code[te])))
    whole = st.predict(s, every)
    # the model flags every other step the stage does not flag, and one the stage flags
    sf = whole.flag[np.searchsorted(every, te)]
    score = np.where(~sf & (np.arange(len(te)) % 2 == 0), 0.99, 0.02)
    score[np.flatnonzero(sf)[:1]] = 0.99
    mot = _memory_answers(score)
    s.extra["predictions"] = {("request", "teller_mot_family"): (te, mot)}
    p = m.predict(s, te)
    over_time, _ = sustained(s, te, mot)
    warm = s.extra["unit_warmup"][s.unit_idx[s.unit_ptr[:-1]]]
    _, length = episode_lengths(step_lanes(s)[every], s.step_num[every], whole.flag & ~warm[every])
    pos = np.searchsorted(every, te)
    own = np.isin(deployments(s)[te], list(st.models_))
    sflag = whole.flag[pos]
    kept = sflag & ~over_time.flag & (length[pos] >= k) & own
    assert p.flag.tolist() == (over_time.flag | kept).tolist()
    assert (sflag & ~over_time.flag & ~kept).any()  # stage flags outside lasting episodes are dropped
    assert kept.any() or k > 1
    # a lasting departure the model rules out (under the floor) is dropped too
    low = score.copy()
    low[kept] = EPISODE_FLOOR / 2
    s.extra["predictions"] = {("request", "teller_mot_family"): (te, _memory_answers(low))}
    assert m.predict(s, te).flag.tolist() == over_time.flag.tolist()
    assert m.describe()["ruled_out_by_floor"] == int(kept.sum())
    # the shipped model is of another dataset: the absolute floor, said so
    assert m.describe()["episode_floor_used"] == EPISODE_FLOOR and m.describe()["episode_floor_from"].startswith("absolute")
    s.extra["predictions"] = {("request", "teller_mot_family"): (te, mot)}
    p = m.predict(s, te)
    sft = np.asarray(whole.fault_type, dtype=object)[pos]
    want = np.where(kept & (sft != ""), sft, over_time.fault_type)
    # a step in an episode of k+ stage flags with an evidence type, all unlike every training
    # step (novelty above 1), takes the evidence's type
    from teller.baselines.rca import step_units
    from teller.rca.context import dataset_context_features

    ds, uidx = step_units(s, every)
    ratio = m.novelty_.ratio(dataset_context_features(ds, uidx, m._trace_tok()), ["vertical"] * len(every))
    _, nlen = episode_lengths(step_lanes(s)[every], s.step_num[every],
                              (ratio > 1) & whole.flag & (np.asarray(whole.fault_type, dtype=object) != "") & ~warm[every])
    novel = (nlen[pos] >= k) & (sft != "")
    want = np.where(novel, sft, want)
    assert p.fault_type.tolist() == want.tolist()
    assert m.describe()["retyped_novel"] == int((novel & (sft != np.where(kept & (sft != ""), sft, over_time.fault_type))).sum())
    assert novel.any() or k > 1  # measured: the slice's lasting departures lie far from its training steps
    assert all(p.operators[i] == whole.operators[pos[i]] for i in np.flatnonzero(kept))
    assert all(p.operators[i] == over_time.operators[i] for i in np.flatnonzero(~kept))


def test_lasting_departures_stay_only_off_the_training_steps(vertical):
    """The rows `teller diagnose` reports keep a lasting departure of the stage only where the
    step's novelty is above ``lasting_novelty`` (:data:`teller.rca.LASTING_NOVELTY`): nearer, it
    is of a kind the model was trained on and the model's "normal" stands. Checked against the
    same row without the gate at three cuts: the default, one inside the kept steps' novelties
    (some stay, some go) and one above them all (none stays)."""
    from teller.baselines import make, register
    from teller.baselines.base import REGISTRY
    from teller.baselines.rca import TellerSustained, sustained
    from teller.rca import LASTING_NOVELTY

    assert REGISTRY["teller_sustained_family"].lasting_novelty == LASTING_NOVELTY
    assert REGISTRY["teller_diagnose_family"].lasting_novelty == LASTING_NOVELTY
    assert REGISTRY["teller_episodes"].lasting_novelty is None  # the measured older row: ungated
    s, tr, te = _fault_free_run_split(vertical)
    s.extra = dict(vertical.extra, split="request", predictions={("request", "teller_mot_family"): (te, _memory_answers(np.zeros(len(te))))})

    def row(tau):
        name = f"teller_sustained_gate_test_{tau}"
        if name not in REGISTRY:
            register(name)(type(f"TSG{len(REGISTRY)}", (TellerSustained,), {"min_episode": 1, "novel_episode": 1, "lasting_novelty": tau}))
        return make(name).fit(s, tr)

    ungated = row(None)
    # every step of the test runs read (the test part alone holds one lasting departure here)
    every = np.flatnonzero(np.isin(s.run_code, np.unique(s.run_code[te])))
    score = np.full(len(every), 0.02)  # the model flags nothing, rules nothing out
    s.extra["predictions"] = {("request", "teller_mot_family"): (every, _memory_answers(score))}
    over_time, _ = sustained(s, every, _memory_answers(score))
    kept = ungated.predict(s, every).flag & ~over_time.flag
    assert kept.sum() >= 2 and "near_training" not in ungated.describe()
    ratio = ungated.step_novelty(s, every)
    mid = float(np.median(ratio[kept]))
    for tau in (LASTING_NOVELTY, mid, float(ratio[kept].max()) + 1.0):
        m = row(tau)
        p = m.predict(s, every)
        stay = kept & (ratio > tau)
        assert p.flag.tolist() == (over_time.flag | stay).tolist(), tau
        assert m.describe()["near_training"] == int((kept & ~stay).sum()) and m.describe()["lasting_novelty"] == tau
        assert m.describe()["kept_by_episode"] == int(stay.sum())
        if tau == mid:
            assert stay.any() and (kept & ~stay).any()
    assert not row(float(ratio[kept].max()) + 1.0).predict(s, every).flag[kept].any()


def test_sustained_row_against_the_runs_own_steps(vertical):
    """teller_sustained_self: teller_sustained_family with the stage reading each run against its
    own steps; every run is then of a deployment with a reference, so the stage's lasting
    departures count on every run (here the model flags nothing and rules nothing out; episodes
    of one step, since on this slice the runs' own steps absorb the lasting faults: its stage
    flags 10 steps, none next to another)."""
    from teller.baselines import make, register
    from teller.baselines.base import REGISTRY
    from teller.baselines.numeric import TellerNumericSelf, step_lanes
    from teller.baselines.steps import split_masks
    from teller.localize.episodes import episode_lengths

    s = copy.copy(vertical)
    train, test, _ = split_masks(s, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    s.extra = dict(vertical.extra, split="request",
                   predictions={("request", "teller_mot_family"): (te, _memory_answers(np.full(len(te), 0.3)))})
    name = "teller_sustained_self_test_1"
    if name not in REGISTRY:
        register(name)(type("TSS1", (REGISTRY["teller_sustained_self"],), {"min_episode": 1, "own_floor_episode": 1, "novel_episode": 1}))
    m = make(name).fit(s, tr)
    st = m.parts_["teller_numeric_self"]
    assert isinstance(st, TellerNumericSelf)
    p = m.predict(s, te)
    every = np.flatnonzero(np.isin(s.run_code, np.unique(s.run_code[te])))
    whole = st.predict(s, every)
    warm = s.extra["unit_warmup"][s.unit_idx[s.unit_ptr[:-1]]]
    _, length = episode_lengths(step_lanes(s)[every], s.step_num[every], whole.flag & ~warm[every])
    pos = np.searchsorted(every, te)
    assert m.describe()["episode_used"] == 1 and length.max() == 1
    kept = whole.flag[pos] & (length[pos] >= 1)
    assert kept.any() and p.flag.tolist() == kept.tolist()
    assert not make("teller_sustained_self").fit(s, tr).predict(s, te).flag.any()  # episodes of 4+: none here


def test_numeric_stage_types_steps_by_the_layer_of_their_evidence(vertical):
    """teller_numeric_deploy names the fault type its evidence points to: the slice's delayed-MLP
    steps (targeted_op_delay: the module's GPU work grows) are typed kernel, and communication is
    answered for the straggler's steps (their all_reduce waits), not for the others."""
    from teller.baselines import make
    from teller.baselines.steps import split_masks
    from teller.evaluate.run import score_method

    train, _, _ = split_masks(vertical, "request")
    m = make("teller_numeric_deploy").fit(vertical, np.flatnonzero(train))
    ab = np.flatnonzero(vertical.is_anomaly)
    p = m.predict(vertical, ab)
    mech = vertical.mechanism[ab]
    delay = mech == "targeted_op_delay"
    assert delay.sum() >= 5 and (p.fault_type[delay] == "kernel").all()
    comm = p.fault_type == "communication"
    assert comm[mech == "straggler_rank"].sum() >= 3 and not comm[mech != "straggler_rank"].any()
    r = score_method(vertical, ab, p)["fault_type"]
    assert r["steps"] == len(ab) and r["accuracy"] > 0.4


def test_lift_to_modules_replaces_framework_ops_by_the_modules_enclosing_their_suspects():
    """Instances: STEP 0 holds FE LlamaMLP 1 (holding BE aten::mm 2), COMM all_reduce 3, FE
    LlamaAttention 4 (holding FE Rotary 5, holding BE aten::mm 6) and BE aten::add 7 (in no
    module). A framework op becomes the modules around the step's suspects of it (the nearest
    one: Rotary, not LlamaAttention); one no module encloses stays; the rest are kept in order."""
    from teller.baselines.numeric import enclosing_modules, lift_to_modules
    from teller.localize.features import Instances

    fams = ["STEP", "FE LlamaMLP", "BE aten::mm", "COMM all_reduce", "FE LlamaAttention", "FE Rotary", "BE aten::add"]
    family = np.array([0, 1, 2, 3, 4, 5, 2, 6], np.int32)
    parent = np.array([-1, 0, 1, 0, 0, 4, 5, 0])
    inst = Instances(np.arange(8), family, fams, np.zeros(8, np.int64), np.zeros((8, 1)), parent, ("FE", "BE", "COMM"))
    module = enclosing_modules(inst)
    np.testing.assert_array_equal(module, [-1, 1, 1, -1, 4, 5, 5, -1])
    got = lift_to_modules(["BE aten::mm", "COMM all_reduce", "BE aten::add", "FE LlamaMLP"], np.array([6, 2, 7]), inst, module)
    assert got == ["FE Rotary", "FE LlamaMLP", "COMM all_reduce", "BE aten::add"]
    # only the step's suspects count: with the one under LlamaMLP alone, Rotary is not named
    assert lift_to_modules(["BE aten::mm"], np.array([2]), inst, module) == ["FE LlamaMLP"]
    # a framework op without a suspect in the step stays as it is
    assert lift_to_modules(["BE aten::mm"], np.zeros(0, np.int64), inst, module) == ["BE aten::mm"]
    # at most `limit`, the first named (an op's modules count where it stood)
    assert lift_to_modules(["BE aten::mm", "COMM all_reduce", "BE aten::add", "FE LlamaMLP"], np.array([6, 2, 7]), inst, module,
                           limit=3) == ["FE Rotary", "FE LlamaMLP", "COMM all_reduce"]
    assert lift_to_modules(["COMM all_reduce", "BE aten::mm"], np.array([6]), inst, module, limit=1) == ["COMM all_reduce"]


def test_named_operators_keep_order_lift_framework_ops_and_stop_at_the_limit():
    from teller.localize.naming import MAX_OPERATORS, named_operators

    sus = [("BE aten::mm", "FE Rotary"), ("BE aten::mm", "FE LlamaMLP"), ("BE aten::add", None), ("FE LlamaMLP", "FE LlamaMLP")]
    fams = ["STEP", "BE aten::mm", "STEP", "BE aten::add", "BE aten::view", "FE LlamaMLP"]
    assert named_operators(fams, sus, None) == ["STEP", "FE Rotary", "FE LlamaMLP", "BE aten::add", "BE aten::view"]
    assert named_operators(fams, sus) == ["STEP", "FE Rotary", "FE LlamaMLP"] and MAX_OPERATORS == 3
    assert named_operators(fams, sus, 1) == ["STEP"] and named_operators([], sus) == []
    assert named_operators(["BE aten::view"], []) == ["BE aten::view"]  # no suspect of it: itself


def test_numeric_stage_names_modules_not_the_framework_ops_inside_them(vertical, monkeypatch):
    """On the real slice the stage's candidates include framework ops: the copy it suspects inside
    a decoder layer is answered as that layer (a pageable-copies step is labelled by it), and every
    framework op it still names has instances in no module (the sampler's copies, the logits'
    matmuls). Flags and types unchanged."""
    import teller.baselines.numeric as numeric
    from teller.baselines import make
    from teller.baselines.steps import split_masks

    train, test, _ = split_masks(vertical, "request")
    m = make("teller_numeric", seed=0).fit(vertical, np.flatnonzero(train))
    te = np.flatnonzero(test)
    got = m.predict(vertical, te)
    # at most three named (the labels' most): the first of every candidate and the evidence's family
    from teller.localize.naming import MAX_OPERATORS

    assert m.max_operators == MAX_OPERATORS == 3 and max(len(o) for o in got.operators) <= MAX_OPERATORS
    m.max_operators = None
    every = m.predict(vertical, te)
    m.max_operators = 1
    one = m.predict(vertical, te)
    m.max_operators = MAX_OPERATORS
    assert max(len(o) for o in every.operators) >= 2
    for g, e, o, f in zip(got.operators, every.operators, one.operators, got.flag, strict=True):
        assert set(o) <= set(g) <= set(e) and len(o) == bool(f)
    assert np.array_equal(every.flag, got.flag) and np.array_equal(every.fault_type, got.fault_type)
    monkeypatch.setattr(numeric, "lift_to_modules", lambda fams, *a: list(dict.fromkeys(fams)))
    raw = m.predict(vertical, te)
    assert np.array_equal(raw.flag, got.flag) and np.array_equal(raw.fault_type, got.fault_type)
    raw_be = {o for ops in raw.operators for o in ops if o.startswith("BE ")}
    got_be = {o for ops in got.operators for o in ops if o.startswith("BE ")}
    assert raw_be and got_be <= raw_be
    inst = vertical.extra["instances"]
    unenclosed = {str(inst.families[f]) for f in np.unique(inst.family[numeric.enclosing_modules(inst) < 0]).tolist()}
    assert got_be <= unenclosed
    lifted = [set(g) - set(r) for g, r in zip(got.operators, raw.operators, strict=True)]
    assert any(lifted) and all(o.startswith("FE ") for s in lifted for o in s)
    assert {"FE LlamaDecoderLayer"} in lifted


@pytest.mark.parametrize("lengths, stage_p", [((1, 2), 0.05), ((1, 1), 0.02)])
def test_sustained_row_takes_the_models_own_floor_with_its_episode_length(vertical, tmp_path, lengths, stage_p):
    """Where the model the row reads keeps its own floor (a model of the split and dataset under
    --models, its config.json read without weights), a stage flag in an episode of
    ``own_floor_episode`` or more (4 in the rows) stays when the model gives it at least that
    floor; without one the absolute floor with episodes of ``min_episode`` or more (5): the pair
    each was chosen in. The slice's lasting departures are single steps, so the lengths are scaled
    down: (1, 2) tells the lengths apart (the model gives the stage's flags 0.05, over both
    floors), (1, 1) the floors (0.02: under the model's 0.03, over the absolute 0.01)."""
    import json

    from teller.baselines import make, register
    from teller.baselines.base import REGISTRY
    from teller.baselines.numeric import deployments, step_lanes
    from teller.baselines.rca import TellerSustained, sustained
    from teller.localize.episodes import episode_lengths
    from teller.rca import DEFAULT_MODEL, EPISODE_FLOOR

    own_len, abs_len = lengths
    name = f"teller_sustained_own_{own_len}_{abs_len}"
    if name not in REGISTRY:
        register(name)(type(f"TSO{own_len}{abs_len}", (TellerSustained,), {"own_floor_episode": own_len, "min_episode": abs_len}))
    s, tr, te = _fault_free_run_split(vertical)
    meta = json.loads((DEFAULT_MODEL / "config.json").read_text())
    meta["training"] = {**meta["training"], "split": "request", "seed": 0, "dataset": str(s.dataset)}
    floor = 0.03
    meta["calibration"]["episode_floor"] = {"quantile": 0.85, "views": {"vertical": {"floor": floor, "units": 9}}}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(meta))
    st0 = make("teller_numeric_deploy").fit(s, tr)
    every = np.flatnonzero(np.isin(s.run_code, np.unique(s.run_code[te])))
    whole = st0.predict(s, every)
    pos = np.searchsorted(every, te)
    sf = whole.flag[pos]
    score = np.where(sf, stage_p, 0.001)
    mot = _memory_answers(score)
    warm = s.extra["unit_warmup"][s.unit_idx[s.unit_ptr[:-1]]]
    _, length = episode_lengths(step_lanes(s)[every], s.step_num[every], whole.flag & ~warm[every])
    own = np.isin(deployments(s)[te], list(st0.models_))
    over_time, _ = sustained(s, te, mot)
    flags = []
    for models, want_floor, want_len in ((tmp_path, floor, own_len), (None, EPISODE_FLOOR, abs_len)):
        s.extra = dict(vertical.extra, split="request", predictions={("request", "teller_mot_family"): (te, mot)})
        if models is not None:
            s.extra["rca_models"] = str(models)
        m = make(name).fit(s, tr)
        p = m.predict(s, te)
        d = m.describe()
        assert d["episode_floor_used"] == want_floor and d["episode_used"] == want_len, d
        assert d["episode_floor_from"].startswith("the model" if models is not None else "absolute")
        kept = sf & ~over_time.flag & (length[pos] >= want_len) & own & (score >= want_floor)
        assert p.flag.tolist() == (over_time.flag | kept).tolist()
        flags.append(p.flag)
    assert flags[0].tolist() != flags[1].tolist()  # the two readings differ on the slice


def test_run_rows_is_take_on_a_table_of_many_chunks():
    from teller.baselines.numeric import run_rows

    # three chunks, as a dataset's decoded blocks come; a run's rows span two of them
    t = pa.concat_tables([pa.table({"x": np.arange(a, b), "s": [f"n{i}" for i in range(a, b)]})
                          for a, b in ((0, 5), (5, 9), (9, 14))])
    assert t.column("x").num_chunks == 3
    for rows in (np.arange(3, 11), np.array([3, 4, 7, 10]), np.array([13]), np.array([0, 13]), np.zeros(0, np.int64)):
        assert run_rows(t, rows).equals(t.take(pa.array(rows, pa.int64()))), rows
    # rows not ascending fall back to the plain take (same rows, same order)
    for rows in (np.array([7, 3, 9]), np.array([4, 4, 5])):
        assert run_rows(t, rows).to_pydict() == t.take(pa.array(rows)).to_pydict(), rows


def test_rows_that_fit_the_same_stage_share_its_fit_and_answers(vertical):
    """The stage's rows fit it once per settings and steps (steps.extra), and the episode rows read
    its answers over the test runs once; each reader gets its own copy, and other settings or
    other steps are fitted apart."""
    from teller.baselines import make
    from teller.baselines.steps import split_masks

    train, test, _ = split_masks(vertical, "request")
    tr, te = np.flatnonzero(train), np.flatnonzero(test)
    a = make("teller_numeric_deploy", seed=0).fit(vertical, tr)
    b = make("teller_numeric_deploy", seed=0).fit(vertical, tr)
    assert all(a.models_[d] is b.models_[d] for d in a.models_) and a.model_ is b.model_
    from teller.baselines.numeric import TellerNumericDeployment

    c = TellerNumericDeployment(seed=0, shift_margin=2.0).fit(vertical, tr)  # other settings: its own fit
    assert c.model_ is not a.model_
    d = make("teller_numeric_deploy", seed=0).fit(vertical, tr[: len(tr) // 2])  # other steps: its own fit
    assert d.model_ is not a.model_
    p1 = a.shared_predict(vertical, te)
    p1.flag[:] = False  # a reader's copy is its own
    p1.operators[0].append("mine")
    p2 = b.shared_predict(vertical, te)
    want = a.predict(vertical, te)
    assert np.array_equal(p2.flag, want.flag) and np.array_equal(p2.score, want.score)
    assert p2.operators == want.operators and np.array_equal(p2.fault_type, want.fault_type) and want.flag.any()
    # a stage fitted on its own steps as it reads them is not kept
    own = make("teller_numeric_self", seed=0).fit(vertical, tr)
    assert not own.answers_from_fit and a.answers_from_fit
