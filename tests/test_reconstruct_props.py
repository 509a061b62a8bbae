"""Property tests: random nested trees come back exactly; damaged input never breaks the counts."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reconstruct_helpers import check_forest, reconciles, write_run

from teller.reconstruct import reconstruct
from teller.reconstruct.layers import KIND_TIE_RANK
from teller.rundir import FLAG_REPAIRED, FLAG_TRUNCATED, RunDir

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _reconstruct(rows):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r"
        write_run(path, rows)
        s = reconstruct(path)
        forest = RunDir(path).read_table("forest")
        return s, forest


@st.composite
def nested_tree(draw, tid):
    """A random tree in preorder with intervals: children strictly inside, siblings apart or
    touching, no two nodes with the same interval. Returns [(name, parent name, start, end, leafkind)]."""
    n = draw(st.integers(1, 25))
    parent = []
    stack = []
    for i in range(n):
        pops = draw(st.integers(0, len(stack)))
        del stack[len(stack) - pops :]
        parent.append(stack[-1] if stack else -1)
        stack.append(i)
    children = {i: [j for j in range(n) if parent[j] == i] for i in range(-1, n)}
    times = {}
    t = [draw(st.integers(0, 3))]

    def walk(i):
        kids = children[i]
        s = t[0]
        if kids:
            pad = draw(st.integers(0, 2))
            t[0] += pad
            for k, c in enumerate(kids):
                if k:
                    t[0] += draw(st.integers(0, 2))
                walk(c)
            tail = draw(st.integers(0, 2))
            if pad == 0 and tail == 0 and len(kids) == 1:
                tail = 1  # never the same interval as its only child
            t[0] += tail
        else:
            t[0] += draw(st.integers(1, 4))
        times[i] = (s, t[0])

    for r in children[-1]:
        walk(r)
        t[0] += draw(st.integers(0, 3))
    kinds = draw(st.lists(st.sampled_from(["range", "range", "call"]), min_size=n, max_size=n))
    steps = draw(st.lists(st.booleans(), min_size=n, max_size=n))  # some ranges are STEPs, nested or not

    def name(i):
        return f"STEP id={i} t{tid}n{i}" if steps[i] and (children[i] or kinds[i] == "range") else f"t{tid}n{i}"

    out = []
    for i in range(n):
        kind = "range" if children[i] else kinds[i]
        out.append((name(i), name(parent[i]) if parent[i] >= 0 else None, *times[i], kind))
    return out


def _rows(tree, tid, mode, order):
    rows = []
    for name, _, s, e, kind in tree:
        if kind == "call":
            rows.append({"kind": "RUNTIME", "name": name, "start_ns": s, "end_ns": e, "tid": tid})
        elif mode == "range":
            rows.append({"kind": "RANGE", "name": name, "start_ns": s, "end_ns": e, "tid": tid})
        else:
            rows.append({"kind": "NVTX_PUSH", "name": name, "start_ns": s, "tid": tid, "_o": (s, 1, len(rows))})
            rows.append({"kind": "NVTX_POP", "start_ns": e, "tid": tid, "_o": (e, 0, -len(rows))})
    if mode == "pushpop":  # time order; at one instant pops first, inner pops before outer ones
        rows.sort(key=lambda r: r.get("_o", (r["start_ns"], 2, 0)))
    for r in rows:
        r.pop("_o", None)
    if order is not None:
        rows = [rows[i] for i in order(len(rows))]
    return rows


@SETTINGS
@given(st.data(), st.sampled_from(["pushpop", "range"]), st.integers(1, 3))
def test_random_nested_trees_come_back_exactly(data, mode, threads):
    trees = [data.draw(nested_tree(tid)) for tid in range(threads)]
    rows = []
    for tid, tree in enumerate(trees):
        rows += _rows(tree, tid + 1, mode, None)
    if mode == "range":
        rows = data.draw(st.permutations(rows))
    s, forest = _reconstruct(rows)
    f = forest.to_pydict()
    names = f["name"]
    got = {names[i]: (names[p] if p >= 0 else None) for i, p in enumerate(f["parent_id"])}
    want = {name: par for tree in trees for name, par, *_ in tree}
    assert got == want
    assert s["repaired"] == 0 and s["truncated"] == 0 and reconciles(s)
    check_forest(forest)


def _ref_lifo(rows):
    """Reference pairing: a Python stack per thread, in input order."""
    stacks, ranges, stray = {}, {}, 0
    for i, r in enumerate(rows):
        st_ = stacks.setdefault(r["tid"], [])
        if r["kind"] == "NVTX_PUSH":
            st_.append(i)
        elif st_:
            ranges[rows[st_.pop()]["name"]] = r["start_ns"]
        else:
            stray += 1
    open_ = {rows[i]["name"] for s in stacks.values() for i in s}
    return ranges, open_, stray


@SETTINGS
@given(st.data())
def test_damaged_pushpop_sequences(data):
    trees = [data.draw(nested_tree(tid)) for tid in range(data.draw(st.integers(1, 2)))]
    rows = []
    for tid, tree in enumerate(trees):
        rows += _rows([t[:4] + ("range",) for t in tree], tid + 1, "pushpop", None)
    # damage: drop random pops, duplicate some, cut the tail
    out = []
    for r in rows:
        if r["kind"] == "NVTX_POP":
            k = data.draw(st.sampled_from(["keep", "keep", "keep", "drop", "dup"]))
            if k == "drop":
                continue
            out.append(r)
            if k == "dup":
                out.append(dict(r))
        else:
            out.append(r)
    out = out[: data.draw(st.integers(0, len(out)))]
    if not out:
        return
    # keep each thread's events in time order (the input a collector produces)
    s, forest = _reconstruct(out)
    assert reconciles(s)
    n_push = sum(r["kind"] == "NVTX_PUSH" for r in out)
    ranges, open_, stray = _ref_lifo(out)
    assert s["nodes"] == n_push and s["repaired_pops_without_push"] == stray
    assert s["pops_consumed"] == len(ranges)
    f = forest.to_pydict()
    for name, end, flags in zip(f["name"], f["end_ns"], f["flags"], strict=True):
        if name in open_:
            assert flags & FLAG_TRUNCATED
        else:
            assert end == ranges[name] and not flags & FLAG_TRUNCATED
    check_forest(forest)


def _ref_stack(ivals):
    """Reference nesting with the stack: sort like the implementation, clip to the open parent."""
    order = sorted(range(len(ivals)), key=lambda i: (ivals[i][0], ivals[i][1], -ivals[i][2], KIND_TIE_RANK[ivals[i][3]], i))
    parent, eff = {}, {}
    stack: dict[int, list[int]] = {}
    for i in order:
        tid, s, e, kind = ivals[i]
        stk = stack.setdefault(tid, [])
        while stk and not (eff[stk[-1]] > s or (eff[stk[-1]] == s and e == s)):
            stk.pop()
        parent[i] = stk[-1] if stk else -1
        eff[i] = min(e, eff[stk[-1]]) if stk else e
        if kind != "MARKER":
            stk.append(i)
    return parent, eff


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 2), st.integers(0, 30), st.integers(0, 12), st.sampled_from(["RANGE", "RANGE", "RUNTIME", "MARKER"])), min_size=1, max_size=30))
def test_overlapping_intervals_match_the_stack_reference(spec):
    ivals = [(tid, s, s + d if kind != "MARKER" else s, kind) for tid, s, d, kind in spec]
    rows = [{"kind": k, "name": f"n{i}", "start_ns": s, "end_ns": e, "tid": tid} for i, (tid, s, e, k) in enumerate(ivals)]
    s, forest = _reconstruct(rows)
    parent, eff = _ref_stack(ivals)
    f = forest.to_pydict()
    idx = {name: i for i, name in enumerate(f["name"])}
    for i in range(len(ivals)):
        row = idx[f"n{i}"]
        p = f["parent_id"][row]
        assert (f["name"][p] if p >= 0 else None) == (f"n{parent[i]}" if parent[i] >= 0 else None), f"parent of n{i}"
        assert f["end_ns"][row] == eff[i]
        assert bool(f["flags"][row] & FLAG_REPAIRED) == (eff[i] != ivals[i][2])
    assert reconciles(s)
    check_forest(forest)


def test_nest_fallback_after_the_round_limit_still_nests():
    import numpy as np

    from teller.reconstruct.forest import nest

    n = 40  # a chain of crossings: each interval overlaps the next one partially
    s = np.arange(n, dtype=np.int64) * 3
    e = s + 10
    first = np.zeros(n, bool)
    first[0] = True
    parent, eff, repaired, rounds = nest(first, s, e, np.zeros(n, bool), max_rounds=2)
    assert rounds == 3 and repaired.any()
    for i, p in enumerate(parent):
        assert eff[i] >= s[i]
        if p >= 0:
            assert s[p] <= s[i] and eff[i] <= eff[p] and eff[p] > s[i]
    full, eff_full, _, r_full = nest(first, s, e, np.zeros(n, bool))
    assert r_full <= 64
