"""Cached decoding of the MoT model (teller.rca.model.MoTModel.extend) against recomputing the
whole sequence for every new token: the same next-token logits, on padded batches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from teller.rca.model import KVCache, RCAConfig, build_model  # noqa: E402


def _batch(g: torch.Generator, B: int, P: int, T: int, text_vocab: int, trace_vocab: int):
    prompt = torch.randint(5, text_vocab, (B, P), generator=g)
    pv = torch.ones(B, P, dtype=torch.bool)
    pv[0, P - 3:] = False  # rows of different prompt and trace lengths: padding inside the sequence
    trace = {"ids": torch.randint(1, trace_vocab, (B, T), generator=g), "depth": torch.randint(0, 6, (B, T), generator=g),
             "parent_off": torch.randint(0, 5, (B, T), generator=g), "dur": torch.randn(B, T, 2, generator=g),
             "valid": torch.ones(B, T, dtype=torch.bool)}
    trace["valid"][1, T - 5:] = False
    return prompt, pv, trace


@pytest.mark.parametrize("layers", [1, 2])
def test_extend_gives_the_logits_of_the_whole_sequence(layers):
    torch.manual_seed(0)
    cfg = RCAConfig.preset("tiny", layers=layers)
    net = build_model(cfg, 400, 200).eval()
    g = torch.Generator().manual_seed(1)
    prompt, pv, trace = _batch(g, 3, 12, 20, 400, 200)
    target = torch.full((3, 1), 7)
    cache = KVCache()
    with torch.no_grad():
        first = net(prompt, pv, trace, target, torch.ones_like(target, dtype=torch.bool), cache=cache)
        plain = net(prompt, pv, trace, target, torch.ones_like(target, dtype=torch.bool))
        for k in ("fault", "ops", "lm"):  # filling the cache changes nothing the heads see
            assert torch.equal(first[k], plain[k]), k
        logits = first["lm"][:, -1]
        for _ in range(12):
            tok = logits.argmax(-1)
            target = torch.cat([target, tok[:, None]], 1)
            logits = net.extend(cache, tok)
            full = net(prompt, pv, trace, target, torch.ones_like(target, dtype=torch.bool))["lm"][:, -1]
            assert torch.allclose(logits, full, atol=1e-4, rtol=1e-4), (logits - full).abs().max()
    assert cache.k[0].shape[2] == 12 + 20 + target.shape[1]  # one cached position per token


def test_plain_torch_llama_equals_transformers():
    """teller.rca.llama builds the same decoder as transformers' LlamaForCausalLM: one state dict
    loads into both, and they give the same logits (grouped-query attention, padding in the mask)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from teller.rca import llama
    from teller.rca.model import _mask, _positions

    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    pad_token_id=0)
    c._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(c).eval()
    saved = {k: v for k, v in c.to_dict().items() if not k.startswith("_")}
    assert llama.supports(saved)
    lite = llama.LlamaLM(saved).eval()
    missing, unexpected = lite.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected
    valid = torch.ones(3, 17, dtype=torch.bool)
    valid[0, 10:13] = False
    h = torch.randn(3, 17, 64)
    kw = dict(inputs_embeds=h, attention_mask=_mask(valid, h.dtype), position_ids=_positions(valid), use_cache=False)
    with torch.no_grad():
        assert torch.allclose(lite(**kw).logits, hf(**kw).logits, atol=1e-5, rtol=1e-5)
    for bad in ({"hidden_act": "gelu"}, {"attention_bias": True}, {"tie_word_embeddings": True},
                {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}):
        assert not llama.supports({**saved, **bad})  # what it does not implement goes to transformers


def test_the_shipped_model_loads_and_predicts_without_transformers():
    import subprocess
    import sys

    code = ("import sys\nfrom teller.rca import load\nfrom teller.report.diagnose import DEFAULT_MODEL\n"
            "m = load(DEFAULT_MODEL)\nprint(type(m.net.lm).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["LlamaLM", "False"]
