"""Per-unit model inputs and targets (:class:`Prepared`) and their padded torch batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from teller.rca.context import units_context
from teller.rca.data import (
    FamilySlots,
    ReferenceStats,
    StepInputs,
    family_slots,
    operator_targets,
    slot_targets,
    unit_statistics,
)
from teller.rca.model import RCAConfig
from teller.rca.text import (
    ABN,
    BOS,
    EOS,
    EXPL,
    LOG,
    NO,
    OPS,
    SEP,
    TRACE,
    TYPE,
    TYPE_TOKENS,
    YES,
    encode_texts,
)
from teller.tpe.tokenizer import BOS as TPE_BOS

#: kinds of target tokens (each has its own share of the loss, :func:`teller.rca.train.losses`)
NONE, DECISION, OPERATOR, EXPLANATION, MARKER = range(5)


@dataclass
class Prepared:
    """Everything a batch needs, per unit, as numpy (built once per split)."""

    inputs: StepInputs
    prompt: list[np.ndarray]  # <bos> <log> log ids <trace>
    dur_feat: np.ndarray  # (tokens, 2) float32, flat like inputs.input_ids: log-duration/8, z/4
    parent_off: np.ndarray  # flat int64: i - parent_idx (0 for a root)
    fault: np.ndarray | None = None  # int64 per unit
    op_target: np.ndarray | None = None  # flat float32 per token
    target: list[np.ndarray] | None = None  # target segment ids per unit
    target_kind: list[np.ndarray] | None = None  # kind of each target token (DECISION, ...)
    trace_visible: bool = True  # False: the model reads one placeholder token instead of the tree
    summary_families: list[list[str]] | None = None  # per unit, the families its text summary names
    #: the family slots a family operator head scores (``cfg.op_unit == "family"``), their features
    #: (float32, (slots, 4)) and, with labels, their targets (1: the family is an operator label)
    slots: FamilySlots | None = None
    slot_feat: np.ndarray | None = None
    slot_target: np.ndarray | None = None
    #: per unit, its statistics against the reference (``cfg.unit_stats``: float32, (units,
    #: 2 × len(UNIT_STAT_COLUMNS)), :meth:`ReferenceStats.unit_features`)
    unit_feat: np.ndarray | None = None
    #: per unit, its shape-free context (float32, (units, len(CONTEXT_COLUMNS)),
    #: :mod:`teller.rca.context`), which a flag expert may read; None where not prepared
    unit_ctx: np.ndarray | None = None
    #: what a model computes once per ``Prepared`` (the operator expert's slot probabilities)
    cache: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.inputs)

    def candidates(self, i: int) -> list[str]:
        """The operator families the model may name as evidence for unit ``i``: those of the
        tokens it reads, those its text summary names, or none when it reads neither."""
        if self.trace_visible:
            return self.inputs.candidates(i)
        return list(self.summary_families[i]) if self.summary_families is not None else []


#: TPE id of the placeholder token a model that does not read the tree gets in its place (the
#: tokenizer's <bos>, which no serialized step contains)
TRACE_PLACEHOLDER = TPE_BOS


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f} ms" if ns < 1e7 else f"{ns / 1e6:.1f} ms"


def step_summary(inp: StepInputs, i: int, top: int = 8) -> tuple[str, list[str]]:
    """A structured text summary of unit ``i``'s step, as a prompt-style model reads it (no numeric
    candidate stage, no reference): the step's node and token counts, its total time, and the
    ``top`` operator families by the time of the tokens they anchor, each with its time and token
    count. Returns the text and the families it names."""
    s = inp.tokens(i)
    fam = inp.family[s].astype(np.int64)
    dur = inp.duration[s].astype(np.float64)
    nodes = int(inp.node_offsets[i + 1] - inp.node_offsets[i])
    tot = np.bincount(fam, weights=dur, minlength=len(inp.families)) if len(fam) else np.zeros(len(inp.families))
    cnt = np.bincount(fam, minlength=len(inp.families)) if len(fam) else np.zeros(len(inp.families), np.int64)
    order = [int(j) for j in np.lexsort((np.arange(len(tot)), -tot)) if cnt[j] > 0][:top]
    ranks = len(inp.step_ids[i]) if inp.step_ids else 1
    head = f"step: {nodes} nodes, {ranks} rank{'s' if ranks != 1 else ''}, {_ms(float(dur.sum()))} of self time."
    parts = [f"{inp.families[j]} {_ms(float(tot[j]))} x{int(cnt[j])}" for j in order]
    return head + " top: " + "; ".join(parts) + ".", [inp.families[j] for j in order]


def prepare(inp: StepInputs, text_tok, ref: ReferenceStats, cfg: RCAConfig, fault: np.ndarray | None = None,
            operator_labels: list[list[str]] | None = None, explanation: list[str] | None = None,
            iterations: np.ndarray | None = None, context: np.ndarray | None = None) -> Prepared:
    """Model inputs of ``inp``; with labels, also the training targets of ``cfg.variant``. A model
    that reads unit statistics also gets each unit's shape-free context (:mod:`teller.rca.context`):
    ``context`` where the caller has it (a dataset's, against its whole runs), else
    :func:`teller.rca.context.units_context` of ``inp`` and ``iterations`` (one row of
    :data:`teller.localize.features.ITER_FEATURES` per unit; None: unknown)."""
    texts = list(inp.log_text) if cfg.reads_log else [""] * len(inp)
    summary_families = None
    if cfg.inputs == "summary+log":
        summ = [step_summary(inp, i) for i in range(len(inp))]
        summary_families = [f for _, f in summ]
        texts = [f"{t}\n{x}" if x else t for (t, _), x in zip(summ, texts, strict=True)]
    logs = encode_texts(text_tok, texts, cfg.max_log_tokens)
    prompt = [np.asarray([BOS, LOG, *ids, TRACE], np.int64) for ids in logs]
    ld = ReferenceStats.log_duration(inp.duration)
    z = ref.z(inp.input_ids, inp.duration)
    feat = np.stack([ld / 8.0, z / 4.0], 1).astype(np.float32)
    pos = np.arange(len(inp.input_ids)) - np.repeat(inp.offsets[:-1], np.diff(inp.offsets))
    par = inp.parent_idx.astype(np.int64)
    poff = np.where(par >= 0, pos - par, 0)
    prep = Prepared(inp, prompt, feat, poff, trace_visible=cfg.reads_trace, summary_families=summary_families)
    if cfg.reads_family_slots:
        prep.slots = family_slots(inp)
        prep.slot_feat = ref.family_features(prep.slots, inp.families)
    if cfg.reads_unit_stats:
        stats = unit_statistics(inp)
        prep.unit_feat = ref.unit_features(stats)
        prep.unit_ctx = units_context(inp, stats, iterations) if context is None else context
    if fault is None:
        return prep
    prep.fault = np.asarray(fault, np.int64)
    prep.op_target = operator_targets(inp, operator_labels or [[] for _ in range(len(inp))])
    if prep.slots is not None:
        prep.slot_target = slot_targets(prep.slots, inp.families, operator_labels or [[] for _ in range(len(inp))])
    ex = encode_texts(text_tok, explanation or [""] * len(inp), cfg.max_expl_tokens)
    tgt, wts = [], []
    if cfg.variant == "mot":
        for e in ex:
            tgt.append(np.asarray([EXPL, *e, EOS], np.int64))
            wts.append(np.asarray([NONE] + [EXPLANATION] * (len(e) + 1), np.int64))
    else:
        cand_ids: dict[str, list[int]] = {}
        for i, e in enumerate(ex):
            f = int(prep.fault[i])
            if f == 0:
                t = [ABN, NO, TYPE, TYPE_TOKENS[0], EOS]
                w = [NONE, DECISION, MARKER, DECISION, MARKER]
                tgt.append(np.asarray(t, np.int64))
                wts.append(np.asarray(w, np.int64))
                continue
            t = [ABN, YES, TYPE, TYPE_TOKENS[f], OPS]
            w = [NONE, DECISION, MARKER, DECISION, MARKER]
            cands = set(prep.candidates(i))
            names = [n for n in dict.fromkeys(operator_labels[i] if operator_labels else []) if n in cands][:cfg.max_ops]
            for k, n in enumerate(names):
                if n not in cand_ids:
                    cand_ids[n] = encode_texts(text_tok, [n], 64)[0]
                if k:
                    t.append(SEP)
                    w.append(OPERATOR)
                t += cand_ids[n]
                w += [OPERATOR] * len(cand_ids[n])
            t.append(EXPL)
            w.append(OPERATOR)
            t += list(e) + [EOS]
            w += [EXPLANATION] * (len(e) + 1)
            tgt.append(np.asarray(t, np.int64))
            wts.append(np.asarray(w, np.int64))
    prep.target, prep.target_kind = tgt, wts
    return prep


def _pad(rows: list[np.ndarray], value: int | float, dtype) -> tuple[np.ndarray, np.ndarray]:
    L = max(1, max((len(r) for r in rows), default=1))
    out = np.full((len(rows), L), value, dtype=dtype)
    valid = np.zeros((len(rows), L), bool)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
        valid[i, :len(r)] = True
    return out, valid


def trace_batch(prep: Prepared, idx: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    inp = prep.inputs
    if not prep.trace_visible:  # one placeholder token per unit: the tree is not read
        n = len(idx)
        z = torch.zeros((n, 1), dtype=torch.long, device=device)
        return {"ids": torch.full((n, 1), TRACE_PLACEHOLDER, dtype=torch.long, device=device), "depth": z,
                "parent_off": z.clone(), "valid": torch.ones((n, 1), dtype=torch.bool, device=device),
                "dur": torch.zeros((n, 1, 2), dtype=torch.float32, device=device)}
    sl = [inp.tokens(int(i)) for i in idx]
    ids, valid = _pad([inp.input_ids[s] for s in sl], 0, np.int64)
    depth, _ = _pad([inp.depth[s] for s in sl], 0, np.int64)
    poff, _ = _pad([prep.parent_off[s] for s in sl], 0, np.int64)
    L = ids.shape[1]
    dur = np.zeros((len(idx), L, 2), np.float32)
    for k, s in enumerate(sl):
        dur[k, :s.stop - s.start] = prep.dur_feat[s]
    t = {"ids": ids, "depth": depth, "parent_off": poff, "valid": valid}
    if prep.slots is not None:
        t.update(slot_batch(prep, idx, L))
    if prep.unit_feat is not None:
        t["unit_feat"] = prep.unit_feat[np.asarray(idx, np.int64)]
    out = {k: torch.from_numpy(v).to(device) for k, v in t.items()}
    out["dur"] = torch.from_numpy(dur).to(device)
    return out


def slot_batch(prep: Prepared, idx: np.ndarray, L: int) -> dict[str, np.ndarray]:
    """The family slots of units ``idx`` padded to the batch: ``fam_member`` (B, S, L) float32,
    each slot's row the mean over the tokens that stand for it (zero when none was kept),
    ``fam_feat`` (B, S, 4), ``fam_valid`` (B, S) and, with targets, ``fam_target`` (B, S)."""
    sl = prep.slots
    S = max(1, max((int(sl.offsets[i + 1] - sl.offsets[i]) for i in idx.tolist()), default=1))
    B = len(idx)
    member = np.zeros((B, S, L), np.float32)
    feat = np.zeros((B, S, prep.slot_feat.shape[1]), np.float32)
    valid = np.zeros((B, S), bool)
    target = np.zeros((B, S), np.float32)
    for k, i in enumerate(idx.tolist()):
        s, m = sl.slots(i), sl.members(i)
        n = s.stop - s.start
        feat[k, :n] = prep.slot_feat[s]
        valid[k, :n] = True
        if prep.slot_target is not None:
            target[k, :n] = prep.slot_target[s]
        member[k, sl.member_slot[m], sl.member_tok[m]] = 1.0
    member /= np.maximum(member.sum(2, keepdims=True), 1.0)
    out = {"fam_member": member, "fam_feat": feat, "fam_valid": valid}
    if prep.slot_target is not None:
        out["fam_target"] = target
    return out


def prompt_batch(prep: Prepared, idx: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    p, v = _pad([prep.prompt[int(i)] for i in idx], 0, np.int64)
    return torch.from_numpy(p).to(device), torch.from_numpy(v).to(device)


def target_batch(rows: list[np.ndarray], device: torch.device, kinds: list[np.ndarray] | None = None):
    t, v = _pad(rows, 0, np.int64)
    out = [torch.from_numpy(t).to(device), torch.from_numpy(v).to(device)]
    if kinds is not None:
        k, _ = _pad(kinds, NONE, np.int64)
        out.append(torch.from_numpy(k).to(device))
    return out
