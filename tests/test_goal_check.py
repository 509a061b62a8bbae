"""benchmarks/goal_check.py: a TELLER row against the best baseline of each column and the 10%
prior floor, on hand-made result blocks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("goal_check", ROOT / "benchmarks" / "goal_check.py")
gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)


def _row(method, kind, f1, macro, ftype=None, prior=None):
    r = {"method": method, "kind": kind, "step": {"f1": f1}, "operator": {"macro_plus_f1": macro}}
    if ftype is not None:
        r["fault_type"] = {"macro_f1": ftype}
    if prior is not None:
        r["low_prior"] = {"0.1": {"f1_mean": prior}, "0.05": {"f1_mean": prior / 2}}
    return r


def _block(view, methods, split="request", seed=4):
    return {"split": split, "view": view, "seed": seed, "test_steps": 100, "test_abnormal": 20, "methods": methods}


def test_columns_ahead_tie_behind_and_the_prior_floor():
    v = _block("vertical", [
        _row("teller_sustained_family", "teller", 0.95, 0.90, 0.97, 0.91),
        _row("teller_numeric_deploy", "teller", 0.99, 0.99, 0.99, 0.99),  # another TELLER row: not a baseline
        _row("rf_names", "supervised", 0.93, 0.90, 0.98, 0.95),
        _row("kmeans", "unsupervised", 0.94, 0.10, None, 0.50),  # no type head: not in that column
        {"method": "xgb", "kind": "supervised", "error": "cannot fit"},  # an error row is no baseline
    ])
    got = gc.check_block(v, "teller_sustained_family")
    c = got["cells"]
    assert c["step F1"]["verdict"] == "ahead" and c["step F1"]["best_baseline"] == 0.94 and c["step F1"]["baseline"] == "kmeans"
    assert c["Macro₊ F1"]["verdict"] == "tie" and c["Macro₊ F1"]["baseline"] == "rf_names"
    assert c["fault-type F1"]["verdict"] == "behind" and c["fault-type F1"]["best_baseline"] == 0.98
    assert c["F1 at 10%"]["verdict"] == "met" and c["F1 at 10%"]["goal"] == 0.90 and c["F1 at 10%"]["best_baseline"] == 0.95
    assert got["met"] is False
    # the horizontal floor is 0.85: 0.86 meets it there, not vertically
    h = _block("horizontal", [_row("teller_sustained_family", "teller", 0.99, 0.95, 1.0, 0.86),
                              _row("svm", "supervised", 0.98, 0.94, 0.99, 0.99)])
    gh = gc.check_block(h, "teller_sustained_family")
    assert gh["cells"]["F1 at 10%"]["verdict"] == "met" and gh["met"] is True
    h["view"] = "vertical"
    assert gc.check_block(h, "teller_sustained_family")["cells"]["F1 at 10%"]["verdict"] == "under"
    # a tie at 1 cannot be beaten: met ("ceiling"); a tie under 1 is not
    top = _block("vertical", [_row("teller_sustained_family", "teller", 1.0, 0.95, 1.0, 0.95),
                              _row("rf", "supervised", 1.0, 0.95, 0.99, 0.99)])
    ct = gc.check_block(top, "teller_sustained_family")["cells"]
    assert ct["step F1"]["verdict"] == "ceiling" and ct["Macro₊ F1"]["verdict"] == "tie" and ct["fault-type F1"]["verdict"] == "ahead"
    # apart by less than the third decimal: the fourth is shown
    near = _block("vertical", [_row("teller_sustained_family", "teller", 0.98321, 0.9, 0.9, 0.95),
                               _row("rf", "supervised", 0.98294, 0.8, 0.8, 0.9)])
    assert "**0.9832** against 0.9829 (rf)" in gc.markdown([gc.check_block(near, "teller_sustained_family")])
    # a block without the row, or without a baseline, is not read
    assert gc.check_block(v, "teller_mot_family") is None
    assert gc.check_block(_block("vertical", [_row("teller_sustained_family", "teller", 1, 1, 1, 1)]),
                          "teller_sustained_family") is None


def test_cli_orders_blocks_and_counts_cells(tmp_path):
    res = {"results": [
        _block("horizontal", [_row("teller_sustained_family", "teller", 0.99, 0.95, 1.0, 0.86),
                              _row("svm", "supervised", 0.98, 0.96, 0.99, 0.99)], split="run", seed=1),
        _block("vertical", [_row("teller_sustained_family", "teller", 0.95, 0.90, 0.97, 0.91),
                            _row("rf_names", "supervised", 0.93, 0.90, 0.98, 0.95)], split="run", seed=1),
        {"split": "mechanism", "view": "vertical", "seed": 1, "skipped": "no test steps"},
    ]}
    p = tmp_path / "results.json"
    p.write_text(json.dumps(res))
    md, js = tmp_path / "goal.md", tmp_path / "goal.json"
    assert gc.main([str(p), "-o", str(md), "--json", str(js)]) == 0
    text = md.read_text()
    # vertical first; cells met: vertical step F1 and the prior, horizontal step F1, type and the prior
    assert text.index("run, vertical, seed 1") < text.index("run, horizontal, seed 1")
    assert "5 of 8 cells met; blocks met whole: 0 of 2" in text
    assert "0.950** against 0.930 (rf_names)" in text and "0.900 (tie) against 0.900 (rf_names)" in text
    checks = json.loads(js.read_text())["checks"]
    assert [c["view"] for c in checks] == ["vertical", "horizontal"]
    assert gc.main([str(p), "--rows", "teller_mot_family"]) == 2  # no such row: nothing to check
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert gc.main([str(bad)]) == 2


def test_baselines_joined_from_an_earlier_evaluation_of_the_same_test_steps(tmp_path):
    new = {"results": [_block("vertical", [_row("teller_sustained_family", "teller", 0.95, 0.90, 0.97, 0.91)], seed=0),
                       _block("horizontal", [_row("teller_sustained_family", "teller", 0.99, 0.95, 1.0, 0.86),
                                             _row("svm", "supervised", 0.90, 0.90, 0.90, 0.5)], seed=0)]}
    old = {"results": [_block("vertical", [_row("teller_sustained_family", "teller", 0.10, 0.10, 0.10, 0.10),
                                           _row("rf_names", "supervised", 0.96, 0.80, 0.90, 0.95)], seed=0),
                       _block("horizontal", [_row("svm", "supervised", 0.999, 0.999, 0.999, 0.999),
                                             _row("rf", "supervised", 0.98, 0.96, 0.99, 0.99)], seed=0),
                       _block("vertical", [_row("xgb", "supervised", 1.0, 1.0, 1.0, 1.0)], seed=1)]}
    pn, po = tmp_path / "new.json", tmp_path / "old.json"
    pn.write_text(json.dumps(new))
    po.write_text(json.dumps(old))
    js = tmp_path / "goal.json"
    assert gc.main([str(pn), "--baselines", str(po), "--json", str(js), "-o", str(tmp_path / "g.md")]) == 0
    checks = {c["view"]: c for c in json.loads(js.read_text())["checks"]}
    v, h = checks["vertical"]["cells"], checks["horizontal"]["cells"]
    # vertically the old file's baseline is read (its TELLER row is not), seed 1's block is not
    assert v["step F1"]["verdict"] == "behind" and v["step F1"]["baseline"] == "rf_names"
    assert v["Macro₊ F1"]["verdict"] == "ahead" and v["fault-type F1"]["best_baseline"] == 0.90
    # horizontally the block's own svm is kept, the old rf joins it
    assert h["Macro₊ F1"]["baseline"] == "rf" and h["Macro₊ F1"]["verdict"] == "behind"
    assert h["step F1"]["verdict"] == "ahead" and h["step F1"]["best_baseline"] == 0.98
    assert "baselines from" in (tmp_path / "g.md").read_text()
    # other test steps: refused, naming both files
    old["results"][0]["test_abnormal"] = 21
    po.write_text(json.dumps(old))
    assert gc.main([str(pn), "--baselines", str(po)]) == 2
    with pytest.raises(ValueError, match=r"N and O: .* test_abnormal \(20 against 21\)"):
        gc.join_baselines([{**new, "_path": "N"}], [{**old, "_path": "O"}])
