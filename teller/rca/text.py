"""The text side's tokenizer: byte-level BPE trained with Hugging Face ``tokenizers`` on the
dataset's log lines, explanations and operator family names, saved as ``tokenizer.json``.

Special tokens (fixed ids, first in the vocabulary) frame the model inputs and the single-stream
target (:mod:`.model`): ``<pad> <bos> <eos> <log> <trace> <expl> <abn> <yes> <no> <type> <ops>
<sep>`` and one ``<t:TYPE>`` per fault class, so the type is one token and constrained decoding
reads it off one distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from teller.errors import InputError
from teller.rca.data import FAULT_TYPES

SPECIALS = ("<pad>", "<bos>", "<eos>", "<log>", "<trace>", "<expl>", "<abn>", "<yes>", "<no>", "<type>", "<ops>",
            "<sep>") + tuple(f"<t:{t}>" for t in FAULT_TYPES)
PAD, BOS, EOS, LOG, TRACE, EXPL, ABN, YES, NO, TYPE, OPS, SEP = range(12)
TYPE_TOKENS = tuple(range(12, 12 + len(FAULT_TYPES)))


def train_text_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    check_specials(tok, "trained tokenizer")
    return tok


def check_specials(tok, where: str) -> None:
    for i, s in enumerate(SPECIALS):
        if tok.token_to_id(s) != i:
            raise InputError(where, f"special token {s!r} is not id {i}",
                             "use the tokenizer.json written by `teller rca train` (or retrain)")


def load_text_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.is_file():
        raise InputError(p, "missing", "retrain the model with `teller rca train`")
    tok = Tokenizer.from_file(str(p))
    check_specials(tok, str(p))
    return tok


def encode_texts(tok, texts: list[str], max_len: int) -> list[list[int]]:
    """Token ids of each text, cut to ``max_len`` (an empty text gives no ids)."""
    out = []
    encs = tok.encode_batch([t or "" for t in texts], add_special_tokens=False)
    for e in encs:
        out.append(e.ids[:max_len])
    return out
