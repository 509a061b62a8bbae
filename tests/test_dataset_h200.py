"""The committed H200 dataset (data/h200_v1) against the committed raw faulty runs (examples/).

The raw runs are recordings from the H200 campaign (events, logs, the fault agents' windows);
reconstructing, aligning, labelling and building them here must give exactly the records and
subtrees that the dataset holds for those runs. The dataset was built with ``--max-normal 125``
(data/h200_v1/README.md); sampling depends only on the run, so one run rebuilds alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
DS = ROOT / "data" / "h200_v1"
EXAMPLES = {"ex-op-delay-r0": ROOT / "examples" / "h200_faulty_op_delay",
            "ex-straggler-tp-r0": ROOT / "examples" / "h200_tp_straggler"}
COMPARED = ["run_id", "request_id", "step_id", "step_ids", "ranks", "step_num", "rank", "view", "start_ns", "end_ns",
            "duration_ns", "log_text", "is_anomaly", "in_window", "fault_type", "mechanism", "operator_labels", "layer",
            "explanation", "effect_ms", "ref_p99_ms", "run_status", "provenance"]
ORDER = [("view", "ascending"), ("rank", "ascending"), ("step_num", "ascending"), ("request_id", "ascending")]


def _rebuild(run_id: str, tmp: Path) -> Path:
    from teller.dataset.build import build_dataset
    from teller.inject.labels import label_run
    from teller.logs import align_run
    from teller.reconstruct import reconstruct

    run = tmp / run_id  # the run directory's name is part of the records' provenance
    shutil.copytree(EXAMPLES[run_id], run)
    reconstruct(run)
    align_run(run)
    labels = json.loads((run / "labels.json").read_text())
    label_run(run, labels)
    build_dataset([run], tmp / "ds", max_normal=125)
    return tmp / "ds"


def _edges(records: pa.Table, comm: pa.Table, ids=lambda x: x) -> list[list[tuple[int, int]]]:
    """Each record's communication edges as (src, dst) node ids (row numbers differ per build)."""
    src, dst = ids(comm.column("src_node_id").to_numpy()), ids(comm.column("dst_node_id").to_numpy())
    return [sorted((int(src[i]), int(dst[i])) for i in rows) for rows in records.column("comm_edge_rows").to_pylist()]


def _v1_ids(run: Path):
    """Node ids of today's forest as v1 numbered them: v1 was built before GAP rows existed
    (docs/design.md §5.7), and every GAP row moves the rows after it down by one."""
    f = pq.read_table(run / "forest.parquet", columns=["node_id", "layer"])
    gaps = np.sort(f.column("node_id").to_numpy()[np.asarray(f.column("layer").to_pylist()) == "GAP"])

    def ids(x):
        x = np.asarray(x, np.int64)
        return np.where(x >= 0, x - np.searchsorted(gaps, x), x)
    return ids


def _as_v1(records: pa.Table, sub: pa.Table, ids) -> tuple[pa.Table, pa.Table]:
    """Records and subtrees in v1's terms: v1 numbering, and only the STEP blocks of the
    subtrees (v1 stored no schedule ranges, GAP rows or roots that joined a step)."""
    records = records.set_column(records.column_names.index("step_id"), "step_id", pa.array(ids(records.column("step_id").to_numpy())))
    sids = [ids(np.asarray(x, np.int64)).tolist() for x in records.column("step_ids").to_pylist()]
    records = records.set_column(records.column_names.index("step_ids"), "step_ids", pa.array(sids, pa.list_(pa.int64())))
    prov = []
    for p in records.column("provenance").to_pylist():
        d = json.loads(p)
        a, b = d["forest_rows"]
        d["forest_rows"] = [int(ids([a])[0]), int(ids([a])[0]) + b - a]
        prov.append(json.dumps(d))
    records = records.set_column(records.column_names.index("provenance"), "provenance", pa.array(prov, pa.string()))
    sub = sub.filter(pc.greater_equal(sub.column("step_id"), 0))
    for c in ("node_id", "parent_id", "step_id"):
        sub = sub.set_column(sub.column_names.index(c), c, pa.array(ids(sub.column(c).to_numpy()), sub.schema.field(c).type))
    return records, sub


@pytest.fixture(scope="module")
def committed():
    from teller.dataset.codec import read_subtrees

    if not (DS / "records.parquet").is_file():
        pytest.fail(f"{DS}: the committed dataset is missing")
    comm = pq.read_table(DS / "comm_edges.parquet")
    return pq.read_table(DS / "records.parquet"), read_subtrees(DS), comm


@pytest.mark.parametrize("run_id", sorted(EXAMPLES))
def test_raw_example_runs_rebuild_the_committed_records(run_id, committed, tmp_path):
    from teller.dataset.codec import read_subtrees

    records, subtrees, comm = committed
    mine = records.filter(pc.equal(records.column("run_id"), run_id)).sort_by(ORDER)
    assert mine.num_rows > 100
    assert pc.sum(mine.column("is_anomaly")).as_py() > 0  # faulty runs with labelled abnormal steps
    ds = _rebuild(run_id, tmp_path)
    ids = _v1_ids(tmp_path / run_id)
    again, sub_again = _as_v1(pq.read_table(ds / "records.parquet").sort_by(ORDER), read_subtrees(ds), ids)
    assert again.num_rows == mine.num_rows
    for c in COMPARED:
        a, b = again.column(c).to_pylist(), mine.column(c).to_pylist()
        if c in ("effect_ms", "ref_p99_ms"):
            np.testing.assert_allclose(np.array(a, float), np.array(b, float), rtol=1e-12, equal_nan=True, err_msg=c)
        else:
            assert a == b, c
    comm_again = pq.read_table(ds / "comm_edges.parquet") if (ds / "comm_edges.parquet").is_file() else comm.slice(0, 0)
    assert _edges(again, comm_again, ids) == _edges(mine, comm)
    # the subtrees (forest rows of every kept step) are the same rows, value for value
    sub = subtrees.filter(pc.equal(subtrees.column("run_id").cast(pa.string()), run_id))
    assert sub_again.num_rows == sub.num_rows
    for c in sub.column_names:
        assert sub_again.column(c).cast(sub.schema.field(c).type).to_pylist() == sub.column(c).to_pylist(), c


def test_datasheet_meets_the_collection_targets(committed):
    sheet = json.loads((DS / "datasheet.json").read_text())
    records = committed[0]
    assert sheet["records"] == records.num_rows >= 10_000
    assert sheet["steps"] >= 9_000 and sheet["steps_recorded"] > sheet["steps"]
    finished = [r for r in sheet["runs"] if r["status"] == "finished"]
    assert len(finished) >= 20
    assert any(r["status"] == "skipped" and r["skipped"] for r in sheet["runs"])  # netem, with its reason
    shares = sheet["category_share_of_abnormal_steps"]
    assert set(shares) == {"memory", "kernel", "runtime", "communication", "scheduling"}
    assert min(shares.values()) >= 0.15
    assert set(sheet["by_view"]) == {"vertical", "horizontal"}
    # normal runs are in, and every record of a normal run is normal
    normal = records.filter(pc.starts_with(records.column("run_id"), "normal-"))
    assert normal.num_rows > 0 and not pc.any(normal.column("is_anomaly")).as_py()
    # the files stay within the repository's budget for the dataset, none of them large
    files = [p for p in DS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 50 * 2**20
    assert max(p.stat().st_size for p in files) <= 8 * 2**20
