"""Calibration statistics: the second moment against a float64 reference, the forward that stops
at the last attention input, and label sampling."""

from __future__ import annotations

import pytest
import torch

from mlakit.arch.families import AttentionShape, attention_shape
from mlakit.convert import calibration
from mlakit.convert.calibration import collect_stats, layer_accumulator, sample_rows
from mlakit.io.source import open_source


def _reference_moments(model, ids):
    """E[x~ x~^T] of every attention input over a full forward, products and sums in float64."""
    inputs = {}

    def keep(i):
        def hook(module, args, kwargs):
            inputs.setdefault(i, []).append(kwargs["hidden_states"].detach().reshape(-1, kwargs["hidden_states"].shape[-1]))
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(keep(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    out = []
    for i in range(len(model.model.layers)):
        x = torch.cat(inputs[i]).double()
        aug = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        out.append((aug.T @ aug / len(x), aug.abs().T @ aug.abs() / len(x)))
    return out


def test_moments_match_a_float64_reference_and_the_forward_stops_after_the_last_attention(tiny_sources):
    source = open_source(str(tiny_sources["llama_gqa"]))
    shape = attention_shape(source.config)
    model = source.load_model(torch.float32)
    ids = torch.randint(3, 96, (12, 24), generator=torch.Generator().manual_seed(0))
    calls = []
    handle = model.model.norm.register_forward_hook(lambda *a: calls.append(1))
    try:
        stats = collect_stats(model, ids, shape, batch_size=4, quiet=True)
    finally:
        handle.remove()
    assert not calls  # the final norm (after the last attention) never ran
    for st, (want, magnitude) in zip(stats, _reference_moments(model, ids)):
        assert st.tokens == ids.numel()
        assert torch.equal(st.sigma, st.sigma.T)
        assert float(((st.sigma - want).abs() / magnitude).max()) < 1e-5


@pytest.mark.parametrize("query_block", [64, 8, 7])  # one block; blocks of 8, 8, 4; a ragged split
def test_lag_profile_matches_the_models_own_attention_probabilities(tiny_sources, monkeypatch, query_block):
    """lag_p2[h, k] = E over queries of sum over keys at lag k of p^2, from the probabilities the
    source's eager attention computes (rotary, grouped KV heads, causal mask, scaling included),
    whatever the query blocks the statistics are computed in."""
    monkeypatch.setattr(calibration, "_QUERY_BLOCK", query_block)
    source = open_source(str(tiny_sources["llama_gqa"]))
    shape = attention_shape(source.config)
    model = source.load_model(torch.float32)
    ids = torch.randint(3, 96, (6, 20), generator=torch.Generator().manual_seed(1))
    stats = collect_stats(model, ids, shape, batch_size=4, attention_samples=4, quiet=True)  # the first batch
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        probs = model(ids[:4], output_attentions=True).attentions  # per layer (B, H, L, L)
    L = ids.shape[1]
    lag = torch.arange(L)[:, None] - torch.arange(L)[None]
    for st, p in zip(stats, probs):
        p2 = p.double().square().sum(0)  # (H, L, L)
        want = torch.stack([p2[:, lag == k].sum(1) for k in range(L)], dim=1) / (4 * L)
        assert torch.allclose(st.lag_p2, want, rtol=1e-5, atol=1e-9)
        assert torch.allclose(st.lag_p2.sum(1), want.sum(1), rtol=1e-5)


def test_float32_products_keep_entries_with_outlier_channels_accurate():
    """Residual streams carry a few channels hundreds of times larger than the rest; the error
    of every entry must stay small next to the magnitude of its own terms."""
    D, n = 64, 6000
    x = torch.randn(2, n // 2, D, generator=torch.Generator().manual_seed(0))
    x[..., 3] *= 800.0
    x[..., 7] += 50.0
    acc = layer_accumulator(None, torch.ones(2), AttentionShape("LlamaForCausalLM", 1, 1, 4, D, False, False, None))
    acc.with_attention = False
    acc(None, (), {"hidden_states": x})
    flat = x.reshape(-1, D).double()
    aug = torch.cat([flat, torch.ones(n, 1, dtype=flat.dtype)], dim=1)
    want, magnitude = aug.T @ aug / n, aug.abs().T @ aug.abs() / n
    got = acc.result().sigma
    assert float(((got - want).abs() / magnitude).max()) < 1e-5
    assert got[D, D] == 1 and torch.allclose(got[:D, D], flat.mean(0), rtol=0, atol=1e-9)


def test_sampled_labels_follow_each_rows_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.0, 0.0, 0.0, 1.0]]).repeat(10000, 1)
    labels = sample_rows(probs, torch.Generator().manual_seed(0)).view(10000, 2)
    freq = torch.bincount(labels[:, 0], minlength=4).double() / 10000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64), atol=0.015), freq
    assert torch.all(labels[:, 1] == 3)
    again = sample_rows(probs, torch.Generator().manual_seed(0)).view(10000, 2)
    assert torch.equal(labels, again)  # seeded


def test_longer_sequences_mean_fewer_measured_sequences_not_fewer_tokens():
    """The lag profile and the sensitivity pass read the first sequences: the same ones as always at
    256 tokens, half as many at 512, never none and never more than their caps."""
    A, S = calibration.ATTENTION_SAMPLES, calibration.SENSITIVITY_SAMPLES
    assert (calibration.attention_sequences(256), calibration.sensitivity_sequences(256)) == (A, S)
    assert (calibration.attention_sequences(512), calibration.sensitivity_sequences(512)) == (A // 2, S // 2)
    for seq_len in (2, 64, 300, 4096, 10**6):
        for n, most, tokens in ((calibration.attention_sequences(seq_len), A, calibration.ATTENTION_TOKENS),
                                (calibration.sensitivity_sequences(seq_len), S, calibration.SENSITIVITY_TOKENS)):
            assert 1 <= n <= most and (n == 1 or n * seq_len <= tokens)


def test_the_lag_profile_reads_the_first_sequences_its_token_count_allows(tiny_sources, monkeypatch):
    monkeypatch.setattr(calibration, "ATTENTION_TOKENS", 40)  # two sequences of 20
    source = open_source(str(tiny_sources["llama_gqa"]))
    shape = attention_shape(source.config)
    model = source.load_model(torch.float32)
    ids = torch.randint(3, 96, (6, 20), generator=torch.Generator().manual_seed(2))
    lag = [st.lag_p2 for st in collect_stats(model, ids, shape, batch_size=2, quiet=True)]
    two = [st.lag_p2 for st in collect_stats(model, ids, shape, batch_size=2, attention_samples=2, quiet=True)]
    four = [st.lag_p2 for st in collect_stats(model, ids, shape, batch_size=2, attention_samples=4, quiet=True)]
    assert all(torch.equal(a, b) for a, b in zip(lag, two))
    assert not all(torch.equal(a, b) for a, b in zip(lag, four))
