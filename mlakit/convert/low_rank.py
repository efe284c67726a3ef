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

Cost at Llama-2-7B shape (W_y 8128 x 4097): M is kept block by block (``BlockMetric``), Sigma^1/2
is any factor R with R R^T = Sigma (Cholesky), and for tall W_y the factors come from the
eigendecomposition of the 4097^2 Gram matrix R^T W_y^T M W_y R (``metric_factor``): one
eigendecomposition per layer instead of two (4097^2 and 8128^2) plus an 8128 x 4097 SVD.
"""

from __future__ import annotations

import torch

from ..choices import LOWRANK_METHODS
from .block_metric import BlockMetric, as_block_metric
from .layer_metrics import LayerMetrics
from .mla_layer import nope_key_coefficients
from .rope_split import RopePlan

__all__ = [
    "LOWRANK_METHODS",
    "bkv_metric",
    "full_rank",
    "gram_energy",
    "metric_energy",
    "metric_factor",
    "metric_gram",
    "metric_spectrum",
    "output_metric",
    "weight_svd",
]



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


def _top_eigh(gram: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K largest eigenvalues (descending) and their eigenvectors of a symmetric matrix."""
    vals, vecs = torch.linalg.eigh(gram)
    return vals.flip(0)[:k], vecs.flip(1)[:, :k]


def _alive(s2: torch.Tensor, n: int) -> torch.Tensor:
    """1/s where s^2 is above the rounding floor of an (n, n) Gram matrix, else 0: a direction with no
    energy gets a zero latent dimension (it adds nothing to the objective either way)."""
    tol = s2.max().clamp_min(1e-300) * n * torch.finfo(torch.float64).eps
    return torch.where(s2 > tol, s2.clamp_min(1e-300).rsqrt(), torch.zeros_like(s2))


def metric_spectrum(w_y, sigma_half, metric_half):
    """Left singular vectors and squared singular values of A = M^1/2 W_y Sigma^1/2 (descending),
    from the eigendecomposition of the smaller Gram matrix of A. SIGMA_HALF may be any factor R with
    R R^T = Sigma; METRIC_HALF a dense matrix or a BlockMetric. Singular vectors whose singular value
    is at the Gram matrix's rounding floor come back as zero columns."""
    a = as_block_metric(metric_half) @ (w_y.double() @ sigma_half.double())  # (Y, X)
    rows, cols = a.shape
    if rows <= cols:
        s2, u = _top_eigh(a @ a.T, rows)
        return u, s2.clamp_min(0)
    s2, v = _top_eigh(a.T @ a, cols)
    s2 = s2.clamp_min(0)
    return (a @ v) * _alive(s2, cols), s2


def metric_gram(w_y: torch.Tensor, sigma_half: torch.Tensor, metric, metric_half=None) -> torch.Tensor:
    """The smaller Gram matrix of A = M^1/2 W_y R (R = SIGMA_HALF): (X, X) A^T A = R^T W^T M W R when
    W_y has more rows than columns (MHA; it needs no power of M), else (Y, Y) A A^T. The costly
    product that the rank planner's error curve and the factorisation share (``metric_energy``,
    ``metric_factor``): a two-pass conversion computes it once and passes it to both. METRIC_HALF:
    M^1/2 when the caller has it already (only the wide case reads it)."""
    metric, w = as_block_metric(metric), w_y.double()
    wr = w @ sigma_half.double()  # (Y, X)
    if w.shape[0] > w.shape[1]:
        return metric.gram(wr)
    a = (metric.powers((0.5,))[0] if metric_half is None else metric_half) @ wr
    return a @ a.T


def metric_energy(w_y: torch.Tensor, sigma_half: torch.Tensor, metric) -> torch.Tensor:
    """The squared singular values of ``metric_spectrum`` from M itself (no power of M when W_y is
    tall) and without singular vectors: all the rank planner's error curve needs."""
    return gram_energy(metric_gram(w_y, sigma_half, metric))


def gram_energy(gram: torch.Tensor) -> torch.Tensor:
    """``metric_energy`` from the ``metric_gram`` already computed: its eigenvalues, descending."""
    return torch.linalg.eigvalsh(gram).flip(0).clamp_min(0)


def metric_factor(w_y: torch.Tensor, sigma_half: torch.Tensor, metric, rank: int, gram: torch.Tensor | None = None):
    """argmin over rank-r (up, down) of E||M^1/2 (W_y - up down) x~||^2 with E[x~ x~^T] = R R^T,
    R = SIGMA_HALF (any such factor). METRIC: a dense PSD matrix or a BlockMetric.

    Closed form: with A = M^1/2 W_y R = U S V^T, up = M^-1/2 U_r and down = U_r^T M^1/2 W_y.
    When W_y has more rows than columns (MHA: 2Gd - d_R > D + 1) the same factors follow from
    the right singular vectors alone, U_r = A V_r S_r^-1, so
        up = W_y R V_r S_r^-1,   down = S_r^-1 (M W_y R V_r)^T W_y,
    with V_r, S_r^2 from the (D+1)^2 Gram matrix R^T W_y^T M W_y R: no power of M, no SVD of the
    tall A. Otherwise (GQA) the (Y, Y) Gram matrix is the small one and M^+-1/2 is taken block
    by block. GRAM: the ``metric_gram`` of these arguments, when already computed."""
    _check_rank(rank, w_y.shape[0])
    metric, w, r_fac = as_block_metric(metric), w_y.double(), sigma_half.double()
    rows, cols = w.shape
    k = min(rank, rows, cols)
    if rows > cols:
        gram = metric_gram(w, r_fac, metric) if gram is None else gram
        s2, v = _top_eigh(gram, k)
        s2 = s2.clamp_min(0)
        del gram
        wz = w @ (r_fac @ v)  # (Y, k) = W R V_r = M^-1/2 U_r S_r
        up = wz * _alive(s2, cols)
        down = (metric @ up).T @ w  # S^-1 (M W R V_r)^T W
        return down, up
    m_half, m_ihalf = metric.powers((0.5, -0.5))  # one eigendecomposition of the blocks serves both
    _, u = _top_eigh(metric_gram(w, r_fac, metric, m_half) if gram is None else gram, k)
    return (m_half @ u).T @ w, m_ihalf @ u


def output_metric(plan: RopePlan, m: LayerMetrics, num_heads: int, num_kv_heads: int, head_dim: int,
                  averaged: bool = True):
    """M = blockdiag(M_k, M_v) over y = [dropped key components (re, im); v]. AVERAGED: the dropped
    components are read by queries scaled by the phase mean (``LayerMetrics.dropped_query_map``)."""
    G, d = num_kv_heads, head_dim
    group = torch.arange(num_heads) // (num_heads // G)
    moment = m.query_moment
    if averaged:
        qmap = m.dropped_query_map()
        moment = qmap @ moment @ qmap.transpose(1, 2)
    w = (m.head_weight * m.rho)[:, None, None] * moment  # (H, d, d)
    q_g = torch.zeros(G, d, d, dtype=torch.float64).index_add_(0, group, w)
    C = nope_key_coefficients(plan, G, d)  # (G, d/2, n)
    n = C.shape[2]
    P = torch.zeros(G, d, 2 * n, dtype=torch.float64)
    P[:, : d // 2, :n] = C
    P[:, d // 2 :, n:] = C
    m_k = torch.einsum("gax,gab,gby->xy", P, q_g, P)  # (2n, 2n): dense, keys of all heads mix
    return BlockMetric([m_k, m.value_metric])  # values: one (d, d) block per KV head


def bkv_metric(w_y: torch.Tensor, sigma: torch.Tensor, n_key_rows: int) -> torch.Tensor:
    """TransMLA's balance: key rows rescaled so their energy matches the values'."""
    energy = torch.einsum("rx,xy,ry->r", w_y.double(), sigma.double(), w_y.double())
    k_energy, v_energy = energy[:n_key_rows].sum(), energy[n_key_rows:].sum()
    s2 = (v_energy / k_energy.clamp_min(1e-300)) if n_key_rows else torch.tensor(1.0, dtype=torch.float64)
    diag = torch.ones(w_y.shape[0], dtype=torch.float64)
    diag[:n_key_rows] = s2
    return BlockMetric([diag])
