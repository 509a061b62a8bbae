"""Log templates with drain3 (a real online template miner), configured in code.

Variable parts are masked before clustering (drain3 masking instructions, listed below as data):
request ids, UUIDs and long hex ids, hex numbers, IP addresses, paths with line numbers, and
numbers (with decimals, signs, exponents and a unit suffix such as ``12.5ms`` or ``3GiB``).
The patterns are valid both for Python ``re`` (drain3) and RE2, so the same masking is first run
over the whole column in Arrow; drain3 then sees each distinct masked message once, in first-seen
order (its own masking of an already masked text changes nothing). Each line gets the final
template of its cluster, and template ids are drain3's cluster ids (1, 2, ...).
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: (regex, mask name), applied in order.
MASKS: tuple[tuple[str, str], ...] = (
    (r"\b(?:chatcmpl|cmpl)-[0-9A-Za-z]+(?:-[0-9A-Za-z]+)*", "REQ"),
    (r"\breq_\d+(?:__child#\d+)?", "REQ"),
    (r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b", "UUID"),
    (r"\b0x[0-9a-fA-F]+\b", "HEX"),
    (r"\b[0-9a-fA-F]{8,}\b", "ID"),
    (r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?::\d+)?\b", "IP"),
    (r"[-+]?\b\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?:[a-zA-Z%]{1,3})?\b", "NUM"),
)


def _miner(sim_th: float = 0.4, depth: int = 4):
    from drain3 import TemplateMiner
    from drain3.masking import MaskingInstruction
    from drain3.template_miner_config import TemplateMinerConfig

    cfg = TemplateMinerConfig()
    cfg.profiling_enabled = False
    cfg.drain_sim_th = sim_th
    cfg.drain_depth = depth
    cfg.masking_instructions = [MaskingInstruction(rx, name) for rx, name in MASKS]
    cfg.mask_prefix, cfg.mask_suffix = "<", ">"
    logging.getLogger("drain3").setLevel(logging.WARNING)
    return TemplateMiner(persistence_handler=None, config=cfg)


def mask(messages: pa.Array) -> pa.Array:
    """Apply :data:`MASKS` to a column of messages (vectorized, RE2)."""
    out = messages
    for rx, name in MASKS:
        out = pc.replace_substring_regex(out, rx, f"<{name}>")
    return out


def mine_templates(messages: pa.Array, sim_th: float = 0.4, depth: int = 4
                   ) -> tuple[np.ndarray, pa.Array]:
    """Template id (int32) and template text for every message."""
    n = len(messages)
    if n == 0:
        return np.zeros(0, np.int32), pa.array([], pa.string())
    masked = mask(messages.cast(pa.string()).fill_null(""))
    enc = masked.dictionary_encode()
    uniq = enc.dictionary.to_pylist()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    # first-seen order of the distinct messages, so clustering follows the log's order
    first = np.full(len(uniq), n, np.int64)
    np.minimum.at(first, codes, np.arange(n))
    miner = _miner(sim_th, depth)
    cluster_of = np.zeros(len(uniq), np.int64)
    for u in np.argsort(first, kind="stable").tolist():
        res = miner.add_log_message(uniq[u])
        cluster_of[u] = res["cluster_id"]
    ids = sorted({int(c) for c in cluster_of.tolist()})
    text = {c.cluster_id: c.get_template() for c in miner.drain.clusters}
    tid = cluster_of[codes].astype(np.int32)
    tmpl = pa.DictionaryArray.from_arrays(
        pa.array(np.searchsorted(ids, cluster_of[codes]).astype(np.int32)),
        pa.array([text.get(c, "") for c in ids], pa.string()),
    )
    return tid, tmpl.cast(pa.string())
