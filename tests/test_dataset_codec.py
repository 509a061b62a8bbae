"""Compact subtree storage: exact round trip on real forests, on a committed part of data/h200_v2
and on a file in the first format (tests/data/), edge cases of every transform, parts cut at steps,
``teller dataset recode``, and clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from teller.dataset.codec import (
    CODEC,
    CODEC_V1,
    codec_of,
    decode,
    differing_columns,
    read_subtrees,
    recode_dataset,
    write_subtree_parts,
    write_subtrees,
)
from teller.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
V2 = ROOT / "data" / "h200_v2" / "subtrees"
#: format-1 file: the first 6,500 stored rows of part 7 of data/h200_v1 (which is in git history:
#: ``git checkout 644acca -- data/h200_v1``), its dictionaries cut to the entries in use plus a few
#: unused ones; it starts inside a step, holds two whole steps and ends inside a fourth
V1_FILE = ROOT / "tests" / "data" / "subtrees_v1_part7_head.parquet"
#: the same rows as read from the whole v1 part (dictionary columns as plain strings)
V1_EXPECTED = ROOT / "tests" / "data" / "subtrees_v1_part7_head.expected.parquet"


def _same(a: pa.Table, b: pa.Table) -> None:
    assert a.schema.remove_metadata().equals(b.schema.remove_metadata())
    for c in a.column_names:
        assert a.column(c).to_pylist() == b.column(c).to_pylist(), c
    assert differing_columns(a, b) == []


def test_round_trip_on_a_real_h200_forest_is_exact_and_smaller(tmp_path):
    from teller.reconstruct import reconstruct

    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "h200_llama8l_cupti", run)
    reconstruct(run)
    forest = pq.read_table(run / "forest.parquet")
    forest = forest.append_column("run_id", pa.array(["r"] * forest.num_rows).dictionary_encode())
    out = tmp_path / "subtrees.parquet"
    write_subtrees(forest, out)
    assert codec_of(out) == CODEC
    _same(read_subtrees(out), forest)
    plain = tmp_path / "plain.parquet"
    pq.write_table(forest, plain, compression="zstd")
    assert out.stat().st_size < 0.6 * plain.stat().st_size


def test_a_format_1_file_reads_back_the_rows_of_the_whole_part(tmp_path):
    """A v1 file (parents, depths and sizes of its first and last step partly outside the file)
    read through the format-1 path gives the rows the whole part gave; re-encoded in the current
    format it reads back the same and is smaller."""
    assert codec_of(V1_FILE) == CODEC_V1
    assert pq.read_metadata(V1_FILE).num_rows == 6_500
    old = read_subtrees(V1_FILE)
    want = pq.read_table(V1_EXPECTED)
    assert old.column_names == want.column_names
    for c in old.column_names:
        col = old.column(c)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        assert col.equals(want.column(c).cast(col.type)), c
    par = old.column("parent_id").to_numpy()
    roots = np.flatnonzero(par == -1)
    assert len(roots) == 3 and roots[0] > 0  # starts inside a step, ends inside one
    write_subtrees(old, tmp_path / "v2.parquet")
    assert codec_of(tmp_path / "v2.parquet") == CODEC
    new = read_subtrees(tmp_path / "v2.parquet")
    assert new.schema == old.schema
    assert differing_columns(old, new) == []
    for c in ("name", "layer", "kind", "run_id", "args", "corr_id", "depth", "size", "start_ns", "end_ns"):
        assert new.column(c).to_pylist() == old.column(c).to_pylist(), c
    # smaller by a third at least (whole parts: benchmarks/README.md)
    assert (tmp_path / "v2.parquet").stat().st_size < 0.75 * V1_FILE.stat().st_size
    # dictionaries hold only the entries in use (the v1 file carries unused ones)
    src = pq.read_table(V1_FILE)
    stored = pq.read_table(tmp_path / "v2.parquet")
    assert len(src.column("name").chunk(0).dictionary) > len(set(old.column("name").to_pylist()))
    assert len(stored.column("name.values").drop_null()) == len(set(old.column("name").to_pylist()))


def test_committed_v2_part_re_encodes_to_the_same_rows_and_size(tmp_path):
    """The smallest part of data/h200_v2, in the current format: read, written again and read back
    value for value, at about the committed size (the writer is deterministic)."""
    src = V2 / "part-00011.parquet"
    assert codec_of(src) == CODEC
    old = read_subtrees(src)
    assert old.num_rows == pq.read_metadata(src).num_rows > 200_000
    assert {"run_id", "step_id", "step_idx", "layer", "name", "start_ns", "end_ns"} <= set(old.column_names)
    write_subtrees(old, tmp_path / src.name)
    new = read_subtrees(tmp_path / src.name)
    assert new.schema == old.schema and differing_columns(old, new) == []
    assert abs((tmp_path / src.name).stat().st_size - src.stat().st_size) <= 0.02 * src.stat().st_size


def test_nulls_negative_parents_and_unsorted_times_survive(tmp_path):
    t = pa.table({
        "node_id": pa.array([0, 1, 2, 7, 8], pa.int64()),  # blocks of several steps: gaps in node ids
        "parent_id": pa.array([-1, 0, 1, -1, 7], pa.int64()),
        "name": pa.array(["STEP id=1", "a", "k", "STEP id=4", "b"]).dictionary_encode(),
        "start_ns": pa.array([5_000_000_000, 5_000_000_100, 4_999_999_000, 9, 2**62], pa.int64()),
        "end_ns": pa.array([5_000_001_000, 5_000_000_200, 5_000_000_000, 10, 2**62 + 1], pa.int64()),
        "corr_id": pa.array([None, 17, 17, None, 3], pa.int64()),
        "args": pa.array([None, '{"x": 1}', None, None, ""], pa.string()),
    })
    write_subtrees(t, tmp_path / "s.parquet")
    _same(read_subtrees(tmp_path / "s.parquet"), t)
    parts = write_subtree_parts(t, tmp_path / "ds" / "subtrees", part_rows=2)  # parts encoded on their own
    assert [p.name for p in parts] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    _same(read_subtrees(tmp_path / "ds"), t)
    empty = t.slice(0, 0)
    write_subtrees(empty, tmp_path / "e.parquet")
    _same(read_subtrees(tmp_path / "e.parquet"), empty)


def _steps(n_steps: int, rng: np.random.Generator) -> pa.Table:
    """Steps of a host range with launches, kernels (device rows) and nested host calls."""
    rows = []
    nid = 100
    for _ in range(n_steps):
        root = nid
        rows.append((nid, -1, "STEP", "RANGE", None))
        nid += 1
        for _ in range(3):
            op = nid
            rows.append((nid, root, "aten::mm", "RANGE", None))
            nid += 1
            rows.append((nid, op, "cudaLaunchKernel", "RUNTIME", 1000 + nid))
            launch = nid
            nid += 1
            rows.append((nid, launch, "gemm", "KERNEL", 1000 + launch))
            nid += 1
            rows.append((nid, op, "cudaMalloc", "RUNTIME", 1000 + nid))  # a host last child
            nid += 1
        nid += 5  # node ids of other steps in between
    n = len(rows)
    start = np.sort(rng.integers(0, 10**12, n))
    start[rng.integers(0, n, 3)] = [-(2**63), 2**63 - 1, 0]  # wrap around in the differences
    end = start + rng.integers(-5, 10**6, n)
    end[rng.integers(0, n, 2)] = [2**63 - 1, -(2**63)]
    depth = rng.integers(-3, 9, n)  # not what the tree says: stored as the difference
    depth[:2] = [2**31 - 1, -(2**31)]
    return pa.table({
        "node_id": pa.array([r[0] for r in rows], pa.int64()),
        "parent_id": pa.array([r[1] for r in rows], pa.int64()),
        "name": pa.DictionaryArray.from_arrays(  # unused and null dictionary entries, a null code
            pa.array([[None, "STEP", "aten::mm", "cudaLaunchKernel", "gemm", "cudaMalloc"].index(r[2]) + 2
                      for r in rows[:-1]] + [None], pa.int32()),
            pa.array(["unused", None, None, "STEP", "aten::mm", "cudaLaunchKernel", "gemm", "cudaMalloc", "x"])),
        "kind": pa.array([r[3] for r in rows]).dictionary_encode(),
        "start_ns": pa.array(start, pa.int64()),
        "end_ns": pa.array(end, pa.int64()),
        "corr_id": pa.array([r[4] for r in rows], pa.int64()),
        "depth": pa.array(depth, pa.int32()),
        "size": pa.array(rng.integers(0, 4, n), pa.int64()),
        "args": pa.array([None if i % 3 else f'{{"i": {i % 7}}}' for i in range(n)], pa.string()),
        "run_id": pa.array(["a"] * (n // 2) + ["b"] * (n - n // 2)).dictionary_encode(),
    })


def test_every_transform_is_exact_on_odd_values_and_steps_cut_by_parts(tmp_path):
    t = _steps(7, np.random.default_rng(3))
    write_subtrees(t, tmp_path / "s.parquet")
    back = read_subtrees(tmp_path / "s.parquet")
    _same(back, t)
    # a forest from reconstruction: depth and size as the tree says, kernels under their launch
    from teller.dataset.codec import _parents, _tree_size

    p = _parents(t.column("node_id").to_numpy(), t.column("parent_id").to_numpy())
    tree = t.set_column(t.schema.get_field_index("size"), "size", pa.array(_tree_size(p)))
    write_subtrees(tree, tmp_path / "t.parquet")
    stored = pq.read_table(tmp_path / "t.parquet")
    assert set(stored.column("size").to_pylist()) == {0}  # nothing but the differences from the tree
    # kernels take their launch's id, ops without one their step's (none): 6 of the 13 rows of a step
    assert stored.column("corr_id").null_count == 7 * 3 * 2
    _same(read_subtrees(tmp_path / "t.parquet"), tree)
    # parts of 10 rows cut steps of 13 rows: every part holds steps in part
    write_subtree_parts(t, tmp_path / "ds" / "subtrees", part_rows=10)
    _same(read_subtrees(tmp_path / "ds"), t)


def test_parts_are_cut_at_step_boundaries_where_they_can_be(tmp_path):
    t = pa.table({"node_id": pa.array(range(7), pa.int64()),
                  "parent_id": pa.array([-1, 0, -1, 2, -1, 4, 4], pa.int64()),
                  "start_ns": pa.array([0, 1, 10, 11, 20, 21, 22], pa.int64()),
                  "end_ns": pa.array([5, 2, 15, 12, 25, 22, 23], pa.int64())})
    parts = write_subtree_parts(t, tmp_path / "a", part_rows=3)
    assert [pq.read_metadata(p).num_rows for p in parts] == [2, 2, 3]
    parts = write_subtree_parts(t.slice(4), tmp_path / "b", part_rows=2)  # one step longer than a part
    assert [pq.read_metadata(p).num_rows for p in parts] == [2, 1]
    _same(read_subtrees(tmp_path / "b"), t.slice(4))


def test_recode_rewrites_a_v1_dataset_and_checks_it(tmp_path):
    from teller.cli import app

    src = tmp_path / "v1"
    (src / "subtrees").mkdir(parents=True)
    shutil.copy(V1_FILE, src / "subtrees" / "part-00000.parquet")
    (src / "datasheet.json").write_text("{}")
    dst = tmp_path / "v2"
    res = CliRunner().invoke(app, ["dataset", "recode", str(src), "-o", str(dst)])
    assert res.exit_code == 0, res.output
    assert "recoded" in res.output and "smaller" in res.output
    assert (dst / "datasheet.json").read_text() == "{}"
    parts = sorted((dst / "subtrees").glob("part-*.parquet"))
    assert [codec_of(p) for p in parts] == [CODEC]
    assert differing_columns(read_subtrees(src), read_subtrees(dst)) == []
    assert parts[0].stat().st_size < 0.75 * (src / "subtrees" / "part-00000.parquet").stat().st_size
    with pytest.raises(InputError, match="is the source dataset"):
        recode_dataset(src, src)
    with pytest.raises(InputError, match="no subtrees/ folder"):
        recode_dataset(tmp_path / "nothing", tmp_path / "x")


def test_a_plain_parquet_file_is_refused_with_the_fix(tmp_path):
    pq.write_table(pa.table({"node_id": [0]}), tmp_path / "subtrees.parquet")
    with pytest.raises(InputError, match="not a TELLER subtree file.*teller dataset build"):
        read_subtrees(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        read_subtrees(tmp_path / "missing")
    with pytest.raises(InputError, match="codec 'none'"):
        decode(pq.read_table(tmp_path / "subtrees.parquet"), "x")
