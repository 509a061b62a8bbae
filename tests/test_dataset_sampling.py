"""Step sampling of the dataset builder: abnormal step numbers stay, whole step numbers are kept."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from teller.dataset.build import build_dataset, sample_steps
from teller.errors import TellerError


def _pairs(n_steps: int, ranks: int, abnormal: dict[int, int]) -> pa.Table:
    """(request, step) rows: 3 requests per step on every rank; ``abnormal`` maps step → rank."""
    num = np.repeat(np.arange(n_steps), 3 * ranks)
    rank = np.tile(np.repeat(np.arange(ranks), 3), n_steps)
    ab = np.array([abnormal.get(int(s)) == int(r) for s, r in zip(num, rank, strict=True)])
    return pa.table({"step_num": num, "rank": rank, "is_anomaly": ab})


def test_every_kth_step_number_and_every_abnormal_one_on_all_ranks():
    v = _pairs(100, 2, {7: 1, 51: 0})
    keep = sample_steps(v, 10)
    kept = np.unique(v.column("step_num").to_numpy()[keep])
    assert kept.tolist() == sorted(set(range(0, 100, 10)) | {7, 51})
    # a kept step number keeps both ranks and all its requests (horizontal records stay whole)
    num = v.column("step_num").to_numpy()
    assert keep[num == 7].all() and keep[num == 51].all() and keep.sum() == len(kept) * 6
    assert sample_steps(v, 1).all()


def test_max_normal_widens_the_stride_for_long_runs():
    v = _pairs(1000, 1, {3: 0})
    kept = np.unique(v.column("step_num").to_numpy()[sample_steps(v, 1, max_normal=50)])
    others = [k for k in kept if k != 3]
    assert 45 <= len(others) <= 50 and 3 in kept
    short = _pairs(40, 1, {})
    assert sample_steps(short, 1, max_normal=50).all()  # a short run keeps everything


def test_bad_sampling_arguments_name_the_option(tmp_path):
    with pytest.raises(TellerError, match="--normal-every 0"):
        build_dataset([tmp_path], tmp_path / "ds", normal_every=0)
    with pytest.raises(TellerError, match="--max-normal 0"):
        build_dataset([tmp_path], tmp_path / "ds", max_normal=0)


def test_attach_tpe_keeps_the_record_schema_and_refuses_bad_columns():
    from teller.dataset.build import TPE_FIELDS, attach_tpe

    n = 2
    records = pa.table({"record_id": pa.array([0, 1], pa.int64()),
                        **{f: pa.nulls(n, pa.list_(pa.int64() if f == "duration" else pa.int32())) for f in TPE_FIELDS}})

    def encode(recs, subtrees):  # int64 ids everywhere: cast to the records' types
        return pa.table({f: pa.array([[1, 2], [3]], pa.list_(pa.int64())) for f in TPE_FIELDS})

    out = attach_tpe(records, pa.table({}), encode)
    assert out.schema == records.schema and out.column("input_ids").to_pylist() == [[1, 2], [3]]
    with pytest.raises(TellerError, match="'depth' missing"):
        attach_tpe(records, pa.table({}), lambda r, s: pa.table({f: encode(r, s).column(f) for f in TPE_FIELDS[:3]}))
