"""The phase average of dropped rotary components (``LayerMetrics.phase_mean``).

A dropped component's score term rotates with the distance between query and key; the converted
layer reads it unrotated, with each head's query scaled by the mean of that rotation over the lags
the head attends. These tests pin the math on a tiny layer where the answer is known exactly.
"""

from __future__ import annotations

import pytest
import torch

from mlakit.convert.calibration import LayerStats
from mlakit.convert.compress import Method, compress_layer
from mlakit.convert.layer_metrics import layer_metrics
from mlakit.convert.rope_select import rope_error, select_rope
from tests.tiny_models import assert_close, random_attention

H, G, d, D = 4, 2, 16, 12
FULL_RANK = 2 * G * d  # no rotary component kept: the latent holds every key and value dim


def _layer(lag_p2: torch.Tensor):
    torch.manual_seed(0)
    w = random_attention(H, G, d, D)
    x = torch.cat([torch.randn(300, D), torch.ones(300, 1)], 1).double()
    inv_freq = 1.0 / 100 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return w, layer_metrics(w, LayerStats(x.T @ x / 300, lag_p2, inv_freq, 300))


def _rotate(v: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """HF rotary layout: dims (j, j + d/2) rotate by ANGLE[j]."""
    re, im = v[..., : d // 2], v[..., d // 2 :]
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.cat([re * c - im * s, im * c + re * s], dim=-1)


def _scores(w, mla, m, lag: int):
    """(source scores at LAG, converted scores, unrotated source scores), (H, T) for T query/key pairs."""
    x = torch.cat([torch.randn(6, D), torch.ones(6, 1)], 1).double()
    y = torch.cat([torch.randn(6, D), torch.ones(6, 1)], 1).double()  # the keys, LAG tokens earlier
    q = (x @ w.q.double().T).view(6, H, d)
    k = (y @ w.k.double().T).view(6, G, d).repeat_interleave(H // G, dim=1)
    source = (_rotate(q, lag * m.inv_freq) * k).sum(-1).T  # only the difference of positions matters
    unrotated = (q * k).sum(-1).T
    q_nope = (x @ mla.q_proj.T).view(6, H, d)
    k_nope = ((y @ mla.kv_a_proj_with_mqa.T) @ mla.kv_b_proj.T).view(6, H, 2 * d)[..., :d]
    return source, (q_nope * k_nope).sum(-1).T, unrotated


def test_one_attended_lag_gives_the_exact_scores_at_that_lag():
    """Every head attending at lag 5 only: the phase mean is that lag's rotation, so a conversion that
    keeps no rotary component (full latent rank) scores key t - 5 exactly as the source does."""
    lag_p2 = torch.zeros(H, 8, dtype=torch.float64)
    lag_p2[:, 5] = 0.3
    w, m = _layer(lag_p2)
    mla = compress_layer(w, m, Method(), 0, FULL_RANK)
    source, got, unrotated = _scores(w, mla, m, 5)
    assert_close("scores at the attended lag", got, source, atol=1e-9, rtol=1e-9)
    assert (source - unrotated).abs().max() > 1e-2  # the rotation over 5 tokens is not negligible
    # TransMLA's split, the reference, reads the dropped components unrotated
    plain = compress_layer(w, m, Method(rope="transmla", lowrank="bkv_pca"), 0, FULL_RANK)
    _, got, unrotated = _scores(w, plain, m, 5)
    assert_close("transmla scores", got, unrotated, atol=1e-9, rtol=1e-9)


def test_attention_at_lag_zero_leaves_the_queries_as_they_are():
    lag_p2 = torch.zeros(H, 8, dtype=torch.float64)
    lag_p2[:, 0] = 0.5
    _, m = _layer(lag_p2)
    assert torch.equal(m.dropped_query_map(), torch.eye(d, dtype=torch.float64).expand(H, d, d))


def test_the_average_never_costs_more_than_dropping_the_rotation():
    """The phase's weighted variance is at most its weighted distance from lag 0, per head and
    frequency, so every plan's predicted error is at most what it was without the average."""
    lag_p2 = torch.rand(H, 64, dtype=torch.float64) / 64
    w, m = _layer(lag_p2)
    freq = torch.linspace(0, 3, 40, dtype=torch.float64)
    averaged, plain = m.averaged_reach(freq), m.reach(freq)
    assert (averaged <= plain + 1e-12).all()
    assert averaged[:, 0].abs().max() < 1e-12  # a frequency that never turns costs nothing
    assert (m.phase_mean(freq).abs() <= 1 + 1e-12).all()
    for n_keep in (0, 2, 4):
        plan = select_rope("scored", w, m, 2 * n_keep)
        assert rope_error(plan, w, m, averaged=True) <= rope_error(plan, w, m, averaged=False) + 1e-12


@pytest.mark.parametrize("rope_dim", [4, 8])
def test_the_unrotated_queries_are_the_sources_times_the_phase_mean(rope_dim):
    lag_p2 = torch.rand(H, 32, dtype=torch.float64) / 32
    w, m = _layer(lag_p2)
    mla = compress_layer(w, m, Method(), rope_dim, 12)  # rope_dim < G * d: some components are dropped
    got = mla.q_proj.view(H, d + rope_dim, -1)[:, :d]
    assert_close("unrotated queries", got, m.dropped_query_map() @ w.q.double().view(H, d, -1), atol=1e-12, rtol=1e-12)
