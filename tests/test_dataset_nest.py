"""`teller dataset nest`: the mechanism split's training part as a dataset of its own, with one
more mechanism per category held out as its test part.

The dataset is built by hand (records of three runs, five categories with one to four mechanisms,
windows without effect naming their mechanism and no category) and split with the dataset's own
rule (:func:`teller.dataset.splits.split_table`), so the held-out mechanisms are the ones a build
draws.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from teller.baselines.steps import TEST, TRAIN, VAL, load_steps, split_masks
from teller.cli import app
from teller.dataset.datasheet import write_datasheet
from teller.dataset.nest import inner_held_out, nest_dataset
from teller.dataset.splits import split_table
from teller.errors import InputError, TellerError

CATS = {"communication": ["link_throttle", "straggler_rank", "throttled_collective"], "kernel": ["targeted_op_delay"],
        "memory": ["gpu_membw_hog", "host_cpu_contention"], "runtime": ["allocator_churn", "hidden_host_sync", "pageable_copies"],
        "scheduling": ["delayed_admission", "gil_contention", "loop_stall", "scheduler_stall"]}


def _dataset(d: Path, cats: dict[str, list[str]] = CATS) -> Path:
    """A dataset folder: per mechanism 6 abnormal steps and 2 in-window steps without effect (no
    category), and 60 normal steps, each one vertical record of its own request, over 3 runs."""
    rows: dict[str, list] = {k: [] for k in ("run_id", "request_id", "step_id", "step_ids", "step_num", "rank", "view",
                                             "is_anomaly", "in_window", "fault_type", "mechanism", "log_text",
                                             "operator_labels", "explanation")}
    sid = 0

    def add(run: str, ab: bool, win: bool, cat: str, mech: str) -> None:
        nonlocal sid
        for k, v in (("run_id", run), ("request_id", f"req_{sid}"), ("step_id", sid), ("step_ids", [sid]), ("step_num", sid),
                     ("rank", 0), ("view", "vertical"), ("is_anomaly", ab), ("in_window", win), ("fault_type", cat),
                     ("mechanism", mech), ("log_text", ""), ("operator_labels", ["op"] if ab else []),
                     ("explanation", "x" if ab else "")):
            rows[k].append(v)
        sid += 1

    for i, (cat, ms) in enumerate(sorted(cats.items())):
        for m in ms:
            for _ in range(6):
                add(f"run{i % 3}", True, True, cat, m)
            for _ in range(2):
                add(f"run{i % 3}", False, True, "", m)
    for j in range(60):
        add(f"run{j % 3}", False, False, "", "")
    t = pa.table(rows)
    t = t.append_column("record_id", pa.array(np.arange(t.num_rows, dtype=np.int64)))
    t, held = split_table(t, seed=0)
    d.mkdir(parents=True)
    pq.write_table(t, d / "records.parquet")
    pq.write_table(pa.table({"run_id": ["run0"], "text": ["a line"]}), d / "logs.parquet")
    (d / "subtrees").mkdir()
    pq.write_table(pa.table({"x": [1]}), d / "subtrees" / "part-00000.parquet")
    runs = [{"run_id": f"run{i}", "status": "ok", "steps": 100, "records": 0} for i in range(3)]
    write_datasheet(t, runs, d, seed=0, held_out=held)
    return d


def _col(t: pa.Table, c: str) -> np.ndarray:
    return np.asarray(t.column(c).cast(pa.string()).to_pylist(), dtype=object).astype(str)


def test_inner_held_out_takes_the_kth_mechanism_of_categories_with_two_or_more():
    mech = np.array(["b", "a", "c", "d", "e", "e", "", "f"])
    cat = np.array(["x", "x", "x", "y", "z", "z", "", ""])  # "f": a window without effect, no category
    assert inner_held_out(mech, cat, 0) == ["a"]
    assert inner_held_out(mech, cat, 1) == ["b"]
    assert inner_held_out(mech, cat, 2) == ["c"]
    assert inner_held_out(mech, cat, 3) == []
    with pytest.raises(TellerError, match="--fold -1"):
        inner_held_out(mech, cat, -1)


def test_nest_leaves_the_held_out_mechanisms_out_and_holds_one_more_out_per_category(tmp_path):
    src = _dataset(tmp_path / "src")
    outer = json.loads((src / "datasheet.json").read_text())["held_out_mechanisms"]
    assert len(outer) == 4  # every category with two or more mechanisms (kernel has one)
    got = {}
    for fold in (0, 1):
        out = tmp_path / f"nest{fold}"
        sheet = nest_dataset(src, out, fold=fold)
        a, b = pq.read_table(src / "records.parquet"), pq.read_table(out / "records.parquet")
        a_part, b_part, b_mech = _col(a, "split_mechanism"), _col(b, "split_mechanism"), _col(b, "mechanism")
        # the held-out mechanisms' records (windows without effect included) are left out, no other
        assert not np.isin(b_mech, outer).any()
        kept_ids = a.column("record_id").to_numpy()[a_part != "test"]
        assert np.array_equal(b.column("record_id").to_numpy(), kept_ids)
        assert sheet["nested"]["records_left_out"] == int((a_part == "test").sum())
        # the fold's mechanism of every category with two or more left is test, nothing else
        left = {c: sorted(set(ms) - set(outer)) for c, ms in CATS.items()}
        want = sorted(ms[fold] for ms in left.values() if len(ms) >= 2 and fold < len(ms))
        assert sheet["held_out_mechanisms"] == want == json.loads((out / "datasheet.json").read_text())["held_out_mechanisms"]
        assert set(b_mech[b_part == "test"]) == set(want)
        assert (b_part[np.isin(b_mech, want)] == "test").all()
        # every other record keeps its part
        rest = ~np.isin(b_mech, want)
        assert np.array_equal(b_part[rest], a_part[a_part != "test"][rest])
        assert sheet["nested"]["outer_held_out_mechanisms"] == sorted(outer) and sheet["nested"]["fold"] == fold
        run_ids = _col(b, "run_id")
        assert {r["run_id"]: r["records"] for r in sheet["runs"]} == {r: int((run_ids == r).sum()) for r in ("run0", "run1", "run2")}
        # side tables and subtrees are the source's
        assert pq.read_table(out / "logs.parquet").equals(pq.read_table(src / "logs.parquet"))
        assert (out / "subtrees" / "part-00000.parquet").is_file()
        got[fold] = want
        # the steps a scorer reads: the test part holds the fold's mechanisms' steps only
        steps = load_steps(out, "vertical")
        train, test, _ = split_masks(steps, "mechanism")
        assert set(steps.mechanism[test]) == set(want)
        assert not set(steps.mechanism[train]) & set(want)
        assert set(np.unique(steps.split["split_mechanism"])) <= {TRAIN, VAL, TEST}
    assert not set(got[0]) & set(got[1])


def test_nest_refuses_what_it_cannot_nest(tmp_path):
    src = _dataset(tmp_path / "src")
    with pytest.raises(TellerError, match="fold 3 holds out no mechanism"):
        nest_dataset(src, tmp_path / "n3", fold=3)
    one = _dataset(tmp_path / "one", {"kernel": ["targeted_op_delay"], "memory": ["gpu_membw_hog"]})
    with pytest.raises(InputError, match="holds no mechanism out"):
        nest_dataset(one, tmp_path / "n", fold=0)
    with pytest.raises(InputError):
        nest_dataset(src, src / "inside", fold=0)


def test_cli_nest(tmp_path):
    src = _dataset(tmp_path / "src")
    out = tmp_path / "nested"
    r = CliRunner().invoke(app, ["dataset", "nest", str(src), "-o", str(out), "--fold", "1"])
    assert r.exit_code == 0, r.output
    assert "held out now" in r.output
    assert json.loads((out / "datasheet.json").read_text())["nested"]["fold"] == 1
    r = CliRunner().invoke(app, ["dataset", "nest", str(src), "-o", str(out), "--fold", "0"])
    assert r.exit_code != 0 and "already exists" in str(r.exception)
    r = CliRunner().invoke(app, ["dataset", "nest", str(src), "-o", str(out), "--fold", "0", "--force"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "datasheet.json").read_text())["nested"]["fold"] == 0
