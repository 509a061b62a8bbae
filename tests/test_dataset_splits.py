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
