"""Schema projection (docs/design.md §9): whatever the network outputs, a prediction is

- a fault type that is one of the five categories, or none (``""``) when the step is normal;
- evidence operators that are nodes of the input (indices into the unit's nodes, anchors of its
  trace tokens), at most ``max_ops``, empty for a normal step;
- an explanation that is one or more complete sentences of at most ``max_chars`` characters
  (empty for a normal step).

:class:`NameTrie` constrains the single-stream model's operator names to the families present in
the input, token by token.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

from teller.rca.data import FAULT_TYPES

#: the abnormal probability from which the model flags a step by itself (:func:`project_fault`)
ABNORMAL_CUT = 0.5

_SENT_END = re.compile(r"[.!?](?=\s|$)")
_WS = re.compile(r"\s+")


def project_fault(probs: np.ndarray, floor: float = ABNORMAL_CUT) -> tuple[float, str, float]:
    """(abnormal probability, fault type or "", its probability given abnormal) from the six
    class probabilities (index 0 normal). The type is the best of the five abnormal classes,
    named when the abnormal probability reaches ``floor``."""
    p = np.nan_to_num(np.asarray(probs, np.float64).reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
    p = np.clip(p, 0.0, None)
    s = p.sum()
    p = p / s if s > 0 else np.full(len(FAULT_TYPES), 1.0 / len(FAULT_TYPES))
    p_ab = float(1.0 - p[0])
    ab = p[1:]
    k = int(np.argmax(ab))
    tp = float(ab[k] / ab.sum()) if ab.sum() > 0 else 1.0 / len(ab)
    return p_ab, (FAULT_TYPES[1 + k] if p_ab >= floor else ""), tp


def project_operators(scores: np.ndarray, anchors: np.ndarray, abnormal: bool, max_ops: int,
                      threshold: float = 0.0, cover: Callable[[int], list[int]] | None = None) -> list[int]:
    """Evidence nodes: anchors of the tokens scored above ``threshold`` (logits; 0 = p 0.5), best
    first, distinct, at most ``max_ops``; the best token's anchor when none passes; none when
    normal. With ``cover`` (token index → its nodes, anchor first) each picked token gives every
    node it returns. Every index returned is one of ``anchors`` or of ``cover``'s nodes."""
    scores = np.nan_to_num(np.asarray(scores, np.float64), nan=-np.inf)
    anchors = np.asarray(anchors, np.int64)
    if not abnormal or not len(anchors) or max_ops <= 0:
        return []
    order = np.argsort(-scores, kind="stable")
    picked = [i for i in order.tolist() if scores[i] > threshold] or order[:1].tolist()
    out: list[int] = []
    for i in picked:
        for a in (cover(i) if cover is not None else [int(anchors[i])]):
            if a not in out:
                out.append(int(a))
            if len(out) >= max_ops:
                return out
    return out


def project_explanation(text: str, fault_type: str, evidence: Sequence[str], max_chars: int) -> str:
    """Whole sentences of ``text`` that fit in ``max_chars``; a sentence that never ends is cut at
    a word and closed; a text with no words is replaced by a sentence built from the type and the
    evidence. Empty for a normal step."""
    if not fault_type:
        return ""
    t = _WS.sub(" ", (text or "").replace("\x00", " ")).strip()
    if not re.search(r"[A-Za-z]{2}", t):
        ev = ", ".join(evidence[:4]) if evidence else "the step as a whole"
        t = f"{fault_type} fault: evidence {ev}."
    ends = [m.end() for m in _SENT_END.finditer(t) if m.end() <= max_chars]
    if ends:
        t = t[:ends[-1]]
    else:
        t = t[:max_chars - 1]
        if " " in t and len(t) >= max_chars - 1:
            t = t[:t.rfind(" ")]
        t = t.rstrip(" ,;:-") + "."
    t = t[0].upper() + t[1:] if t else t
    return t[:max_chars]


class NameTrie:
    """Token-level prefix tree of the allowed operator names (their text token ids)."""

    def __init__(self, names: Sequence[str], ids: Sequence[Sequence[int]]):
        self.root: dict = {}
        for name, seq in zip(names, ids, strict=True):
            if not seq:
                continue
            node = self.root
            for t in seq:
                node = node.setdefault(int(t), {})
            node[None] = name

    def step(self, node: dict, token: int) -> dict | None:
        return node.get(int(token))

    @staticmethod
    def allowed(node: dict) -> list[int]:
        return [k for k in node if k is not None]

    @staticmethod
    def complete(node: dict) -> str | None:
        return node.get(None)

    def remove(self, seq: Sequence[int]) -> None:
        """Forget a name once emitted (no name twice)."""
        path = [self.root]
        for t in seq:
            nxt = path[-1].get(int(t))
            if nxt is None:
                return
            path.append(nxt)
        path[-1].pop(None, None)
        for parent, t in zip(reversed(path[:-1]), reversed(list(seq)), strict=True):
            if parent[int(t)]:
                break
            del parent[int(t)]
