"""Real traces written by others (tests/data/external): ingest, reconstruct, check binding."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_reconstruct_helpers import check_forest, reconciles

from teller.reconstruct import reconstruct
from teller.rundir import RunDir

DATA = Path(__file__).parent / "data" / "external"


def _ingest_and_reconstruct(src: Path, out: Path) -> tuple[dict, RunDir]:
    from teller.ingest import ingest

    ingest(src, out)
    return reconstruct(out), RunDir(out)


@pytest.mark.parametrize(
    "name, min_coverage",
    [
        ("h200_transformers_cb_llama4l.json.gz", 0.99),
        ("h200_torch211_matmul.json.gz", 0.99),
        ("hta_nccl_data_rank0.json.gz", 0.99),
        ("hta_alexnet.json.gz", 0.99),
        ("hta_inference_rank1_2022format.json.gz", 0.9),
    ],
)
def test_kineto_traces_bind_their_kernels(tmp_path, name, min_coverage):
    pytest.importorskip("teller.ingest.kineto")
    s, rd = _ingest_and_reconstruct(DATA / "kineto" / name, tmp_path / "run")
    assert reconciles(s)
    assert s["gpu_activity"] > 0 and s["binding_coverage"] >= min_coverage
    forest = rd.read_table("forest")
    assert forest.num_rows == s["nodes"]
    if forest.num_rows < 20000:
        check_forest(forest)


def test_kineto_steps_and_comm_nodes(tmp_path):
    pytest.importorskip("teller.ingest.kineto")
    s, rd = _ingest_and_reconstruct(DATA / "kineto" / "hta_nccl_data_rank0.json.gz", tmp_path / "run")
    steps = rd.read_table("steps").to_pylist()
    assert s["steps"] == len(steps) > 0
    assert all(r["name"].startswith("ProfilerStep#") and r["step_num"] >= 0 for r in steps)
    assert s["comm_nodes"] > 0 and s["comm_edges"] == 0  # one rank only: nothing to match
    forest = rd.read_table("forest").to_pydict()
    nccl = [i for i, n in enumerate(forest["name"]) if n.startswith("ncclKernel")]
    assert nccl and all(forest["layer"][i] == "COMM" and forest["parent_id"][i] >= 0 for i in nccl)


@pytest.mark.parametrize("name", ["vecadd_report1.sqlite", "cupy_report3.sqlite"])
def test_nsys_exports_bind_all_kernels(tmp_path, name):
    pytest.importorskip("teller.ingest.nsys")
    s, rd = _ingest_and_reconstruct(DATA / "nsys" / name, tmp_path / "run")
    assert reconciles(s) and s["gpu_activity"] > 0 and s["binding_coverage"] == 1.0
    check_forest(rd.read_table("forest"))
