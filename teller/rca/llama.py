"""A Llama decoder in plain torch, for the models TELLER trains and ships.

Importing ``transformers`` costs about 6.5 s of CPU (its Llama module pulls in the hub, kernel and
conversion machinery), more than the model's whole prediction for a run's flagged steps. The
shipped model is a small Llama built from a config, so it needs none of that: this module builds
the same layers with the same parameter names (``model.embed_tokens``, ``model.layers.N.self_attn
.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``,
``model.norm``, ``lm_head``) and the same arithmetic (RMSNorm in float32, default rotary
embeddings, grouped-query attention through ``scaled_dot_product_attention`` with an additive
mask), so a checkpoint loads into either and predicts the same.

:func:`supports` says whether a saved backbone config is one this module implements (a plain
Llama: SiLU, no biases, untied embeddings, default rope); anything else, and every pretrained
``--backbone``, is built by ``transformers`` (:func:`teller.rca.model.build_backbone`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def supports(c: dict[str, Any]) -> bool:
    """A saved backbone config this module builds exactly."""
    rope = c.get("rope_parameters") or {}
    return (c.get("model_type", "llama") == "llama" and c.get("hidden_act", "silu") == "silu"
            and not c.get("attention_bias", False) and not c.get("mlp_bias", False)
            and not c.get("tie_word_embeddings", False) and rope.get("rope_type", "default") == "default"
            and not c.get("rope_scaling") and int(c.get("pretraining_tp", 1)) == 1
            and all(k in c for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads")))


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        pos = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=False):  # the angles in float32
            freqs = (inv @ pos).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(x.dtype), sin.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: SimpleNamespace, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = c.head_dim
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = c.attention_dropout
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: Any = None) -> tuple[torch.Tensor, None]:
        B, L, _ = h.shape
        q = self.q_proj(h).view(B, L, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, L, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, L, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = attention_mask[:, :, :, : k.shape[-2]] if attention_mask is not None else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.attention_dropout if self.training else 0.0,
                                           scale=self.scaling)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1)), None


class MLP(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: SimpleNamespace, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(c, layer_idx)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, position_embeddings, attention_mask=None):
        h = h + self.self_attn(self.input_layernorm(h), position_embeddings, attention_mask)[0]
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = Rotary(c.head_dim, c.rope_theta)


class LlamaLM(nn.Module):
    """The causal LM: ``model`` and ``lm_head``, as ``transformers``' ``LlamaForCausalLM`` names them."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        c = dict(config)
        heads = int(c["num_attention_heads"])
        self.config = SimpleNamespace(
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]), intermediate_size=int(c["intermediate_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))),
            attention_dropout=float(c.get("attention_dropout", 0.0)), pad_token_id=c.get("pad_token_id"))
        self.model = Model(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                use_cache: bool = False) -> SimpleNamespace:
        """Logits over ``inputs_embeds`` (B, L, H) with an additive mask (B, 1, L, L)."""
        h = inputs_embeds
        pe = self.model.rotary_emb(h, position_ids)
        for lay in self.model.layers:
            h = lay(h, pe, attention_mask)
        return SimpleNamespace(logits=self.lm_head(self.model.norm(h)))
