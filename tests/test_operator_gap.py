"""benchmarks/operator_gap.py: a row's Macro₊ loss against another method's, mechanism by
mechanism — the per-step F1 by hand, the sums adding up to the evaluation's own Macro₊, and the
join to a real dataset's labels (data/h200_v2, horizontal) with its refusals."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from teller.evaluate.scores import operator_scores

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("operator_gap", ROOT / "benchmarks" / "operator_gap.py")
og = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(og)
DS = ROOT / "data" / "h200_v2"


def test_step_f1_and_losses_by_hand():
    assert og.step_f1({"a"}, set()) == 0.0  # not flagged: names nothing
    assert og.step_f1({"a", "b"}, {"a"}) == pytest.approx(2 / 3)
    assert og.step_f1({"a", "b", "c"}, {"a", "b", "d", "e"}) == pytest.approx(4 / 7)
    truth = [{"a"}, {"a", "b"}, set(), {"c"}]
    mech = ["m1", "m1", "", "m2"]
    got = og.mechanism_losses(truth, mech, {"row": [set(), {"a"}, {"x"}, {"c"}], "base": [{"a"}, {"a", "b"}, set(), set()]})
    assert got["steps"] == 3  # the step without a true operator is not read
    assert got["mechanisms"]["m1"] == {"steps": 2, "loss": {"row": pytest.approx(1 + 1 / 3), "base": 0.0}}
    assert got["mechanisms"]["m2"] == {"steps": 1, "loss": {"row": 0.0, "base": 1.0}}
    assert got["methods"]["row"]["macro_plus_f1"] == pytest.approx((0 + 2 / 3 + 1) / 3)
    assert got["step_f1"]["row"] == pytest.approx({0: 0.0, 1: 2 / 3, 3: 1.0})  # the operator-positive steps
    # the same figure as the evaluation's Macro₊
    ref = operator_scores([sorted(t) for t in truth], [[], ["a"], ["x"], ["c"]])["macro_plus_f1"]
    assert got["methods"]["row"]["macro_plus_f1"] == pytest.approx(ref)


def _predictions(path: Path, keys, methods: dict) -> Path:
    rows = []
    for name, answer in methods.items():
        for (run, step), (flag, ops) in zip(keys, answer, strict=True):
            rows.append({"view": "horizontal", "split": "request", "method": name, "run_id": run, "step": step,
                         "flag": flag, "score": float(flag), "operators": ops})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_a_real_datasets_labels_joined(tmp_path, capsys):
    if not (DS / "records.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    from teller.baselines.steps import load_steps

    st = load_steps(DS, view="horizontal")
    keys = [(str(st.runs[st.run_code[i]]), int(st.step_num[i])) for i in range(st.n)]
    labels = [sorted(x) for x in st.labels]
    # the oracle names every labelled step's operators; the other flags every second step only
    oracle = [(bool(lab), lab) for lab in labels]
    half = [(bool(lab) and i % 2 == 0, lab if i % 2 == 0 else []) for i, lab in enumerate(labels)]
    pred = _predictions(tmp_path / "p.parquet", keys, {"oracle": oracle, "half": half})
    out = tmp_path / "g.json"
    assert og.main([str(DS), str(pred), "--split", "request", "--view", "horizontal", "--row", "half",
                    "--against", "oracle", "--json", str(out), "-o", str(tmp_path / "g.md")]) == 0
    got = json.loads(out.read_text())
    positive = [i for i, lab in enumerate(labels) if lab]
    assert got["steps"] == len(positive) > 0
    assert got["methods"]["oracle"]["macro_plus_f1"] == 1.0
    # the row loses one whole step for every odd labelled step, per mechanism
    lost = {}
    for i in positive:
        if i % 2:
            lost[str(st.mechanism[i])] = lost.get(str(st.mechanism[i]), 0) + 1
    assert {m: v["loss"]["half"] for m, v in got["mechanisms"].items() if v["loss"]["half"]} == pytest.approx(lost)
    for m in ("half", "oracle"):
        assert got["methods"][m]["macro_plus_f1"] == pytest.approx(got["methods"][m]["evaluation_macro_plus_f1"])
    assert len(got["row_losses"]) == sum(lost.values()) and all(not w["flag"] for w in got["row_losses"])
    assert "| straggler_rank |" in (tmp_path / "g.md").read_text()
    # refusals: a method the file does not hold, steps of another dataset
    assert og.main([str(DS), str(pred), "--split", "request", "--view", "horizontal", "--against", "svm"]) == 2
    assert "no request/horizontal answers of teller_sustained_family, svm" in capsys.readouterr().err
    other = _predictions(tmp_path / "q.parquet", [("no-such-run", 1)], {"a": [(True, ["x"])], "b": [(False, [])]})
    assert og.main([str(DS), str(other), "--split", "request", "--view", "horizontal", "--row", "a", "--against", "b"]) == 2
    assert "not in" in capsys.readouterr().err
