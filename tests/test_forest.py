"""The one forest model (teller/forest.py) on a real reconstructed forest, against plain Python."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from teller.errors import TellerError
from teller.forest import FOREST_SCHEMA, Forest, family_name, ranges
from teller.rundir import EVENT_SCHEMA, GPU_KINDS, KINDS, LAYERS, RunDir

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "h200_faulty_op_delay"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from teller.reconstruct import reconstruct

    if not EXAMPLE.is_dir():
        pytest.skip("examples/h200_faulty_op_delay not present")
    out = tmp_path_factory.mktemp("forest") / "run"
    shutil.copytree(EXAMPLE, out)
    reconstruct(out)
    return out


@pytest.fixture(scope="module")
def table(run) -> pa.Table:
    return RunDir(run).read_table("forest")


def _reference(table: pa.Table) -> dict[str, list]:
    """Parents, depths, sizes, GPU rows, self times and subtree GPU time by walking Python lists."""
    d = table.select(["node_id", "parent_id", "kind", "tid", "device", "start_ns", "end_ns"]).to_pydict()
    row = {nid: r for r, nid in enumerate(d["node_id"])}
    n = len(row)
    parent = [row.get(p, -1) if p >= 0 else -1 for p in d["parent_id"]]
    kids: list[list[int]] = [[] for _ in range(n)]
    for r, p in enumerate(parent):
        if p >= 0:
            kids[p].append(r)
    depth = []
    for r in range(n):
        k, p = 0, parent[r]
        while p >= 0:
            k, p = k + 1, parent[p]
        depth.append(k)
    dur = [max(e - s, 0) for s, e in zip(d["start_ns"], d["end_ns"], strict=True)]
    work = [k in GPU_KINDS for k in d["kind"]]
    gpu = [w or (t < 0 and (dev >= 0 or k == "SYNC")) for w, t, dev, k in zip(work, d["tid"], d["device"], d["kind"], strict=True)]
    self_ns = [max(dur[r] - sum(dur[c] for c in kids[r] if not gpu[c]), 0) for r in range(n)]

    def subtree(r: int) -> list[int]:
        out, stack = [], [r]
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(kids[x])
        return out

    return {"parent": parent, "depth": depth, "gpu": gpu, "self": self_ns, "kids": kids, "dur": dur, "work": work,
            "subtree": subtree}


def test_schema_is_the_event_schema_plus_the_forest_columns(table):
    assert table.schema.remove_metadata().equals(FOREST_SCHEMA)
    for f in FOREST_SCHEMA:
        if f.name in EVENT_SCHEMA.names:
            assert EVENT_SCHEMA.field(f.name).type == f.type
    assert set(FOREST_SCHEMA.names) - set(EVENT_SCHEMA.names) == {"node_id", "parent_id", "step_id", "step_idx", "depth", "size"}


def test_structure_and_times_match_a_python_walk(run, table):
    f = Forest.read(run)
    ref = _reference(table)
    assert f.n == table.num_rows > 1000
    assert f.preorder
    assert f.parent.tolist() == ref["parent"]
    assert f.depth.tolist() == ref["depth"]
    assert f.is_gpu.tolist() == ref["gpu"]
    assert f.is_gpu.sum() > f.is_gpu_work.sum() > 0  # the forest has sync records without a thread
    assert f.self_ns.tolist() == ref["self"]
    rng = np.random.default_rng(0)
    sample = rng.choice(f.n, 300, replace=False)
    gpu_ns = np.where(f.is_gpu_work, f.dur_ns, 0)
    sums = f.subtree_sums(gpu_ns)
    for r in sample.tolist():
        sub = ref["subtree"](r)
        assert f.size[r] == len(sub)
        assert sorted(sub) == list(range(r, r + len(sub)))  # depth-first layout
        assert sums[r] == sum(ref["dur"][x] for x in sub if ref["work"][x])
        assert f.children(r).tolist() == sorted(ref["kids"][r], key=lambda c: (f.start[c], c))
    steps = np.flatnonzero(f.layer == LAYERS.index("STEP"))
    assert len(steps) and (f.step_id[steps] == f.node_id[steps]).all()
    # the host self times of a step add up to its span (no nested interval counted twice)
    s = int(steps[len(steps) // 2])
    rows = np.arange(s, s + f.size[s])
    assert f.self_ns[rows][~f.is_gpu[rows]].sum() == f.dur_ns[s]


def test_any_row_order_and_node_numbering_give_the_same_forest(run, table):
    f = Forest.read(run)
    rng = np.random.default_rng(1)
    perm = rng.permutation(table.num_rows)
    shuffled = table.take(pa.array(perm)).drop_columns(["depth", "size"])
    shuffled = shuffled.set_column(0, "node_id", pa.array(table.column("node_id").to_numpy()[perm] * 3 + 7))
    par = shuffled.column("parent_id").to_numpy()
    shuffled = shuffled.set_column(1, "parent_id", pa.array(np.where(par >= 0, par * 3 + 7, -1)))
    g = Forest.from_table(shuffled)
    assert not g.preorder
    assert (np.where(g.parent >= 0, perm[np.maximum(g.parent, 0)], -1) == f.parent[perm]).all()
    assert (g.depth == f.depth[perm]).all() and (g.size == f.size[perm]).all()
    assert (g.self_ns == f.self_ns[perm]).all()
    v = np.where(f.is_gpu_work, f.dur_ns, 0)
    assert (g.subtree_sums(v[perm]) == f.subtree_sums(v)[perm]).all()
    # sums over a sparse mask for a few rows, preorder layout or not
    mask = f.is_gpu_work & (rng.random(f.n) < 0.3)
    few = rng.choice(f.n, 40, replace=False)
    want = f.subtree_sums(np.where(mask, f.dur_ns, 0), few)
    assert (f.subtree_sums_sparse(mask, f.dur_ns, few) == want).all()
    assert (g.subtree_sums_sparse(mask[perm], f.dur_ns[perm], np.argsort(perm)[few]) == want).all()
    assert (f.subtree_sums_sparse(mask, None, few) == f.subtree_sums(mask, few)).all()
    assert g.rows_of(f.node_id[perm[:50]] * 3 + 7).tolist() == list(range(50))
    assert g.rows_of([5]).tolist() == [-1]  # 5 is no node id here
    assert [g.families[c] for c in g.family] == [f.families[c] for c in f.family[perm]]


def test_families_one_encoding(run):
    f = Forest.read(run, columns=[])
    assert family_name("COMM", "all_reduce bytes=8192 group=tp seq=3") == "COMM all_reduce"
    assert family_name("FE", "model.layers.3.mlp") == "FE model.layers.#.mlp"
    assert f.families == sorted(f.families)
    r = int(np.flatnonzero(f.layer == LAYERS.index("FE"))[0])
    assert f.families[f.family[r]] == family_name("FE", f.name(r))
    codes, table = f.pair_map(lambda layers, names: [lay for lay in layers])
    assert table == sorted({LAYERS[x] for x in f.layer.tolist()}) and table[codes[r]] == "FE"


def test_columns_are_read_on_demand(run):
    f = Forest.read(run, columns=["kind"])
    assert "tid" not in f.table.column_names and "kind" in f.table.column_names
    assert (f.tid == -1).all()  # absent columns read as -1
    assert KINDS[int(f.kind[f.is_gpu_work][0])] in GPU_KINDS


def test_missing_or_damaged_forest_is_a_clear_error(run, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(run / "events", bare / "events")
    with pytest.raises(TellerError, match=r"forest\.parquet: missing; run `teller reconstruct"):
        Forest.read(bare)
    (bare / "forest.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(TellerError, match=r"forest\.parquet: unreadable Parquet .*re-run `teller reconstruct"):
        Forest.read(bare)
    with pytest.raises(TellerError, match="no such run directory"):
        Forest.read(tmp_path / "nowhere")
    with pytest.raises(TellerError, match=r"lacks columns \['name', 'parent_id'\]"):
        Forest.from_table(pq.read_table(run / "forest.parquet").drop_columns(["parent_id", "size", "name"]))


def test_sizes_alone_give_the_parents_of_a_depth_first_layout(run, table):
    f = Forest.read(run)
    g = Forest.from_table(table.select(["layer", "name", "start_ns", "end_ns", "size", "kind"]))
    assert (g.parent == f.parent).all() and (g.depth == f.depth).all() and g.preorder
    assert (g.node_id == np.arange(f.n)).all()


def test_a_parent_cycle_is_an_error():
    t = pa.table({"node_id": [0, 1, 2], "parent_id": [-1, 2, 1], "layer": ["FE"] * 3, "name": ["a", "b", "c"],
                  "start_ns": [0, 1, 2], "end_ns": [10, 5, 4]})
    with pytest.raises(TellerError, match="its own ancestor"):
        _ = Forest.from_table(t).depth


def test_ranges():
    assert ranges(np.array([3, 10, 0]), np.array([5, 10, 2])).tolist() == [3, 4, 0, 1]
    assert ranges(np.zeros(0), np.zeros(0)).tolist() == []
