"""Allocate the KV-cache budget across layers: one shared rope dim d_R, a latent rank r per layer.

Every layer gets an error curve: the predicted output error of its RoPE split plus the tail of
its reduced-rank spectrum at each r (``layer_metrics`` units). Layers are not comparable in
absolute error (their outputs feed residual streams of very different scale), so the planner
minimises the sum of *log* errors, which no per-layer scale can distort: a cached value goes
where it cuts a layer's error by the largest factor. A Lagrangian sweep (each layer picks
argmin log error + lambda * r) finds the price of one cached value; leftovers go greedily.

Measured on SmolLM2-135M the planned ranks did not beat the same rank in every layer (README,
bench/quality_sweep.py), so ``uniform`` is the default allocation and ``planned`` is opt-in.

The shared d_R defaults to ``ROPE_SHARE`` of the per-layer budget. We also tried letting the
first-order model choose d_R per layer, and choosing it by the attention-output error on
held-out sequences; both gave worse perplexity than this fixed share on SmolLM2 (see README).
"""

from __future__ import annotations

import logging
import math

import torch

from .compress import Method, compress_layer, layer_plan
from .layer_metrics import LayerMetrics
from .low_rank import metric_energy, output_metric
from .mla_layer import AttentionWeights, MLAWeights, nope_value_map
from .rope_select import rope_error

__all__ = ["ROPE_SHARE", "budget_layout", "budget_rope_dim", "log_error_curve", "plan_ranks", "plan_budget", "uniform_ranks"]

log = logging.getLogger(__name__)

ROPE_SHARE = 0.4  # fraction of each layer's cached values given to the rotary key by default


def budget_rope_dim(num_kv_heads: int, head_dim: int, per_layer_budget: float, stock: bool = False) -> int:
    """Default shared d_R: ROPE_SHARE of the per-layer budget, a multiple of 8, within [8, G*d].

    STOCK (rope of the form stock DeepSeek-V3 rotates): the nearest d_R whose half divides
    head_dim / 2 (every k-th frequency), the smaller one on a tie."""
    target = ROPE_SHARE * per_layer_budget
    if stock:
        half = head_dim // 2
        return min((2 * n for n in range(1, half + 1) if half % n == 0), key=lambda a: (abs(a - target), a))
    d_r = 8 * round(target / 8)
    return int(min(num_kv_heads * head_dim, max(8, d_r)))


def log_error_curve(w: AttentionWeights, m: LayerMetrics, method: Method, rope_dim: int) -> torch.Tensor:
    """log predicted error at r = 0 .. 2Gd - d_R for this layer with RoPE dims ROPE_DIM."""
    plan = layer_plan(w, m, method, rope_dim)
    metric = output_metric(plan, m, w.num_heads, w.num_kv_heads, w.head_dim)
    s2 = metric_energy(nope_value_map(w, plan), m.sigma_half, metric)
    n_rows = 2 * w.num_kv_heads * w.head_dim - rope_dim
    spectrum = torch.zeros(n_rows, dtype=torch.float64)
    spectrum[: s2.shape[0]] = s2
    tail = torch.cat([spectrum.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])  # tail[r]
    total = rope_error(plan, w, m) + tail
    return torch.log(total.clamp_min(total[0] * 1e-15 + 1e-300))


def plan_ranks(curves: list[torch.Tensor], rank_budget: int, min_rank: int = 4) -> list[int]:
    """Ranks per layer, sum <= rank_budget, minimising the summed log errors."""
    if rank_budget < min_rank * len(curves):
        raise ValueError(f"a latent budget of {rank_budget} is below {min_rank} per layer")

    def pick(lam: float) -> list[int]:
        out = []
        for err in curves:
            cost = err + lam * torch.arange(err.shape[0], dtype=torch.float64)
            cost[:min_rank] = float("inf")
            out.append(int(cost.argmin()))
        return out

    lo, hi, best = -12.0, 6.0, None  # log10 of the price of one cached value, in nats of log error
    for _ in range(60):
        mid = (lo + hi) / 2
        ranks = pick(10**mid)
        if sum(ranks) <= rank_budget:
            best, hi = ranks, mid
        else:
            lo = mid
    ranks = best if best is not None else [min_rank] * len(curves)
    left = rank_budget - sum(ranks)
    while left > 0:  # spend leftovers where one more rank cuts the log error most
        gains = [float(c[r] - c[r + 1]) if r + 1 < c.shape[0] else -math.inf for c, r in zip(curves, ranks)]
        i = max(range(len(gains)), key=gains.__getitem__)
        if gains[i] == -math.inf:
            break
        ranks[i] += 1
        left -= 1
    return ranks


def budget_layout(n_layers: int, num_kv_heads: int, head_dim: int, budget: int,
                  rope_dim: int | None = None, stock: bool = False) -> tuple[int, int]:
    """(shared d_R, values left for the latents of all layers) of a BUDGET of values per token."""
    if rope_dim is None:
        rope_dim = budget_rope_dim(num_kv_heads, head_dim, budget / n_layers, stock)
    d_r = rope_dim
    rank_budget = budget - n_layers * d_r
    if rank_budget < 4 * n_layers:
        raise ValueError(f"a KV budget of {budget} values per token leaves {rank_budget} for the latents of "
                         f"{n_layers} layers after rope dims {d_r}; raise --kv-budget or lower --rope-dim")
    return d_r, rank_budget


def uniform_ranks(n_layers: int, num_kv_heads: int, head_dim: int, d_r: int, rank_budget: int) -> list[int]:
    """The same latent rank in every layer, capped at full rank."""
    return [min(2 * num_kv_heads * head_dim - d_r, rank_budget // n_layers)] * n_layers


def plan_budget(ws: list[AttentionWeights], ms: list[LayerMetrics], method: Method, budget: int,
                rope_dim: int | None = None, planned: bool = False,
                progress=lambda it, desc: it) -> tuple[list[MLAWeights], dict]:
    """Build every layer within BUDGET values per token (sum over layers of r + d_R): the same rank
    in every layer, or (PLANNED) ranks from the log-error curves."""
    n, w0 = len(ws), ws[0]
    d_r, rank_budget = budget_layout(n, w0.num_kv_heads, w0.head_dim, budget, rope_dim, method.stock_rope)
    if planned:
        curves = [log_error_curve(w, m, method, d_r) for w, m in progress(list(zip(ws, ms)), "planning ranks")]
        ranks = plan_ranks(curves, rank_budget)
    else:
        ranks = uniform_ranks(n, w0.num_kv_heads, w0.head_dim, d_r, rank_budget)
    layers = [compress_layer(w, m, method, d_r, r) for w, m, r in progress(list(zip(ws, ms, ranks)), "converting")]
    return layers, {"rope_dim": d_r, "ranks": ranks}
