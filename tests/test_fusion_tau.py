"""benchmarks/fusion_tau.py scores the pipeline's flag rules from stored per-step answers alone;
on the union of dataset v2 (the committed answers of the root-cause model's second training and
of the numeric stage) its figures are those `teller evaluate` wrote for the `teller`,
`teller_confirm` and `teller_screened` rows from the same answers
(benchmarks/results/evaluate_h200_v2_whole_teller_row.json)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results"
_spec = importlib.util.spec_from_file_location("fusion_tau", ROOT / "benchmarks" / "fusion_tau.py")
ft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ft)


def test_rules_from_stored_answers_match_the_evaluate_rows(tmp_path):
    out = tmp_path / "f.json"
    assert ft.main([str(RES / "predictions_h200_v2_whole_mot_second.parquet"),
                    str(RES / "predictions_h200_v2_whole_numeric.parquet"), "--taus", "0.1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["blocks"]
    ev = json.loads((RES / "evaluate_h200_v2_whole_teller_row.json").read_text())
    rows = {(r["split"], r["view"]): {m["method"]: m["step"] for m in r["methods"]} for r in ev["results"]}
    assert len(got) == len(rows) == 8
    for (split, view), m in rows.items():
        g = got[f"{split}/{view}"]
        for rule, method in (("model", "teller_mot"), ("stage", "teller_numeric"), ("either", "teller"),
                             ("screen tau=0.1", "teller_screened")):
            assert (g[rule]["tp"], g[rule]["fp"]) == (m[method]["tp"], m[method]["fp"]), (split, view, rule)
            assert g[rule]["f1"] == pytest.approx(m[method]["f1"])
        # teller_confirm (as `teller diagnose`): the stage's flags the model gives at least 0.1,
        # which keeps every step both flag (the model's own 0.5) and more
        c = g["stage and model>=0.1"]
        assert (c["tp"], c["fp"]) == (m["teller_confirm"]["tp"], m["teller_confirm"]["fp"]), (split, view)
        assert g["both"]["tp"] <= c["tp"] and g["both"]["fp"] <= c["fp"]
