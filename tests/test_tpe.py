"""TPE: name normalization, serialization of real forests, the pair rule, artefacts and the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from teller.errors import InputError, TellerError
from teller.forest import Forest
from teller.ingest import ingest
from teller.reconstruct import reconstruct
from teller.rundir import RunDir
from teller.tpe.cli import register
from teller.tpe.normalize import DEFAULT_RULES, Normalizer, mini_demangle, normalize
from teller.tpe.serialize import (
    Sequences,
    Trace,
    check_preorder,
    serialize_nodes,
    serialize_run,
    serialize_steps,
)
from teller.tpe.tokenizer import TraceTokenizer, render
from teller.tpe.trainer import get_stats, merge, pair_relation, train

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "h200_llama8l_cupti"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    if not EXAMPLE.is_dir():
        pytest.skip("examples/h200_llama8l_cupti not present")
    out = tmp_path_factory.mktemp("tpe") / "run"
    ingest(EXAMPLE, out)
    reconstruct(out)
    return out


@pytest.fixture(scope="module")
def steps(run) -> Sequences:
    return serialize_run(run)


# ---- normalization ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer,name,symbol",
    [
        ("K", "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1})", "K at::native::elementwise_kernel"),
        ("K", "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<2u>*, at::native::(anonymous namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 64, 64>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)", "K at::native::CatArrayBatchedCopy"),
        ("K", "nvjet_sm90_tst_64x8_64x16_2x4_h_bz_TNT", "K nvjet_sm90_tst_#_#_#_h_bz_TNT"),
        ("K", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0", "K cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_#_#_#_cga#_kernel0_#"),
        ("K", "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_13BUnaryFunctorIfffNS0_15binary_internal10MulFunctorIfEEEESt5arrayIPcLm2EEEEviT0_T1_", "K at::native::vectorized_elementwise_kernel"),
        ("COMM", "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "COMM ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
        ("COMM", "COMM all_reduce bytes=8192 group=tp seq=17", "COMM all_reduce group=tp"),
        ("STEP", "STEP id=12 reqs=req_0,req_3", "STEP"),
        ("STEP", "ProfilerStep#7", "STEP ProfilerStep#"),
        ("FE", "FE LlamaAttention", "FE LlamaAttention"),
        ("OTHER", "OTHER schedule", "OTHER schedule"),
        ("BE", "aten::conv2d", "BE aten::conv2d"),
        ("RT", "cudaLaunchKernel", "RT cudaLaunchKernel"),
        ("BE", "my_op 0x7f3a9c001200 cache deadbeef42", "BE my_op # cache #"),
        ("FE", "Block⟨1⟩ · x", "FE Block/#/ / x"),
    ],
)
def test_normalization_rules(layer, name, symbol):
    assert normalize([layer], [name]) == [symbol]


def test_builtin_demangler_recovers_qualified_names():
    assert mini_demangle("_Z5saxpyifPfS_") == "saxpy"
    assert mini_demangle("_ZNK3foo3barEv") == "foo::bar"
    assert mini_demangle("_ZN7cutlass6KernelI42cutlass_80_simt_sgemm_128x32_8x5_nn_align1EEvNT_6ParamsE") == "cutlass::Kernel"
    assert mini_demangle("_ZN2at6native18elementwise_kernelILi128ELi4EZNS0_22gpu_kernel_impl_nocastIZZZNS0_23direct_copy_kernel_cudaERNS_18TensorIteratorBaseEENKUlvE1_clEvENKUlvE2_clEvEUlfE_EEvS5_RKT_EUliE_EEviT1_") == "at::native::elementwise_kernel"
    assert mini_demangle("notmangled") is None
    assert mini_demangle("_ZN3foo") is None  # cut short: not understood, left to the caller


def test_normalizer_rules_round_trip_through_json():
    n = Normalizer()
    again = Normalizer.from_json(json.loads(json.dumps(n.to_json())))
    assert again.rules == DEFAULT_RULES
    with pytest.raises(ValueError, match="unknown normalization rule kind"):
        Normalizer.from_json({"rules": [{"id": "x", "kind": "nope"}]})


# ---- serialization -----------------------------------------------------------------------------


def test_a_step_is_its_iteration_rows(run, steps):
    """A step's sequence holds the rows of its step_idx in forest order: its STEP block whole,
    plus the iteration's schedule ranges and GAP rows (docs/design.md §5.7)."""
    forest = RunDir(run).read_table("forest")
    st = RunDir(run).read_table("steps")
    assert len(steps) == st.num_rows == 20
    sid = st.column("step_id").to_numpy()
    size = st.column("size").to_numpy()
    sidx = forest.column("step_idx").to_numpy()
    assert steps.lengths().tolist() == np.bincount(sidx[sidx >= 0], minlength=20).tolist()
    assert (steps.lengths() > size).any() and (steps.lengths() >= size).all()
    assert steps.key.tolist() == sid.tolist()
    par = forest.column("parent_id").to_numpy()
    layer = np.asarray(forest.column("layer").to_pylist())
    for i in (0, 7, 19):
        a, b = steps.offsets[i], steps.offsets[i + 1]
        rows = np.flatnonzero(sidx == i)
        assert steps.node_id[a:b].tolist() == rows.tolist()
        j = int(np.searchsorted(rows, sid[i]))
        assert rows[j : j + size[i]].tolist() == list(range(sid[i], sid[i] + size[i]))  # the STEP block, whole
        block = slice(a + j, a + j + size[i])
        expect = np.where(rows[j : j + size[i]] == sid[i], -1, par[rows[j : j + size[i]]] - sid[i] + j)
        assert steps.parent[block].tolist() == expect.tolist()
        assert steps.depth[a + j] == 0 and steps[i].symbols[j] == "STEP"
        outside = np.r_[rows[:j], rows[j + size[i]:]]
        assert set(layer[outside[par[outside] < 0]]) <= {"OTHER", "GAP", "RT", "DRV", "FE", "BE", "COMM", "SYNC"}
    check_preorder(steps.parent, steps.depth, steps.offsets)


def test_self_durations(run, steps):
    f = Forest.read(run)
    tr = steps[5]
    a = steps.offsets[5]
    node = steps.node_id[a : steps.offsets[6]]
    in_block = (node >= steps.key[5]) & (node < steps.key[5] + f.size[steps.key[5]])
    host = ~np.array([s.split(" ")[0] in ("K", "MEM", "SYNC") for s in tr.symbols]) & in_block
    # the step's self time plus its host descendants' self times is the step's span
    assert int(tr.duration[host].sum()) == int(f.dur_ns[steps.key[5]])
    total = serialize_steps(f, [steps.key[5]], duration="total")
    assert int(total.duration[0]) == int(f.dur_ns[steps.key[5]])
    assert (tr.duration[in_block] <= total.duration).all()


def test_slices_take_the_nearest_ancestor_inside(run, steps):
    f = Forest.read(run)
    sid = int(steps.key[3])
    nodes = np.arange(sid, sid + int(f.size[sid]))[::4]
    s = serialize_nodes(f, [nodes, nodes[:5]])
    got = s[0]
    inside = {int(v): k for k, v in enumerate(nodes)}
    for k, v in enumerate(nodes.tolist()):
        u = int(f.parent[v])
        while u >= 0 and u not in inside:
            u = int(f.parent[u])
        assert got.parent[k] == (inside[u] if u >= 0 else -1)
    check_preorder(s.parent, s.depth, s.offsets)
    assert len(s[1]) == 5


def test_a_forest_out_of_preorder_is_an_error(run, steps):
    forest = RunDir(run).read_table("forest")
    par = forest.column("parent_id").to_numpy()
    sid = int(steps.key[0])
    i = int(np.flatnonzero(par[sid + 2 :] == np.arange(sid + 1, len(par) - 1))[0]) + sid + 1  # a node right before its child
    perm = np.arange(len(par))
    perm[[i, i + 1]] = perm[[i + 1, i]]  # the child now comes before its parent
    inv = np.argsort(perm)
    bad = forest.take(pa.array(perm))
    bad = bad.set_column(1, "parent_id", pa.array(np.where(par[perm] >= 0, inv[np.maximum(par[perm], 0)], -1)))
    bad = bad.set_column(0, "node_id", pa.array(np.arange(len(par))))  # node ids follow the rows
    f = Forest.from_table(bad)
    with pytest.raises(TellerError, match="breaks the depth-first order"):
        serialize_steps(f, [sid])
    with pytest.raises(TellerError, match="does not exist"):
        serialize_steps(f, [10**9])


# ---- the pair rule and the docs/design.md §8 update --------------------------------------------------


def test_pairs_are_first_child_or_next_sibling():
    #   0 X
    #   ├─ 1 Y
    #   │   └─ 2 Z
    #   └─ 3 W        boundaries: 0|1 child, 1|2 child, 2|3 leaf → uncle: not a pair
    parent, depth = [-1, 0, 1, 0], [0, 1, 2, 1]
    assert [pair_relation(parent, depth, i) for i in range(3)] == [1, 1, None]
    # merged Y⟨Z⟩ then sits beside W: now a pair (siblings at the same depth)
    ids, par, dep, dur = merge([10, 11, 12, 13], parent, depth, [1, 2, 3, 4], (11, 12, 1), 20)
    assert (ids, par, dep, dur) == ([10, 20, 13], [-1, 0, 0], [0, 1, 1], [1, 5, 4])
    assert get_stats(ids, par, dep) == {(10, 20, 1): 1, (20, 13, 0): 1}


def test_merge_is_the_design_rule_literally():
    # 0 A ─ 1 B ─ 2 C (child of B), 3 D (child of A), 4 E (child of D)
    parent, depth, dur = [-1, 0, 1, 0, 3], [0, 1, 2, 1, 2], [10, 20, 30, 40, 50]
    ids, par, dep, d = merge([1, 2, 3, 4, 5], parent, depth, dur, (1, 2, 1), 9)
    # Δ'_0 = Δ_0 + Δ_1; p'_0 = p_0, d'_0 = d_0; the reference to 1 (from C) redirects to 0;
    # parents above 1 shift left by one (D's child E: 3 → 2)
    assert ids == [9, 3, 4, 5] and d == [30, 30, 40, 50]
    assert par == [-1, 0, 0, 2] and dep == [0, 2, 1, 2]


def test_chains_merge_left_to_right_without_overlap():
    ids, par, dep, dur = merge([7, 7, 7, 7, 7], [-1, -1, -1, -1, -1], [0] * 5, [1] * 5, (7, 7, 0), 8)
    assert ids == [8, 8, 7] and dur == [2, 2, 1]


def test_render_writes_the_subtree():
    assert render(["a", "b", "c", "d"], [0, 1, 2, 0]) == "a ⟨b ⟨c⟩⟩ · d"
    assert render(["a"], [0]) == "a"


# ---- training, artefacts, encoding on the real recording ----------------------------------------


def test_train_encode_decode_on_the_recording(steps, tmp_path):
    tok = train(steps, vocab_size=600)
    t = tok.meta["training"]
    assert t["sequences"] == 20 and t["symbols"] == steps.n_nodes
    assert len(tok) <= 600 and t["merges"] >= len(tok) - tok.n_base
    enc = tok.encode_batch(steps)
    assert (enc.lengths() < steps.lengths()).all()
    for i in range(len(steps)):
        assert tok.decode(enc[i].input_ids) == steps[i].symbols
        assert int(enc[i].duration.sum()) == int(steps[i].duration.sum())
    # same corpus, same files
    a, b = tmp_path / "a", tmp_path / "b"
    tok.save(a)
    train(steps, vocab_size=600).save(b)
    for name in ("vocab.json", "merges.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    cfg = json.loads((a / "tokenizer_config.json").read_text())
    assert cfg["vocab_size"] == len(tok) and cfg["base_vocab_size"] == tok.n_base
    assert cfg["normalization"]["rules"][0]["id"] == "tag-prefix"
    loaded = TraceTokenizer.load(a)
    again = loaded.encode_batch(steps)
    assert again.input_ids.tolist() == enc.input_ids.tolist()
    assert again.parent_idx.tolist() == enc.parent_idx.tolist()


def test_truncation_equals_training_with_a_smaller_target(steps):
    big = train(steps, vocab_size=500)
    for v in (50, big.n_base, big.n_base + 1, 300, 499, 500):
        small = train(steps, vocab_size=max(v, big.n_base))
        cut = big.truncate(v)
        assert cut.vocab == small.vocab
        assert cut.merges.tolist() == small.merges.tolist()


def test_training_limits(steps):
    with pytest.raises(TellerError, match="smaller than the base vocabulary"):
        train(steps, vocab_size=10)
    tok = train(steps.select(np.array([0])), vocab_size=10_000)
    assert tok.meta["training"]["stop"] == "no pair occurs 2 times"


def test_loading_damaged_artefacts(steps, tmp_path):
    tok = train(steps, vocab_size=200)
    d = tok.save(tmp_path / "tok")
    shutil.copytree(d, tmp_path / "missing")
    (tmp_path / "missing" / "merges.json").unlink()
    with pytest.raises(InputError, match="merges.json: missing; train one with `teller tpe train"):
        TraceTokenizer.load(tmp_path / "missing")
    shutil.copytree(d, tmp_path / "bad")
    m = json.loads((d / "merges.json").read_text())
    m["merges"][3][0] = 10**6
    (tmp_path / "bad" / "merges.json").write_text(json.dumps(m))
    with pytest.raises(TellerError, match="merges file is damaged"):
        TraceTokenizer.load(tmp_path / "bad")
    shutil.copytree(d, tmp_path / "newer")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["version"] = 99
    (tmp_path / "newer" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="version 99"):
        TraceTokenizer.load(tmp_path / "newer")


def test_user_traces_are_checked():
    tok = TraceTokenizer(["BE a", "BE b"])
    with pytest.raises(TellerError, match="depth-first order"):
        tok.encode(Trace(["BE a", "BE b"], np.array([-1, 0], np.int32), np.array([0, 2], np.int32), np.zeros(2, np.int64)))
    with pytest.raises(TellerError, match="reserves"):
        TraceTokenizer(["BE a ⟨b⟩"])


# ---- command line ---------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _main() -> None:
        pass

    register(app)
    return app


def test_cli_train_and_encode(run, tmp_path):
    cli = CliRunner()
    out = tmp_path / "tok"
    r = cli.invoke(_app(), ["tpe", "train", str(run), "-o", str(out), "--vocab-size", "400"])
    assert r.exit_code == 0, r.output
    assert "trained" in r.output and {p.name for p in out.iterdir()} == {"vocab.json", "merges.json", "tokenizer_config.json"}
    enc = tmp_path / "enc.parquet"
    r = cli.invoke(_app(), ["tpe", "encode", str(out), str(run), "-o", str(enc)])
    assert r.exit_code == 0, r.output
    t = pq.read_table(enc)
    assert t.num_rows == 20
    assert t.column_names[:2] == ["step_id", "step_num"]
    assert t.column("step_num").to_pylist() == list(range(20))
    n_tok = t.column("n_tokens").to_numpy()
    assert (n_tok < t.column("n_nodes").to_numpy()).all()
    assert [len(x) for x in t.column("input_ids").to_pylist()] == n_tok.tolist()


def test_cli_on_a_run_that_was_not_reconstructed(tmp_path):
    raw = tmp_path / "raw"
    ingest(EXAMPLE, raw)
    r = CliRunner().invoke(_app(), ["tpe", "train", str(raw), "-o", str(tmp_path / "t"), "--vocab-size", "300"])
    assert isinstance(r.exception, TellerError)
    assert "forest.parquet: missing; run `teller reconstruct" in str(r.exception)


def test_serialize_run_of_fixed_windows_serializes_each_windows_rows(tmp_path):
    """A run without STEP ranges: its steps are fixed windows (no step node); each sequence is
    one window's rows (the forest's step_idx), parents kept."""
    from pathlib import Path

    from teller.forest import Forest
    from teller.ingest import ingest
    from teller.reconstruct import reconstruct
    from teller.tpe.serialize import serialize_run

    src = Path(__file__).parent / "data" / "external" / "kineto" / "hta_alexnet.json.gz"
    ingest(src, tmp_path / "run")
    s = reconstruct(tmp_path / "run")
    assert s["steps_rule"] == "fixed windows" and s["steps"] >= 2
    f = Forest.read(tmp_path / "run")
    seq = serialize_run(tmp_path / "run")
    assert len(seq.offsets) - 1 == s["steps"]
    for k in range(s["steps"]):
        rows = seq.node_id[seq.offsets[k]:seq.offsets[k + 1]]
        assert rows.tolist() == np.flatnonzero(f.step_idx == k).tolist()
        par = seq.parent[seq.offsets[k]:seq.offsets[k + 1]]
        assert [rows[p] if p >= 0 else -1 for p in par.tolist()] == f.parent[rows].tolist()


def test_cli_encode_of_fixed_windows_keeps_one_row_per_step(tmp_path):
    """A window step has no node (step_id -1 in steps.parquet): encode matches sequences to steps
    by position and writes each window's step_num (it used to look ids up and crash)."""
    src = Path(__file__).parent / "data" / "external" / "kineto" / "hta_alexnet.json.gz"
    ingest(src, tmp_path / "run")
    reconstruct(tmp_path / "run")
    steps = pq.read_table(tmp_path / "run" / "steps.parquet")
    assert (steps.column("step_id").to_numpy() == -1).all()
    cli = CliRunner()
    r = cli.invoke(_app(), ["tpe", "train", str(tmp_path / "run"), "-o", str(tmp_path / "tok"), "--vocab-size", "300"])
    assert r.exit_code == 0, r.output
    r = cli.invoke(_app(), ["tpe", "encode", str(tmp_path / "tok"), str(tmp_path / "run"), "-o", str(tmp_path / "e.parquet")])
    assert r.exit_code == 0, r.output
    t = pq.read_table(tmp_path / "e.parquet")
    assert t.column("step_num").to_pylist() == steps.column("step_num").to_pylist()
    f = Forest.read(tmp_path / "run")
    assert t.column("n_nodes").to_pylist() == np.bincount(f.step_idx[f.step_idx >= 0], minlength=steps.num_rows).tolist()
