"""scripts/gpu/rca_matrix.py on the CPU (tiny config, a sample of data/h200_v2): jobs forked from
one read of the dataset, each trained and scored, a failing job kept as a row, the TPE lengths
of the test steps, and a kept model that loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "h200_v2"


def test_matrix_trains_scores_and_keeps(tmp_path):
    if not (DATA / "records.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu" / "rca_matrix.py"), "--data", str(DATA), "--out", str(out),
           "--work", str(work), "--device", "cpu", "--config", "tiny", "--workers", "2", "--threads", "1", "--epochs", "1",
           "--batch-size", "16", "--max-units", "160", "--deadline-s", "900",
           "--job", "m=mot:request", "--job", "v0=mot:request:trace_vocab=0", "--job", "it=single:request:unit=iteration",
           "--job", "bad=mot:request:inputs=nonsense", "--keep", "m"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((out / "matrix.json").read_text())
    assert res["protocol"]["epochs"] == 1 and set(res["jobs"]) == {"m", "v0", "it", "bad"}
    assert "--inputs nonsense" in res["jobs"]["bad"]["error"]  # a failing job is a row, not the end of the call
    for name in ("m", "v0", "it"):
        j = res["jobs"][name]
        assert j["training"]["stopped_by"] == "steps" and j["test"]["all"]["units"] == j["tpe"]["units"] > 0
    assert res["jobs"]["v0"]["tpe"]["length_reduction"] == 0.0  # no merges: a token per node
    assert 0.0 < res["jobs"]["m"]["tpe"]["length_reduction"] < 1.0
    with tarfile.open(out / "rca_m.tar") as tf:
        names = tf.getnames()
    assert "rca_m/config.json" in names and not any("checkpoint" in n for n in names)
