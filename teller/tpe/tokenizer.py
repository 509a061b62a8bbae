"""The TPE tokenizer: symbols of a serialized step or slice → tokens with side channels.

Saved as three files, loadable without the trainer (docs/design.md §8):

- ``vocab.json``: ``{token: id}``. Base tokens are the specials, one unknown token per layer
  (``<unk:K>``, ...) and the symbols seen in training (``"K at::native::elementwise_kernel"``);
  a merged token is written as the subtree it stands for: ``a ⟨b⟩`` (b hangs under a),
  ``a · b`` (b beside a), nested as needed.
- ``merges.json``: ``{"merges": [[left_id, right_id, depth_step, new_id], ...]}`` in rank order.
  ``depth_step`` is 0 for siblings and k ≥ 1 when the right token hangs k levels below the left
  token's first node. Two merges that build the same subtree (``(a·b)·c`` and ``a·(b·c)``) make the
  same token, as two BPE merges that spell the same string do in Hugging Face ``tokenizers``;
  otherwise ``new_id`` is the next free id.
- ``tokenizer_config.json``: format, version, sizes, special and unknown tokens, the pair rule,
  how sequences are serialized (symbol form, duration kind) and the normalization rules.

``encode`` applies the merges as BPE does (the lowest-ranked pair present first), with TPE's pair
rule and side channels (see :mod:`teller.tpe.engine`). A symbol the vocabulary does not know
becomes its layer's unknown token (``<unk>`` for an unknown layer): it keeps its place, parent,
depth and duration, and merges with nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from teller.errors import InputError, TellerError
from teller.rundir import LAYERS
from teller.tpe.engine import MergeEngine
from teller.tpe.normalize import RESERVED, Normalizer, symbol_layer
from teller.tpe.serialize import (
    DURATIONS,
    Sequences,
    Trace,
    check_preorder,
    dfs_parents,
    ranges,
    serialize_run,
)

FORMAT = "teller-tpe"
FORMAT_VERSION = 1
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
PAD, UNK, BOS, EOS = range(4)
#: Layers with an unknown-symbol token of their own: those of format version 1 (GAP, added to the
#: forest later, has none: an unknown GAP symbol reads as ``<unk>``).
TOKEN_LAYERS = tuple(lay for lay in LAYERS if lay != "GAP")
UNK_LAYER = {lay: f"<unk:{lay}>" for lay in TOKEN_LAYERS}
PAIR_RULE = (
    "adjacent tokens (L, R) in depth-first order where R is L's child (parent(R) = L) or L's "
    "sibling at the same depth (parent(R) = parent(L), depth(R) = depth(L)); key (id L, id R, "
    "depth(R) - depth(L))"
)
CHILD, SIBLING = "⟨", "·"
#: Longer renderings of merged tokens are cut and suffixed with the token id (still unique).
MAX_TOKEN_TEXT = 200


@dataclass
class Encoding:
    """One encoded sequence (docs/design.md §8 names)."""

    input_ids: np.ndarray
    parent_idx: np.ndarray
    duration: np.ndarray
    depth: np.ndarray
    n_nodes: int = 0
    n_unknown: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, k: str) -> np.ndarray:
        return getattr(self, k)

    def keys(self) -> tuple[str, ...]:
        return ("input_ids", "parent_idx", "duration", "depth")


@dataclass
class BatchEncoding:
    """Encoded sequences, columnar: sequence ``i`` is ``offsets[i]:offsets[i+1]`` of each array."""

    input_ids: np.ndarray
    parent_idx: np.ndarray
    duration: np.ndarray
    depth: np.ndarray
    offsets: np.ndarray
    n_nodes: np.ndarray
    n_unknown: np.ndarray
    key: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Encoding:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Encoding(self.input_ids[a:b], self.parent_idx[a:b], self.duration[a:b], self.depth[a:b],
                        int(self.n_nodes[i]), int(self.n_unknown[i]))

    def __iter__(self) -> Iterator[Encoding]:
        for i in range(len(self)):
            yield self[i]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def to_arrow(self) -> pa.Table:
        """One row per sequence, list columns (what ``teller tpe encode`` writes)."""
        off = pa.array(self.offsets.astype(np.int32) if self.offsets[-1] < 2**31 else self.offsets)
        lst = pa.ListArray if off.type == pa.int32() else pa.LargeListArray
        return pa.table({
            "key": pa.array(self.key if len(self.key) else np.arange(len(self), dtype=np.int64)),
            "n_nodes": pa.array(self.n_nodes.astype(np.int64)),
            "n_tokens": pa.array(self.lengths().astype(np.int64)),
            "n_unknown": pa.array(self.n_unknown.astype(np.int64)),
            "input_ids": lst.from_arrays(off, pa.array(self.input_ids)),
            "parent_idx": lst.from_arrays(off, pa.array(self.parent_idx)),
            "duration": lst.from_arrays(off, pa.array(self.duration)),
            "depth": lst.from_arrays(off, pa.array(self.depth)),
        })


def token_text(symbols: Sequence[str], depths: Sequence[int], token_id: int) -> str:
    """The vocabulary text of a merged token: its rendering, cut at MAX_TOKEN_TEXT."""
    s = render(symbols, depths)
    return s if len(s) <= MAX_TOKEN_TEXT else s[:MAX_TOKEN_TEXT] + f"… ⟪{token_id}⟫"


def render(symbols: Sequence[str], depths: Sequence[int]) -> str:
    """A subtree fragment as text: ``a ⟨b ⟨c⟩⟩ · d`` (b under a, c under b, d beside a)."""
    out: list[str] = []
    prev = 0
    for k, (s, d) in enumerate(zip(symbols, depths, strict=True)):
        if k == 0:
            out.append(s)
        elif d > prev:
            out.append(f" {CHILD}" + s)
        else:
            out.append("⟩" * (prev - d) + f" {SIBLING} " + s)
        prev = d
    out.append("⟩" * prev)
    return "".join(out)


class TraceTokenizer:
    """A trained TPE vocabulary: ``encode``/``encode_batch``/``decode``; ``save``/``load``."""

    def __init__(self, symbols: Sequence[str], merges: Sequence[Sequence[int]] = (), normalizer: Normalizer | None = None,
                 duration: str = "self", meta: dict[str, Any] | None = None):
        if duration not in DURATIONS:
            raise ValueError(f"duration must be one of {DURATIONS}, not {duration!r}")
        self.normalizer = normalizer or Normalizer()
        self.duration = duration
        self.meta = dict(meta or {})
        base = list(SPECIAL_TOKENS) + list(UNK_LAYER.values())
        seen = set(base)
        for s in symbols:
            if any(c in s for c in RESERVED):
                raise TellerError(f"symbol {s!r} uses one of the characters {RESERVED} that TPE reserves for merged tokens; normalize names with teller.tpe.normalize")
            if s in seen:
                raise TellerError(f"symbol {s!r} appears twice in the base vocabulary (or clashes with a special token)")
            seen.add(s)
            base.append(s)
        self.n_base = len(base)
        self.merges = np.asarray(merges, dtype=np.int64).reshape(-1, 4)
        self._tokens = base
        self._build_templates()

    # ---- vocabulary ---------------------------------------------------------------------------
    def _build_templates(self) -> None:
        """Each token's inner subtree: base symbol ids and depths relative to its first node."""
        tsym: list[np.ndarray] = [np.array([i], np.int32) for i in range(self.n_base)]
        tdep: list[np.ndarray] = [np.zeros(1, np.int32) for _ in range(self.n_base)]
        strings = list(self._tokens)
        for r, (a, b, dd, new) in enumerate(self.merges.tolist()):
            n = len(tsym)
            if not (0 <= a < n and 0 <= b < n) or a in (PAD, UNK, BOS, EOS) or b in (PAD, UNK, BOS, EOS) or not 0 <= dd <= int(tdep[a].max()) + 1 or not self.n_base <= new <= n:
                raise TellerError(f"merge {r} {[a, b, dd, new]} names an unknown token or an impossible depth step; the merges file is damaged")
            sym = np.concatenate([tsym[a], tsym[b]])
            dep = np.concatenate([tdep[a], tdep[b] + dd])
            if new < n:
                if not (np.array_equal(tsym[new], sym) and np.array_equal(tdep[new], dep)):
                    raise TellerError(f"merge {r} {[a, b, dd, new]} builds a different subtree than token {new}; the merges file is damaged")
                continue
            tsym.append(sym)
            tdep.append(dep)
            strings.append(token_text([strings[k] for k in sym.tolist()], dep.tolist(), new))
        if len(set(strings)) != len(strings):
            raise TellerError("two tokens have the same text; a base symbol uses the characters reserved for merged tokens")
        self.vocab: list[str] = strings
        self.token_to_id: dict[str, int] = {s: i for i, s in enumerate(strings)}
        lens = np.array([len(t) for t in tsym], dtype=np.int64)
        self._t_off = np.zeros(len(tsym) + 1, dtype=np.int64)
        np.cumsum(lens, out=self._t_off[1:])
        self._t_sym = np.concatenate(tsym).astype(np.int32)
        self._t_dep = np.concatenate(tdep).astype(np.int32)
        self._capacity = len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def id_of(self, symbol: str) -> int:
        """The token id of a base symbol, or its layer's unknown token."""
        i = self.token_to_id.get(symbol)
        if i is not None and i >= len(SPECIAL_TOKENS) + len(UNK_LAYER) and i < self.n_base:
            return i
        lay = symbol_layer(symbol)
        return self.token_to_id[UNK_LAYER[lay]] if lay in UNK_LAYER else UNK

    def is_unknown(self, ids: np.ndarray) -> np.ndarray:
        return (ids == UNK) | ((ids >= len(SPECIAL_TOKENS)) & (ids < len(SPECIAL_TOKENS) + len(UNK_LAYER)))

    # ---- encoding -----------------------------------------------------------------------------
    def encode(self, trace: Trace | Sequences) -> Encoding:
        """Encode one sequence: ``input_ids``, ``parent_idx``, ``duration``, ``depth``."""
        batch = trace if isinstance(trace, Sequences) else Sequences.from_traces([trace])
        if len(batch) != 1:
            raise TellerError(f"encode takes one sequence, got {len(batch)}; use encode_batch")
        return self.encode_batch(batch)[0]

    def encode_batch(self, batch: Sequences | Sequence[Trace]) -> BatchEncoding:
        """Encode many sequences at once (identical sequences are encoded once)."""
        if not isinstance(batch, Sequences):
            batch = Sequences.from_traces(list(batch))
        if not batch.checked:
            check_preorder(batch.parent, batch.depth, batch.offsets)
        lut = np.array([self.id_of(s) for s in batch.symbols] or [UNK], dtype=np.int32)
        ids = lut[batch.codes] if len(batch.codes) else np.zeros(0, np.int32)
        unknown = self.is_unknown(ids)
        uniq, rep = _dedup(ids, batch.parent, batch.depth, batch.offsets)
        sub = _select(ids, batch.parent, batch.depth, batch.offsets, uniq)
        eng = MergeEngine(sub[0], sub[1], sub[2], sub[3], capacity=self._capacity, count_pairs=False, merges=self.merges)
        eng.drain()
        pos = eng.live()
        u_off = sub[3]
        u_tok_off = np.searchsorted(pos, u_off).astype(np.int64)
        u_seq = np.repeat(np.arange(len(uniq), dtype=np.int64), np.diff(u_tok_off))
        p = eng.par[pos]  # the first node's parent (n for roots); its token holds it
        u_par = np.where(p < eng.n, np.searchsorted(pos, p, side="right") - 1 - u_tok_off[u_seq], -1)
        u_rel = pos - u_off[u_seq]  # token starts relative to their sequence
        # every sequence takes its representative's tokens; durations from its own nodes
        n_tok = np.diff(u_tok_off)[rep]
        offsets = np.zeros(len(rep) + 1, dtype=np.int64)
        np.cumsum(n_tok, out=offsets[1:])
        take = ranges(u_tok_off[rep], u_tok_off[rep + 1])
        starts = u_rel[take] + np.repeat(batch.offsets[:-1], n_tok)
        dur = np.add.reduceat(batch.duration.astype(np.int64), starts) if starts.size else np.zeros(0, np.int64)
        seq_of_node = np.repeat(np.arange(len(batch), dtype=np.int64), batch.lengths())
        n_unk = np.bincount(seq_of_node[unknown], minlength=len(batch)) if len(batch) else np.zeros(0, np.int64)
        return BatchEncoding(
            input_ids=eng.sym[pos][take].astype(np.int32),
            parent_idx=u_par[take].astype(np.int32),
            duration=dur.astype(np.int64),
            depth=eng.dep[pos][take].astype(np.int32),
            offsets=offsets,
            n_nodes=batch.lengths().astype(np.int64),
            n_unknown=n_unk.astype(np.int64),
            key=batch.key.copy() if len(batch.key) else np.arange(len(batch), dtype=np.int64),
        )

    def encode_run(self, run: str | os.PathLike, step_ids: Sequence[int] | None = None) -> BatchEncoding:
        """Every step of a reconstructed run (or the given step node ids)."""
        return self.encode_batch(serialize_run(run, step_ids, self.duration, self.normalizer))

    # ---- decoding -----------------------------------------------------------------------------
    def _expand(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.vocab)):
            bad = int(ids[(ids < 0) | (ids >= len(self.vocab))][0])
            raise TellerError(f"token id {bad} is outside the vocabulary (size {len(self.vocab)})")
        rows = ranges(self._t_off[ids], self._t_off[ids + 1])
        lens = self._t_off[ids + 1] - self._t_off[ids]
        return self._t_sym[rows], self._t_dep[rows], lens

    def decode(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        """The symbol sequence the tokens stand for (``<pad>`` skipped)."""
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[ids != PAD]
        syms, _, _ = self._expand(ids)
        voc = self.vocab
        return [voc[i] for i in syms.tolist()]

    def decode_tree(self, ids: Sequence[int] | np.ndarray, depth: Sequence[int] | np.ndarray) -> Trace:
        """Symbols with their node-level parents and depths (durations of merged nodes are summed
        in the tokens and cannot be split: the trace's durations are zero)."""
        ids = np.asarray(ids, dtype=np.int64)
        syms, rel, lens = self._expand(ids)
        d = np.repeat(np.asarray(depth, dtype=np.int64), lens) + rel
        par = dfs_parents(d, np.array([0, len(d)], dtype=np.int64))
        voc = self.vocab
        return Trace([voc[i] for i in syms.tolist()], par.astype(np.int32), d.astype(np.int32), np.zeros(len(d), np.int64))

    def truncate(self, vocab_size: int) -> "TraceTokenizer":
        """The tokenizer that training with target ``vocab_size`` would have produced from the same
        corpus: merges are learned greedily, so it is the prefix of merges up to the one that
        creates token ``vocab_size - 1`` (all of them when this vocabulary is not larger)."""
        if vocab_size <= self.n_base:
            k = 0
        elif vocab_size >= len(self.vocab):
            k = len(self.merges)
        else:
            k = int(np.flatnonzero(self.merges[:, 3] == vocab_size - 1)[0]) + 1
        base = self.vocab[len(SPECIAL_TOKENS) + len(UNK_LAYER) : self.n_base]
        return TraceTokenizer(base, self.merges[:k], self.normalizer, self.duration, self.meta)

    def token_length(self, ids: np.ndarray) -> np.ndarray:
        """Number of serialized nodes each token stands for."""
        ids = np.asarray(ids, dtype=np.int64)
        return self._t_off[ids + 1] - self._t_off[ids]

    # ---- files --------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tokenizer_class": "TraceTokenizer",
            "vocab_size": len(self.vocab),
            "base_vocab_size": self.n_base,
            "num_merges": int(len(self.merges)),
            "special_tokens": {"pad": SPECIAL_TOKENS[PAD], "unk": SPECIAL_TOKENS[UNK], "bos": SPECIAL_TOKENS[BOS], "eos": SPECIAL_TOKENS[EOS]},
            "unknown_tokens": UNK_LAYER,
            "pair_rule": PAIR_RULE,
            "side_channels": {
                "parent_idx": "index of the parent token in the same sequence, -1 for a root",
                "depth": "depth of the token's first node below the sequence root",
                "duration": f"sum of the {self.duration} times (ns) of the nodes the token stands for",
            },
            "serialization": {"order": "depth-first preorder (forest row order)", "symbol": "LAYER normalized-name", "duration": self.duration},
            "normalization": self.normalizer.to_json(),
            **({"training": {k: v for k, v in self.meta["training"].items() if "seconds" not in k}} if "training" in self.meta else {}),
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``vocab.json``, ``merges.json`` and ``tokenizer_config.json``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        files = {
            "vocab.json": {s: i for i, s in enumerate(self.vocab)},
            "merges.json": {"version": FORMAT_VERSION, "merges": self.merges.tolist()},
            "tokenizer_config.json": self.config(),
        }
        for name, obj in files.items():
            tmp = d / f"{name}.tmp"
            tmp.write_text(json.dumps(obj, indent=1 if name != "merges.json" else None, ensure_ascii=False))
            tmp.replace(d / name)
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "TraceTokenizer":
        """Read a saved tokenizer (only this module and :mod:`.normalize` are needed)."""
        d = Path(directory)
        fix = "train one with `teller tpe train RUN... -o DIR --vocab-size N`"
        objs = {}
        for name in ("vocab.json", "merges.json", "tokenizer_config.json"):
            p = d / name
            if not p.is_file():
                raise InputError(p, "missing", fix)
            try:
                objs[name] = json.loads(p.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InputError(p, f"not valid JSON ({e})", fix) from e
        cfg = objs["tokenizer_config.json"]
        if cfg.get("format") != FORMAT or not isinstance(cfg.get("version"), int) or cfg["version"] > FORMAT_VERSION:
            raise InputError(d / "tokenizer_config.json", f"format {cfg.get('format')!r} version {cfg.get('version')!r} is not a TPE tokenizer this teller reads ({FORMAT} ≤ {FORMAT_VERSION})", fix)
        vocab = objs["vocab.json"]
        n_base = int(cfg["base_vocab_size"])
        by_id = sorted(vocab.items(), key=lambda kv: kv[1])
        if [i for _, i in by_id] != list(range(len(by_id))):
            raise InputError(d / "vocab.json", "ids are not 0..N-1", fix)
        n_fixed = len(SPECIAL_TOKENS) + len(UNK_LAYER)
        if [s for s, _ in by_id[:n_fixed]] != list(SPECIAL_TOKENS) + list(UNK_LAYER.values()):
            raise InputError(d / "vocab.json", "the special and unknown tokens are not the first ids", fix)
        symbols = [s for s, _ in by_id[n_fixed:n_base]]
        m = objs["merges.json"]
        merges = m["merges"] if isinstance(m, dict) else m
        try:
            tok = cls(symbols, merges, Normalizer.from_json(cfg["normalization"]), cfg.get("serialization", {}).get("duration", "self"),
                      {"training": cfg["training"]} if "training" in cfg else None)
        except (KeyError, ValueError, TypeError) as e:
            raise InputError(d, f"inconsistent tokenizer files ({e})", fix) from e
        if tok.vocab != [s for s, _ in by_id]:
            raise InputError(d / "vocab.json", "merged tokens do not match merges.json", fix)
        return tok


def _dedup(ids: np.ndarray, parent: np.ndarray, depth: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Representatives of identical sequences (same tokens and shape): (unique indices, index of
    each sequence's representative among them). One hash per sequence, a loop over sequences."""
    n = len(offsets) - 1
    seen: dict[bytes, int] = {}
    uniq: list[int] = []
    rep = np.empty(n, dtype=np.int64)
    off = offsets.tolist()
    for i in range(n):
        a, b = off[i], off[i + 1]
        k = ids[a:b].tobytes() + b"|" + depth[a:b].tobytes() + b"|" + parent[a:b].tobytes()
        j = seen.get(k)
        if j is None:
            j = seen[k] = len(uniq)
            uniq.append(i)
        rep[i] = j
    return np.asarray(uniq, dtype=np.int64), rep


def _select(ids: np.ndarray, parent: np.ndarray, depth: np.ndarray, offsets: np.ndarray, idx: np.ndarray):
    a, b = offsets[idx], offsets[idx + 1]
    rows = ranges(a, b)
    off = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(b - a, out=off[1:])
    return ids[rows], parent[rows], depth[rows], off
