"""The fault type `teller diagnose` reads from the numeric evidence, scored on labelled runs.

    python benchmarks/evidence_types.py RUNS_DIR -o OUT.json [--jobs N]

RUNS_DIR holds runs recorded and labelled by a fault campaign (`teller inject run`, or
scripts/gpu/campaign.py): every run with a fault window is diagnosed with no model against the
fault-free runs of the same directory that have its number of ranks (`teller diagnose RUN
--reference NORMAL... --no-model`), and its flagged steps' ``evidence_type``
(teller.localize.faulttype) is compared with the step labels (``step_labels.parquet``: type of
the abnormal steps). Writes per run: mechanism, type, abnormal steps, those flagged, their
evidence types, and the normal steps flagged; pooled: the confusion and fault-type scores over the
flagged abnormal steps (``teller.evaluate.scores.fault_type_scores``) and the step recall.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np


def _labels(run: Path) -> tuple[dict[tuple[int, int], tuple[bool, str, str]], int]:
    from teller.inject.labels import read_step_labels

    t = read_step_labels(run)
    if t is None:
        raise SystemExit(f"{run}: no step_labels.parquet (label the run: teller inject label)")
    d = t.select(["rank", "step_num", "is_anomaly", "fault_type", "mechanism"]).to_pydict()
    out = {(int(r), int(n)): (bool(a), str(f or ""), str(m or ""))
           for r, n, a, f, m in zip(d["rank"], d["step_num"], d["is_anomaly"], d["fault_type"], d["mechanism"], strict=True)}
    return out, len(set(d["rank"]))


def _faulty(run: Path) -> bool:
    lab = json.loads((run / "labels.json").read_text())
    return bool(lab.get("windows"))


def one(run: str, refs: list[str]) -> dict[str, Any]:
    from teller.report.diagnose import diagnose

    t0 = time.perf_counter()
    lab, _ = _labels(Path(run))
    with tempfile.TemporaryDirectory() as tmp:
        d = diagnose(run, reference=refs, out=Path(tmp), model=False)
    ab_total = sum(a for a, _, _ in lab.values())
    typed: Counter[str] = Counter()
    normal_typed: Counter[str] = Counter()
    pairs = []
    mech = Counter(m for a, _, m in lab.values() if a)
    for s in d["steps"]:
        if not s["flag"]:
            continue
        a, ft, _ = lab.get((int(s["rank"]), int(s["step_num"])), (False, "", ""))
        et = (s.get("evidence_type") or {}).get("fault_type") or ""
        if a:
            typed[et or "-"] += 1
            pairs.append((ft, et))
        else:
            normal_typed[et or "-"] += 1
    true_type = Counter(ft for a, ft, _ in lab.values() if a)
    return {"run": Path(run).name, "references": [Path(r).name for r in refs],
            "mechanism": mech.most_common(1)[0][0] if mech else "", "fault_type": true_type.most_common(1)[0][0] if true_type else "",
            "steps": len(lab), "abnormal": int(ab_total), "abnormal_flagged": int(sum(typed.values())),
            "evidence_types": dict(typed.most_common()), "normal_flagged": int(sum(normal_typed.values())),
            "normal_evidence_types": dict(normal_typed.most_common()), "pairs": pairs,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    from teller.evaluate.scores import fault_type_scores

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=1)
    a = ap.parse_args(argv)
    runs = sorted(p for p in a.runs.iterdir() if (p / "labels.json").is_file() and (p / "forest.parquet").is_file())
    ranks = {p: _labels(p)[1] for p in runs}
    normal = [p for p in runs if not _faulty(p)]
    jobs = []
    for p in runs:
        if p in normal:
            continue
        refs = [str(r) for r in normal if ranks[r] == ranks[p]]
        if not refs:
            print(f"{p.name}: no fault-free run of {ranks[p]} rank(s) in {a.runs}; skipped", file=sys.stderr)
            continue
        jobs.append((str(p), refs))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        rows = list(ex.map(one, *zip(*jobs, strict=True))) if jobs else []
    pairs = [p for r in rows for p in r.pop("pairs")]
    truth = [t for t, _ in pairs]
    pred = [p or "" for _, p in pairs]
    ab = sum(r["abnormal"] for r in rows)
    out = {"runs_dir": str(a.runs), "command": "python benchmarks/evidence_types.py " + " ".join(argv or sys.argv[1:]),
           "references": {p.name: ranks[p] for p in normal}, "runs": rows,
           "pooled": {"abnormal": ab, "abnormal_flagged": len(pairs), "recall": (len(pairs) / ab) if ab else None,
                      "normal_flagged": sum(r["normal_flagged"] for r in rows),
                      "normal_steps": sum(r["steps"] - r["abnormal"] for r in rows),
                      "fault_type_on_flagged": fault_type_scores(truth, pred) if pairs else None},
           "seconds": round(time.perf_counter() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1, default=lambda x: x.tolist() if isinstance(x, np.ndarray) else str(x)))
    for r in rows:
        print(f"{r['run']:34s} {r['mechanism']:22s} {r['fault_type']:13s} abnormal {r['abnormal']:4d} flagged {r['abnormal_flagged']:4d} "
              f"types {r['evidence_types']} | normal flagged {r['normal_flagged']}")
    ft = out["pooled"]["fault_type_on_flagged"]
    if ft:
        print(f"pooled: {len(pairs)} flagged abnormal steps, accuracy {ft['accuracy']:.3f}, macro-F1 {ft['macro_f1']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
