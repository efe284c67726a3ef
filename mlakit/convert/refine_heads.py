"""``--refine values-per-head``: the value refit head by head, then o_proj: a refit whose cost stays small at any size.

The joint refit (``refine_values``) solves for every head's latent at once: its moments grow as (H r)^2 a
token and its solves as (H r)^3, past the layer's forward at 7B shapes with a 512 latent. This refit takes
two passes over the calibration sequences, each reading the converted layer's attention-weighted latents
a_h (``refine_values.latent_inputs``) on the source layer's own input:

1. **Value maps, per head.** W_UV_h (d x r) is refitted so that W_UV_h a_h matches the source head's own
   output o_h (its d columns of the source o_proj's input): ridge least squares from Sigma_aa,h (r x r),
   Sigma_ao,h (r x d) and Sigma_oo,h (d x d), H r^2 a token. Errors are measured where they land, in each
   head's o_proj metric G_h = W_O,h^T W_O,h; one ridge for all heads, shrinking toward the closed form and
   chosen on held-out sequences (``refit_moments.choose_ridge``). Without the cross-head terms of the joint
   fit, each head must match its own output rather than only their sum.
2. **o_proj.** With those value maps stored, o_proj is refitted by ridge least squares from the moments of
   its input z = [W_UV_h a_h]_h against the source attention's output y = W_O o (+ b), (H d)^2 a token:
   it absorbs across heads what step 1 left.

The latent, the scores and so the cache never change. Like the joint refit, it is skipped when the start
is already exact or a validation fold holds fewer tokens than the fit has unknowns per output
(``refit_moments.fold_check``; step 2 alone is skipped where only o_proj's H d are too many), and it never
returns a higher calibration loss (measured directly before, from the moments after) than it was given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .refine import EXACT_LOSS
from .refine_values import assign_values, latent_inputs, value_weights
from .refit_moments import (
    RIDGES,
    VALUE_RIDGES,
    FoldMoments,
    choose_ridge,
    fold_check,
    loss_of,
    ridge_solve,
    sum_folds,
    with_one,
)

__all__ = ["HeadMoments", "refit_per_head"]

Batches = Callable[[], Iterable[tuple[int, torch.Tensor, torch.Tensor]]]  # () -> (first, x, o) per batch


class HeadMoments:
    """Per head and per fold (sequence k in fold k % 2): Sigma_aa (H, r, r), Sigma_ao (H, r, d) and
    Sigma_oo (H, d, d), float32 products summed in float64; and the closed form's attention loss,
    measured directly (``add``)."""

    def __init__(self):
        self.folds: list[list[torch.Tensor] | None] = [None, None]
        self.rows = [0, 0]  # the rows (tokens) summed into each fold
        self.error = self.energy = 0.0

    def add(self, a: torch.Tensor, o: torch.Tensor, first: int) -> None:
        """A (B, T, H, r) and O (B, T, H, d) of sequences FIRST .. FIRST + B - 1."""
        for k in range(2):
            ak = a[(first + k) % 2 :: 2].flatten(0, 1).transpose(0, 1)  # (H, N, r)
            ok = o[(first + k) % 2 :: 2].flatten(0, 1).transpose(0, 1)  # (H, N, d)
            if ak.shape[1] == 0:
                continue
            self.rows[k] += ak.shape[1]
            at = ak.transpose(1, 2)
            new = [(at @ ak).double(), (at @ ok).double(), (ok.transpose(1, 2) @ ok).double()]
            fold = self.folds[k]
            self.folds[k] = new if fold is None else [s + t for s, t in zip(fold, new)]

    def result(self, metric: torch.Tensor) -> list[tuple]:
        """Each fold's (Sigma_aa, Sigma_ao, sum ||W_O o||^2 over heads, Sigma_oo), errors in METRIC (H, d, d);
        an empty fold is all zeros."""
        out = []
        for fold in self.folds:
            if fold is None:
                out.append((0.0, 0.0, 0.0, 0.0))
            else:
                out.append((fold[0], fold[1], float((metric * fold[2]).sum()), fold[2]))
        return out


def _head_metric(w_o: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """G_h = W_O,h^T W_O,h (H, d, d) of o_proj W_O (D, H d [+1]), float64."""
    w = w_o[:, : num_heads * head_dim].double().reshape(-1, num_heads, head_dim).transpose(0, 1)  # (H, D, d)
    return w.transpose(1, 2) @ w


def _head_error(w: torch.Tensor, moments: tuple, metric: torch.Tensor) -> float:
    """sum_h tr(G_h (W_h S_aa W_h^T - 2 W_h S_ao + S_oo)) for value maps W (H, d, r): each head's own error in its
    o_proj metric, summed (the cross-head terms are left out)."""
    aa, ao, _, oo = moments
    wao = w @ ao
    inner = (w @ aa) @ w.transpose(1, 2) - wao - wao.transpose(1, 2) + oo
    return max(float((metric * inner).sum()), 0.0)


def _fit_heads(moments: tuple, ridge: float, prior: torch.Tensor) -> torch.Tensor:
    """argmin over W_h of sum ||W_h a_h - o_h||^2 + lam_h ||W_h - PRIOR_h||^2 for every head (the metric drops out
    of an unconstrained fit), lam_h = ridge * mean(diag Sigma_aa,h): (H, d, r)."""
    aa, ao = moments[0], moments[1]
    lam = ridge * aa.diagonal(dim1=1, dim2=2).mean(-1) + 1e-30
    lhs = aa + lam[:, None, None] * torch.eye(aa.shape[-1], dtype=aa.dtype, device=aa.device)
    rhs = ao + lam[:, None, None] * prior.transpose(1, 2)
    factor, info = torch.linalg.cholesky_ex(lhs)
    solved = torch.cholesky_solve(rhs, factor) if int(info.max()) == 0 else torch.linalg.solve(lhs, rhs)
    return solved.transpose(1, 2)


@torch.no_grad()
def refit_per_head(block: nn.Module, run: Callable, batches: Batches, start_ridge: float | None = None,
                   start_o_ridge: float | None = None, exact: float = EXACT_LOSS) -> dict:
    """Refit converted decoder layer BLOCK's value maps (step 1) and o_proj (step 2) in place. BATCHES() yields
    (first sequence, x, o) over the calibration sequences: the source layer's input (B, T, D) and its
    attention's o_proj input (B, T, H d); it is called once per pass. RUN(block, hidden) runs a layer.
    START_RIDGE, START_O_RIDGE: steps 1 and 2's ridges in the layer below, where their walks start (step 2's
    fits at a 7B shape are p x p solves with D right-hand sides, p = H d: each one saved counts). Returns the
    report: loss_before, loss_after (relative to sum ||y||^2), kept, the ridges and their held-out losses, or
    why it was skipped. EXACT: the start loss at or below which the start is kept (``refine.exact_loss``)."""
    start = time.time()
    attn = block.self_attn
    H, d = attn.num_heads, attn.v_head_dim
    bias = attn.o_proj.bias is not None
    w_uv0, w_o0 = value_weights(attn)  # float64; w_o0 with the bias column
    weight, o_bias = attn.o_proj.weight.detach(), None if not bias else attn.o_proj.bias.detach()  # replaced, not written
    moments = HeadMoments()
    for first, x, o in batches():  # pass 1: the per-head moments and the closed form's loss, directly
        a = latent_inputs(block, run, x).float()
        o = o.float().view(*o.shape[:2], H, d)
        moments.add(a, o, first)
        z0 = torch.einsum("bthr,hdr->bthd", a, w_uv0.float())
        moments.error += float(((z0 - o).flatten(2) @ weight.T).double().square().sum())
        moments.energy += float(torch.nn.functional.linear(o.flatten(2), weight, o_bias).double().square().sum())
    before = moments.error / moments.energy if moments.energy > 0 else moments.error
    report = {"loss_before": before}

    def done(kept: str, after: float, **more) -> dict:
        return report | more | {"loss_after": after, "kept": kept, "seconds": round(time.time() - start, 3)}

    if before <= exact:
        return done("start (already exact)", before)
    metric = _head_metric(w_o0, H, d)
    folds = moments.result(metric)
    if why := fold_check(moments.rows, w_uv0.shape[-1]):  # unknowns per output: a head's latent dims
        return done("start", before, refit=why)
    ridge, validation = choose_ridge(w_uv0, folds, lambda f, r: _fit_heads(folds[f], r, w_uv0), VALUE_RIDGES,
                                     error=lambda w, m: _head_error(w, m, metric), first=start_ridge)
    report |= {"values_" + k: v for k, v in validation.items()} | {"ridge": validation["ridge"]}
    if ridge is None:
        return done("start", before, refit="skipped: no ridge beat the closed form on held-out sequences")
    assign_values(attn, _fit_heads(sum_folds(folds), ridge, w_uv0), w_o0)

    w_uv = value_weights(attn)[0]  # as stored (float32), in float64
    out = FoldMoments(torch.float32)
    for first, x, o in batches():  # pass 2: moments of o_proj's new input against the source's output
        z = torch.einsum("bthr,hdr->bthd", latent_inputs(block, run, x).float(), w_uv.float()).flatten(2)
        out.add(with_one(z, bias), torch.nn.functional.linear(o.float(), weight, o_bias), first)
    folds = out.result()
    total = sum_folds(folds)
    if why := fold_check(out.rows, total[0].shape[0]):  # o_proj has more unknowns per output than a head's map
        o_ridge, o_validation = None, {"refit": why}
    else:
        o_ridge, o_validation = choose_ridge(w_o0, folds, lambda f, r: ridge_solve(*folds[f][:2], r, w_o0), RIDGES,
                                             first=start_o_ridge)
    report |= {"o_proj_" + k: v for k, v in o_validation.items()}
    w_o = w_o0 if o_ridge is None else ridge_solve(total[0], total[1], o_ridge, w_o0)
    assign_values(attn, w_uv, w_o)
    after = loss_of(value_weights(attn)[1], *total)  # of the weights as stored (float32)
    if after >= before:  # no gain, or rounding ate it: put the closed form back
        assign_values(attn, w_uv0, w_o0)
        return done("start", before, refit="skipped: no lower calibration loss than the closed form")
    return done("values refit per head", after)
