"""Property tests of TPE on random trees: the fast trainer and encoder equal the clear reference
(docs/design.md §8 rule applied one merge at a time), and encodings keep the tree and the time."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teller.tpe.serialize import Sequences, Trace
from teller.tpe.tokenizer import UNK, UNK_LAYER, TraceTokenizer
from teller.tpe.trainer import reference_encode, reference_train, train

# TPE_EXAMPLES=2000 for a longer search
SETTINGS = settings(max_examples=int(os.environ.get("TPE_EXAMPLES", 80)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALPHABET = ["BE a", "BE b", "RT c", "K d", "FE e"]


@st.composite
def trees(draw, max_nodes: int = 24, alphabet: list[str] = ALPHABET) -> Trace:
    """A random forest in depth-first order (a stack process), symbols from a small alphabet so
    that pairs repeat and chains (a a a) occur."""
    n = draw(st.integers(1, max_nodes))
    k = draw(st.integers(1, len(alphabet)))
    parent, depth, stack = [], [], []
    for _ in range(n):
        pops = draw(st.integers(0, len(stack)))
        del stack[len(stack) - pops :]
        parent.append(stack[-1] if stack else -1)
        depth.append(len(stack))
        stack.append(len(parent) - 1)
    syms = [alphabet[draw(st.integers(0, k - 1))] for _ in range(n)]
    dur = draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
    return Trace(syms, np.array(parent, np.int32), np.array(depth, np.int32), np.array(dur, np.int64))


@st.composite
def corpora(draw):
    base = draw(st.lists(trees(), min_size=1, max_size=5))
    dups = draw(st.lists(st.integers(0, len(base) - 1), max_size=3))  # identical steps (weights)
    return base + [base[i] for i in dups]


def _ids(tok: TraceTokenizer, t: Trace) -> list[int]:
    return [tok.id_of(s) for s in t.symbols]


def _check_encoding(tok: TraceTokenizer, t: Trace, e) -> None:
    ids, par, dep, dur = e.input_ids, e.parent_idx, e.depth, e.duration
    m = len(ids)
    # parent indices point to earlier tokens or are -1
    assert ((par >= -1) & (par < np.arange(m))).all()
    # the time budget survives
    assert int(dur.sum()) == int(t.duration.sum())
    # depth is consistent with parents: children deeper than their parent, roots at depth 0
    has = par >= 0
    assert (dep[has] > dep[par[has]]).all()
    assert (dep[~has] == 0).all()
    # decode gives the symbols back, and the node-level tree
    assert tok.decode(ids) == [tok.vocab[i] for i in _ids(tok, t)]
    back = tok.decode_tree(ids, dep)
    assert back.parent.tolist() == t.parent.tolist()
    assert back.depth.tolist() == t.depth.tolist()
    # the call relation: a node's parent is in its token or in its token's parent token
    tok_of = np.repeat(np.arange(m), tok.token_length(ids))
    child = np.flatnonzero(t.parent >= 0)
    tu, tv = tok_of[t.parent[child]], tok_of[child]
    assert ((tu == tv) | (par[tv] == tu)).all()


@SETTINGS
@given(corpus=corpora(), extra=st.integers(0, 14), min_freq=st.sampled_from([1, 2]), cap=st.sampled_from([None, 2, 3, 5]))
def test_fast_training_and_encoding_equal_the_reference(corpus, extra, min_freq, cap):
    batch = Sequences.from_traces(corpus)
    vocab_size = TraceTokenizer([]).n_base + len(set(batch.symbols)) + extra
    tok = train(batch, vocab_size=vocab_size, min_frequency=min_freq, max_token_nodes=cap)
    ref_corpus = [(_ids(tok, t), t.parent.tolist(), t.depth.tolist()) for t in corpus]
    ref = reference_train(ref_corpus, tok.n_base, vocab_size, min_freq, cap)
    if cap:
        assert (tok.token_length(np.arange(len(tok))) <= cap).all()
    assert [tuple(m) for m in tok.merges.tolist()] == [tuple(m) for m in ref]
    enc = tok.encode_batch(batch)
    for t, (ids, par, dep), e in zip(corpus, ref_corpus, enc, strict=True):
        r_ids, r_par, r_dep, r_dur = reference_encode(ids, par, dep, t.duration.tolist(), ref)
        assert e.input_ids.tolist() == r_ids
        assert e.parent_idx.tolist() == r_par
        assert e.depth.tolist() == r_dep
        assert e.duration.tolist() == r_dur
        _check_encoding(tok, t, e)


@SETTINGS
@given(corpus=corpora(), probe=trees(alphabet=ALPHABET + ["K zzz", "BE yyy", "NOPE x"]))
def test_unknown_symbols_keep_their_place(corpus, probe):
    tok = train(Sequences.from_traces(corpus), vocab_size=200, min_frequency=1)
    e = tok.encode(probe)
    _check_encoding(tok, probe, e)
    known = set(tok.vocab[: tok.n_base])
    unknown = [s not in known for s in probe.symbols]
    assert e.n_unknown == sum(unknown)
    # every unknown node is its own token: its layer's unknown token (or <unk>), never merged
    tok_of = np.repeat(np.arange(len(e)), tok.token_length(e.input_ids))
    for i, (s, u) in enumerate(zip(probe.symbols, unknown, strict=True)):
        if u:
            j = tok_of[i]
            lay = s.split(" ", 1)[0]
            assert e.input_ids[j] == (tok.token_to_id[UNK_LAYER[lay]] if lay in UNK_LAYER else UNK)
            assert tok.token_length(e.input_ids[j : j + 1])[0] == 1


@SETTINGS
@given(corpus=corpora(), seed=st.integers(0, 2**16))
def test_training_is_deterministic_and_order_free(corpus, seed):
    a = train(Sequences.from_traces(corpus), vocab_size=60)
    order = np.random.default_rng(seed).permutation(len(corpus))
    b = train(Sequences.from_traces([corpus[i] for i in order]), vocab_size=60)
    assert a.vocab == b.vocab
    assert a.merges.tolist() == b.merges.tolist()


@SETTINGS
@given(t=trees(max_nodes=30))
def test_batch_encoding_equals_one_by_one(t):
    tok = train(Sequences.from_traces([t, t]), vocab_size=80, min_frequency=1)
    other = Trace(t.symbols[::-1], np.full(len(t), -1, np.int32), np.zeros(len(t), np.int32), t.duration[::-1].copy())
    batch = tok.encode_batch([t, other, t])
    for i, x in enumerate([t, other, t]):
        one = tok.encode(x)
        assert batch[i].input_ids.tolist() == one.input_ids.tolist()
        assert batch[i].parent_idx.tolist() == one.parent_idx.tolist()
        assert batch[i].duration.tolist() == one.duration.tolist()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), max_size=25), max_size=6))
def test_dfs_parents_is_the_last_node_one_level_up(seqs):
    """Each node's parent is the last earlier node of its sequence one level up (a stack walk,
    node by node), for any depths, preorders or not."""
    from teller.tpe.serialize import dfs_parents

    depth = np.asarray([d for s in seqs for d in s], np.int64)
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    want = []
    for s in seqs:
        for i, d in enumerate(s):
            ups = [j for j in range(i) if s[j] == d - 1] if d > 0 else []
            want.append(ups[-1] if ups else -1)
    assert dfs_parents(depth, offsets).tolist() == want
