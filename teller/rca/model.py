"""The two RCA models of docs/design.md §9, on a Hugging Face ``transformers`` causal LM.

Symbols (per unit: a step and view):

- trace tokens ``w_i`` with parent index ``p_i``, depth ``d_i`` and duration ``Δ_i`` (TPE);
  the trace encoder gives ``e_i = E_tok[w_i] + E_depth[min(d_i, D-1)] + E_par[min(i - p_i, P)]
  + MLP([log1p(Δ_i/1µs)/8, z_i/4])`` where ``E_par[0]`` marks a root and ``z_i`` is the robust z
  of the log-duration against the token's reference statistics (:class:`.data.ReferenceStats`);
- log tokens ``x`` (byte-level BPE of the step's log lines) and explanation tokens ``y``.

**Variant A, "mot"** (mixture of traces and logs, dual head). The sequence is
``[<bos> <log> x] [e_1..e_T] [<expl> y <eos>]``: the first and last segments are the *log stream*,
the middle one the *trace stream*. At every layer ℓ both streams are normalised by their own
RMSNorm, concatenated and passed through the **one shared causal self-attention** of the backbone's
layer ℓ (``LlamaAttention``, rotary positions over the whole sequence), split again, and refined
by two separate feed-forward branches: the backbone layer's ``LlamaMLP`` for the log stream and a
trace ``LlamaMLP`` of the same shape for the trace stream (initialised from the backbone's when it
is pretrained). Heads: ``fault = W_f · (mean_i h^trace_i + u)`` over the six classes (normal + five
types), ``op_i = w_o · h^trace_i`` per trace token, and the backbone's LM head on the log stream
writes ``y``; ``u = MLP(unit statistics)`` with ``RCAConfig.unit_stats``, else 0 (in training a
share ``RCAConfig.pool_drop`` of the units' fault heads read ``u`` alone). Loss ``L = CE(fault) + λ · LM(y) + μ · BCE(op)``.

**Variant B, "single"**. The backbone reads ``[<bos> <log> x <trace>] [e_1..e_T]`` followed by
the target ``<abn> yes|no <type> <t:TYPE> <ops> name (<sep> name)* <expl> y <eos>`` (trace
embeddings enter through ``inputs_embeds``), and generates the target autoregressively; the loss
is the target's cross-entropy, split as in A: decision tokens + μ · operator-name tokens + λ ·
explanation tokens. Decoding is constrained (:mod:`.schema`).

Attention masks are additive float masks (causal and key padding), which both the eager and the
SDPA attention functions of transformers accept, in 5.17 and 5.24 alike.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from teller.rca import llama
from teller.rca.data import FAULT_TYPES, UNIT_STAT_COLUMNS, UNITS
from teller.rca.text import PAD

#: features of a family slot (:meth:`teller.rca.data.ReferenceStats.family_features`); two more
#: with ``RCAConfig.fam_span`` (its summed span against the family's reference)
FAMILY_FEATURES = 4

VARIANTS = ("mot", "single")
#: what a model reads (``RCAConfig.inputs``): the TPE-encoded step tree and the log lines (the
#: model of docs/design.md §9), one of the two alone (modality ablations), or a structured text
#: summary of the step beside its log lines instead of the tree (the prompt-style baseline:
#: :func:`teller.rca.batch.step_summary`)
INPUTS = ("trace+log", "trace", "log", "summary+log")
#: what the MoT's operator head scores (``RCAConfig.op_unit``): each trace token (its anchor's family
#: is named when a token passes), or each operator family of the unit (a family slot: the mean of
#: its tokens' states, the unit's pooled state and its summed time and node count against the
#: reference, :class:`teller.rca.data.FamilySlots`), the unit the operator labels name
OP_UNITS = ("token", "family")


@dataclass
class RCAConfig:
    """Hyper-parameters of a model (saved in ``config.json``)."""

    variant: str = "mot"
    inputs: str = "trace+log"
    #: what a unit's trace holds (:data:`.data.UNITS`): the STEP subtree, or the whole engine
    #: iteration (with its schedule/update ranges and GAP rows); a config.json without it is "step"
    unit: str = "step"
    #: :data:`OP_UNITS`; a config.json without it is "token"
    op_unit: str = "token"
    #: the family head also reads each slot's summed span (its nodes' whole time, children
    #: included: what the operator labels compare with the family's reference p99) beside its
    #: summed self time; a config.json without it is false
    fam_span: bool = False
    #: the MoT also reads the unit's layer mix (per layer its nodes' mean self time and span, its
    #: share of the nodes and of the self time, against the normal units' spread,
    #: :func:`teller.rca.data.unit_statistics`),
    #: added to the pooled trace state the fault and family heads read; a config.json without it
    #: is false
    unit_stats: bool = False
    #: with ``unit_stats``: the share of training units whose fault head reads the layer mix alone
    #: (their pooled trace state left out of the head's input, each unit drawn anew per step), so
    #: the head also learns to answer from the statistics; 0 = never (a config.json without it)
    pool_drop: float = 0.0
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 688
    text_vocab: int = 2048
    trace_vocab: int = 512
    tpe_max_token_nodes: int = 16
    max_trace_tokens: int = 256
    max_log_tokens: int = 96
    max_expl_tokens: int = 112
    max_ops_tokens: int = 40
    max_depth: int = 32
    max_parent_offset: int = 64
    lm_weight: float = 0.5  # λ
    op_weight: float = 1.0  # μ
    op_pos_weight: float = 4.0
    max_ops: int = 8
    max_explanation_chars: int = 480
    dropout: float = 0.0
    save_dtype: str = "float16"
    backbone: str | None = None  # a local pretrained checkpoint, or None: built from this config
    backbone_config: dict = field(default_factory=dict)  # the backbone's own config (filled at build)

    @classmethod
    def preset(cls, name: str, **over: Any) -> "RCAConfig":
        from teller.errors import TellerError

        if name not in PRESETS:
            raise TellerError(f"--config {name}: expected one of {', '.join(PRESETS)}")
        d = dict(PRESETS[name])
        d.update({k: v for k, v in over.items() if v is not None})
        for key in ("fam_span", "unit_stats"):
            if key in d:
                d[key] = bool(d[key])
        for key, allowed in (("variant", VARIANTS), ("inputs", INPUTS), ("unit", UNITS), ("op_unit", OP_UNITS)):
            if key in d and d[key] not in allowed:
                raise TellerError(f"--{key} {d[key]}: expected one of {', '.join(allowed)}")
        if d.get("unit_stats") and d.get("variant", "mot") != "mot":
            raise TellerError("--unit-stats: only the mot variant reads the unit statistics; use --variant mot")
        if "pool_drop" in d:
            d["pool_drop"] = float(d["pool_drop"])
            if not 0.0 <= d["pool_drop"] < 1.0:
                raise TellerError(f"--pool-drop {d['pool_drop']}: expected a share in [0, 1)")
            if d["pool_drop"] and not d.get("unit_stats"):
                raise TellerError("--pool-drop: the fault head reads the layer mix alone only when there is one; add --unit-stats")
        return cls(**d)

    @property
    def reads_trace(self) -> bool:
        """The model reads the step's TPE tokens (else one placeholder token stands for them)."""
        return self.inputs in ("trace+log", "trace")

    @property
    def reads_family_slots(self) -> bool:
        """The MoT's family head scores family slots (``op_unit`` "family", on a trace it reads)."""
        return self.variant == "mot" and self.op_unit == "family" and self.reads_trace

    @property
    def reads_unit_stats(self) -> bool:
        """The MoT reads the unit statistics (``unit_stats``, on a trace it reads)."""
        return self.variant == "mot" and self.unit_stats and self.reads_trace

    @property
    def reads_log(self) -> bool:
        return self.inputs != "trace"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RCAConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


PRESETS: dict[str, dict[str, Any]] = {
    # a model that trains in seconds on a CPU (tests)
    "tiny": dict(hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64, text_vocab=400, trace_vocab=200,
                 max_trace_tokens=64, max_log_tokens=24, max_expl_tokens=40, max_ops_tokens=16, max_depth=16,
                 max_parent_offset=16, save_dtype="float32"),
    # the shipped size: about 6-7 M parameters, 12-14 MB as float16
    "small": dict(),
}


def llama_config(cfg: RCAConfig, vocab: int):
    from transformers import LlamaConfig

    c = LlamaConfig(vocab_size=vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                    num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                    max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    attention_dropout=cfg.dropout, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    c._attn_implementation = "sdpa"
    return c


def build_backbone(cfg: RCAConfig, vocab: int, pretrained: bool):
    """The causal LM: from ``cfg.backbone`` with ``from_pretrained`` when ``pretrained``, else
    built from ``cfg.backbone_config`` (a saved model) or from the size fields (a new model)."""
    if not (pretrained and cfg.backbone) and cfg.backbone_config and llama.supports(cfg.backbone_config):
        return llama.LlamaLM(cfg.backbone_config)  # a saved plain Llama: no transformers import (teller.rca.llama)
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    if pretrained and cfg.backbone:
        lm = AutoModelForCausalLM.from_pretrained(cfg.backbone, attn_implementation="sdpa", dtype=torch.float32)
        if lm.get_input_embeddings().weight.shape[0] != vocab:
            lm.resize_token_embeddings(vocab, mean_resizing=False)
    elif cfg.backbone_config:
        d = dict(cfg.backbone_config)
        mt = d.pop("model_type", "llama")
        c = AutoConfig.for_model(mt, **d)
        c._attn_implementation = "sdpa"
        lm = AutoModelForCausalLM.from_config(c)
    else:
        lm = LlamaForCausalLM(llama_config(cfg, vocab))
    lm.config._attn_implementation = "sdpa"
    keep = {k: v for k, v in lm.config.to_dict().items() if not k.startswith("_") and k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
    cfg.backbone_config = keep
    return lm


class TraceEncoder(nn.Module):
    """``e_i = E_tok[w_i] + E_depth[d_i] + E_par[i - p_i] + MLP(log-duration, z)`` (module docstring)."""

    def __init__(self, vocab: int, hidden: int, max_depth: int, max_parent_offset: int):
        super().__init__()
        self.max_depth, self.max_parent_offset = max_depth, max_parent_offset
        self.tok = nn.Embedding(vocab, hidden)
        self.depth = nn.Embedding(max_depth, hidden)
        self.parent = nn.Embedding(max_parent_offset + 1, hidden)
        self.dur = nn.Sequential(nn.Linear(2, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        for e in (self.tok, self.depth, self.parent):
            nn.init.normal_(e.weight, std=0.02)

    def forward(self, ids: torch.Tensor, depth: torch.Tensor, parent_off: torch.Tensor, dur: torch.Tensor) -> torch.Tensor:
        return (self.tok(ids) + self.depth(depth.clamp(0, self.max_depth - 1))
                + self.parent(parent_off.clamp(0, self.max_parent_offset)) + self.dur(dur))


def _mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal + key-padding mask (B, 1, L, L); every query sees at least itself."""
    L = valid.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=valid.device).tril()
    allow = causal[None] & valid[:, None, :]
    allow = allow | torch.eye(L, dtype=torch.bool, device=valid.device)[None]
    m = torch.zeros(allow.shape, dtype=dtype, device=valid.device)
    m.masked_fill_(~allow, torch.finfo(dtype).min)
    return m[:, None]


def _mask_dtype(h: torch.Tensor) -> torch.dtype:
    """Under autocast the attention's queries are in the autocast dtype: the mask must match."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return h.dtype


def _positions(valid: torch.Tensor) -> torch.Tensor:
    return (valid.long().cumsum(1) - 1).clamp(min=0)


class MoTModel(nn.Module):
    """Variant A (module docstring)."""

    def __init__(self, cfg: RCAConfig, text_vocab: int, trace_vocab: int, pretrained: bool = False):
        super().__init__()
        self.cfg = cfg
        self.lm = build_backbone(cfg, text_vocab, pretrained)
        if isinstance(self.lm, llama.LlamaLM):
            LlamaMLP, LlamaRMSNorm = llama.MLP, llama.RMSNorm
        else:
            from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        base = self.lm.model
        if not all(hasattr(lay, a) for lay in base.layers for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")):
            from teller.errors import TellerError

            raise TellerError(f"--backbone {cfg.backbone}: the mot variant needs Llama-style decoder layers "
                              "(self_attn, mlp, input_layernorm, post_attention_layernorm); use --variant single")
        lc = self.lm.config
        H = lc.hidden_size
        eps = getattr(lc, "rms_norm_eps", 1e-5)
        self.trace = TraceEncoder(trace_vocab, H, cfg.max_depth, cfg.max_parent_offset)
        self.trace_ln1 = nn.ModuleList(LlamaRMSNorm(H, eps) for _ in base.layers)
        self.trace_ln2 = nn.ModuleList(LlamaRMSNorm(H, eps) for _ in base.layers)
        self.trace_mlp = nn.ModuleList(LlamaMLP(lc) for _ in base.layers)
        if pretrained and cfg.backbone:
            for m, lay in zip(self.trace_mlp, base.layers, strict=True):
                m.load_state_dict(lay.mlp.state_dict())
        self.trace_norm = LlamaRMSNorm(H, eps)
        self.fault_head = nn.Linear(H, len(FAULT_TYPES))
        self.op_head = nn.Linear(H, 1)
        if cfg.unit_stats:
            self.unit_feat = nn.Sequential(nn.Linear(2 * len(UNIT_STAT_COLUMNS), H), nn.SiLU(), nn.Linear(H, H))
        if cfg.op_unit == "family":
            self.fam_feat = nn.Sequential(nn.Linear(FAMILY_FEATURES + 2 * bool(cfg.fam_span), H), nn.SiLU(), nn.Linear(H, H))
            self.fam_head = nn.Sequential(nn.Linear(2 * H, H), nn.SiLU(), nn.Linear(H, 1))

    def forward(self, prompt: torch.Tensor, prompt_valid: torch.Tensor, trace: dict[str, torch.Tensor],
                target: torch.Tensor, target_valid: torch.Tensor, cache: "KVCache | None" = None) -> dict[str, torch.Tensor]:
        """The three heads over [prompt | trace | target]. With ``cache`` (decoding) every layer's
        keys and values are kept in it, and ``cache.valid``/``cache.last_pos`` record the layout,
        so :meth:`extend` can append target tokens one at a time."""
        base = self.lm.model
        emb = base.embed_tokens
        hp, ht, hy = emb(prompt), self.trace(trace["ids"], trace["depth"], trace["parent_off"], trace["dur"]), emb(target)
        ht = ht.to(hp.dtype)
        P, T = hp.shape[1], ht.shape[1]
        h = torch.cat([hp, ht, hy], 1)
        valid = torch.cat([prompt_valid, trace["valid"], target_valid], 1)
        pos = _positions(valid)
        pe = base.rotary_emb(h, pos)
        mask = _mask(valid, _mask_dtype(h))
        kw = {} if cache is None else {_cache_kw(base.layers[0].self_attn): cache}
        for i, lay in enumerate(base.layers):
            x = torch.cat([lay.input_layernorm(h[:, :P]), self.trace_ln1[i](h[:, P:P + T]),
                           lay.input_layernorm(h[:, P + T:])], 1)
            a = lay.self_attn(x, position_embeddings=pe, attention_mask=mask, **kw)[0]  # shared by both streams
            h = h + a
            hl = torch.cat([h[:, :P], h[:, P + T:]], 1)
            hl = hl + lay.mlp(lay.post_attention_layernorm(hl))
            htr = h[:, P:P + T]
            htr = htr + self.trace_mlp[i](self.trace_ln2[i](htr))
            h = torch.cat([hl[:, :P], htr, hl[:, P:]], 1)
        if cache is not None:
            cache.valid, cache.last_pos = valid, pos[:, -1]
        ht = self.trace_norm(h[:, P:P + T])
        tv = trace["valid"].to(ht.dtype)[..., None]
        pooled = (ht * tv).sum(1) / tv.sum(1).clamp(min=1.0)
        fault_in = pooled
        if "unit_feat" in trace and hasattr(self, "unit_feat"):
            u = self.unit_feat(trace["unit_feat"].to(ht.dtype))
            fault_in = pooled = pooled + u
            if self.training and self.cfg.pool_drop > 0:
                keep = torch.rand(u.shape[0], 1, device=u.device) >= self.cfg.pool_drop
                fault_in = torch.where(keep, pooled, u)
        logits = self.lm.lm_head(base.norm(h[:, P + T:]))
        out = {"fault": self.fault_head(fault_in).float(), "ops": self.op_head(ht).squeeze(-1).float(), "lm": logits.float()}
        if "fam_member" in trace and hasattr(self, "fam_head"):
            # a slot: the mean of its tokens' states (member rows sum to 1, or 0 for a slot no kept
            # token stands for) plus its time and count features, beside the unit's pooled state
            m = trace["fam_member"].to(ht.dtype)
            fs = torch.bmm(m, ht) + self.fam_feat(trace["fam_feat"].to(ht.dtype))
            x = torch.cat([fs, pooled[:, None].expand(-1, fs.shape[1], -1)], -1)
            out["fam"] = self.fam_head(x).squeeze(-1).float()
        return out

    def extend(self, cache: "KVCache", token: torch.Tensor) -> torch.Tensor:
        """Append one target token per row (``token``: (B,)) after :meth:`forward` filled
        ``cache``; returns the next-token logits (B, V). The token only attends to the cached
        positions (the prompt and trace states never depend on the target: the mask is causal and
        they come first), so each new token costs one position instead of the whole sequence."""
        base = self.lm.model
        h = base.embed_tokens(token[:, None])
        valid = torch.cat([cache.valid, torch.ones_like(cache.valid[:, :1])], 1)
        pos = (cache.last_pos + 1)[:, None]
        pe = base.rotary_emb(h, pos)
        m = torch.zeros((valid.shape[0], 1, 1, valid.shape[1]), dtype=_mask_dtype(h), device=h.device)
        m.masked_fill_(~valid[:, None, None, :], torch.finfo(m.dtype).min)
        for lay in base.layers:  # the new token is in the log stream: the text branch's norms and MLP
            h = h + lay.self_attn(lay.input_layernorm(h), position_embeddings=pe, attention_mask=m, **{_cache_kw(lay.self_attn): cache})[0]
            h = h + lay.mlp(lay.post_attention_layernorm(h))
        cache.valid, cache.last_pos = valid, pos[:, 0]
        return self.lm.lm_head(base.norm(h))[:, 0].float()


class KVCache:
    """Keys and values per decoder layer for :meth:`MoTModel.extend` (what the attention modules'
    cache argument needs: ``update`` appends along the sequence and returns the whole)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.valid: torch.Tensor | None = None
        self.last_pos: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if layer_idx in self.k:
            key, value = torch.cat([self.k[layer_idx], key], 2), torch.cat([self.v[layer_idx], value], 2)
        self.k[layer_idx], self.v[layer_idx] = key, value
        return key, value


def _cache_kw(attn: nn.Module) -> str:
    """The attention module's name for its cache argument: ``cache`` (teller.rca.llama, and
    transformers from 5.2x), ``past_key_values`` (earlier transformers)."""
    return _forward_cache_kw(type(attn))


@functools.cache
def _forward_cache_kw(cls: type) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"



class SingleModel(nn.Module):
    """Variant B (module docstring)."""

    def __init__(self, cfg: RCAConfig, text_vocab: int, trace_vocab: int, pretrained: bool = False):
        super().__init__()
        self.cfg = cfg
        self.lm = build_backbone(cfg, text_vocab, pretrained)
        H = self.lm.config.hidden_size
        self.trace = TraceEncoder(trace_vocab, H, cfg.max_depth, cfg.max_parent_offset)

    def forward(self, prompt: torch.Tensor, prompt_valid: torch.Tensor, trace: dict[str, torch.Tensor],
                target: torch.Tensor, target_valid: torch.Tensor) -> dict[str, torch.Tensor]:
        emb = self.lm.get_input_embeddings()
        hp, hy = emb(prompt), emb(target)
        ht = self.trace(trace["ids"], trace["depth"], trace["parent_off"], trace["dur"]).to(hp.dtype)
        P, T = hp.shape[1], ht.shape[1]
        h = torch.cat([hp, ht, hy], 1)
        valid = torch.cat([prompt_valid, trace["valid"], target_valid], 1)
        out = self.lm(inputs_embeds=h, attention_mask=_mask(valid, _mask_dtype(h)), position_ids=_positions(valid),
                      use_cache=False)
        return {"lm": out.logits[:, P + T:].float()}


def build_model(cfg: RCAConfig, text_vocab: int, trace_vocab: int, pretrained: bool = False) -> nn.Module:
    if cfg.variant == "mot":
        return MoTModel(cfg, text_vocab, trace_vocab, pretrained)
    if cfg.variant == "single":
        return SingleModel(cfg, text_vocab, trace_vocab, pretrained)
    from teller.errors import TellerError

    raise TellerError(f"--variant {cfg.variant}: expected one of {', '.join(VARIANTS)}")


def token_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy at every target position (B, L-1): position t predicts t+1."""
    lg = logits[:, :-1]
    y = target[:, 1:]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), reduction="none").view_as(y)
