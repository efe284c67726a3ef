"""Least-squares refits of a converted attention from accumulated second moments (pure math, float64).

Two refits share the machinery here: moments split in two folds, ridge solves, the exact loss of
any linear map from the moments alone, and a ridge chosen by two-fold cross-validation.

**o_proj refit** (``refine.refine_layer``): z is the attention's output before o_proj, r the
update the attention should add; fit W in r ~ W z.

**Joint value / o_proj refit** (``--refine values``, ``refit_values``). Per head h the converted
attention outputs o_h = W_UV_h a_h, where a_h = sum_s p_{h,t,s} c_kv,s (r dims) is the
attention-weighted latent under the converted layer's own scores and latent
(``refine_values.latent_attention``); the layer adds y_hat = sum_h W_O_h W_UV_h a_h (+ b). With
a = [a_1; ...; a_H] (and a trailing 1 when o_proj has a bias) and M = [W_O_1 W_UV_1 | ... | b],
y_hat = M a, and for a target y (the source layer's attention output)

    sum ||M a - y||^2 = sum ||y||^2 - 2 <M, (A^T Y)^T> + <M (A^T A), M>,

so Sigma_aa = sum a a^T, Sigma_ay = sum a y^T and sum ||y||^2 give the loss of any M exactly.
The fit, for a ridge lambda:

1. M* = argmin sum ||M a - y||^2 + lambda ||M||^2 (normal equations over all heads at once, so
   heads that read correlated latents share the work);
2. per head, the best rank-d approximation of M*_h in the metric of that head's latent,
   E||(M*_h - P M*_h) a_h||^2: P projects onto the leading d left singular vectors U_d of
   M*_h S_h^{1/2} (S_h the head's block of Sigma_aa), and W_UV_h = c U_d^T M*_h (d x r, c keeps
   the closed form's RMS). When r <= d nothing is lost; when r > d this is where rank goes;
3. given those W_UV, z = [W_UV_h a_h]_h is linear in a (z = B a, B block-diagonal), so
   Sigma_zz = B Sigma_aa B^T and Sigma_zy = B Sigma_ay, and o_proj is the ridge least-squares
   solve on them: it absorbs what step 2 lost across heads.

The ridge is chosen from a grid on held-out sequences (fit on one fold, measure on the other,
both ways; ``choose_ridge`` walks the grid to the minimum, and halves it for the fit on both folds:
``HELD_OUT_SHARE``), which reports None when no ridge beats
the start held out: a calibration of few or similar sequences leaves directions of a it never
excites, and an unregularised solve puts weight there that new text excites. The latent (and so the cache),
the scores and the queries never change: only W_UV (the value rows of kv_b_proj) and o_proj.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "HELD_OUT_SHARE",
    "RIDGES",
    "FoldMoments",
    "choose_ridge",
    "effective_map",
    "fold_check",
    "fit_values",
    "head_roots",
    "loss_of",
    "project_moments",
    "quadratic_error",
    "ridge_solve",
    "sum_folds",
    "values_error",
    "with_one",
]

# ridges of the normal equations tried, relative to their mean diagonal (a log grid from "none" to
# strong shrinkage); the held-out error picks one (``choose_ridge``)
RIDGES = (1e-8, 1e-6, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1)
# the value refit shrinks toward the closed form, not toward zero, so a large ridge is a small step
# from a good start rather than a collapse: its grid reaches further
VALUE_RIDGES = (*RIDGES, 1.0, 3.0, 10.0, 30.0)
# A ridge is relative to its moments' mean diagonal, which grows with the sequences summed, while the
# prior's best absolute weight does not (it is the noise over the prior's spread): the weight that held
# out best for a fit on one fold is, relative to both folds' moments, the fold's share of them (a half).
# Kept at the grid's ridge, the fit on both folds shrank twice as hard as validated, and converted models
# were worse on every text measured (docs/results.md, "The ridge of the fit on all sequences").
HELD_OUT_SHARE = 0.5

Moments = tuple  # (Sigma_zz (p, p), Sigma_zr (p, D), sum ||r||^2): float64, one fold or both


class FoldMoments:
    """sum z z^T, sum z r^T and sum ||r||^2 (float64) over rows z, r, in two folds, and each fold's row count:
    sequence k of the calibration set belongs to fold k % 2. Each batch's products are taken in PRODUCT_DTYPE
    and summed in float64 (float32 products take half the time of float64 ones)."""

    def __init__(self, product_dtype: torch.dtype = torch.float64):
        self.folds = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
        self.rows = [0, 0]  # the rows (tokens) summed into each fold
        self.product_dtype = product_dtype

    def add(self, z: torch.Tensor, r: torch.Tensor, first: int) -> None:
        """Z (B, T, p) and R (B, T, D) of sequences FIRST .. FIRST + B - 1."""
        z, r = z.to(self.product_dtype), r.to(self.product_dtype)
        for k, fold in enumerate(self.folds):  # sequence first + j belongs to fold (first + j) % 2
            zk = z[(first + k) % 2 :: 2].reshape(-1, z.shape[-1])
            rk = r[(first + k) % 2 :: 2].reshape(-1, r.shape[-1])
            fold[0] = fold[0] + _upper_gram(zk).double()
            fold[1] = fold[1] + (zk.T @ rk).double()
            fold[2] += float(rk.double().square().sum())
            self.rows[k] += zk.shape[0]

    def result(self) -> list[Moments]:
        return [(_mirror(f[0]), f[1], f[2]) for f in self.folds]


def _upper_gram(z: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The upper triangle (diagonal blocks whole) of Z^T Z for Z (N, p), in column blocks: about half the
    work of the whole product. ``_mirror`` completes it."""
    p = z.shape[1]
    if p <= chunk:
        return z.T @ z
    out = z.new_zeros(p, p)
    for a in range(0, p, chunk):
        out[a : a + chunk, a:] = z[:, a : a + chunk].T @ z[:, a:]
    return out


def _mirror(upper):
    """The symmetric matrix whose upper triangle UPPER holds (0.0, an empty fold, passes through)."""
    return upper.triu() + upper.triu(1).T if isinstance(upper, torch.Tensor) else upper


def with_one(z: torch.Tensor, bias: bool) -> torch.Tensor:
    """Z (..., p) with a trailing column of ones when BIAS (a bias acts on it as one more input), else Z."""
    return torch.cat([z, torch.ones(*z.shape[:-1], 1, dtype=z.dtype, device=z.device)], dim=-1) if bias else z


def sum_folds(folds: list[Moments]) -> Moments:
    return tuple(a + b for a, b in zip(*folds))


def quadratic_error(w: torch.Tensor, zz, zr, rr: float) -> float:
    """sum ||W z - r||^2 from the moments, clamped at 0 (rounding)."""
    return max(rr - 2 * float((w * zr.T).sum()) + float(((w @ zz) * w).sum()), 0.0)


def loss_of(w: torch.Tensor, zz, zr, rr: float) -> float:
    """sum ||W z - r||^2 relative to sum ||r||^2."""
    return quadratic_error(w, zz, zr, rr) / rr if rr > 0 else quadratic_error(w, zz, zr, rr)


def ridge_solve(
    zz: torch.Tensor, zr: torch.Tensor, ridge: float, prior: torch.Tensor | None = None
) -> torch.Tensor:
    """argmin_W sum ||W z - r||^2 + lam ||W - PRIOR||^2 (PRIOR None: zero), lam = ridge * mean(diag Z^T Z):
    the normal equations (Z^T Z + lam I) W^T = Z^T R + lam PRIOR^T, by Cholesky (the matrix is positive
    definite for any lam > 0; a general solve takes over where rounding makes the factorisation fail)."""
    lam = ridge * float(zz.diagonal().mean()) + 1e-30
    rhs = zr if prior is None else zr + lam * prior.T
    lhs = zz + lam * torch.eye(zz.shape[0], dtype=zz.dtype, device=zz.device)
    factor, info = torch.linalg.cholesky_ex(lhs)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, factor).T
    return torch.linalg.solve(lhs, rhs).T


def fold_check(rows: list[int], unknowns: int) -> str | None:
    """Why a ridge chosen by two-fold validation over folds of ROWS tokens each cannot be trusted for a fit with
    UNKNOWNS weights per output, or None when it can. An empty fold validates nothing. A fold with fewer tokens
    than unknowns leaves directions of the fit's input it never excites, where its own fit is set by the prior
    alone, and which ridge holds out best is then read off one or two sequences: too noisy to trust over the
    closed form (a refit from such folds made unseen sequences worse, tests/test_refine_values.py)."""
    if min(rows) == 0:
        return "skipped: two-fold validation needs at least 2 sequences"
    if min(rows) < unknowns:
        return (f"skipped: a validation fold holds {min(rows)} tokens, fewer than the {unknowns} unknowns per "
                f"output of the fit; calibrate on more tokens")
    return None


def choose_ridge(
    w0,
    folds: list[Moments],
    fit: Callable[[int, float], object],
    ridges: tuple[float, ...] = RIDGES,
    error: Callable[[object, Moments], float] | None = None,
    first: float | None = None,
):
    """The ridge of RIDGES (ascending) whose fit (``fit(fold, ridge)``: fitted on ``folds[fold]``) has
    the lowest held-out error over the two folds, as the ridge of the fit on both folds (``HELD_OUT_SHARE``
    of it), or None when it does not beat W0's own held-out error; and the report (cv_loss_start,
    cv_loss_refit, ridge: the grid's, ridge_all: the one returned, ridges_tried; cv_folds_start and
    cv_folds_refit: each fold's share of the held-out losses). ERROR(fitted, moments)
    is the summed squared error of a fit (or of W0) on MOMENTS; by default fits are matrices W acting
    on z (``quadratic_error``).

    The grid is walked from its middle toward the lower held-out error and the walk stops at a ridge
    both of whose neighbours are worse: the held-out error is unimodal in the log ridge (every layer
    of a SmolLM2 conversion, bench/experiments/ridge_search.py), so this finds the grid's minimum with
    a few fits instead of one per ridge. FIRST (a ridge of the grid) is where the walk begins instead of
    the middle; on a unimodal error the minimum found is the same from anywhere."""
    error = error or (lambda w, m: quadratic_error(w, *m))
    held = lambda w_of: [error(w_of(1 - f), folds[f]) for f in (0, 1)]  # noqa: E731
    start_folds = held(lambda f: w0)
    at_start = sum(start_folds)
    per_fold: dict[int, list[float]] = {}
    errors: dict[int, float] = {}

    def at(k: int) -> float:
        if k not in errors:
            per_fold[k] = held(lambda f: fit(f, ridges[k]))
            errors[k] = sum(per_fold[k])
        return errors[k]

    k = ridges.index(first) if first in ridges else len(ridges) // 2
    while (best := min((j for j in (k - 1, k, k + 1) if 0 <= j < len(ridges)), key=at)) != k:
        k = best
    total = folds[0][2] + folds[1][2]
    report = {"cv_loss_start": at_start / total, "cv_loss_refit": errors[k] / total, "ridge": ridges[k],
              "ridge_all": ridges[k] * HELD_OUT_SHARE, "ridges_tried": len(errors),
              "cv_folds_start": [e / total for e in start_folds], "cv_folds_refit": [e / total for e in per_fold[k]]}
    return (ridges[k] * HELD_OUT_SHARE if errors[k] < at_start else None), report


def project_moments(w_uv: torch.Tensor, moments: Moments, bias: bool) -> Moments:
    """The moments of z = B a (``B``: the block-diagonal map a -> [W_UV_h a_h]_h of W_UV (H, d, r), with a
    bias-augmented a's trailing 1 passed through) from those of a: (B Sigma_aa B^T, B Sigma_ay, sum ||y||^2),
    block by block (B is never formed: a dense product would cost H times as much)."""
    aa, ay, yy = moments
    H, d, r = w_uv.shape
    w, n = w_uv.double(), H * r
    blocks = torch.einsum("hdr,hrgs->hdgs", w, aa[:n, :n].reshape(H, r, H, r))
    zz = torch.einsum("hdgs,ges->hdge", blocks, w).reshape(H * d, H * d)
    zy = torch.einsum("hdr,hrk->hdk", w, ay[:n].reshape(H, r, -1)).reshape(H * d, -1)
    if bias:
        cross = torch.einsum("hdr,hr->hd", w, aa[:n, n].reshape(H, r)).reshape(H * d, 1)
        zz = torch.cat([torch.cat([zz, cross], 1), torch.cat([cross.T, aa[n:, n:]], 1)], 0)
        zy = torch.cat([zy, ay[n:]], 0)
    return zz, zy, yy


def effective_map(w_uv: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """M = W_O B (D, H r [+1]) of W_UV (H, d, r) and o_proj W_O (D, H d [+1]): y_hat = M a."""
    H, d, r = w_uv.shape
    w_o = w_o.double()
    m = torch.einsum("khd,hdr->khr", w_o[:, : H * d].reshape(-1, H, d), w_uv.double()).reshape(-1, H * r)
    return torch.cat([m, w_o[:, H * d :]], dim=1)  # the bias column, if any, acts on a's trailing 1


def values_error(w_uv: torch.Tensor, w_o: torch.Tensor, moments: Moments) -> float:
    """sum ||W_O B a - y||^2 of value maps W_UV and o_proj W_O (bias column included) on MOMENTS of a, y."""
    return quadratic_error(w_o.double(), *project_moments(w_uv, moments, w_o.shape[1] > w_uv.shape[0] * w_uv.shape[1]))


def head_roots(aa: torch.Tensor, num_heads: int, bias: bool) -> list[torch.Tensor]:
    """S_h^{1/2} of every head's diagonal block S_h (r, r) of Sigma_aa (H r rows, + 1 for a BIAS-augmented a):
    the metric step 2 of ``fit_values`` reads, the same for every ridge of a fold."""
    r = (aa.shape[0] - int(bias)) // num_heads
    roots = []
    for h in range(num_heads):
        evals, evecs = torch.linalg.eigh(aa[h * r : (h + 1) * r, h * r : (h + 1) * r])
        roots.append((evecs * evals.clamp_min(0).sqrt()) @ evecs.T)
    return roots


def _leading_left_vectors(x: torch.Tensor, k: int) -> torch.Tensor:
    """The leading min(k, columns) left singular vectors of X (D, r), D >= r: from the eigenvectors of the
    small Gram X^T X (r, r), a fraction of an SVD's time, when k < r and the k-th singular value is
    well above rounding; otherwise (the span needs every column, or one is near zero) by SVD."""
    r = x.shape[1]
    if k < r <= x.shape[0]:
        evals, evecs = torch.linalg.eigh(x.T @ x)  # ascending
        top, vecs = evals.flip(0)[:k], evecs.flip(1)[:, :k]
        if float(top[-1]) > 1e-8 * float(top[0]):  # u^T u = I to about 1e-16 / 1e-8
            return (x @ vecs) / top.sqrt()
    return torch.linalg.svd(x, full_matrices=False)[0][:, :k]


def _head_values(
    m: torch.Tensor, root: torch.Tensor, d: int, rms: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 for one head: W_UV_h (d, r) spanning the best rank-d part of M_h (D, r) in the metric
    of the head's latent (ROOT = S_h^{1/2}, ``head_roots``), scaled to RMS; and the W_O_h (D, d) with
    W_O_h W_UV_h that part."""
    u = _leading_left_vectors(m @ root, d)  # (D, min(d, r, D))
    if u.shape[1] < d:  # r < d: the head needs only r value dims; the rest stay zero
        u = torch.cat([u, u.new_zeros(u.shape[0], d - u.shape[1])], dim=1)
    w = u.T @ m
    scale = float(w.square().mean().sqrt())
    c = rms / scale if scale > 0 and rms > 0 else 1.0
    return w * c, u / c


def fit_values(
    moments: Moments,
    ridge: float,
    prior: torch.Tensor,
    num_heads: int,
    head_dim: int,
    bias: bool,
    rms: float,
    roots: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-3 of the module docstring on MOMENTS of a = [a_1; ...; a_H (; 1)] and y, each ridge
    shrinking toward the start (PRIOR: its M, ``effective_map``; step 3 toward step 2's own o_proj, so
    a large ridge returns the start): W_UV (H, d, r), each head scaled to RMS, and o_proj W_O (D, H d [+1]).
    ROOTS: ``head_roots`` of these moments, when the caller fits them for several ridges."""
    aa, ay, _ = moments
    r = (aa.shape[0] - int(bias)) // num_heads
    roots = roots if roots is not None else head_roots(aa, num_heads, bias)
    m = ridge_solve(aa, ay, ridge, prior)  # (D, H r [+1])
    heads = [_head_values(m[:, h * r : (h + 1) * r], roots[h], head_dim, rms) for h in range(num_heads)]
    w_uv = torch.stack([w for w, _ in heads])
    w_o = torch.cat([o for _, o in heads] + ([m[:, -1:]] if bias else []), dim=1)  # step 2's o_proj
    zz, zy, _ = project_moments(w_uv, moments, bias)
    return w_uv, ridge_solve(zz, zy, ridge, w_o)
