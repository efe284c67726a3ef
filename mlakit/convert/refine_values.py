"""``--refine values``: refit one converted attention's value maps and o_proj jointly, from moments.

After the closed form, each head's value map W_UV_h (the value rows of ``kv_b_proj``) and
``o_proj`` are refitted so that the converted attention's output matches the source layer's
attention output (math and algebra: ``refit_moments``). The fit needs only the attention-weighted
latents a_h (``latent_attention``) of the layer's inputs and its targets, gathered as second
moments (``add_batch``). Which inputs and targets is the driver's choice (``pipeline.refine_steps``):
the converted model's hidden states, with a target that weighs the source's function on them against
undoing the error the layers below left (the default, ``compensating_target``), or the source's own,
which need no forward of the converted model.

Only W_UV and o_proj change: the latent, the rotary key, the scores and so the cache stay as the
closed form made them. The refit is skipped when the start is already exact (the full-rank
conversion must stay bit-exact), when a validation fold holds fewer tokens than the fit has unknowns
per output, when no ridge beats the closed form on held-out sequences, and when it does not lower the
calibration loss: it never returns a higher loss than it was given.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from .refine import EXACT_LOSS, run_to_attention
from .refit_moments import (
    VALUE_RIDGES,
    FoldMoments,
    choose_ridge,
    effective_map,
    fit_values,
    fold_check,
    head_roots,
    loss_of,
    project_moments,
    sum_folds,
    values_error,
    with_one,
)

# the largest block of attention scores ``latent_attention`` materialises at once (bytes), and the most
# queries in one block: smaller blocks skip more of the keys a causal mask hides, larger ones make
# larger products (16 and 32 rows tied as the fastest of 16-128 at SmolLM2's shapes in a scratch timing,
# 40% under all 256 at once)
_SCORE_BYTES = 1 << 28
_QUERY_BLOCK = 32

__all__ = [
    "ValueMoments", "add_batch", "assign_values", "compensating_target", "first_masked_key", "flat_latents",
    "key_span", "latent_attention", "latent_inputs", "layer_from_latents", "refit_values", "sampled_sequences",
    "value_weights",
]


class ValueMoments(FoldMoments):
    """The refit's moments of a and y (``add_batch``), with float32 products summed in float64: half
    the time of float64 products, and the held-out ridge choice sees their rounding. That rounding
    would hide whether the closed form is already exact (a full-rank conversion must stay bit-exact),
    so START_LOSS measures it directly on the first batch, in float64."""

    def __init__(self):
        super().__init__(torch.float32)
        self.start_loss: float | None = None


def latent_attention(attn, hidden_states, position_embeddings, attention_mask=None) -> torch.Tensor:
    """The attention-weighted latent of every head of MLA attention ATTN, a_{h,t} = sum_s p_{h,t,s} c_kv,s
    (B, S, H, r), with its own scores: what each head's value map W_UV_h turns into its output
    (o_h = W_UV_h a_h).

    Scored in the absorbed form, q_h W_UK_h against the shared [c_kv; k_rope], and weighted over the
    shared c_kv: every head's scores and weights are one batched product against keys and values
    that are the same for all heads (a fused attention kernel takes them per head, expanded: 2.4x the
    time at SmolLM2's calibration batch in a scratch timing). The scores are materialised a block of
    at most ``_QUERY_BLOCK`` queries at a time, at most ``_SCORE_BYTES`` each, over only the keys some
    query of the block may see (``key_span``): under a causal mask about half the score work."""
    q_nope, q_rope, c_kv, k_rope = attn._project(hidden_states, position_embeddings)
    B, H, S, d = q_nope.shape
    r = attn.kv_lora_rank
    w_uk = attn.kv_b_proj.weight.view(H, d + attn.v_head_dim, r)[:, :d]  # (H, d, r): the key rows only
    q = torch.cat([q_nope @ w_uk, q_rope], dim=-1) * attn.scaling  # (B, H, S, r + d_R), scaled: fewer than the scores
    keys = torch.cat([c_kv, k_rope], dim=-1).transpose(1, 2)  # (B, r + d_R, T), every head's
    T = keys.shape[-1]
    allowed = None if attention_mask is None else attention_mask.allowed  # (1 or B, 1, S, T)
    step = max(1, min(_QUERY_BLOCK, _SCORE_BYTES // (B * H * T * q.element_size())))
    out = c_kv.new_empty(B, S, H, r)
    for a in range(0, S, step):
        qa = q[:, :, a : a + step]
        s = qa.shape[2]
        span = slice(None) if allowed is None else key_span(allowed[..., a : a + s, :])
        k = keys[..., span]
        t = k.shape[-1]
        scores = (qa.reshape(B, H * s, -1) @ k).view(B, H, s, t)
        if allowed is not None:  # a masked key weighs as under an additive finfo.min bias, as in the model
            block = allowed[..., a : a + s, span]
            first = first_masked_key(block)  # keys before it are seen by every query: nothing to mask there
            scores[..., first:].masked_fill_(~block[..., first:], torch.finfo(scores.dtype).min)
        out[:, a : a + s] = (scores.softmax(-1).view(B, H * s, t) @ c_kv[:, span]).view(B, H, s, r).transpose(1, 2)
    return out


def key_span(allowed: torch.Tensor) -> slice:
    """The keys from the first to the last that some query of ALLOWED (.., s, T) may see: the others weigh
    exactly 0 in every row's softmax. All keys when a row sees none (its softmax is uniform over all)."""
    rows = allowed.flatten(0, -2)  # (N, T)
    if not bool(rows.any(-1).all()):
        return slice(None)
    seen = rows.any(0).nonzero()
    return slice(int(seen[0]), int(seen[-1]) + 1)


def first_masked_key(allowed: torch.Tensor) -> int:
    """The first key of ALLOWED (.., s, t) that some query may not see (t when every query sees every key):
    under a causal mask only the block's last s keys, so masking the rest would be work for nothing."""
    hidden = ~allowed.flatten(0, -2).all(0)
    return int(hidden.nonzero()[0]) if bool(hidden.any()) else allowed.shape[-1]


def latent_inputs(block: nn.Module, run: Callable, hidden: torch.Tensor) -> torch.Tensor:
    """The attention-weighted latents of converted decoder layer BLOCK on HIDDEN (B, T, D), through
    RUN(block, hidden): (B, T, H, r). The attention itself is not run: the layer stops at its input,
    read with the layer's own norm, rotary table and mask."""
    return run_to_attention(block, run, hidden, lambda attn, args: latent_attention(attn, *args[:3]), before=True)


def flat_latents(block: nn.Module, run: Callable, hidden: torch.Tensor) -> torch.Tensor:
    """``latent_inputs`` as float32 (B, T, H r): every head's latent side by side."""
    latents = latent_inputs(block, run, hidden).float()
    return latents.reshape(*latents.shape[:2], -1)


@torch.no_grad()
def add_batch(
    moments: ValueMoments,
    block: nn.Module,
    run: Callable,
    hidden: torch.Tensor,
    target: torch.Tensor,
    first: int,
) -> torch.Tensor:
    """Add sequences FIRST .. of HIDDEN (B, T, D) (the layer's input) and TARGET (B, T, D) (what its attention
    should add to it) to MOMENTS: a = [a_1; ...; a_H] (plus a 1 when o_proj has a bias). Returns the
    latents a (B, T, H r): the refit leaves the scores alone, so they still hold after it
    (``layer_from_latents``)."""
    latents = flat_latents(block, run, hidden)
    a = with_one(latents, block.self_attn.o_proj.bias is not None)
    if moments.start_loss is None:
        y = target.double()
        energy = float(y.square().sum())
        error = float((a.double() @ effective_map(*value_weights(block.self_attn)).T - y).square().sum())
        moments.start_loss = error / energy if energy > 0 else error
    moments.add(a, target, first)
    return latents


def compensating_target(attention: torch.Tensor, source_input: torch.Tensor, converted_input: torch.Tensor,
                        share: float, source_function: Callable, first: int) -> torch.Tensor:
    """The target of the value refit on the converted stream for calibration sequences FIRST .. (one batch):
    what the converted attention should add to CONVERTED_INPUT x' (B, T, D), given the source's input x
    (SOURCE_INPUT) and its attention's output a on it (ATTENTION).

    Two aims pull apart once the streams differ. Restoring the source's residual stream asks for
    g = x + a - x': the layer then also undoes what the layers below got wrong, but that error is fitted
    from x' through this layer's latents alone, and how much of it they can say on other text is open.
    Reproducing the source's function asks for f = attn_src(x') (SOURCE_FUNCTION(x'), rounded as the kept
    targets are): what the source would add to the converted stream, with no error to chase. Least squares
    toward f + SHARE (g - f) minimises (1 - SHARE) ||y - f||^2 + SHARE ||y - g||^2 up to a constant, so SHARE
    weighs the two aims (``options.refine_compensate``); with SHARE 1 f is never computed. The default 1/2 is
    not fitted to a model: for a least-squares fit (projection P onto what the latents can say) each aim's
    loss exceeds what fitting that aim alone would leave by SHARE^2 ||P (g - f)||^2 for f and (1 - SHARE)^2
    times the same for g, so 1/2 is the share that keeps the larger excess smallest, in every layer of every
    model, whatever the calibration says about either aim.

    f costs a source attention, and the fit reads it only through the cross moment sum a_lat y^T (the
    latents' own second moment does not depend on the target), so f is estimated rather than computed
    everywhere: a, which is already at hand, serves as a control variate, f = a + (f - a), and the difference
    is taken on half the sequences (``sampled_sequences``) and doubled there. The cross moment is unbiased
    and its error scales with f - a, the source attention's response to the drift between the streams,
    not with f itself; where the streams agree the target is a, exactly as the full blend's. The refit's
    reported losses are against this estimated target."""
    gap = attention + (source_input - converted_input)  # the gap first: exact where the streams agree
    if share == 1:
        return gap
    anchor = attention.clone()
    sampled = sampled_sequences(first, attention.shape[0])
    if bool(sampled.any()):
        anchor[sampled] = 2 * source_function(converted_input[sampled]) - attention[sampled]
    return torch.lerp(anchor, gap, share)


def sampled_sequences(first: int, count: int) -> torch.Tensor:
    """Which of calibration sequences FIRST .. FIRST + COUNT - 1 ``compensating_target`` runs the source
    attention on: every other pair of sequences, (0, 1), (4, 5), ..., half of the set, and so half of each
    of the refit's validation folds (sequence k belongs to fold k % 2)."""
    return (torch.arange(first, first + count) // 2) % 2 == 0


def layer_from_latents(block: nn.Module, hidden: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """Converted decoder layer BLOCK's output on HIDDEN (B, T, D) from its attention-weighted latents LATENTS
    (B, T, H r, as ``add_batch`` returns them): each head's value map and o_proj, then the residual and the
    MLP (``MLADecoderLayer.after_attention``), without scoring the attention again."""
    attn = block.self_attn
    B, T, _ = latents.shape
    H, d = attn.num_heads, attn.qk_nope_head_dim
    w_uv = attn.kv_b_proj.weight.view(H, d + attn.v_head_dim, -1)[:, d:]  # (H, d_v, r)
    heads = torch.bmm(latents.view(B * T, H, -1).transpose(0, 1), w_uv.transpose(1, 2))  # (H, B T, d_v)
    return block.after_attention(hidden, attn.o_proj(heads.transpose(0, 1).reshape(B, T, -1)))


def value_weights(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UV (H, d, r) and [W_O | b] (D, H d [+1]) of ATTN, float64."""
    H, d = attn.num_heads, attn.qk_nope_head_dim
    w_uv = attn.kv_b_proj.weight.detach().double().view(H, d + attn.v_head_dim, -1)[:, d:]
    o = attn.o_proj
    w_o = o.weight.detach().double()
    return w_uv, (torch.cat([w_o, o.bias.detach().double()[:, None]], dim=1) if o.bias is not None else w_o)


def assign_values(attn, w_uv: torch.Tensor, w_o: torch.Tensor) -> None:
    """New parameters (not in-place writes: the layer may share storage with the tensors it was built from)."""
    H, d = attn.num_heads, attn.qk_nope_head_dim
    kv_b = attn.kv_b_proj.weight.detach().clone().view(H, d + attn.v_head_dim, -1)
    kv_b[:, d:] = w_uv.to(kv_b.dtype)
    attn.kv_b_proj.weight = nn.Parameter(kv_b.view(-1, kv_b.shape[-1]), requires_grad=False)
    o = attn.o_proj
    o.weight = nn.Parameter(w_o[:, : o.in_features].to(o.weight.dtype).contiguous(), requires_grad=False)
    if o.bias is not None:
        o.bias = nn.Parameter(w_o[:, -1].to(o.bias.dtype).contiguous(), requires_grad=False)


def refit_values(block: nn.Module, moments: ValueMoments, start_ridge: float | None = None,
                 exact: float = EXACT_LOSS) -> dict:
    """Refit BLOCK's W_UV and o_proj in place from MOMENTS (``add_batch``); returns the report:
    loss_before, loss_after (relative to the target's energy), kept, and the ridge validation
    (cv_loss_start, cv_loss_refit, ridge) or why the refit was skipped. START_RIDGE (the layer below's
    choice) is where the ridge search starts: neighbouring layers mostly pick the same or the next
    ridge, so the walk is shorter from there. EXACT: the start loss at or below which the start is kept
    as exact (``refine.exact_loss``)."""
    start = time.time()
    attn = block.self_attn
    w_uv, w_o = value_weights(attn)
    folds, start_loss = moments.result(), moments.start_loss
    total = sum_folds(folds)
    bias = attn.o_proj.bias is not None
    loss = lambda uv, o: loss_of(o.double(), *project_moments(uv, total, bias))  # noqa: E731
    before = loss(w_uv, w_o)
    report = {"loss_before": before}

    def done(kept: str, after: float, **more) -> dict:
        return report | more | {"loss_after": after, "kept": kept, "seconds": round(time.time() - start, 3)}

    if start_loss is not None and start_loss <= exact:
        report["loss_before"] = start_loss  # measured directly; the moments' rounding is larger
        return done("start (already exact)", start_loss)
    if why := fold_check(moments.rows, total[0].shape[0]):  # unknowns per output: one weight per entry of a
        return done("start", before, refit=why)
    H, d = attn.num_heads, attn.v_head_dim
    rms = float(w_uv.square().mean().sqrt())
    start_map = effective_map(w_uv, w_o)
    roots = [head_roots(f[0], H, bias) for f in folds]  # each fold's metric, shared by its ridges
    ridge, validation = choose_ridge(
        (w_uv, w_o),
        folds,
        lambda f, ridge: fit_values(folds[f], ridge, start_map, H, d, bias, rms, roots[f]),
        VALUE_RIDGES,
        error=lambda fitted, m: values_error(*fitted, m),
        first=start_ridge,
    )
    report |= validation
    if ridge is None:
        return done("start", before, refit="skipped: no ridge beat the closed form on held-out sequences")
    new_uv, new_o = fit_values(total, ridge, start_map, H, d, bias, rms)
    if loss(new_uv, new_o) >= before:
        return done("start", before, refit="skipped: no lower calibration loss than the closed form")
    assign_values(attn, new_uv, new_o)
    after = loss(*value_weights(attn))  # of the weights as stored (float32)
    if after >= before:  # rounding ate the gain: put the closed form back
        assign_values(attn, w_uv, w_o)
        return done("start", before, refit="skipped: no lower calibration loss after rounding")
    return done("values refit", after)
