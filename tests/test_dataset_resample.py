"""`teller dataset resample`: a dataset built with every step, thinned, is exactly the dataset that
`teller dataset build` with that step sampling writes over the same runs (records, subtrees, the
side tables and the datasheet), and a dataset already sampled is refused.

The runs are the bundled recordings (examples/): the CPU loop stall (abnormal steps in a window,
schedule/update ranges and GAP rows in its iterations), its fault-free run, and the two-rank
tensor-parallel straggler (horizontal records, communication edges).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from teller.dataset.build import build_dataset
from teller.dataset.codec import differing_columns, read_subtrees
from teller.dataset.resample import resample_dataset
from teller.errors import TellerError
from tests.test_dataset_merge import _assert_same_table

EX = Path(__file__).resolve().parents[1] / "examples"
RUNS = ["cpu_loop_stall", "cpu_normal", "h200_tp_straggler"]


def _decoded(t: pa.Table) -> pa.Table:
    """Dictionary columns as their values: which unused entries a dictionary carries is not data."""
    return pa.table({c: t.column(c).cast(t.column(c).type.value_type) if pa.types.is_dictionary(t.column(c).type) else t.column(c)
                     for c in t.column_names})


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    from teller.inject.labels import label_run
    from teller.logs import align_run
    from teller.reconstruct import reconstruct

    d = tmp_path_factory.mktemp("resample")
    for name in RUNS:
        shutil.copytree(EX / name, d / "runs" / name)
        reconstruct(d / "runs" / name)
        align_run(d / "runs" / name)
        label_run(d / "runs" / name, json.loads((d / "runs" / name / "labels.json").read_text()))
    runs = [d / "runs" / n for n in RUNS]
    out = {"runs": d / "runs"}
    for key, kw in [("all", {}), ("k3", {"normal_every": 3}), ("m20", {"max_normal": 20}), ("both", {"normal_every": 2, "max_normal": 25})]:
        out[key] = d / key / "ds"  # one folder name: the datasheet.md title is the folder's name
        build_dataset(runs, out[key], **kw)
    return out


@pytest.mark.parametrize(("key", "kw"), [("k3", {"normal_every": 3}), ("m20", {"max_normal": 20}),
                                         ("both", {"normal_every": 2, "max_normal": 25})])
def test_resample_equals_a_build_with_that_sampling(built, tmp_path, key, kw):
    want, got = built[key], tmp_path / "x" / "ds"
    sheet = resample_dataset(built["all"], got, **kw)
    _assert_same_table(pq.read_table(want / "records.parquet"), pq.read_table(got / "records.parquet"), "records")
    for name in ("logs", "comm_edges", "iterations"):
        _assert_same_table(_decoded(pq.read_table(want / f"{name}.parquet")), _decoded(pq.read_table(got / f"{name}.parquet")), name)
    a, b = read_subtrees(want), read_subtrees(got)
    assert a.num_rows == b.num_rows > 0 and differing_columns(a, b) == []
    for name in ("datasheet.json", "datasheet.md"):
        assert (want / name).read_text() == (got / name).read_text(), name
    # not vacuous: steps were dropped, rows of iterations outside the STEP blocks are kept, both views remain
    whole = json.loads((built["all"] / "datasheet.json").read_text())
    assert sheet["steps"] < whole["steps"] and sheet["abnormal_steps"] == whole["abnormal_steps"] > 0
    assert set(sheet["by_view"]) == {"vertical", "horizontal"}
    assert "GAP" in set(b.column("layer").cast("string").to_pylist())
    kept = np.asarray(b.column("step_id").to_numpy(zero_copy_only=False))
    steps = set(pq.read_table(got / "records.parquet", columns=["step_id"]).column("step_id").to_pylist())
    assert not set(kept[kept >= 0].tolist()) - steps - {-1}


def test_resample_refuses_a_sampled_dataset_and_no_sampling(built, tmp_path):
    with pytest.raises(TellerError, match=r"m20/ds/datasheet.json: already sampled: run 'ex-loop-stall-r0' kept \d+ of its \d+ steps .* resample a dataset that kept every step"):
        resample_dataset(built["m20"], tmp_path / "o", max_normal=10)
    # a sampling that kept every step (a stride of 1 everywhere) resamples like no sampling
    loose = tmp_path / "loose" / "ds"
    build_dataset([built["runs"] / n for n in RUNS], loose, max_normal=100_000)
    resample_dataset(loose, tmp_path / "r" / "ds", max_normal=20)
    assert (tmp_path / "r" / "ds" / "datasheet.json").read_text() == (built["m20"] / "datasheet.json").read_text()
    with pytest.raises(TellerError, match="no sampling asked for"):
        resample_dataset(built["all"], tmp_path / "o")
    with pytest.raises(TellerError, match="is the dataset"):
        resample_dataset(built["all"], built["all"], max_normal=5)
    assert not (tmp_path / "o").exists()


def test_resample_command(built, tmp_path, capsys):
    from teller.cli import main

    out = tmp_path / "r"
    assert main(["dataset", "resample", str(built["all"]), "-o", str(out), "--max-normal", "20"]) == 0
    assert "resampled" in capsys.readouterr().err
    assert (out / "datasheet.json").read_text().replace(str(out), "") == (built["m20"] / "datasheet.json").read_text()
    assert main(["dataset", "resample", str(built["all"]), "-o", str(out), "--max-normal", "20"]) == 2
    assert "already exists" in capsys.readouterr().err
