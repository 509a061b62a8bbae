"""Causal-context slices on hand-built trees whose correct slice is known."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from teller.forest import Forest
from teller.slicing import SliceConfig, StepIndex, build_slice, comm_pairs_rows

_KIND = {"STEP": "RANGE", "FE": "RANGE", "BE": "RANGE", "COMM": "RANGE", "OTHER": "RANGE", "RT": "RUNTIME",
         "DRV": "DRIVER", "K": "KERNEL", "MEM": "MEMCPY", "SYNC": "SYNC"}


def N(layer, name, s, e, *children, stream=-1, rank=0):
    """A node; times given in µs."""
    return dict(layer=layer, name=name, s=s * 1000, e=e * 1000, children=list(children), stream=stream, rank=rank)


def build(roots):
    """(Forest, {name: row}) of nested specs in preorder; names must be unique."""
    rows = []

    def walk(nd, parent):
        i = len(rows)
        rows.append(dict(nd, parent=parent))
        for c in nd["children"]:
            walk(c, i)

    for r in roots:
        walk(r, -1)
    n = len(rows)
    gpu = [r["stream"] >= 0 for r in rows]
    t = pa.table({
        "node_id": pa.array(np.arange(n) + 1000),  # ids differ from rows on purpose
        "parent_id": pa.array([r["parent"] + 1000 if r["parent"] >= 0 else -1 for r in rows], pa.int64()),
        "layer": pa.array([r["layer"] for r in rows]).dictionary_encode(),
        "name": pa.array([r["name"] for r in rows]).dictionary_encode(),
        "start_ns": pa.array([r["s"] for r in rows], pa.int64()), "end_ns": pa.array([r["e"] for r in rows], pa.int64()),
        "node": pa.array([0] * n, pa.int32()), "rank": pa.array([r["rank"] for r in rows], pa.int32()),
        "pid": pa.array([10 + r["rank"] for r in rows], pa.int64()),
        "tid": pa.array([-1 if g else 1 for g in gpu], pa.int64()),
        "device": pa.array([0 if g else -1 for g in gpu], pa.int32()),
        "stream": pa.array([r["stream"] for r in rows], pa.int64()),
        "step_id": pa.array([-1] * n, pa.int64()),
        "kind": pa.array([_KIND[r["layer"]] for r in rows]).dictionary_encode(),
    })
    return Forest.from_table(t), {r["name"]: i for i, r in enumerate(rows)}


def tree():
    return [N("STEP", "step", 0, 1000,
              N("FE", "A", 10, 500,
                N("BE", "x", 20, 200,
                  N("RT", "launch1", 30, 50, N("K", "k1", 100, 160, stream=7)),
                  N("RT", "launch2", 60, 70, N("K", "k2", 150, 200, stream=8)),
                  N("DRV", "drv", 80, 90)),
                N("BE", "y", 250, 300, N("RT", "copy_call", 260, 280, N("MEM", "copy", 270, 290, stream=7))),
                N("BE", "far", 450, 490)),
              N("COMM", "allreduce", 600, 700, N("RT", "nccl_call", 610, 620, N("K", "nccl", 650, 690, stream=9))),
              N("FE", "B", 800, 900, N("BE", "z", 810, 890))),
            N("STEP", "step_r1", 0, 1000, N("COMM", "allreduce_r1", 620, 720), rank=1)]


def names_of(fa, rows, ix):
    inv = {v: k for k, v in ix.items()}
    return {inv[int(r)] for r in rows}


def step_rows(fa, ix, root="step"):
    r = ix[root]
    return np.arange(r, r + fa.size[r])


def test_slice_around_a_slow_op():
    fa, ix = build(tree())
    rows = step_rows(fa, ix)
    score = np.zeros(len(rows))
    score[rows == ix["x"]] = 1.0
    sl = build_slice(fa, rows, [ix["x"]], score)
    # x, its calls (0.64) and kernels (0.51), its close successor y (gap 50 < half of x's 180 ns),
    # and two ancestor hops; not the far sibling, not y's calls, not the other module or the collective
    assert names_of(fa, sl.rows, ix) == {"step", "A", "x", "launch1", "k1", "launch2", "k2", "drv", "y"}
    rel = dict(zip(names_of_list(fa, sl.rows, ix), sl.relevance, strict=True))
    assert rel["x"] == 1.8 and abs(rel["launch1"] - 0.64) < 1e-9 and abs(rel["k1"] - 0.512) < 1e-9
    assert abs(rel["y"] - 0.8 * np.exp(-50 / 180)) < 1e-9
    assert list(sl.suspect) == [n == "x" for n in names_of_list(fa, sl.rows, ix)]
    par = dict(zip(names_of_list(fa, sl.rows, ix), sl.parent, strict=True))
    assert par["y"] == ix["A"] and par["k1"] == ix["launch1"] and par["step"] == -1
    assert [tuple(e) for e in sl.edges_t.tolist()] == [(ix["x"], ix["y"])]
    assert {tuple(e) for e in sl.edges_p.tolist()} >= {(ix["A"], ix["x"]), (ix["x"], ix["launch1"])}


def names_of_list(fa, rows, ix):
    inv = {v: k for k, v in ix.items()}
    return [inv[int(r)] for r in rows]


def test_knobs_change_the_slice():
    fa, ix = build(tree())
    rows = step_rows(fa, ix)
    x = [ix["x"]]
    assert names_of(fa, build_slice(fa, rows, x, config=SliceConfig(hops=0)).rows, ix) == \
        {"x", "launch1", "k1", "launch2", "k2", "drv", "y"}
    assert names_of(fa, build_slice(fa, rows, x, config=SliceConfig(threshold=5.0)).rows, ix) == {"step", "A", "x"}
    assert names_of(fa, build_slice(fa, rows, x, config=SliceConfig(gamma=0.0)).rows, ix) == \
        {"step", "A", "x", "launch1", "k1", "launch2", "k2", "drv"}
    # a larger time scale reaches the far sibling (gap 250) as well
    wide = build_slice(fa, rows, x, config=SliceConfig(temporal_scale_ns=2_000_000))
    assert {"y", "far"} <= names_of(fa, wide.rows, ix)
    capped = build_slice(fa, rows, x, config=SliceConfig(max_nodes=3))
    assert names_of(fa, capped.rows, ix) == {"step", "A", "x"} and capped.dropped == 6


def test_communication_coupling_and_peers():
    fa, ix = build(tree())
    rows = step_rows(fa, ix)
    pairs = np.array([[ix["allreduce"], ix["allreduce_r1"]]])
    sl = build_slice(fa, rows, [ix["allreduce"]], comm_pairs=pairs)
    got = names_of(fa, sl.rows, ix)
    # the compute feeding the collective (A), the collective's call and kernel, its peer on
    # rank 1 with that rank's step; not module B which runs after it
    assert got == {"step", "A", "allreduce", "nccl_call", "nccl", "allreduce_r1", "step_r1"}
    assert (ix["A"], ix["allreduce"]) in {tuple(e) for e in sl.edges_c.tolist()}
    assert (ix["allreduce"], ix["allreduce_r1"]) in {tuple(e) for e in sl.edges_c.tolist()}
    assert sl.info["peers"] == 1
    # and a slow compute op pulls in the collective that waits for it
    sl2 = build_slice(fa, rows, [ix["A"]])
    assert "allreduce" in names_of(fa, sl2.rows, ix)


def test_no_suspects_no_slice_and_step_index():
    fa, ix = build(tree())
    assert len(build_slice(fa, step_rows(fa, ix), []).rows) == 0
    idx = StepIndex(np.array([1, 0, 1, -1, 0]))
    assert list(idx.rows(0)) == [1, 4] and list(idx.rows(1)) == [0, 2] and list(idx.rows(7)) == []


def test_comm_pairs_rows_maps_node_ids():
    fa, ix = build(tree())
    edges = pa.table({"src_node_id": [1000 + ix["allreduce"], 5], "dst_node_id": [1000 + ix["allreduce_r1"], 1000]})
    assert comm_pairs_rows(fa, edges).tolist() == [[ix["allreduce"], ix["allreduce_r1"]]]
    assert comm_pairs_rows(fa, None).shape == (0, 2)


@st.composite
def random_tree(draw):
    def node(s, e, depth, k):
        kids, t = [], s + 1
        if depth < 4:
            for j in range(draw(st.integers(0, 3))):
                if e - t < 4:
                    break
                a = draw(st.integers(t, e - 3))
                b = draw(st.integers(a + 1, e - 1))
                kids.append(node(a, b, depth + 1, f"{k}.{j}"))
                t = b + 1
        layer = "STEP" if depth == 0 else draw(st.sampled_from(["FE", "BE", "COMM", "RT"]))
        return N(layer, k, s, e, *kids)

    return [node(0, draw(st.integers(50, 2000)), 0, "r")]


@settings(max_examples=50, deadline=None)
@given(random_tree(), st.data())
def test_slice_invariants(roots, data):
    fa, ix = build(roots)
    rows = np.arange(fa.n)
    k = data.draw(st.integers(1, min(3, fa.n)))
    sus = np.array(sorted(set(data.draw(st.lists(st.integers(0, fa.n - 1), min_size=k, max_size=k)))))
    cfg = SliceConfig(max_nodes=data.draw(st.integers(1, 40)), hops=data.draw(st.integers(0, 3)))
    sl = build_slice(fa, rows, sus, data.draw(st.lists(st.floats(0, 1), min_size=fa.n, max_size=fa.n)), config=cfg)
    got = set(sl.rows.tolist())
    assert set(sus.tolist()) <= got  # suspects always in
    assert list(sl.rows) == sorted(got)
    for r, p in zip(sl.rows.tolist(), sl.parent.tolist(), strict=True):
        if p >= 0:  # the slice parent is the nearest ancestor inside the slice
            assert p in got
            a = fa.parent[r]
            while a != p:
                assert a >= 0 and a not in got
                a = fa.parent[a]
    for e in (sl.edges_p, sl.edges_t, sl.edges_c):
        assert set(e.reshape(-1).tolist()) <= got
    anc = set()
    for s_ in sus.tolist():
        a = fa.parent[s_]
        while a >= 0:
            anc.add(a)
            a = fa.parent[a]
    assert len(got) <= max(cfg.max_nodes, len(set(sus.tolist()) | (anc & got)))
    assert np.all(sl.relevance >= 0)
