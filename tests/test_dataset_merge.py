"""`teller dataset merge`: datasets built from disjoint runs merge into exactly the dataset that
one `teller dataset build` over all the runs, in the parts' order, writes.

The runs are the bundled recordings (examples/), reconstructed, aligned and labelled on a copy:
the CPU loop stall and its fault-free run, and the two-rank tensor-parallel straggler (the only
one with communication edges) twice under two run ids, once in each part, so the second part's
``comm_edge_rows`` must be shifted past the first part's edges.
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

from teller.dataset.build import build_dataset
from teller.dataset.codec import differing_columns, read_subtrees
from teller.dataset.merge import merge_datasets
from teller.errors import TellerError

EX = Path(__file__).resolve().parents[1] / "examples"
PART_A = ["cpu_loop_stall", "tp_r0"]
PART_B = ["cpu_normal", "tp_r1"]
SAMPLING = {"max_normal": 30}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    from teller.inject.labels import label_run
    from teller.logs import align_run
    from teller.reconstruct import reconstruct

    d = tmp_path_factory.mktemp("merge")
    runs = d / "runs"
    for name, src in [("cpu_loop_stall", "cpu_loop_stall"), ("cpu_normal", "cpu_normal"), ("tp_r0", "h200_tp_straggler")]:
        shutil.copytree(EX / src, runs / name)
        reconstruct(runs / name)
        align_run(runs / name)
        label_run(runs / name, json.loads((runs / name / "labels.json").read_text()))
    # the same recording again as another run of the campaign (its labels name another run id)
    shutil.copytree(runs / "tp_r0", runs / "tp_r1")
    lab = json.loads((runs / "tp_r1" / "labels.json").read_text())
    lab["run_id"] = lab["run_id"].replace("-r0", "-r1")
    (runs / "tp_r1" / "labels.json").write_text(json.dumps(lab))
    out = {"runs": runs}
    for key, names in [("a", PART_A), ("b", PART_B), ("all", PART_A + PART_B)]:
        out[key] = d / key / "ds"  # one folder name: the datasheet.md title is the folder's name
        build_dataset([runs / n for n in names], out[key], **SAMPLING)
    out["merged"] = d / "merged" / "ds"
    merge_datasets([out["a"], out["b"]], out["merged"])
    return out


def _assert_same_table(a: pa.Table, b: pa.Table, what: str) -> None:
    """Equal schemas and values, NaN equal to NaN (the labels' effect_ms of normal steps)."""
    assert a.schema.equals(b.schema), what
    assert a.num_rows == b.num_rows, what
    for c in a.column_names:
        x, y = a.column(c), b.column(c)
        if pa.types.is_floating(x.type):
            assert np.array_equal(x.is_null().to_numpy(zero_copy_only=False), y.is_null().to_numpy(zero_copy_only=False)), (what, c)
            assert np.array_equal(pc.fill_null(x, 0).to_numpy(), pc.fill_null(y, 0).to_numpy(), equal_nan=True), (what, c)
        else:
            assert x.equals(y), (what, c)


def test_merge_equals_one_build_over_all_the_runs(built):
    all_, merged = built["all"], built["merged"]
    rec = pq.read_table(merged / "records.parquet")
    _assert_same_table(pq.read_table(all_ / "records.parquet"), rec, "records")
    for name in ("logs", "comm_edges", "iterations"):
        _assert_same_table(pq.read_table(all_ / f"{name}.parquet"), pq.read_table(merged / f"{name}.parquet"), name)
    want, got = read_subtrees(all_), read_subtrees(merged)
    assert want.num_rows == got.num_rows > 0 and differing_columns(want, got) == []
    for name in ("datasheet.json", "datasheet.md"):
        assert (all_ / name).read_text() == (merged / name).read_text(), name
    # the test is not vacuous: both parts hold a tensor-parallel run, so part B's edge rows moved
    # past part A's, and the splits were drawn over both parts
    n_a = pq.read_table(built["a"] / "comm_edges.parquet").num_rows
    rows_b = rec.filter(pc.equal(rec.column("run_id"), "ex-straggler-tp-r1")).column("comm_edge_rows")
    flat = pc.list_flatten(rows_b).to_numpy()
    assert n_a > 0 and len(flat) and flat.min() >= n_a
    assert set(rec.column("view").to_pylist()) == {"vertical", "horizontal"}
    parts = [pq.read_table(built[k] / "records.parquet") for k in ("a", "b")]
    for c in ("split_request", "split_run"):  # drawn over all the records, not part by part
        assert rec.column(c).to_pylist() != parts[0].column(c).to_pylist() + parts[1].column(c).to_pylist(), c
    assert rec.column("record_id").to_pylist() == list(range(rec.num_rows))
    # two model shapes (the CPU runs' hidden 128, the H200 run's hidden 1024): the shape with fewer
    # records is the workload-disjoint test, and only it
    wl, sw = np.array(rec.column("workload").to_pylist()), np.array(rec.column("split_workload").to_pylist())
    shapes, counts = np.unique(wl, return_counts=True)
    assert sorted(shapes) == ["2 layers, hidden 1024", "2 layers, hidden 128"]
    held = shapes[np.argmin(counts)]
    assert set(sw[wl == held]) == {"test"} and "test" not in set(sw[wl != held])
    assert json.loads((merged / "datasheet.json").read_text())["held_out_workloads"] == [held]


def test_merge_of_one_shape_parts_equals_one_build(built, tmp_path):
    """Parts of one model shape have no split_workload column, and neither has their merge."""
    runs = built["runs"]
    parts = []
    for name in ("cpu_loop_stall", "cpu_normal"):
        parts.append(tmp_path / name / "ds")
        build_dataset([runs / name], parts[-1], **SAMPLING)
    whole, merged = tmp_path / "whole" / "ds", tmp_path / "merged" / "ds"
    build_dataset([runs / "cpu_loop_stall", runs / "cpu_normal"], whole, **SAMPLING)
    merge_datasets(parts, merged)
    rec = pq.read_table(merged / "records.parquet")
    assert "split_workload" not in rec.column_names
    _assert_same_table(pq.read_table(whole / "records.parquet"), rec, "records")
    assert (whole / "datasheet.json").read_text() == (merged / "datasheet.json").read_text()


def test_merge_refuses_overlapping_parts(built, tmp_path):
    c = tmp_path / "c"
    build_dataset([built["runs"] / "cpu_normal"], c, **SAMPLING)
    with pytest.raises(TellerError, match=r"c: holds run 'ex-normal-r0', which .*b/ds holds too \(the parts overlap\); rebuild one"):
        merge_datasets([built["a"], built["b"], c], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TellerError, match="given twice"):
        merge_datasets([built["a"], built["a"]], tmp_path / "out")


def test_merge_refuses_what_is_not_a_dataset(built, tmp_path):
    (tmp_path / "nope").mkdir()
    with pytest.raises(TellerError, match=r"nope: not a dataset \(no datasheet.json\); give dataset folders"):
        merge_datasets([built["a"], tmp_path / "nope"], tmp_path / "out")
    with pytest.raises(TellerError, match=r"ds: is the dataset .* write the merged dataset to a folder of its own"):
        merge_datasets([built["a"], built["b"]], built["b"])
    with pytest.raises(TellerError, match="holds the dataset"):
        merge_datasets([built["a"], built["b"]], built["a"].parent.parent)


def _copy(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        sheet = json.loads((dst / "datasheet.json").read_text())
        edit(sheet)
        (dst / "datasheet.json").write_text(json.dumps(sheet))
    return dst


def test_merge_needs_one_seed_and_one_sampling_rule(built, tmp_path):
    b1 = _copy(built["b"], tmp_path / "b1", lambda s: s.update(seed=1))
    with pytest.raises(TellerError, match=r"b1/datasheet.json: split seed 1, but .* has seed 0; pass --seed"):
        merge_datasets([built["a"], b1], tmp_path / "out")
    sheet = merge_datasets([built["a"], b1], tmp_path / "out", seed=1)
    assert sheet["seed"] == 1
    b2 = _copy(built["b"], tmp_path / "b2", lambda s: s["sampling"].update(max_normal=10))
    with pytest.raises(TellerError, match=r"b2/datasheet.json: sampled steps by .* rebuild the parts with the same"):
        merge_datasets([built["a"], b2], tmp_path / "out2", seed=0)


def test_merge_refuses_parts_with_tpe_fields(built, tmp_path):
    from teller.dataset.build import TPE_FIELDS, attach_tpe

    b = _copy(built["b"], tmp_path / "b")
    rec = pq.read_table(b / "records.parquet")
    rec = attach_tpe(rec, read_subtrees(b), lambda r, s: pa.table({f: pa.array([[1]] * r.num_rows) for f in TPE_FIELDS}))
    pq.write_table(rec, b / "records.parquet")
    with pytest.raises(TellerError, match=r"records.parquet: has TPE fields .* merge before attaching a tokenizer"):
        merge_datasets([built["a"], b], tmp_path / "out")


def test_merge_command_guards_its_output(built, tmp_path, capsys):
    from teller.cli import main

    out = tmp_path / "m"
    args = ["dataset", "merge", str(built["a"]), str(built["b"]), "-o", str(out)]
    assert main(args) == 0
    assert "merged 2 datasets" in capsys.readouterr().err
    assert main(args) == 2
    assert f"{out}: already exists and holds a dataset; pass --force" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    capsys.readouterr()
    assert main(["dataset", "merge", str(built["a"]), str(built["b"]), "-o", str(built["a"]), "--force"]) == 2
    assert "is the dataset" in capsys.readouterr().err
    assert (built["a"] / "datasheet.json").is_file()  # a part is never replaced
