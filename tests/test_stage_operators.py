"""benchmarks/stage_operators.py summarizes, per cap on the operators the stage names, each row's
operator Macro₊ F1 over folds and views: checked on hand-written results files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("stage_operators", ROOT / "benchmarks" / "stage_operators.py")
so = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(so)


def _results(path: Path, cells: dict[tuple[str, str], float]) -> None:
    """A results.json of `teller evaluate` holding only what summarize reads: per view, each
    method's operator Macro₊ F1 (and one row it must leave out)."""
    blocks = []
    for view in ("vertical", "horizontal"):
        methods = [{"method": m, "operator": {"macro_plus_f1": x}} for (v, m), x in cells.items() if v == view]
        methods.append({"method": "svm", "operator": {"macro_plus_f1": 0.99}})
        blocks.append({"split": "mechanism", "view": view, "methods": methods})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": blocks}))


def test_caps_parse_with_none():
    assert so.parse_caps("none,1, 3") == [None, 1, 3]
    assert [so.cap_name(c) for c in so.parse_caps("none,2")] == ["cap_none", "cap_2"]


def test_summarize_averages_each_row_over_folds_and_views(tmp_path):
    row = "teller_sustained_family"
    for fold, base in (("nest0", 0.2), ("nest1", 0.6)):
        for cap, add in (("none", 0.0), ("3", 0.1)):
            _results(tmp_path / fold / f"cap_{cap}" / "results.json",
                     {("vertical", row): base + add, ("horizontal", row): base + add + 0.2,
                      ("vertical", "teller_numeric_deploy"): base})
    res = so.summarize([str(tmp_path / "nest0"), str(tmp_path / "nest1")])
    assert res["folds"] == ["nest0", "nest1"]
    by = {r["cap"]: r for r in res["rows"]}
    assert set(by) == {"3", "none"}
    # none: fold 0 (0.2, 0.4), fold 1 (0.6, 0.8); cap 3 adds 0.1 to each
    assert by["none"][row]["mean"] == pytest.approx(0.5)
    assert by["none"][row]["per_fold"] == pytest.approx({"nest0": 0.3, "nest1": 0.7})
    assert by["3"][row]["mean"] == pytest.approx(0.6)
    # a row scored in one view only averages that view; one never scored is left out; svm is not a row
    assert by["3"]["teller_numeric_deploy"]["mean"] == pytest.approx(0.4)
    assert "teller_diagnose_family" not in by["3"] and "svm" not in by["3"]
    assert by["3"]["blocks"]["nest1"][row] == pytest.approx({"vertical": 0.7, "horizontal": 0.9})


def test_a_cap_missing_on_one_fold_is_refused(tmp_path):
    _results(tmp_path / "a" / "cap_3" / "results.json", {("vertical", "teller_sustained_family"): 0.5})
    _results(tmp_path / "b" / "cap_none" / "results.json", {("vertical", "teller_sustained_family"): 0.5})
    with pytest.raises(SystemExit, match="cap_3"):
        so.summarize([str(tmp_path / "a"), str(tmp_path / "b")])
