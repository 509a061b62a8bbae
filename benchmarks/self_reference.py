"""`teller diagnose` without a reference (the run's own steps) against a fault-free reference, on
the bundled H200 recordings and the planted run of the tests.

    python benchmarks/self_reference.py [-o benchmarks/results/self_reference.json]

For each run: the verdicts (steps flagged and not read as normal by the model), the numeric
stage's own flags outside warm-up steps with the model and without it (``--no-model``), the
self-reference's steps read and left out, and the labelled fault steps (the run's fault window,
labels.json) where it has one. Copies the runs to a temporary folder (diagnose writes there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"
#: run, its fault-free references (bundled)
CASES = (("h200_faulty_op_delay", ("h200_normal_a", "h200_normal_b")), ("h200_normal_a", ("h200_normal_b",)),
         ("h200_normal_b", ("h200_normal_a",)))


def _window_steps(d: dict[str, Any], labels: dict[str, Any]) -> list[int]:
    out = set()
    for w in labels.get("windows", []):
        out |= {s["step_num"] for s in d["steps"] if s["start_ns"] < w["end_tau_ns"] and s["end_ns"] > w["start_tau_ns"]}
    return sorted(out)


def _reading(d: dict[str, Any], model: bool) -> dict[str, Any]:
    stage = sorted(s["step_num"] for s in d["steps"] if (s.get("stage_flag") if model else s["flag"]) and not s.get("warmup"))
    out: dict[str, Any] = {"stage_flags_outside_warmup": stage, "seconds_fit": d["summary"]["seconds"]["fit_or_load"]}
    if model:
        out["verdicts"] = sorted(s["step_num"] for s in d["steps"] if s["flag"] and not s.get("model_says_normal"))
    if "self_reference" in d["localizer"]:
        out["self_reference"] = d["localizer"]["self_reference"]
    return out


def main() -> None:
    from teller.evaluate.metrics import evaluate
    from teller.report.diagnose import diagnose
    from teller.testing.planted import Plant, write_planted_run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", default=str(ROOT / "benchmarks" / "results" / "self_reference.json"))
    a = ap.parse_args()
    res: dict[str, Any] = {"command": "python benchmarks/self_reference.py", "runs": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for name, _ in CASES:
            shutil.copytree(EX / name, t / name)
        for name, refs in CASES:
            row: dict[str, Any] = {"reference": list(refs)}
            for mode in ("reference", "own_steps"):
                ref = [t / r for r in refs] if mode == "reference" else None
                with_model = diagnose(t / name, reference=ref, out=t / f"{name}_{mode}")
                alone = diagnose(t / name, reference=ref, out=t / f"{name}_{mode}_stage", model=False)
                row[mode] = {"with_model": _reading(with_model, True), "stage_alone": _reading(alone, False)}
                row["steps"] = len(with_model["steps"])
                row["steps_outside_warmup"] = sum(not s.get("warmup") for s in with_model["steps"])
                lab = t / name / "labels.json"
                if lab.is_file():
                    row["fault_window_steps"] = _window_steps(with_model, json.loads(lab.read_text()))
            res["runs"][name] = row
            print(name, json.dumps(row), flush=True)
        plants = [Plant("BE aten::mul", [12, 40], "host", 4.0), Plant("BE aten::silu", [70], "churn", 4.0)]
        write_planted_run(t / "planted_ref", 40_000, [], seed=1)
        write_planted_run(t / "planted", 40_000, plants, seed=2)
        labels = json.loads((t / "planted" / "labels.json").read_text())
        row = {"plants": "aten::mul x4 in steps 12 and 40, aten::silu x4 (churn) in step 70; reference: a planted run without plants (seed 1)"}
        for mode, ref in (("reference", [t / "planted_ref"]), ("own_steps", None)):
            d = diagnose(t / "planted", reference=ref, out=t / f"planted_{mode}", model=False)
            row[mode] = {**_reading(d, False), "step": evaluate(d, labels)["step"]}
        res["runs"]["planted"] = row
        print("planted", json.dumps(row), flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
