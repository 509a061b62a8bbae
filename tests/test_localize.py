"""Numeric localization: instance features, step rules and the per-family GMM estimator."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.base import clone

from teller.errors import TellerError
from teller.forest import Forest, step_blocks
from teller.localize import fit_localizer, localize
from teller.localize.features import (
    FEATURES,
    Instances,
    family_names,
    instance_features,
    run_features,
)
from teller.localize.gmm import GMMLocalizer

F = {name: i for i, name in enumerate(FEATURES)}
_KIND = {"STEP": "RANGE", "FE": "RANGE", "BE": "RANGE", "COMM": "RANGE", "OTHER": "RANGE", "RT": "RUNTIME",
         "DRV": "DRIVER", "K": "KERNEL", "MEM": "MEMCPY", "SYNC": "SYNC"}


def N(layer, name, s, e, *children, tid=1, stream=-1, nbytes=-1, kind=None, rank=0):
    """A hand-built forest node (GPU nodes: a stream >= 0)."""
    return dict(layer=layer, name=name, s=s, e=e, children=list(children), tid=-1 if stream >= 0 else tid,
                stream=stream, nbytes=nbytes, kind=kind or _KIND[layer], rank=rank)


def forest_table(roots, with_layout=True):
    """Preorder forest table of nested ``N`` specs, with step_id like reconstruct writes it."""
    rows = []

    def walk(nd, parent, step, depth):
        i = len(rows)
        step = i if nd["layer"] == "STEP" else step
        rows.append(dict(nd, parent=parent, step=step, depth=depth))
        for c in nd["children"]:
            walk(c, i, step, depth + 1)
        rows[i]["size"] = len(rows) - i

    for r in roots:
        walk(r, -1, -1, 0)
    n = len(rows)
    cols = {
        "node_id": np.arange(n), "parent_id": [r["parent"] for r in rows],
        "layer": pa.array([r["layer"] for r in rows]).dictionary_encode(),
        "name": pa.array([r["name"] for r in rows]).dictionary_encode(),
        "start_ns": [r["s"] for r in rows], "end_ns": [r["e"] for r in rows], "node": [0] * n,
        "rank": [r["rank"] for r in rows], "pid": [100 + r["rank"] for r in rows], "tid": [r["tid"] for r in rows],
        "device": [0 if r["stream"] >= 0 else -1 for r in rows], "stream": [r["stream"] for r in rows],
        "corr_id": [-1] * n, "step_id": [r["step"] for r in rows], "flags": [0] * n,
        "kind": pa.array([r["kind"] for r in rows]).dictionary_encode(), "bytes": [r["nbytes"] for r in rows],
    }
    if with_layout:
        cols["depth"] = [r["depth"] for r in rows]
        cols["size"] = [r["size"] for r in rows]
    return pa.table({k: (v if isinstance(v, pa.Array) else pa.array(np.asarray(v, np.int64))) for k, v in cols.items()})


def sample_step():
    return N("STEP", "STEP id=0 reqs=a", 0, 1000,
             N("FE", "A", 10, 500,
               N("BE", "aten::x", 20, 200,
                 N("RT", "cudaLaunchKernel", 30, 50, N("K", "k1", 100, 160, stream=7)),
                 N("RT", "cudaLaunchKernel", 60, 70, N("K", "k2", 150, 200, stream=8)),
                 N("DRV", "cuMemAlloc", 80, 90)),
               N("BE", "aten::y", 250, 300,
                 N("RT", "cudaMemcpyAsync", 260, 280, N("MEM", "Memcpy HtoD", 270, 290, stream=7, nbytes=4096)))),
             N("COMM", "all_reduce bytes=8192 group=tp seq=3", 600, 700,
               N("RT", "cudaLaunchKernel", 610, 620,
                 N("COMM", "ncclDevKernel_AllReduce", 650, 690, stream=9, nbytes=8192, kind="KERNEL")), nbytes=8192))


def test_features_on_a_hand_built_step():
    fa = Forest.from_table(forest_table([sample_step()]))
    assert fa.preorder
    inst = instance_features(fa, np.zeros(fa.n, np.int64))
    fam = list(inst.family_of())
    # COMM nodes are instances whether host ranges or NCCL kernels
    # and so is the STEP range itself (family ``STEP``, as the labels name it)
    assert fam == ["STEP", "FE A", "BE aten::x", "BE aten::y", "COMM all_reduce", "COMM ncclDevKernel_AllReduce"]
    x, A, y, c = (inst.X[fam.index(k)] for k in ("BE aten::x", "FE A", "BE aten::y", "COMM all_reduce"))
    assert x[F["dur_ns"]] == 180 and x[F["self_ns"]] == 140
    assert (x[F["rt_ns"]], x[F["rt_n"]], x[F["drv_ns"]], x[F["drv_n"]]) == (30, 2, 10, 1)
    assert (x[F["k_n"]], x[F["k_ns"]]) == (2, 110)
    # k1 [100,160] and k2 [150,200] overlap for 10 ns each
    assert x[F["overlap"]] == pytest.approx(20 / 110)
    assert A[F["self_ns"]] == 490 - 180 - 50
    assert (A[F["rt_n"]], A[F["mem_bytes"]], A[F["mem_ns"]]) == (3, 4096, 20)
    assert y[F["k_n"]] == 0 and y[F["overlap"]] == 0
    # the COMM range counts its bytes once, not again for the NCCL kernel below it
    assert (c[F["comm_bytes"]], c[F["k_n"]], c[F["k_ns"]]) == (8192, 1, 40)
    assert A[F["comm_bytes"]] == 0
    nccl = inst.X[fam.index("COMM ncclDevKernel_AllReduce")]
    assert (nccl[F["dur_ns"]], nccl[F["k_n"]], nccl[F["comm_bytes"]]) == (40, 1, 0)
    # ... and its time: the STEP sums its collectives' time (a slow link across many calls), the
    # kernel under the range adds none
    step = inst.X[fam.index("STEP")]
    assert (c[F["comm_ns"]], step[F["comm_ns"]], A[F["comm_ns"]], nccl[F["comm_ns"]]) == (100, 100, 0, 0)
    # nearest instance ancestor
    assert inst.parent[fam.index("BE aten::x")] == fam.index("FE A")
    assert inst.parent[fam.index("FE A")] == fam.index("STEP") and inst.parent[fam.index("STEP")] == -1
    # the STEP instance carries the runtime-call mix of its subtree; operators leave it NaN
    s = inst.X[fam.index("STEP")]
    assert (s[F["memcpy_async_n"]], s[F["memcpy_async_ns"]], s[F["memcpy_sync_n"]]) == (1, 20, 0)
    assert (s[F["alloc_n"]], s[F["alloc_ns"]]) == (1, 10)  # the driver's cuMemAlloc (no runtime call above it)
    assert (s[F["stream_sync_n"]], s[F["device_sync_n"]]) == (0, 0)
    assert np.isnan(s[F["pageable_n"]])  # memory kinds not given: unknown, not zero
    assert np.isnan(x[F["memcpy_async_n"]]) and np.isnan(x[F["iter.dur"]])
    assert (s[F["dur_ns"]], s[F["k_n"]]) == (1000, 3)


def test_family_names_drop_parameters_and_numbers():
    assert family_names("COMM", ["all_reduce bytes=8192 group=tp seq=3"]) == ["COMM all_reduce"]
    assert family_names("FE", ["model.layers.3.mlp"]) == ["FE model.layers.#.mlp"]
    assert family_names("BE", ["aten::_to_copy"]) == ["BE aten::_to_copy"]
    assert family_names("K", ["gemm_bf16 128"]) == ["K gemm_bf16 #"]


@st.composite
def random_forest(draw):
    """Random nested intervals with GPU leaves, as N specs."""
    n_roots = draw(st.integers(1, 3))
    counter = [0]

    def build(s, e, depth):
        counter[0] += 1
        layer = draw(st.sampled_from(["FE", "BE", "RT", "DRV", "SYNC"] if depth else ["STEP", "FE", "BE"]))
        kids = []
        if depth < 4 and e - s > 20 and layer != "SYNC":
            t = s + 1
            for _ in range(draw(st.integers(0, 3))):
                if e - t < 6:
                    break
                a = draw(st.integers(t, e - 5))
                b = draw(st.integers(a + 1, min(a + 200, e - 1)))
                kids.append(build(a, b, depth + 1))
                t = b + 1
        if layer == "RT" and draw(st.booleans()):
            ks = draw(st.integers(s, s + 50))
            kids.append(N("K", "kern", ks, ks + draw(st.integers(1, 80)), stream=draw(st.integers(7, 8))))
        return N(layer, f"op{draw(st.integers(0, 2))}", s, e, *kids)

    roots, t = [], 0
    for _ in range(n_roots):
        roots.append(build(t, t + draw(st.integers(50, 800)), 0))
        t += 1000
    return roots


def _bfs(table: pa.Table) -> pa.Table:
    """The same forest in breadth-first row order (parents still first, subtrees not contiguous)."""
    depth = table.column("depth").to_numpy()
    order = np.argsort(depth, kind="stable")
    return table.take(pa.array(order)).drop(["size", "depth"])


@settings(max_examples=40, deadline=None)
@given(random_forest())
def test_features_do_not_depend_on_the_row_layout(roots):
    t = forest_table(roots)
    fa1 = Forest.from_table(t)
    fa2 = Forest.from_table(_bfs(t))
    assert fa1.preorder
    i1 = instance_features(fa1, step_blocks(fa1)[0])
    i2 = instance_features(fa2, step_blocks(fa2)[0])
    k1 = fa1.node_id[i1.rows]
    k2 = fa2.node_id[i2.rows]
    o1, o2 = np.argsort(k1), np.argsort(k2)
    assert np.array_equal(k1[o1], k2[o2])
    np.testing.assert_allclose(i1.X[o1], i2.X[o2])
    assert np.array_equal(i1.step[o1], i2.step[o2])
    # subtree sizes agree with the explicit preorder sizes
    assert np.array_equal(fa1.subtree_sums(np.ones(fa1.n, np.int64)), t.column("size").to_numpy())


def test_step_blocks_follow_the_step_id_column():
    t = forest_table([N("STEP", "STEP id=0", 0, 100, N("FE", "A", 5, 10, N("BE", "aten::mm", 6, 9))),
                      N("BE", "aten::mm", 150, 160), N("STEP", "STEP id=1", 200, 300, N("FE", "A", 205, 210))])
    step_of_row, step_node = step_blocks(Forest.from_table(t))
    assert list(step_of_row) == [0, 0, 0, -1, 1, 1] and list(step_node) == [0, 4]


def test_run_features_refuses_a_forest_without_step_idx(tmp_path):
    import pyarrow.parquet as pq

    from teller.reconstruct import reconstruct
    from teller.testing.planted import write_planted_run

    write_planted_run(tmp_path / "r", 2_000, [], seed=1)
    reconstruct(tmp_path / "r")
    f = tmp_path / "r" / "forest.parquet"
    pq.write_table(pq.read_table(f).drop_columns(["step_idx"]), f)
    with pytest.raises(TellerError, match=r"step_idx.*teller reconstruct"):
        run_features(tmp_path / "r")


# ------------------------------------------------------------------------------------------------
# the estimator


def _reference(rng, n=400):
    """Two families: 'BE mm' (two modes), 'FE att' (one), 'BE const' (never varies)."""
    d = len(FEATURES)
    X = np.zeros((3 * n, d))
    X[:n, F["dur_ns"]] = np.where(rng.random(n) < 0.5, 1000, 8000) * rng.lognormal(0, 0.1, n)
    X[:n, F["k_n"]] = 1
    X[:n, F["k_ns"]] = X[:n, F["dur_ns"]] * 0.8
    X[n:2 * n, F["dur_ns"]] = 50000 * rng.lognormal(0, 0.1, n)
    X[n:2 * n, F["self_ns"]] = 10000 * rng.lognormal(0, 0.1, n)
    X[2 * n:, F["dur_ns"]] = 3000
    X[2 * n:, F["rt_n"]] = 1
    fam = np.array(["BE mm"] * n + ["FE att"] * n + ["BE const"] * n)
    return X, fam


def test_inliers_score_low_and_outliers_high():
    rng = np.random.default_rng(0)
    X, fam = _reference(rng)
    est = GMMLocalizer().fit(X, families=fam)
    Xt, ft = _reference(np.random.default_rng(1))
    a = est.score_samples(Xt, ft)
    assert (a < 0.5).mean() > 0.99
    slow = Xt.copy()
    slow[:, [F["dur_ns"], F["self_ns"], F["k_ns"]]] *= 20  # beyond the slow mode of 'BE mm' too
    assert (est.score_samples(slow, ft) > 0.9).mean() > 0.99
    # 5x slower puts the fast mode of 'BE mm' near its slow mode: the mixture cannot tell
    five = Xt.copy()
    five[:, [F["dur_ns"], F["self_ns"], F["k_ns"]]] *= 5
    assert (est.score_samples(five, ft)[ft != "BE mm"] > 0.9).all()
    assert set(est.families_) == {"BE mm", "FE att", "BE const"}
    assert est.n_components_[list(est.families_).index("BE mm")] >= 2  # BIC sees both modes


def test_one_sided_ignores_faster_instances():
    X, fam = _reference(np.random.default_rng(0))
    fast = X.copy()
    fast[:, [F["dur_ns"], F["self_ns"], F["k_ns"]]] /= 20  # below every mode
    assert (GMMLocalizer().fit(X, families=fam).score_samples(fast, fam) < 0.5).mean() > 0.99
    assert (GMMLocalizer(one_sided=False).fit(X, families=fam).score_samples(fast, fam) > 0.9).mean() > 0.95


def test_zero_variance_single_instance_nan_and_unseen_families():
    X, fam = _reference(np.random.default_rng(0))
    one = np.zeros((1, X.shape[1]))
    one[0, F["dur_ns"]] = 777
    Xn = np.vstack([X, one])
    Xn[3, F["self_ns"]] = np.nan  # a missing value in the reference
    Xn[5, F["k_ns"]] = np.inf
    fam_n = np.append(fam, "BE lonely")
    est = GMMLocalizer().fit(Xn, families=fam_n)
    const = X[fam == "BE const"][:2].copy()
    assert (est.score_samples(const, ["BE const"] * 2) < 0.01).all()
    const[1, F["dur_ns"]] *= 2  # a family that never varied: a doubling is an anomaly
    assert est.score_samples(const, ["BE const"] * 2)[1] > 0.99
    lone = np.vstack([one, one * 10])
    a = est.score_samples(lone, ["BE lonely"] * 2)
    assert a[0] < 0.5 < 0.99 < a[1]
    probe = X[:3].copy()
    probe[0, :] = np.nan
    probe[1, F["k_ns"]] = np.nan
    det = est.details(probe, ["BE mm", "BE mm", "BE never-seen"])
    assert np.isfinite(det["a"]).all()
    assert det["a"][0] < 0.5  # nothing known: nothing abnormal
    assert list(det["unseen"]) == [False, False, True]
    assert det["a"][2] == est.unseen_score
    assert est.nan_values_ == 2


def test_save_load_roundtrip(tmp_path):
    X, fam = _reference(np.random.default_rng(0))
    est = GMMLocalizer(max_components=3, tail=1e-3).fit(X, families=fam, groups=np.arange(len(X)) // 10)
    est.extra_ = {"instance_layers": ["FE", "BE", "COMM"]}
    p = tmp_path / "loc.npz"
    est.save(p)
    back = GMMLocalizer.load(p)
    assert back.get_params() == est.get_params()
    assert back.extra_ == est.extra_
    Xt, ft = _reference(np.random.default_rng(5))
    Xt[::7, F["dur_ns"]] *= 6
    np.testing.assert_allclose(back.score_samples(Xt, ft), est.score_samples(Xt, ft))
    np.testing.assert_allclose(back.shift_radius_, est.shift_radius_)
    np.testing.assert_array_equal(back.count_p99_, est.count_p99_)  # the families' instances per step
    assert np.isfinite(est.count_p99_).all()
    # no pickled objects inside
    with np.load(p, allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
    assert clone(est).get_params() == est.get_params()


def _wide(rng, n, fam):
    """A step-level reference: 24 independent features, each lognormal (σ 0.3 in log space)."""
    d = len(FEATURES)
    X = np.full((n, d), np.nan)
    X[:, :24] = np.exp(rng.normal(10.0, 0.3, (n, 24)))
    return X, np.array([fam] * n)


def test_one_feature_far_beyond_the_reference_flags_a_step_level_family(tmp_path):
    """24 features: a single one 7 σ above the reference moves the joint distance by 49, inside
    the joint radius (the χ² point at 1e-4 of 24 degrees of freedom is 56, and the reference's own spread
    adds to it), so only the per-feature test of STEP and OTHER families catches it."""
    rng = np.random.default_rng(3)
    Xs, fs = _wide(rng, 600, "STEP")
    Xb, fb = _wide(rng, 600, "BE op")
    X, fam = np.vstack([Xs, Xb]), np.concatenate([fs, fb])
    groups = np.arange(len(X)) % 600
    est = GMMLocalizer().fit(X, families=fam, groups=groups)
    off = GMMLocalizer(feature_test=()).fit(X, families=fam, groups=groups)
    probe, _ = _wide(np.random.default_rng(4), 50, "x")
    probe[:, :24] = np.exp(10.0)  # every feature at the reference median ...
    probe[:, F["sync_ns"]] = np.exp(10.0 + 7 * 0.3)  # ... but one, 7 σ above it
    step, be = ["STEP"] * 50, ["BE op"] * 50
    tested = [j for j in range(24) if FEATURES[j] != "overlap"]
    assert np.isfinite(est.feature_radius_[list(est.families_).index("STEP"), tested]).all()
    assert np.isinf(est.feature_radius_[list(est.families_).index("BE op")]).all()  # operators: joint test only
    assert (off.score_samples(probe, step) < 0.5).all()  # the joint test alone misses it
    assert (est.score_samples(probe, step) > 0.99).all()
    assert (est.score_samples(probe, be) < 0.5).all()
    # the overlap share is left to the joint test (FEATURE_TEST_EXEMPT): a whole run can move it
    shifted = probe.copy()
    shifted[:, F["sync_ns"]] = np.exp(10.0)
    shifted[:, F["overlap"]] = np.exp(10.0 + 7 * 0.3)
    assert (est.score_samples(shifted, step) < 0.5).all()
    assert np.isinf(est.feature_radius_[list(est.families_).index("STEP"), F["overlap"]])
    # the reference itself and fresh normal steps stay inside the per-feature radii
    fresh, _ = _wide(np.random.default_rng(5), 2000, "STEP")
    assert (est.score_samples(fresh, ["STEP"] * 2000) >= 0.5).mean() < 0.005
    assert est.reference_steps_flagged_ <= 3
    # the radii travel with the artefact; an artefact written before the test has none
    p = tmp_path / "loc.npz"
    est.save(p)
    back = GMMLocalizer.load(p)
    assert back.feature_test == ("STEP", "OTHER")
    np.testing.assert_allclose(back.score_samples(probe, step), est.score_samples(probe, step))
    with np.load(p, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files if k != "feature_radius"}
    import json

    header = json.loads(str(data.pop("header")))
    del header["params"]["feature_test"]
    old = tmp_path / "old.npz"
    np.savez(old, header=np.asarray(json.dumps(header)), **data)
    legacy = GMMLocalizer.load(old)
    assert legacy.feature_test == ()
    np.testing.assert_allclose(legacy.score_samples(probe, step), off.score_samples(probe, step), atol=1e-9)


def test_bad_artefacts_are_refused(tmp_path):
    with pytest.raises(TellerError, match="teller localize fit"):
        GMMLocalizer.load(tmp_path / "missing.npz")
    p = tmp_path / "other.npz"
    np.savez(p, x=np.arange(3))
    with pytest.raises(TellerError, match="not a localizer artefact"):
        GMMLocalizer.load(p)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TellerError):
        GMMLocalizer.load(tmp_path / "junk.npz")
    with pytest.raises(TellerError, match="no operator instances"):
        GMMLocalizer().fit(np.zeros((0, len(FEATURES))), families=np.zeros(0, str))


def test_family_suspiciousness_is_the_kth_instance_score():
    a = np.array([0.9, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] + [1.0, 0.8] + [0.0] * 18 + [0.2]
                 + [0.7] * 25 + [0.6] * 5)
    fam = np.array([0] * 10 + [1] * 20 + [0] + [1] * 30)
    step = np.array([0] * 30 + [1] + [2] * 30)
    ss = GMMLocalizer(shift_test=False).score_steps(a, fam, step)
    got = {(int(s), int(f)): round(float(v), 6) for s, f, v in zip(ss.sf_step, ss.sf_family, ss.sf_susp, strict=True)}
    # k = max(ceil(0.1 n), min(n, 2)): the 2nd score of 10 and of 20, the only one of 1, the 3rd of 30
    assert got == {(0, 0): 0.1, (0, 1): 0.8, (1, 0): 0.2, (2, 1): 0.7}
    assert list(ss.steps) == [0, 1, 2] and list(ss.flag) == [True, False, True]
    assert list(ss.score) == pytest.approx([0.8, 0.2, 0.7])
    assert list(ss.top_family) == [1, 0, 1]
    # the rule before (and of artefacts written before it): the mean of the top ceil(0.1 n) scores
    old = GMMLocalizer(shift_test=False, min_instances=1, aggregate="mean").score_steps(a, fam, step)
    got = {(int(s), int(f)): round(float(v), 6) for s, f, v in zip(old.sf_step, old.sf_family, old.sf_susp, strict=True)}
    assert got == {(0, 0): 0.9, (0, 1): 0.9, (1, 0): 0.2, (2, 1): 0.7}
    with pytest.raises(ValueError, match="aggregate"):
        GMMLocalizer(aggregate="max").score_steps(a, fam, step)


def test_one_slow_instance_among_several_does_not_flag_its_step(tmp_path):
    """A step of 12 'BE op' instances and one 'FE mod': one op instance twice as slow (a descheduled
    thread) leaves the step unflagged, two of them flag it, and so does a slow instance of a
    family with one instance per step; the rule before flagged the single one. (Fifty times as
    slow, the one instance would move the family's summed deviation past the shift test's radius:
    another test.)"""
    rng = np.random.default_rng(7)
    n_steps, per = 200, 12
    d = len(FEATURES)
    X = np.zeros((n_steps * (per + 1), d))
    X[:, F["dur_ns"]] = 20000 * rng.lognormal(0, 0.1, len(X))
    X[:, F["self_ns"]] = X[:, F["dur_ns"]] * 0.5
    fam = np.array((["BE op"] * per + ["FE mod"]) * n_steps)
    groups = np.repeat(np.arange(n_steps), per + 1)
    est = GMMLocalizer().fit(X, families=fam, groups=groups)
    old = GMMLocalizer(min_instances=1, aggregate="mean").fit(X, families=fam, groups=groups)
    Xt = np.zeros((4 * (per + 1), d))
    Xt[:, F["dur_ns"]] = 20000 * np.random.default_rng(8).lognormal(0, 0.1, len(Xt))
    Xt[:, F["self_ns"]] = Xt[:, F["dur_ns"]] * 0.5
    ft = np.array((["BE op"] * per + ["FE mod"]) * 4)
    st = np.repeat(np.arange(4), per + 1)
    slow = [[], [0], [0, 5], [per]]  # per step: the rows made twice as slow (step 3: its FE instance)
    for s, rows in enumerate(slow):
        for r in rows:
            Xt[s * (per + 1) + r, [F["dur_ns"], F["self_ns"]]] *= 2
    codes = np.unique(ft, return_inverse=True)[1]

    def flags(e):
        det = e.details(Xt, ft, steps=st)
        return list(e.score_steps(det["a"], codes, st, codes=det["family"], shift_groups=det["shift"]).flag)

    assert flags(est) == [False, False, True, True]
    assert flags(old) == [False, True, True, True]
    # the rule travels with the artefact; an artefact written before it keeps the rule before
    p = tmp_path / "loc.npz"
    est.save(p)
    assert flags(GMMLocalizer.load(p)) == [False, False, True, True]
    import json

    with np.load(p, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    header = json.loads(str(data.pop("header")))
    del header["params"]["min_instances"], header["params"]["aggregate"]
    legacy_path = tmp_path / "old.npz"
    np.savez(legacy_path, header=np.asarray(json.dumps(header)), **data)
    legacy = GMMLocalizer.load(legacy_path)
    assert (legacy.min_instances, legacy.aggregate) == (1, "mean")
    assert flags(legacy) == [False, True, True, True]


def _tree_instances(X, fam, parent):
    return Instances(np.arange(len(X)), np.unique(fam, return_inverse=True)[1].astype(np.int32),
                     sorted(set(fam)), np.zeros(len(X), np.int64), X, np.asarray(parent), ("FE", "BE", "COMM"))


def test_a_module_slow_because_of_its_op_is_explained_away():
    rng = np.random.default_rng(0)
    n = 300
    X = np.zeros((2 * n, len(FEATURES)))
    op = 1000 * rng.lognormal(0, 0.1, n)
    own = 500 * rng.lognormal(0, 0.1, n)
    X[:n, F["dur_ns"]], X[:n, F["self_ns"]] = op, op
    X[n:, F["dur_ns"]], X[n:, F["self_ns"]] = op + own, own
    fam = np.array(["BE op"] * n + ["FE mod"] * n)
    est = GMMLocalizer().fit(X, families=fam)
    # test: module 0 contains op 1 (slow); module 2 contains op 3 (normal)
    T = np.zeros((4, len(FEATURES)))
    T[0, [0, 1]] = [10000 + 500, 500]
    T[1, [0, 1]] = [10000, 10000]
    T[2, [0, 1]] = [1500, 500]
    T[3, [0, 1]] = [1000, 1000]
    inst = _tree_instances(T, np.array(["FE mod", "BE op", "FE mod", "BE op"]), [-1, 0, -1, 2])
    loc = localize(est, inst)
    assert list(loc.flagged) == [0]
    res = loc.flagged[0]
    assert list(res.suspects) == [1]
    assert res.explained == {0: 1}
    assert [c["family"] for c in res.candidates] == ["BE op"]
    # when the module's own time is abnormal too, it stays a suspect
    T[0, [0, 1]] = [20000, 10000]
    loc = localize(est, _tree_instances(T, np.array(["FE mod", "BE op", "FE mod", "BE op"]), [-1, 0, -1, 2]))
    assert sorted(loc.flagged[0].suspects.tolist()) == [0, 1]


def test_fit_localizer_on_runs(tmp_path):
    from teller.reconstruct import reconstruct
    from teller.testing.planted import Plant, write_planted_run

    write_planted_run(tmp_path / "ref", 30_000, [], seed=1)
    reconstruct(tmp_path / "ref")
    est = fit_localizer([tmp_path / "ref"])
    assert est.extra_["reference_steps"] > 50
    assert est.extra_["reference_steps_flagged"] <= 1
    assert est.extra_["instance_layers"] == ["FE", "BE", "COMM", "OTHER", "STEP"]
    write_planted_run(tmp_path / "bad", 30_000, [Plant("BE aten::mul", [10, 20], "host", 4.0)], seed=2)
    reconstruct(tmp_path / "bad")

    rf = run_features(tmp_path / "bad")
    loc = localize(est, rf.instances)
    flagged = {int(rf.steps.step_num[s]) for s in loc.flagged}
    assert {10, 20} <= flagged
    for s, res in loc.flagged.items():
        if rf.steps.step_num[s] in (10, 20):
            assert res.candidates[0]["family"] == "BE aten::mul"


def test_reference_median_is_the_family_median():
    X, fam = _reference(np.random.default_rng(0))
    est = GMMLocalizer().fit(X, families=fam)
    med = est.reference_median(np.array(["FE att", "BE const", "BE mm", "BE new"], dtype=object))
    j = F["dur_ns"]
    assert med[0, j] == pytest.approx(np.median(X[fam == "FE att", j]), rel=0.01)
    assert med[1, j] == pytest.approx(3000, rel=1e-6)
    # two modes (1 µs and 8 µs): the median lies between them, whatever mode a row is nearest to
    assert 900 < med[2, j] < 9000
    assert np.isnan(med[3]).all()  # a family the reference never saw


def test_diag_mixture_is_sklearns_fit():
    """The EM of the localizer reproduces scikit-learn's diagonal GaussianMixture (same
    k-means++ start, updates and stopping rule): weights, means, variances and BIC."""
    import warnings

    from sklearn.mixture import GaussianMixture

    from teller.localize.gmm import diag_mixture

    rng = np.random.default_rng(3)
    for k, d in [(1, 3), (2, 5), (4, 9)]:
        X = np.concatenate([rng.normal(rng.normal(0, 3, d), rng.uniform(0.2, 2, d), (400, d)) for _ in range(k)])
        X[rng.random(X.shape) < 0.1] = 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = GaussianMixture(k, covariance_type="diag", reg_covar=1e-4, random_state=0,
                                 init_params="k-means++", max_iter=200).fit(X)
        w, mu, var, bic = diag_mixture(X, k, 1e-4, 0)
        np.testing.assert_allclose(w, gm.weights_, atol=1e-9)
        np.testing.assert_allclose(mu, gm.means_, atol=1e-9)
        np.testing.assert_allclose(var, gm.covariances_, atol=1e-9)
        assert bic == pytest.approx(gm.bic(X), rel=1e-9)


def test_fit_by_codes_and_in_sample_flags():
    """Families given as codes into ``family_names`` fit the same model as names per row; a
    name no row uses is no family of the model (unseen when scored); the fit's own step flags
    are those the fitted model gives its reference steps."""
    rng = np.random.default_rng(5)
    n = 3000
    names = ["BE a", "BE b", "BE never", "FE c"]
    codes = rng.choice([0, 1, 3], n)
    X = np.full((n, len(FEATURES)), np.nan)
    X[:, :13] = np.exp(rng.normal(8, 0.3, (n, 13))) * (1 + codes[:, None])
    X[:, F["overlap"]] = 0.0
    groups = np.arange(n) // 6
    X[groups == 7, F["self_ns"]] *= 30  # one abnormal reference step
    by_name = GMMLocalizer().fit(X, families=np.asarray(names, dtype=object)[codes], groups=groups)
    by_code = GMMLocalizer().fit(X, families=codes, groups=groups, family_names=names)
    assert list(by_code.families_) == ["BE a", "BE b", "FE c"]
    np.testing.assert_allclose(by_code.radius_, by_name.radius_)
    np.testing.assert_allclose(by_code.means_, by_name.means_)
    det = by_code.details(X, codes, family_names=names)
    assert by_code.details(X[:1], [2], family_names=names)["unseen"].all()
    ss = by_code.score_steps(det["a"], det["family"], groups, det["z"], det["family"])
    assert by_code.reference_steps_ == len(ss.steps) == groups.max() + 1
    assert by_code.reference_steps_flagged_ == int(ss.flag.sum()) >= 1
    assert ss.flag[7]


def test_fit_localizer_samples_steps(tmp_path):
    """``max_steps`` fits on that many reference steps drawn at random (the same ones every
    time); a reference within the cap is fitted whole."""
    from teller.reconstruct import reconstruct
    from teller.testing.planted import write_planted_run

    write_planted_run(tmp_path / "ref", 20_000, [], seed=1)
    reconstruct(tmp_path / "ref")
    rf = run_features(tmp_path / "ref")
    full = fit_localizer([rf])
    n = full.extra_["reference_steps"]
    assert "reference_steps_sampled_from" not in full.extra_
    assert fit_localizer([rf], max_steps=n).extra_["reference_instances"] == full.extra_["reference_instances"]
    a, b = fit_localizer([rf], max_steps=n // 2), fit_localizer([rf], max_steps=n // 2)
    assert a.extra_["reference_steps"] == n // 2 and a.extra_["reference_steps_sampled_from"] == n
    assert a.extra_["reference_instances"] < full.extra_["reference_instances"]
    np.testing.assert_array_equal(a.radius_, b.radius_)
    assert list(a.families_) == list(full.families_)


def test_calibration_sample_whole_steps():
    """A family larger than ``max_calibration_samples`` is calibrated on whole reference steps
    (seeded: the same sample every time; all of a step's instances or none); a cap above every
    family fits exactly what no cap fits; the in-sample flag rate counts the steps every
    family's sample holds."""
    rng = np.random.default_rng(3)
    n = 6000
    names = ["BE big", "BE small"]
    codes = np.where(np.arange(n) % 6 == 0, 1, 0)  # per step of 6 rows: 5 big, 1 small
    X = np.full((n, len(FEATURES)), np.nan)
    X[:, :13] = np.exp(rng.normal(8, 0.3, (n, 13)))
    X[:, F["overlap"]] = 0.0
    groups = np.arange(n) // 6
    full = GMMLocalizer(max_calibration_samples=None).fit(X, families=codes, groups=groups, family_names=names)
    same = GMMLocalizer(max_calibration_samples=n).fit(X, families=codes, groups=groups, family_names=names)
    for k in ("radius_", "shift_radius_", "median_", "scale_", "means_", "covariances_"):
        np.testing.assert_array_equal(getattr(same, k), getattr(full, k))
    assert same.reference_steps_ == full.reference_steps_ == groups.max() + 1
    a = GMMLocalizer(max_calibration_samples=1000).fit(X, families=codes, groups=groups, family_names=names)
    b = GMMLocalizer(max_calibration_samples=1000).fit(X, families=codes, groups=groups, family_names=names)
    np.testing.assert_array_equal(a.radius_, b.radius_)
    np.testing.assert_array_equal(a.scale_, b.scale_)
    # the big family: 200 whole steps of 5 (1000 rows); the small one (1000 rows) is whole
    assert list(a.calibration_rows_) == [1000, 1000] and list(a.n_samples_) == [5000, 1000]
    assert a.reference_steps_ == 200
    assert not np.array_equal(a.scale_[0], full.scale_[0])
    np.testing.assert_array_equal(a.scale_[1], full.scale_[1])
    c = GMMLocalizer(max_calibration_samples=1000, random_state=1).fit(X, families=codes, groups=groups, family_names=names)
    assert not np.array_equal(c.scale_[0], a.scale_[0])


def test_kmeans_pp_picks_scikit_learns_centres_and_the_estimator_clones():
    """The numpy k-means++ seeding draws and computes as scikit-learn's does (ties included:
    rounded data), so the mixtures start alike; the estimator's parameters behave as an
    estimator's (clone, set_params) without scikit-learn imported by the module."""
    from sklearn.cluster import kmeans_plusplus

    from teller.localize.gmm import _chi2_isf, _kmeans_pp

    rng = np.random.default_rng(0)
    for t in range(40):
        n, d, k = int(rng.integers(5, 800)), int(rng.integers(1, 12)), int(rng.integers(2, 8))
        X = rng.normal(size=(n, d)) * rng.uniform(0.1, 50)
        if t % 2:
            X = np.round(X)
        sq = (X * X).sum(axis=1)
        want = kmeans_plusplus(X, k, x_squared_norms=sq, random_state=t)[1]
        assert np.array_equal(_kmeans_pp(X, k, t, sq), want)
    from scipy.stats import chi2

    assert all(_chi2_isf(p, d) == chi2.isf(p, d) for p in (1e-4, 1e-3, 0.3) for d in (1, 7, 36))
    est = GMMLocalizer(tail=1e-3, max_components=3)
    assert clone(est).get_params() == est.get_params() and est.get_params()["tail"] == 1e-3
    assert est.set_params(tail=1e-2).tail == 1e-2 and "tail=0.01" in repr(est)
    with pytest.raises(ValueError, match="invalid parameter 'nope'"):
        est.set_params(nope=1)


def test_steps_another_reader_flags_get_suspects_and_the_stage_keeps_its_flags():
    """``localize(also=...)``: a step the stage leaves unflagged but another reader (diagnose's
    root-cause model) flags gets candidates and suspects by the same rules; the stage's own flags
    and counts do not move, and a step without instances is passed over."""
    rng = np.random.default_rng(3)
    n = 300
    X = np.zeros((n, len(FEATURES)))
    X[:, F["dur_ns"]] = 1000 * rng.lognormal(0, 0.1, n)
    X[:, F["self_ns"]] = X[:, F["dur_ns"]]
    est = GMMLocalizer().fit(X, families=np.array(["BE op"] * n))
    T = np.zeros((3, len(FEATURES)))
    T[:, F["dur_ns"]] = T[:, F["self_ns"]] = [30000, 1000, 1100]  # step 0 far off, steps 1 and 2 normal
    inst = Instances(np.arange(3), np.zeros(3, np.int32), ["BE op"], np.array([0, 1, 2]), T, np.full(3, -1),
                     ("FE", "BE", "COMM"))
    alone = localize(est, inst)
    both = localize(est, inst, also=np.array([2, 7]))  # 7: no instances, no scores
    assert list(alone.flagged) == [0] and sorted(both.flagged) == [0, 2]
    assert both.steps.flag.tolist() == alone.steps.flag.tolist()
    assert both.summary["steps_flagged"] == alone.summary["steps_flagged"] == 1
    assert np.array_equal(both.a, alone.a)
    r0, r2 = both.flagged[0], both.flagged[2]
    assert list(r0.suspects) == list(alone.flagged[0].suspects) == [0]
    assert [c["family"] for c in r0.candidates] == ["BE op"]
    assert len(r2.suspects) == 0 and r2.candidates == []  # nothing of it departs: the same rules name nothing
