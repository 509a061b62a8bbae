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
