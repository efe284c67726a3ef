"""The quality ablation with each layer's latent refitted so that its keys are judged on the centred input
moment: a key offset that is the same at every position adds the same score to every key a query reads,
which the softmax cancels, so the no-rotary keys' error belongs under E[(x - mu)(x - mu)^T] while the
values' stays under E[x x^T]. The two moments differ, so there is no single SVD: block-coordinate descent
from the RRR start (latent given the up-projections, solved in the basis that diagonalises both moments;
up-projections given the latent, least squares), CK_ITERS rounds. It prints each layer's key and value
error before and after. A measurement, not an option of the converter.

    python bench/experiments/centred_keys.py --budgets 0.3125 --rows 6 --out DIR

Every argument goes to bench/quality_ablation.py.
"""

from __future__ import annotations

import os

import torch
from ablation_run import run_ablation  # noqa: E402 (first: it puts this checkout on sys.path)

import mlakit.convert.compress as compress  # noqa: E402
from mlakit.convert.block_metric import BlockMetric  # noqa: E402

ITERS = int(os.environ.get("CK_ITERS", "10"))
_rrr = compress.metric_factor


def _objective(wk, wv, uk, uv, d, mk, mv, sk, sv):
    ek, ev = wk - uk @ d, wv - uv @ d
    return float(((mk @ ek @ sk) * ek).sum()), float(((mv @ ev @ sv) * ev).sum())


def centred_factor(w_y, sigma_half, metric, rank, gram=None):
    down, up = _rrr(w_y, sigma_half, metric, rank, gram)
    if not isinstance(metric, BlockMetric) or metric.blocks[-1].dim() != 3 or rank >= w_y.shape[0]:
        return down, up
    w = w_y.double()
    n_val = metric.sizes[-1]
    n_key = w.shape[0] - n_val
    if n_key == 0:
        return down, up
    mk, mv = metric.blocks[0], torch.block_diag(*metric.blocks[-1])
    sigma = sigma_half.double() @ sigma_half.double().T
    bias = bool(w[:, -1].abs().max() > 0)
    keep = w.shape[1] if bias else w.shape[1] - 1
    mu = sigma[:keep, -1].clone()
    sv = sigma[:keep, :keep]
    sk = sv - mu[:, None] * mu[None]
    w, d = w[:, :keep], down.double()[:, :keep]
    wk, wv = w[:n_key], w[n_key:]
    L = torch.linalg.cholesky(sv)
    eye = torch.eye(keep, dtype=torch.float64)
    linv = torch.linalg.solve_triangular(L, eye, upper=False)
    lam, z = torch.linalg.eigh(linv @ sk @ linv.T)
    V = linv.T @ z  # V^T sv V = I, V^T sk V = diag(lam)

    def ups(d):
        uk = wk @ sk @ d.T @ torch.linalg.pinv(d @ sk @ d.T, hermitian=True)
        uv = wv @ sv @ d.T @ torch.linalg.pinv(d @ sv @ d.T, hermitian=True)
        return uk, uv

    uk0, uv0 = up.double()[:n_key], up.double()[n_key:]
    first = _objective(wk, wv, uk0, uv0, d, mk, mv, sk, sv)
    uk, uv = ups(d)
    for _ in range(ITERS):
        P, Q = uk.T @ mk @ uk, uv.T @ mv @ uv
        B = uk.T @ mk @ wk @ sk + uv.T @ mv @ wv @ sv
        E = torch.linalg.solve(lam[:, None, None] * P[None] + Q[None], (B @ V).T[..., None])[..., 0]
        d = E.T @ V.T
        uk, uv = ups(d)
    last = _objective(wk, wv, uk, uv, d, mk, mv, sk, sv)
    print(f"centred keys: key {first[0]:.4g}->{last[0]:.4g} value {first[1]:.4g}->{last[1]:.4g}", flush=True)
    down_new = torch.zeros_like(down.double())
    down_new[:, :keep] = d
    return down_new.to(down.dtype), torch.cat([uk, uv]).to(up.dtype)


compress.metric_factor = centred_factor
run_ablation()
