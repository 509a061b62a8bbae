"""The committed H200 dataset (data/h200_v2) and the committed raw faulty runs (examples/).

The raw runs (``examples/h200_faulty_op_delay``, ``examples/h200_tp_straggler``: events, logs, the
fault agents' windows) are reconstructed, aligned, labelled and built into a dataset here with the
sampling rule of data/h200_v2; that dataset must be in v2's format (the same files, columns, types
and subtree codec) and labelled as the faults say. data/h200_v2 itself must agree with its own
datasheet: every count in ``datasheet.json`` is recomputed from ``records.parquet``, the subtrees
and ``iterations.parquet``, the splits are disjoint, every abnormal record is labelled.
(The raw runs were part of data/h200_v1, which is in git history: ``git checkout 644acca -- data/h200_v1``.)
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from teller.dataset.splits import SPLIT_COLUMNS as SPLIT_COLS

ROOT = Path(__file__).resolve().parents[1]
DS = ROOT / "data" / "h200_v2"
DS_TP = ROOT / "data" / "h200_v2_tp"  # part 3: tensor-parallel runs, joined to DS by `teller dataset merge`
DS_LINK = ROOT / "data" / "h200_v2_link"  # part 4: the link between tensor-parallel ranks throttled
EXAMPLES = {"ex-op-delay-r0": ROOT / "examples" / "h200_faulty_op_delay",
            "ex-straggler-tp-r0": ROOT / "examples" / "h200_tp_straggler"}
TABLES = ("records.parquet", "logs.parquet", "comm_edges.parquet", "iterations.parquet")


def _str(t: pa.Table, c: str) -> np.ndarray:
    return np.asarray(t.column(c).cast(pa.string()).to_pylist(), dtype=object)


def _sheet_counts(records: pa.Table) -> dict:
    """The datasheet's record and step counts, recomputed from the records alone."""
    ab = records.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    splits = [c for c in SPLIT_COLS if c in records.column_names]  # split_workload: datasets of two or more shapes
    cols = {c: _str(records, c) for c in ("view", "fault_type", "mechanism", "run_id", "request_id", *splits)}
    cnt = lambda x: dict(sorted(Counter(x.tolist()).items()))  # noqa: E731
    out = {"records": records.num_rows, "abnormal": int(ab.sum()), "by_view": cnt(cols["view"]),
           "abnormal_by_category": cnt(cols["fault_type"][ab]), "abnormal_by_mechanism": cnt(cols["mechanism"][ab]),
           "by_split": {s: cnt(cols[s]) for s in splits}, "abnormal_by_split": {s: cnt(cols[s][ab]) for s in splits},
           "requests": len(set(zip(cols["run_id"].tolist(), cols["request_id"].tolist(), strict=True))),
           "in_window_without_effect": int((records.column("in_window").to_numpy(zero_copy_only=False) & ~ab).sum())}
    vert = cols["view"] == "vertical"
    sid = records.column("step_id").to_numpy()
    steps: dict[tuple[str, int], int] = {}  # (run, step id) -> index of its first vertical record
    for i in np.flatnonzero(vert):
        steps.setdefault((cols["run_id"][i], int(sid[i])), int(i))
    first = np.fromiter(steps.values(), np.int64)
    sab = ab[first]
    out.update(steps=len(first), abnormal_steps=int(sab.sum()),
               abnormal_steps_by_category=cnt(cols["fault_type"][first][sab]),
               abnormal_steps_by_mechanism=cnt(cols["mechanism"][first][sab]))
    out["steps_kept_by_run"] = dict(Counter(r for r, _ in steps))
    out["records_by_run"] = dict(Counter(cols["run_id"].tolist()))
    out["step_keys"] = set(steps)
    return out


def _stored_steps(ds: Path) -> tuple[set[tuple[str, int]], set[str]]:
    """(run, step id) of every STEP row in ``ds``'s subtrees, and the runs they hold, from the stored
    columns: the current format keeps ``run_id`` and ``step_id`` as they are and ``layer`` as codes
    into ``layer.values`` (decoding every row's times is the codec tests' work)."""
    from teller.dataset.codec import CODEC

    keys: set[tuple[str, int]] = set()
    runs: set[str] = set()
    for part in sorted((ds / "subtrees").glob("part-*.parquet")):
        meta = pq.read_schema(part).metadata
        assert meta[b"teller.codec"].decode() == CODEC, part
        assert not {"run_id", "step_id"} & set(json.loads(meta[b"teller.transforms"])), part
        t = pq.read_table(part, columns=["run_id", "step_id", "layer", "layer.values"])
        values = t.column("layer.values").to_pylist()
        if "STEP" in values:  # a part may hold the inside of one long step only
            st = t.filter(pc.equal(t.column("layer"), values.index("STEP")))
            keys |= set(zip(_str(st, "run_id").tolist(), st.column("step_id").to_pylist(), strict=True))
        runs |= set(pc.unique(t.column("run_id").cast(pa.string())).to_pylist())
    return keys, runs


def _check_consistent(ds: Path, records: pa.Table) -> dict:
    """Assert that ``ds``'s datasheet matches its files; returns the datasheet."""
    sheet = json.loads((ds / "datasheet.json").read_text())
    got = _sheet_counts(records)
    for k in ("records", "abnormal", "by_view", "abnormal_by_category", "abnormal_by_mechanism", "by_split",
              "abnormal_by_split", "requests", "in_window_without_effect", "steps", "abnormal_steps",
              "abnormal_steps_by_category", "abnormal_steps_by_mechanism"):
        assert sheet[k] == got[k], k
    assert sheet["fault_prior"] == pytest.approx(got["abnormal"] / got["records"])
    na = got["abnormal_steps"]
    assert sheet["category_share_of_abnormal_steps"] == pytest.approx(
        {k: v / na for k, v in got["abnormal_steps_by_category"].items()})
    runs = {r["run_id"]: r for r in sheet["runs"]}
    assert len(runs) == len(sheet["runs"])
    kept = {r: x for r, x in runs.items() if x["status"] != "skipped"}
    assert {r: x["records"] for r, x in kept.items()} == got["records_by_run"]
    assert {r: x["steps_kept"] for r, x in kept.items()} == got["steps_kept_by_run"]
    assert all(x["steps"] >= x["steps_kept"] for x in kept.values())
    assert sheet["steps_recorded"] == sum(x.get("steps", 0) for x in runs.values())
    # the subtrees hold the forest rows of exactly the kept steps (STEP rows carry their step id)
    have, runs_in = _stored_steps(ds)
    assert have == got["step_keys"] and runs_in == set(got["records_by_run"])
    # one iteration row per kept step
    it = pq.read_table(ds / "iterations.parquet", columns=["run_id", "step_id"])
    keys = list(zip(it.column("run_id").to_pylist(), it.column("step_id").to_pylist(), strict=True))
    assert len(keys) == len(set(keys)) and set(keys) == got["step_keys"]
    # communication edges: every record's rows lie inside comm_edges.parquet
    n_edges = pq.read_metadata(ds / "comm_edges.parquet").num_rows
    flat = pc.list_flatten(records.column("comm_edge_rows")).to_numpy()
    assert len(flat) > 0 and flat.min() >= 0 and flat.max() < n_edges
    return sheet


def _check_labels_and_splits(records: pa.Table, held_out: list[str]) -> None:
    from teller.inject.mechanisms import registry

    ab = records.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    ft, mech = _str(records, "fault_type"), _str(records, "mechanism")
    cat_of = {k: m.category for k, m in registry().items()}
    # every abnormal record names its category and mechanism, the pair the registry gives, operators
    # and an explanation; a normal record none of them (it may lie in a window without effect)
    assert ab.any() and all(cat_of[m] == c for m, c in zip(mech[ab].tolist(), ft[ab].tolist(), strict=True))
    assert (ft[~ab] == "").all()
    ops = records.column("operator_labels").to_pylist()
    expl = records.column("explanation").to_pylist()
    assert all(bool(o) == a for o, a in zip(ops, ab.tolist(), strict=True))
    assert all(bool(e) for e, a in zip(expl, ab.tolist(), strict=True) if a)
    assert records.column("in_window").to_numpy(zero_copy_only=False)[ab].all()
    # splits: a request in one part of split_request, a run in one part of split_run; the
    # mechanism split tests exactly the held-out mechanisms' records (none held out: it is the request split)
    run, req = _str(records, "run_id"), _str(records, "request_id")
    for col, key in (("split_request", np.char.add(np.char.add(run.astype(str), "\x1f"), req.astype(str))),
                     ("split_run", run.astype(str))):
        part = _str(records, col)
        assert set(part.tolist()) <= {"train", "val", "test"}
        per = {}
        for k, p in zip(key.tolist(), part.tolist(), strict=True):
            assert per.setdefault(k, p) == p, (col, k)
    sm, sr = _str(records, "split_mechanism"), _str(records, "split_request")
    if held_out:
        assert ((sm == "test") == np.isin(mech, held_out)).all()
        assert (sm[sm != "test"] == np.where(sr == "test", "train", sr)[sm != "test"]).all()
    else:
        assert (sm == sr).all()
    # one mechanism held out for every category with two or more mechanisms among the abnormal records
    multi = {c for c in set(ft[ab].tolist()) if len(set(mech[ab & (ft == c)].tolist())) >= 2}
    assert sorted(cat_of[m] for m in held_out) == sorted(multi)


@pytest.fixture(scope="module")
def committed() -> pa.Table:
    if not (DS / "records.parquet").is_file():
        pytest.fail(f"{DS}: the committed dataset is missing")
    return pq.read_table(DS / "records.parquet")


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    """The two raw example runs reconstructed, aligned, labelled and built with v2's sampling."""
    from teller.dataset.build import build_dataset
    from teller.inject.labels import label_run
    from teller.logs import align_run
    from teller.reconstruct import reconstruct

    tmp = tmp_path_factory.mktemp("h200_examples")
    runs = []
    for run_id, src in EXAMPLES.items():
        run = tmp / run_id  # the run directory's name is part of the records' provenance
        shutil.copytree(src, run)
        reconstruct(run)
        align_run(run)
        label_run(run, json.loads((run / "labels.json").read_text()))
        runs.append(run)
    sampling = json.loads((DS / "datasheet.json").read_text())["sampling"]
    build_dataset(runs, tmp / "ds", max_normal=sampling["max_normal"], normal_every=sampling["normal_every"])
    return tmp / "ds"


def test_raw_example_runs_build_a_dataset_in_the_format_of_v2(rebuilt):
    from teller.dataset.codec import CODEC, codec_of, read_subtrees

    assert {p.name for p in rebuilt.iterdir()} == {p.name for p in DS.iterdir()} - {"README.md"}  # the README is written by hand
    for name in TABLES:
        mine, theirs = pq.read_schema(rebuilt / name).remove_metadata(), pq.read_schema(DS / name).remove_metadata()
        if name == "records.parquet":  # v2 serves two model shapes, the examples one: no split_workload here
            assert "split_workload" not in mine.names and "workload" in mine.names
            theirs = theirs.remove(theirs.get_field_index("split_workload"))
        assert mine.equals(theirs), (name, mine, theirs)
    parts = sorted((rebuilt / "subtrees").glob("part-*.parquet"))
    assert parts and {codec_of(p) for p in parts} == {codec_of(p) for p in (DS / "subtrees").glob("part-*.parquet")} == {CODEC}
    sub = read_subtrees(rebuilt)
    assert sub.schema.remove_metadata().equals(read_subtrees(DS / "subtrees" / "part-00011.parquet").schema.remove_metadata())
    records = pq.read_table(rebuilt / "records.parquet")
    ours = json.loads((DS / "datasheet.json").read_text())
    sheet = _check_consistent(rebuilt, records)
    assert sheet["sampling"] == ours["sampling"]
    assert set(sheet) == set(ours)
    _check_labels_and_splits(records, sheet["held_out_mechanisms"])
    # each faulty run has abnormal steps of its own fault, and only of it
    run, mech = _str(records, "run_id"), _str(records, "mechanism")
    ab = records.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    view = _str(records, "view")
    for run_id, want in (("ex-op-delay-r0", "targeted_op_delay"), ("ex-straggler-tp-r0", "straggler_rank")):
        m = run == run_id
        assert (m & ab).sum() > 0 and set(mech[m & ab].tolist()) == {want}
    # the tensor-parallel run gives horizontal records joining its two ranks' steps; the other run none
    tp = (run == "ex-straggler-tp-r0") & (view == "horizontal")
    assert tp.sum() > 100 and not ((run == "ex-op-delay-r0") & (view == "horizontal")).any()
    ranks = records.column("ranks").to_pylist()
    assert all(len(ranks[i]) == 2 for i in np.flatnonzero(tp)) and (tp & ab).any()


def test_v2_datasheet_counts_match_its_files(committed):
    sheet = _check_consistent(DS, committed)
    assert sheet["records"] >= 200_000 and sheet["steps"] >= 9_000 and sheet["steps_recorded"] > sheet["steps"]
    finished = [r for r in sheet["runs"] if r["status"] == "finished"]
    assert len(finished) >= 45
    assert any(r["status"] == "skipped" and r["skipped"] for r in sheet["runs"])  # netem, with its reason
    # every category is a tenth of the abnormal steps at least
    shares = sheet["category_share_of_abnormal_steps"]
    assert set(shares) == {"memory", "kernel", "runtime", "communication", "scheduling"}
    assert min(shares.values()) >= 0.10
    assert set(sheet["by_view"]) == {"vertical", "horizontal"}
    # normal runs are in, and every record of a normal run is normal
    normal = committed.filter(pc.starts_with(committed.column("run_id"), "normal-"))
    assert normal.num_rows > 0 and not pc.any(normal.column("is_anomaly")).as_py()


def test_v2_labels_are_complete_and_splits_disjoint(committed):
    sheet = json.loads((DS / "datasheet.json").read_text())
    assert sheet["held_out_mechanisms"]
    _check_labels_and_splits(committed, sheet["held_out_mechanisms"])
    for s in SPLIT_COLS:
        assert set(sheet["by_split"][s]) == {"train", "val", "test"}
    # the workload split tests exactly the held-out model shapes (v2: the 4-layer runs)
    wl, sw = _str(committed, "workload"), _str(committed, "split_workload")
    assert sheet["held_out_workloads"] == ["4 layers, hidden 1024"]
    assert ((sw == "test") == np.isin(wl, sheet["held_out_workloads"])).all()


def test_v2_tensor_parallel_part_is_consistent_and_covers_the_other_categories():
    """Part 3 agrees with its datasheet, its labels and splits are complete, it builds with the
    sampling of parts 1-2 (so the parts merge), and its horizontal steps are abnormal through the
    four categories besides communication, each on three runs or more."""
    records = pq.read_table(DS_TP / "records.parquet")
    sheet = _check_consistent(DS_TP, records)
    assert sheet["sampling"] == json.loads((DS / "datasheet.json").read_text())["sampling"]
    _check_labels_and_splits(records, sheet["held_out_mechanisms"])
    assert {r["status"] for r in sheet["runs"]} == {"finished"} and len(sheet["runs"]) == 14
    assert not set(_str(records, "run_id").tolist()) & set(_str(pq.read_table(DS / "records.parquet", columns=["run_id"]), "run_id").tolist())
    view, ab, ft, run = (_str(records, "view"), records.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool),
                         _str(records, "fault_type"), _str(records, "run_id"))
    h = (view == "horizontal") & ab
    assert set(ft[h].tolist()) == {"kernel", "memory", "runtime", "scheduling"}
    for cat in ("kernel", "memory", "scheduling"):
        assert len(set(run[h & (ft == cat)].tolist())) >= 3, cat
    # every horizontal record joins both ranks' steps
    ranks = records.column("ranks").to_pylist()
    assert all(len(ranks[i]) == 2 for i in np.flatnonzero(view == "horizontal"))


def test_v2_link_part_is_consistent_and_labels_the_link():
    """Part 4 agrees with its datasheet and samples as parts 1-3 (so the parts merge); its abnormal
    steps are link_throttle's, on both ranks, with `COMM all_reduce` as the operator, in every
    repetition, and the netem run is skipped with the kernel's reason."""
    records = pq.read_table(DS_LINK / "records.parquet")
    sheet = _check_consistent(DS_LINK, records)
    assert sheet["sampling"] == json.loads((DS / "datasheet.json").read_text())["sampling"]
    _check_labels_and_splits(records, sheet["held_out_mechanisms"])
    runs = {r["run_id"]: r for r in sheet["runs"]}
    assert runs["netem-b-r0"]["status"] == "skipped" and "netem" in runs["netem-b-r0"]["skipped"][0]["reason"]
    assert {r["status"] for k, r in runs.items() if k != "netem-b-r0"} == {"finished"}
    ab = records.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    run, mech, view = _str(records, "run_id"), _str(records, "mechanism"), _str(records, "view")
    assert set(mech[ab].tolist()) == {"link_throttle"}
    assert set(run[ab].tolist()) == {"link-throttle-a-r0", "link-throttle-b-r0", "link-throttle-c-r0"}
    assert {tuple(o) for o in np.asarray(records.column("operator_labels").to_pylist(), dtype=object)[ab]} == {("COMM all_reduce",)}
    rank = records.column("rank").to_numpy()
    assert set(rank[ab & (view == "vertical")].tolist()) == {0, 1} and (ab & (view == "horizontal")).any()
    assert not set(run.tolist()) & set(_str(pq.read_table(DS_TP / "records.parquet", columns=["run_id"]), "run_id").tolist())


def test_committed_data_stays_within_the_budget():
    """Committed datasets stay within their budget (v2 in four parts: 92 MiB), no file large."""
    files = [p for p in (ROOT / "data").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 95 * 2**20
    assert max(p.stat().st_size for p in files) <= 8 * 2**20
