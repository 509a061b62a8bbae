"""Communication edges E_c (docs/design.md §5.5): the same collective on different ranks.

A COMM node is described by (collective, process group, sequence number, bytes), read from:

- our hooks' message ``COMM <collective> bytes=<n> group=<g> seq=<k>`` (the node name keeps
  everything after the tag word);
- Kineto args of NCCL kernels / comm ops: ``Collective name``, ``Process Group Name`` (else
  ``Process Group Description``), a ``Seq``/``seq`` when present, ``In msg nelems`` × ``dtype``.

When no sequence number is given, collectives are numbered 0, 1, ... per (rank, source, group,
collective name) in start order, so the k-th all_reduce of a group on one rank meets the k-th on
the others. Ranges and GPU kernels are matched separately (``source``), since a hooked range and
the NCCL kernel it launches describe the same collective twice.

Instances are matched on (source, group, seq) — plus the collective name when seq was numbered.
Each instance gives edges from its lowest-rank participant to every other participant (a star:
k-1 edges for k ranks, enough to reach all of them). Repeats on one rank keep the earliest.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.reconstruct._np import cumcount, factorize, lexorder, segment_starts

COMM_EDGES_SCHEMA = pa.schema(
    [
        ("src_node_id", pa.int64()),
        ("dst_node_id", pa.int64()),
        ("src_rank", pa.int32()),
        ("dst_rank", pa.int32()),
        ("group", pa.string()),
        ("seq", pa.int64()),
        ("collective", pa.string()),
        ("bytes", pa.int64()),
    ]
)

#: Bytes per element of Kineto ``dtype`` names.
DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2,
    "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "ComplexFloat": 8,
}

_MSG = {
    "collective": r"^(?P<v>[^\s=]+)",
    "bytes": r"(?:^|\s)bytes=(?P<v>\d{1,18})(?:\s|$)",
    "group": r"(?:^|\s)group=(?P<v>\S+)",
    "seq": r"(?:^|\s)seq=(?P<v>\d{1,18})(?:\s|$)",
}
_ARGS = {
    "collective": r'"Collective name"\s*:\s*"(?P<v>[^"]*)"',
    "group": r'"Process Group Name"\s*:\s*"(?P<v>[^"]*)"',
    "group_desc": r'"Process Group Description"\s*:\s*"(?P<v>[^"]*)"',
    "seq": r'"(?:Seq|seq|Sequence number)"\s*:\s*"?(?P<v>\d{1,18})',
    "nelems": r'"In msg nelems"\s*:\s*(?P<v>\d{1,18})',
    "dtype": r'"dtype"\s*:\s*"(?P<v>[^"]*)"',
}


def _grab(text: pa.DictionaryArray, pattern: str) -> pa.Array:
    """The ``v`` group of ``pattern`` per row (null where it does not match), matched once per
    distinct text (the same collective message repeats on every rank)."""
    st = pc.extract_regex(pc.fill_null(text.dictionary, ""), pattern)
    per_text = pc.if_else(st.is_valid(), st.field("v"), pa.scalar(None, pa.string()))
    return per_text.take(text.indices)


def _int(text: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.cast(text, pa.int64()), -1).to_numpy(zero_copy_only=False)


def describe(name: pa.Array, args: pa.Array, is_range: np.ndarray, nbytes: np.ndarray) -> dict[str, object]:
    """Collective, group, seq (-1 unknown) and bytes (-1 unknown) of each COMM node."""
    name = pc.fill_null(name.cast(pa.string()), "")
    names, argd = name.dictionary_encode(), args.cast(pa.string()).dictionary_encode()
    tagged = pc.match_substring_regex(names.dictionary, r"(?:^|\s)(?:bytes|group|seq)=").take(names.indices)
    msg = {k: _grab(names, p) for k, p in _MSG.items()}
    arg = {k: _grab(argd, p) for k, p in _ARGS.items()}
    collective = pc.coalesce(pc.if_else(tagged, msg["collective"], pa.scalar(None, pa.string())), arg["collective"], name)
    group = pc.coalesce(msg["group"], arg["group"], arg["group_desc"], pa.scalar(""))
    seq = _int(pc.coalesce(msg["seq"], arg["seq"]))
    # dtype sizes through a dictionary, not per row
    dt = arg["dtype"].dictionary_encode()
    sizes = np.array([DTYPE_BYTES.get(x, -1) for x in dt.dictionary.to_pylist()] + [-1], dtype=np.int64)
    idx = pc.fill_null(dt.indices, len(dt.dictionary)).to_numpy(zero_copy_only=False)
    elem = sizes[idx]
    nelems = _int(arg["nelems"])
    from_args = np.where((nelems >= 0) & (elem > 0), nelems * elem, -1)
    b = np.where(nbytes >= 0, nbytes, np.maximum(_int(msg["bytes"]), from_args))
    return {"collective": collective, "group": group, "seq": seq, "bytes": b}


def comm_edges(node_id: np.ndarray, rank: np.ndarray, start: np.ndarray, source: np.ndarray, desc: dict[str, object]) -> pa.Table:
    """Match COMM nodes across ranks; ``source`` separates ranges (0) from GPU kernels (1)."""
    n = len(node_id)
    if n == 0:
        return COMM_EDGES_SCHEMA.empty_table()
    coll = desc["collective"].dictionary_encode()
    grp = desc["group"].dictionary_encode()
    cc = coll.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    gc = grp.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    seq = np.asarray(desc["seq"], dtype=np.int64).copy()
    numbered = seq < 0
    if numbered.any():
        k = np.flatnonzero(numbered)
        o = lexorder([rank[k], source[k], gc[k], cc[k], start[k], node_id[k]])
        k = k[o]
        grp_key, _ = factorize([rank[k], source[k], gc[k], cc[k]])
        seq[k] = cumcount(grp_key)
    key, _ = factorize([source.astype(np.int64), gc, np.where(numbered, cc, -1), seq, numbered.astype(np.int64)])
    o = lexorder([key, rank, start, node_id])
    key_o, rank_o = key[o], rank[o]
    first_rank = np.r_[True, (key_o[1:] != key_o[:-1]) | (rank_o[1:] != rank_o[:-1])]
    o = o[first_rank]  # one node per (instance, rank): the earliest
    key_o = key[o]
    lead = segment_starts(key_o)
    head = o[np.maximum.accumulate(np.where(lead, np.arange(len(o)), 0))]
    dst = o[~lead]
    src = head[~lead]
    names = coll.dictionary.take(pa.array(cc[src])) if len(src) else pa.array([], pa.string())
    groups = grp.dictionary.take(pa.array(gc[src])) if len(src) else pa.array([], pa.string())
    return pa.table(
        {
            "src_node_id": node_id[src].astype(np.int64),
            "dst_node_id": node_id[dst].astype(np.int64),
            "src_rank": rank[src].astype(np.int32),
            "dst_rank": rank[dst].astype(np.int32),
            "group": groups,
            "seq": seq[src],
            "collective": names,
            "bytes": np.asarray(desc["bytes"], dtype=np.int64)[src],
        }
    ).cast(COMM_EDGES_SCHEMA)
