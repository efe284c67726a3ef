"""The value refit's algebra (convert/refit_moments.py) against the dense formulation it replaces:
the block-by-block moments of z = B a, the effective map, the Cholesky ridge solve and the fit with
cached per-head roots give what forming B and solving densely gives."""

from __future__ import annotations

import pytest
import torch

from mlakit.convert.refit_moments import (
    HELD_OUT_SHARE,
    VALUE_RIDGES,
    FoldMoments,
    choose_ridge,
    effective_map,
    fit_values,
    head_roots,
    project_moments,
    quadratic_error,
    ridge_solve,
    values_error,
)

H, D_HEAD, R, D_MODEL = 3, 4, 6, 7


def _dense_b(w_uv: torch.Tensor, bias: bool) -> torch.Tensor:
    blocks = list(w_uv.double().unbind(0)) + ([torch.ones(1, 1, dtype=torch.float64)] if bias else [])
    return torch.block_diag(*blocks)


def _dense_fit(moments, ridge, prior, bias, rms):
    """The refit as first written: a general solve, each head's root from its block, B formed densely."""
    aa, ay, _ = moments
    lam = lambda zz: ridge * float(zz.diagonal().mean()) + 1e-30  # noqa: E731
    solve = lambda zz, zr, p: torch.linalg.solve(zz + lam(zz) * torch.eye(zz.shape[0], dtype=zz.dtype),  # noqa: E731
                                                 zr + lam(zz) * p.T).T
    m = solve(aa, ay, prior)
    uvs, os_ = [], []
    for h in range(H):
        evals, evecs = torch.linalg.eigh(aa[h * R : (h + 1) * R, h * R : (h + 1) * R])
        root = (evecs * evals.clamp_min(0).sqrt()) @ evecs.T
        u = torch.linalg.svd(m[:, h * R : (h + 1) * R] @ root, full_matrices=False)[0][:, :D_HEAD]
        w = u.T @ m[:, h * R : (h + 1) * R]
        c = rms / float(w.square().mean().sqrt())
        uvs.append(w * c)
        os_.append(u / c)
    w_uv = torch.stack(uvs)
    w_o = torch.cat(os_ + ([m[:, -1:]] if bias else []), dim=1)
    b = _dense_b(w_uv, bias)
    return w_uv, solve(b @ aa @ b.T, b @ ay, w_o)


def _moments(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 40, H * R, generator=g, dtype=torch.float64) @ torch.randn(H * R, H * R, generator=g,
                                                                                  dtype=torch.float64)
    if bias:
        a = torch.cat([a, torch.ones(2, 40, 1, dtype=torch.float64)], dim=-1)
    y = a @ torch.randn(a.shape[-1], D_MODEL, generator=g, dtype=torch.float64) + torch.randn(2, 40, D_MODEL,
                                                                                                generator=g)
    folds = FoldMoments()
    folds.add(a, y, 0)
    return folds.result()


def _start(bias: bool):
    g = torch.Generator().manual_seed(1)
    w_uv = torch.randn(H, D_HEAD, R, generator=g, dtype=torch.float64)
    return w_uv, torch.randn(D_MODEL, H * D_HEAD + int(bias), generator=g, dtype=torch.float64)


@pytest.mark.parametrize("bias", [False, True])
def test_block_moments_and_map_equal_the_dense_products(bias):
    moments = _moments(bias)[0]
    w_uv, w_o = _start(bias)
    b = _dense_b(w_uv, bias)
    zz, zy, yy = project_moments(w_uv, moments, bias)
    assert torch.allclose(zz, b @ moments[0] @ b.T, rtol=1e-10, atol=1e-9)
    assert torch.allclose(zy, b @ moments[1], rtol=1e-10, atol=1e-9) and yy == moments[2]
    assert torch.allclose(effective_map(w_uv, w_o), w_o @ b, rtol=1e-12, atol=1e-12)
    dense = quadratic_error(w_o @ b, *moments)
    assert values_error(w_uv, w_o, moments) == pytest.approx(dense, rel=1e-9)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ridge", [1e-6, 1e-2, 3.0])
def test_fit_equals_the_dense_fit(bias, ridge):
    moments = _moments(bias)[1]
    w_uv, w_o = _start(bias)
    prior, rms = effective_map(w_uv, w_o), float(w_uv.square().mean().sqrt())
    want_uv, want_o = _dense_fit(moments, ridge, prior, bias, rms)
    for roots in (None, head_roots(moments[0], H, bias)):
        got_uv, got_o = fit_values(moments, ridge, prior, H, D_HEAD, bias, rms, roots)
        # singular vectors are unique up to sign: compare the products W_O W_UV, which are not
        assert torch.allclose(effective_map(got_uv, got_o), effective_map(want_uv, want_o), rtol=1e-7, atol=1e-8)


def test_ridge_solve_falls_back_when_cholesky_fails():
    """Where the system is not positive definite (rounding can make it so), the general solve answers."""
    zz = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)  # eigenvalues 3 and -1
    zr = torch.tensor([[1.0], [4.0]], dtype=torch.float64)
    assert int(torch.linalg.cholesky_ex(zz).info) != 0
    assert torch.allclose(ridge_solve(zz, zr, 0.0), torch.linalg.solve(zz, zr).T)


def test_ridge_solve_by_cholesky_equals_the_general_solve():
    z = torch.randn(50, 5, dtype=torch.float64)
    r = torch.randn(50, 3, dtype=torch.float64)
    prior = torch.randn(3, 5, dtype=torch.float64)
    lam = 0.1 * float((z.T @ z).diagonal().mean())
    want = torch.linalg.solve(z.T @ z + lam * torch.eye(5, dtype=torch.float64), z.T @ r + lam * prior.T).T
    assert torch.allclose(ridge_solve(z.T @ z, z.T @ r, 0.1, prior), want, rtol=1e-10, atol=1e-12)


def test_choose_ridge_with_a_custom_error_matches_the_dense_errors():
    folds = _moments(False)
    w_uv, w_o = _start(False)
    prior, rms = effective_map(w_uv, w_o), float(w_uv.square().mean().sqrt())
    fit = lambda f, r: fit_values(folds[f], r, prior, H, D_HEAD, False, rms)  # noqa: E731
    got = choose_ridge((w_uv, w_o), folds, fit, VALUE_RIDGES, error=lambda fitted, m: values_error(*fitted, m))
    dense = choose_ridge(prior, folds, lambda f, r: effective_map(*fit(f, r)), VALUE_RIDGES)
    assert got[0] == dense[0] and sorted(got[1]) == sorted(dense[1])
    assert all(got[1][k] == pytest.approx(v, rel=1e-8) for k, v in dense[1].items())
    folds = got[1]["cv_folds_refit"]  # each validation fold's share of the held-out loss
    assert len(folds) == 2 and sum(folds) == pytest.approx(got[1]["cv_loss_refit"], rel=1e-12)


def test_fold_moments_equal_the_direct_products():
    """The half-work Gram matrix, mirrored, is Z^T Z of each fold (wider than one column block, and narrower)."""
    for p in (5, 600):
        z = torch.randn(5, 8, p, dtype=torch.float64)
        r = torch.randn(5, 8, 3, dtype=torch.float64)
        moments = FoldMoments()
        moments.add(z[:2], r[:2], 0)
        moments.add(z[2:], r[2:], 2)
        for k, (zz, zr, rr) in enumerate(moments.result()):
            zk, rk = z[k::2].reshape(-1, p), r[k::2].reshape(-1, 3)
            assert torch.equal(zz, zz.T)
            assert torch.allclose(zz, zk.T @ zk, rtol=1e-12, atol=1e-10)
            assert torch.allclose(zr, zk.T @ rk) and rr == pytest.approx(float(rk.square().sum()))


def test_float32_products_are_summed_in_float64_and_agree_with_float64_moments():
    """The value refit's float32 products (``ValueMoments``) give float64 moments within float32 rounding."""
    z = torch.randn(6, 64, 300, dtype=torch.float64)
    r = torch.randn(6, 64, 20, dtype=torch.float64)
    exact, fast = FoldMoments(), FoldMoments(torch.float32)
    for m in (exact, fast):
        m.add(z[:3], r[:3], 0)
        m.add(z[3:], r[3:], 3)
    for (zz, zr, rr), (zz32, zr32, rr32) in zip(exact.result(), fast.result()):
        assert zz32.dtype == zr32.dtype == torch.float64 and not torch.equal(zz32, zz)
        assert torch.allclose(zz32, zz, rtol=1e-5, atol=1e-4) and torch.allclose(zr32, zr, rtol=1e-5, atol=1e-4)
        assert rr32 == pytest.approx(rr, rel=1e-6)


@pytest.mark.parametrize("best", [1e-8, 1e-2, 30.0])
def test_ridge_walk_finds_the_minimum_of_a_unimodal_error_with_few_fits(best):
    """The walk from the grid's middle (or a given ridge) reaches the minimum at either end or inside, fitting
    fewer ridges than the grid holds when the minimum is near the start; a start that beats every ridge gives
    None."""
    import math

    folds = [(None, None, 1.0), (None, None, 1.0)]
    tried = []

    def fit(f, ridge):
        tried.append(ridge)
        return ridge

    def error(ridge, m):
        return 1.0 if ridge == "start" else 0.5 + (math.log10(ridge) - math.log10(best)) ** 2

    ridge, report = choose_ridge("start", folds, fit, VALUE_RIDGES, error)
    assert report["ridge"] == best and ridge == report["ridge_all"] == best * HELD_OUT_SHARE
    assert report["ridges_tried"] == len(set(tried)) and (best != 1e-2 or report["ridges_tried"] <= 5)
    assert choose_ridge("start", folds, fit, VALUE_RIDGES, lambda w, m: 0.1 if w == "start" else error(w, m))[0] is None
    # from any start of the grid the walk ends at the same minimum; from the minimum itself, after 3 fits
    for first in (VALUE_RIDGES[0], 1e-3, best, VALUE_RIDGES[-1], 0.5):  # 0.5 is off the grid: the middle
        assert choose_ridge("start", folds, fit, VALUE_RIDGES, error, first=first)[1]["ridge"] == best
    edge = best in (VALUE_RIDGES[0], VALUE_RIDGES[-1])
    assert choose_ridge("start", folds, fit, VALUE_RIDGES, error, first=best)[1]["ridges_tried"] == (2 if edge else 3)
