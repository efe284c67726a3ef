"""Block-wise metric and Gram-matrix factorisation == the dense eigendecomposition/SVD formulas."""

from __future__ import annotations

import pytest
import torch

from mlakit.convert.block_metric import BlockMetric
from mlakit.convert.layer_metrics import psd_factor, psd_powers
from mlakit.convert.low_rank import metric_energy, metric_factor, metric_spectrum
from tests.tiny_models import assert_close


def _psd(n: int, gen: torch.Generator, rank: int | None = None) -> torch.Tensor:
    a = torch.randn(n, rank or n, generator=gen, dtype=torch.float64)
    return a @ a.T / n


def _metric(gen: torch.Generator) -> BlockMetric:
    """Shaped like output_metric: a dense key block, then per-head value blocks; plus a diagonal block."""
    return BlockMetric(
        [_psd(9, gen), torch.stack([_psd(4, gen) for _ in range(3)]), torch.rand(5, generator=gen)]
    )


def _dense_factor(w_y, sigma_half, metric, rank):
    """The dense reference: M^+-1/2 from one eigendecomposition of the whole metric, SVD of M^1/2 W R."""
    m_half, m_ihalf = psd_powers(metric, (0.5, -0.5))
    u, _, _ = torch.linalg.svd(m_half @ w_y @ sigma_half, full_matrices=False)
    u = u[:, :rank]
    return u.T @ m_half @ w_y, m_ihalf @ u


def _sign_aligned(down, up, ref_down, ref_up):
    """Latent directions are defined up to sign: flip each to match the reference."""
    sign = torch.sign((up * ref_up).sum(0))
    return down * sign[:, None], up * sign


def test_block_powers_equal_dense_powers():
    gen = torch.Generator().manual_seed(0)
    m = _metric(gen)
    dense = m.dense()
    for got, want in zip(m.powers((0.5, -0.5, 1.0)), psd_powers(dense, (0.5, -0.5, 1.0))):
        err = assert_close("block power vs dense power", got.dense(), want, atol=1e-10)
        print(f"block vs dense power: bound 1e-10, observed {err:.2e}")
    x = torch.randn(dense.shape[0], 6, generator=gen, dtype=torch.float64)
    assert_close("block matmul", m @ x, dense @ x, atol=1e-12)
    assert_close("block gram", m.gram(x), x.T @ dense @ x, atol=1e-12)


@pytest.mark.parametrize("cols", [11, 40])  # tall W_y (MHA: Gram on the input side) and wide (GQA)
@pytest.mark.parametrize("rank", [5, 21])
def test_metric_factor_equals_dense_reference(cols, rank):
    gen = torch.Generator().manual_seed(cols + rank)
    m = _metric(gen)
    rows = m.shape[0]  # 26
    w_y = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    sigma = _psd(cols, gen)
    sigma_half = psd_powers(sigma, (0.5,))[0]
    ref_down, ref_up = _dense_factor(w_y, sigma_half, m.dense(), rank)
    # any square-root factor of sigma gives the same factors: the Cholesky one
    down, up = metric_factor(w_y, psd_factor(sigma), m, rank)
    down, up = _sign_aligned(down, up, ref_down, ref_up)
    scale = float(ref_up.abs().max() * ref_down.abs().max())
    err = assert_close("up @ down vs dense", up @ down, ref_up @ ref_down, atol=1e-9 * scale)
    assert_close("up vs dense", up, ref_up, atol=1e-8 * float(ref_up.abs().max()))
    assert_close("down vs dense", down, ref_down, atol=1e-8 * float(ref_down.abs().max()))
    print(f"metric_factor vs dense ({rows}x{cols}, r={rank}): bound {1e-9 * scale:.1e}, observed {err:.2e}")


@pytest.mark.parametrize("cols", [11, 40])
def test_spectrum_and_energy_equal_svd(cols):
    gen = torch.Generator().manual_seed(7)
    m = _metric(gen)
    w_y = torch.randn(m.shape[0], cols, generator=gen, dtype=torch.float64)
    sigma = _psd(cols, gen, rank=min(cols, 8))  # singular: exercises the floor
    m_half = psd_powers(m.dense(), (0.5,))[0]
    s = torch.linalg.svdvals(m_half @ w_y @ psd_powers(sigma, (0.5,))[0])
    want = s.square()
    bound = 1e-9 * float(want[0])
    _, s2 = metric_spectrum(w_y, psd_factor(sigma), m.powers((0.5,))[0])
    err = assert_close("metric_spectrum s^2 vs svd", s2, want, atol=bound)
    assert_close("metric_energy vs svd", metric_energy(w_y, psd_factor(sigma), m), want, atol=bound)
    print(f"spectrum vs svd: bound {bound:.1e}, observed {err:.2e}")


def test_psd_factor_reproduces_the_matrix():
    gen = torch.Generator().manual_seed(3)
    for rank in (30, 6):  # full rank, and singular (needs the 1e-12 ridge)
        sigma = _psd(30, gen, rank=rank)
        r = psd_factor(sigma)
        bound = 1e-10 * float(sigma.abs().max())
        err = assert_close("R R^T vs sigma", r @ r.T, sigma, atol=bound)
        print(f"psd_factor rank {rank}: bound {bound:.1e}, observed {err:.2e}")


def test_psd_factor_stays_cholesky_for_a_second_moment_of_few_tokens():
    """Fewer calibration tokens than columns, products in float32 as the calibration takes them:
    rounding leaves the matrix slightly indefinite, the 1e-12 ridge is not enough, and the factor
    must still come from Cholesky (lower triangular), not from the ten-times dearer eigendecomposition."""
    gen = torch.Generator().manual_seed(4)
    tokens, columns = 200, 600
    x = torch.randn(tokens, columns, generator=gen) * torch.logspace(0, -2, columns)  # uneven channels
    x = torch.cat([x, torch.ones(tokens, 1)], 1)
    sigma = (x.T @ x).double() / tokens
    first = sigma.clone()
    first.diagonal().add_(1e-12 * float(torch.linalg.matrix_norm(sigma)))
    assert int(torch.linalg.cholesky_ex(first)[1]) != 0  # the case the larger ridges are for
    r = psd_factor(sigma)
    assert torch.equal(r, r.tril())
    bound = 2e-6 * float(torch.linalg.matrix_norm(sigma))  # the largest ridge, 1e-6 ||sigma||_F, plus rounding
    err = assert_close("R R^T vs sigma", r @ r.T, sigma, atol=bound)
    print(f"few-token psd_factor: bound {bound:.1e}, observed {err:.2e}")
