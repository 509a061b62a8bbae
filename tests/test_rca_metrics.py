"""The root-cause model's metrics on hand-made predictions: BLEU of the explanations on the right units."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sacrebleu")

from teller.rca.metrics import evaluate_predictions  # noqa: E402


def _pred(abnormal: bool, text: str) -> dict:
    return {"abnormal": abnormal, "fault_type": "kernel" if abnormal else "", "fault_type_best": "kernel",
            "evidence_operators": ["FE LlamaMLP"] if abnormal else [], "explanation": text}


def test_bleu_counts_the_flagged_abnormal_units_only():
    ref = "CUDA/kernel fault in step 7: the MLP kernels ran 67 times longer than the reference."
    pred = [_pred(True, ref),                    # abnormal, flagged, explained: scored, identical
            _pred(True, "something else entirely"),  # abnormal, flagged: scored, no overlap
            _pred(False, ""),                     # abnormal, missed: not scored
            _pred(True, ref)]                     # normal but flagged: not scored (no reference)
    ab = np.array([True, True, True, False])
    fault = np.array([2, 2, 2, 0])
    ops = [["FE LlamaMLP"]] * 3 + [[]]
    m = evaluate_predictions(pred, ab, fault, ops, [ref, ref, ref, ""])
    assert m["explanation"]["units"] == 2
    assert 0.4 < m["explanation"]["bleu1"] < 0.6  # one hypothesis equal to its reference, one sharing nothing
    same = evaluate_predictions(pred[:1], ab[:1], fault[:1], ops[:1], [ref])
    assert same["explanation"]["units"] == 1 and same["explanation"]["bleu4"] == pytest.approx(1.0)
    assert "explanation" not in evaluate_predictions(pred, ab, fault, ops)  # no references given, no BLEU
