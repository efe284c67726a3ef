"""The shared rotary dims d_R chosen by measurement on the calibration data (``--rope-dim measured``).

Within a budget, every rotary dim taken is a latent dim lost: d_R trades the rotary key against the room
the latent has for the non-rotary keys and the values. The closed form's error model does not judge that
trade well once the value refit follows (the refit gives the latent more to do), and the default share of
the budget (``rank_plan.ROPE_SHARE``) is one constant for every model. So each candidate d_R is measured
the way the layer will be converted: in the statistics pass every layer is converted at each candidate
(its fold measured at that d_R, its latent at the uniform rank the budget leaves), the value refit runs on
the layer's first calibration sequences, and the refit's held-out error on each of its two validation
folds (disjoint halves of those sequences) is summed over the layers (``pipeline.fold_steps``). Without
a value refit the closed form's error on each half is what counts.

The choice (``choose_rope_dim``) is the candidate of least summed held-out error, but only when it beats
the default share's d_R on both halves: a difference the two halves do not agree on is not one these
sequences can tell from noise, and the default keeps it. The halves are of the calibration's kind of text,
and that kind favours the candidate whose smaller latent fits it: on SmolLM2 at 68.75% both halves prefer more
rotary dims than the default while every other text measured prefers the default, and unseen text is worse
for the change (docs/results.md, "The rotary share measured in the conversion"). So the candidate must also
beat the default on the same sequences with their tokens shuffled (``shuffled_sequences``): the calibration's
words without its order, text unlike it that the conversion makes without running the model (the model's own
samples rank the candidates as unseen text does too, but need the whole model, which a streaming conversion
never holds). That check is measured, not assumed: docs/results.md, "A check on text unlike the calibration's".

``--rope-dim measured-per-layer`` applies the same rule to each layer's own errors, so d_R may differ between
layers (``pipeline.fold_steps``). A layer's own attention error does not see what its rotary dims cost the
layers above; on one model it chose fewer for the first layer than the model's perplexity prefers, so it is
an option, not the default (docs/results.md, "d_R per layer, converted").
"""

from __future__ import annotations

import torch

__all__ = ["MIN_LATENT", "choose_rope_dim", "rope_candidates", "shuffled_sequences"]

# the narrowest latent a candidate may leave per layer: below it the latent cannot carry the values of even
# one head of the usual widths, and no such split came near the best in the measurements
MIN_LATENT = 16


def rope_candidates(num_kv_heads: int, head_dim: int, per_layer_budget: int, reference: int) -> list[int]:
    """The d_R measured: multiples of 8 from half the default REFERENCE to twice it, within [8, G d], that leave
    a latent of at least ``MIN_LATENT`` in PER_LAYER_BUDGET cached values; REFERENCE always among them."""
    top = min(num_kv_heads * head_dim, per_layer_budget - MIN_LATENT, 2 * reference)
    grid = range(8 * max(1, -(-reference // 16)), top + 1, 8)
    return sorted({*grid, reference})


def shuffled_sequences(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """IDS (n, T) with each sequence's tokens after its first in an order drawn from SEED."""
    generator = torch.Generator().manual_seed(seed)
    out = ids.clone()
    for row in out:
        row[1:] = row[1:][torch.randperm(row.numel() - 1, generator=generator)]
    return out


def choose_rope_dim(search: dict[int, list[float]], reference: int) -> int:
    """The candidate of SEARCH (d_R -> summed held-out error on each validation fold, then on the shuffled
    sequences) whose held-out total is least, when it is lower than REFERENCE's on every fold and on the
    shuffled sequences; else REFERENCE. On equal totals the smaller d_R."""
    best = min(search, key=lambda d: (sum(search[d][:2]), d))
    if all(b < r for b, r in zip(search[best], search[reference])):
        return best
    return reference
