"""Split invariants (hypothesis): requests never straddle splits; mechanisms held out entirely."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from teller.dataset.splits import assign_splits


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.sampled_from(["", "a", "b", "c"])),
                min_size=1, max_size=200), st.integers(0, 5))
def test_splits_invariants(rows, seed):
    run = np.array([f"r{a}" for a, _, _ in rows], dtype=object)
    req = np.array([f"q{b}" for _, b, _ in rows], dtype=object)
    mech = np.array([m for _, _, m in rows], dtype=object)
    cat = np.array(["x" if m else "" for m in mech], dtype=object)
    s = assign_splits(run, req, mech, cat, seed)
    by = {}
    for k, v in zip(zip(run, req, strict=False), s["split_request"], strict=False):
        by.setdefault(k, set()).add(v)
    assert all(len(v) == 1 for v in by.values())
    for m, v in zip(mech, s["split_mechanism"], strict=False):
        if m in s["held_out_mechanisms"]:
            assert v == "test"
    assert s == assign_splits(run, req, mech, cat, seed)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 20), st.sampled_from(["2 layers", "4 layers", "8 layers"])),
                min_size=1, max_size=200), st.integers(0, 5))
def test_workload_split(rows, seed):
    run = np.array([f"r{a}" for a, _, _ in rows], dtype=object)
    req = np.array([f"q{b}" for _, b, _ in rows], dtype=object)
    wl = np.array([w for _, _, w in rows], dtype=object)
    mech = np.array([""] * len(rows), dtype=object)
    s = assign_splits(run, req, mech, mech, seed, workload=wl)
    shapes, counts = np.unique(wl.astype(str), return_counts=True)
    if len(shapes) < 2:
        assert "split_workload" not in s and s["held_out_workloads"] == []
        return
    main = shapes[int(np.argmax(counts))]
    assert s["held_out_workloads"] == sorted(set(shapes) - {main})
    sw, sr = np.array(s["split_workload"]), np.array(s["split_request"])
    # every other shape is test, the trained shape never is; its records keep their request split (test → train)
    assert (sw[wl != main] == "test").all()
    assert (sw[wl == main] != "test").all()
    assert (sw[(wl == main) & (sr == "val")] == "val").all()
    assert (sw[(wl == main) & (sr != "val")] == "train").all()
    # the other splits do not depend on the workloads
    s0 = assign_splits(run, req, mech, mech, seed)
    assert all(s[k] == s0[k] for k in ("split_request", "split_run", "split_mechanism"))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.sampled_from(["a", "b", "c", "d"]), st.booleans()),
                min_size=1, max_size=200), st.integers(0, 5))
def test_held_out_mechanisms_come_from_categories_of_two_or_more(rows, seed):
    """A record in a window without effect names its mechanism and no category; such records do
    not make a category of their own, so a category's only mechanism is never held out (it would
    leave the category without train records). Mechanisms a, b are category x, c and d each alone."""
    run = np.array([f"r{a}" for a, _, _, _ in rows], dtype=object)
    req = np.array([f"q{b}" for _, b, _, _ in rows], dtype=object)
    mech = np.array([m for _, _, m, _ in rows], dtype=object)
    shown = np.array([s for _, _, _, s in rows])
    cat = np.where(shown, np.array([{"a": "x", "b": "x", "c": "y", "d": "z"}[m] for m in mech], dtype=object), "")
    s = assign_splits(run, req, mech, cat, seed)
    held = set(s["held_out_mechanisms"])
    assert held <= {"a", "b"}
    assert (len(held) == 1) == ({"a", "b"} <= set(mech[shown].tolist()))
