"""scripts/gpu/rca_matrix.py on the CPU (tiny config, a sample of data/h200_v2): jobs forked from
one read of the dataset, each trained and scored, a failing job kept as a row, the TPE lengths
of the test steps, and a kept model that loads; a kept model over what a device call may return
in one file is sent compressed."""

from __future__ import annotations

import importlib.util
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


def _script():
    spec = importlib.util.spec_from_file_location("rca_matrix", ROOT / "scripts" / "gpu" / "rca_matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_kept_tar_over_the_return_limit_is_sent_compressed(tmp_path, capsys):
    from teller.rca.api import pack

    send_back = _script().send_back
    src = tmp_path / "m"
    (src / "checkpoint").mkdir(parents=True)
    (src / "checkpoint" / "state.json").write_text("{}")  # training state: never shipped
    (src / "config.json").write_text(json.dumps({"trees": ["split on x"] * 5000}))  # compressible, like the experts
    (src / "w.bin").write_bytes(os.urandom(20_000))  # incompressible, like the weights
    tar = pack(src, tmp_path / "rca_m.tar", "rca_m")
    size = tar.stat().st_size
    with tarfile.open(tar) as tf:
        assert sorted(tf.getnames()) == ["rca_m/config.json", "rca_m/w.bin"]
    assert pack(src, tar, "rca_m", max_bytes=size) == tar and tar.is_file()  # at the limit: as it is
    out = tmp_path / "out"
    out.mkdir()
    got = send_back(src, out, "m", size - 1)
    assert got == out / "rca_m.tar.gz" and not (out / "rca_m.tar").exists()
    assert size // 2 > got.stat().st_size > 20_000
    with tarfile.open(got, "r:gz") as tf:
        assert json.loads(tf.extractfile("rca_m/config.json").read()) == {"trees": ["split on x"] * 5000}
        assert tf.extractfile("rca_m/w.bin").read() == (src / "w.bin").read_bytes()
    assert capsys.readouterr().err == ""
    # still over the limit once compressed: written, and the way to split it named
    again = send_back(src, out, "m", 1000)
    assert again.stat().st_size > 1000 and "split -b 1000 rca_m.tar.gz" in capsys.readouterr().err


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
