"""Low-rank factorisations of the joint NoPE-key/value map y = W_y x~ (x~ = [x; 1]).

Each returns ``(down, up)`` with c_kv = down @ x~ (r rows) and y ~= up @ c_kv.

- ``svd``      MHA2MLA's joint SVD of the weights (data-free, Eckart-Young in weight space).
- ``bkv_pca``  TransMLA's BKV-PCA: PCA of the calibration activations of [k_nope; v], keys
               rescaled to the values' norm.
- ``rrr``      ours: reduced-rank regression that minimises the first-order output error,
               E||M^1/2 (y - up down x~)||^2 with M = blockdiag(M_k, M_v): keys weighted by the
               second moments of the queries that read them and by how much their logits move
               the output, values by W_O (layer_metrics). Closed form: the SVD of
               M^1/2 W_y Sigma^1/2 (Eckart-Young in the metric).
BKV-PCA is the same closed form with M = diag(s^2 for keys, 1 for values).
"""

from __future__ import annotations

import torch

from .layer_metrics import LayerMetrics, psd_power
from .mla_layer import nope_key_coefficients
from .rope_split import RopePlan

__all__ = [
    "LOWRANK_METHODS", "bkv_metric", "full_rank", "metric_factor", "metric_spectrum", "output_metric", "weight_svd",
]

LOWRANK_METHODS = ("rrr", "bkv_pca", "svd")


def full_rank(w_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent is y itself: exact."""
    return w_y.clone(), torch.eye(w_y.shape[0], dtype=w_y.dtype)


def _check_rank(rank: int, rows: int) -> None:
    if not 1 <= rank <= rows:
        raise ValueError(f"rank must be in [1, {rows}], got {rank}")


def weight_svd(w_y: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-free: best rank-r approximation of W_y in Frobenius norm."""
    _check_rank(rank, w_y.shape[0])
    u, s, vh = torch.linalg.svd(w_y.double(), full_matrices=False)
    return s[:rank, None] * vh[:rank], u[:, :rank]


def metric_spectrum(w_y, sigma_half, metric_half):
    """Left singular vectors and squared singular values of M^1/2 W_y Sigma^1/2."""
    u, s, _ = torch.linalg.svd(metric_half @ w_y.double() @ sigma_half, full_matrices=False)
    return u, s.square()


def metric_factor(w_y: torch.Tensor, sigma_half: torch.Tensor, metric: torch.Tensor, rank: int):
    """argmin over rank-r (up, down) of E||M^1/2 (W_y - up down) x~||^2, sigma_half = E[x~ x~^T]^1/2."""
    _check_rank(rank, w_y.shape[0])
    m_half, m_ihalf = psd_power(metric, 0.5), psd_power(metric, -0.5)
    u, _ = metric_spectrum(w_y, sigma_half, m_half)
    u = u[:, :rank]
    return u.T @ m_half @ w_y.double(), m_ihalf @ u


def output_metric(plan: RopePlan, m: LayerMetrics, num_heads: int, num_kv_heads: int, head_dim: int):
    """M = blockdiag(M_k, M_v) over y = [dropped key components (re, im); v]."""
    G, d = num_kv_heads, head_dim
    group = torch.arange(num_heads) // (num_heads // G)
    w = (m.head_weight * m.rho)[:, None, None] * m.query_moment  # (H, d, d)
    q_g = torch.zeros(G, d, d, dtype=torch.float64).index_add_(0, group, w)
    C = nope_key_coefficients(plan, G, d)  # (G, d/2, n)
    n = C.shape[2]
    P = torch.zeros(G, d, 2 * n, dtype=torch.float64)
    P[:, : d // 2, :n] = C
    P[:, d // 2 :, n:] = C
    m_k = torch.einsum("gax,gab,gby->xy", P, q_g, P)
    return torch.block_diag(m_k, torch.block_diag(*m.value_metric))


def bkv_metric(w_y: torch.Tensor, sigma: torch.Tensor, n_key_rows: int) -> torch.Tensor:
    """TransMLA's balance: key rows rescaled so their energy matches the values'."""
    energy = torch.einsum("rx,xy,ry->r", w_y.double(), sigma.double(), w_y.double())
    k_energy, v_energy = energy[:n_key_rows].sum(), energy[n_key_rows:].sum()
    s2 = (v_energy / k_energy.clamp_min(1e-300)) if n_key_rows else torch.tensor(1.0, dtype=torch.float64)
    diag = torch.ones(w_y.shape[0], dtype=torch.float64)
    diag[:n_key_rows] = s2
    return torch.diag(diag)
