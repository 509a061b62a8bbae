"""Trace Pair Encoding (docs/design.md §8): a structure-preserving tokenizer for call trees.

- :mod:`.serialize`: steps and slices of ``forest.parquet`` → symbol sequences with parent, depth
  and duration side channels (:class:`Sequences`, :class:`Trace`).
- :mod:`.normalize`: name normalization rules (as data) that turn node names into symbols.
- :mod:`.trainer`: the reference statement of TPE (``get_stats``, ``merge``) and the fast ``train``.
- :mod:`.tokenizer`: :class:`TraceTokenizer` (``encode``, ``encode_batch``, ``decode``,
  ``decode_tree``, ``save``/``load``); loading needs neither the trainer nor the engine's counts.
- :mod:`.engine`: merges applied to a whole batch at once, shared by trainer and tokenizer.

``docs/tpe.md`` explains the pair rule and records the compression and speed figures.
"""

from teller.tpe.serialize import (
    Sequences,
    Trace,
    run_step_ids,
    serialize_nodes,
    serialize_run,
    serialize_steps,
)
from teller.tpe.tokenizer import BatchEncoding, Encoding, TraceTokenizer

__all__ = [
    "BatchEncoding",
    "Encoding",
    "Sequences",
    "Trace",
    "TraceTokenizer",
    "run_step_ids",
    "serialize_nodes",
    "serialize_run",
    "serialize_steps",
]
