"""Compact subtree storage: exact round trip on real forests, edge cases, and a clear error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from teller.dataset.codec import read_subtrees, write_subtree_parts, write_subtrees
from teller.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


def _same(a: pa.Table, b: pa.Table) -> None:
    assert a.schema.remove_metadata().equals(b.schema.remove_metadata())
    for c in a.column_names:
        assert a.column(c).to_pylist() == b.column(c).to_pylist(), c


def test_round_trip_on_a_real_h200_forest_is_exact_and_smaller(tmp_path):
    from teller.reconstruct import reconstruct

    run = tmp_path / "run"
    shutil.copytree(ROOT / "examples" / "h200_llama8l_cupti", run)
    reconstruct(run)
    forest = pq.read_table(run / "forest.parquet")
    forest = forest.append_column("run_id", pa.array(["r"] * forest.num_rows).dictionary_encode())
    out = tmp_path / "subtrees.parquet"
    write_subtrees(forest, out)
    _same(read_subtrees(out), forest)
    plain = tmp_path / "plain.parquet"
    pq.write_table(forest, plain, compression="zstd")
    assert out.stat().st_size < 0.8 * plain.stat().st_size


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


def test_a_plain_parquet_file_is_refused_with_the_fix(tmp_path):
    pq.write_table(pa.table({"node_id": [0]}), tmp_path / "subtrees.parquet")
    with pytest.raises(InputError, match="not a TELLER subtree file.*teller dataset build"):
        read_subtrees(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        read_subtrees(tmp_path / "missing")
