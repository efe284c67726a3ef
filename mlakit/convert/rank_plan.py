"""Allocate the KV-cache budget across layers: one shared rope dim d_R, a latent rank r per layer (a d_R per
layer where ``--rope-dim measured-per-layer`` measured one: ``rope_choice``).

Every layer gets an error curve: the predicted output error of its RoPE split plus the tail of
its reduced-rank spectrum at each r (``layer_metrics`` units). Layers are not comparable in
absolute error (their outputs feed residual streams of very different scale), so errors must be
put on one scale before they are traded:

- ``fisher`` (the default where the pipeline can measure it): each layer's error times half its
  measured loss sensitivity (``calibration``: E||d loss / d attention output||^2 / D with labels
  sampled from the source) is its predicted KL from the source, in nats per token. The planner
  minimises the summed KL, then takes a damped step (``FISHER_STEP``) from uniform ranks toward
  that optimum (``damped_ranks`` says why).
- ``planned``: the sum of *log* errors, which no per-layer scale can distort: a cached value goes
  where it cuts a layer's error by the largest factor. It loses to uniform ranks
  (bench/quality_sweep.py; results in bench/results/quality_sweep/).
- ``uniform``: the same rank in every layer, in one pass (no statistics pass, no backward sweep).

A Lagrangian sweep (each layer picks argmin curve + lambda * r) finds the price of one cached
value; leftovers go greedily.

The shared d_R defaults to ``ROPE_SHARE`` of the per-layer budget. We also tried letting the
first-order model choose d_R per layer, and choosing it by the attention-output error on
held-out sequences; both gave worse perplexity than this fixed share, and so did choosing it from
the fisher KL curves (bench/experiments/rope_per_layer.py; README, "Not done yet"). The share was
first chosen with the closed form; under the value refit (the default since) the latent's room for
the values limits the conversion more than the rotary key does (bench/experiments/oracle_split.py),
and a smaller share gave lower perplexity on both texts unlike the calibration's at every budget
where it changes d_R, a little higher on the calibration's own kind (docs/results.md, "The rotary
share under the value refit"). ``--rope-dim measured`` chooses d_R by each candidate's held-out attention
error after the value refit instead (``rope_choice``): better on a second family trained here, worse on
SmolLM2's unseen text at one budget, so not the default.
"""

from __future__ import annotations

import logging
import math

import torch

from ..choices import ALLOCATIONS
from .compress import LayerPrep, Method, compress_layer, prepare_layer
from .layer_metrics import LayerMetrics
from .low_rank import gram_energy
from .mla_layer import AttentionWeights, MLAWeights
from .rope_select import rope_error

__all__ = [
    "ALLOCATIONS", "FISHER_STEP", "ROPE_SHARE", "allocate_ranks", "budget_layout", "budget_rope_dim", "damped_ranks",
    "equal_share_ranks", "error_curve", "kl_curve", "log_curve", "log_error_curve", "plan_budget", "plan_ranks", "ranks_from_curves", "spend_leftovers", "uniform_ranks",
]

log = logging.getLogger(__name__)

ROPE_SHARE = 0.3  # fraction of each layer's cached values given to the rotary key by default


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


def error_curve(w: AttentionWeights, m: LayerMetrics, method: Method, rope_dim: int,
                prep: LayerPrep | None = None) -> torch.Tensor:
    """Predicted output error (``layer_metrics`` units) at r = 0 .. 2Gd - d_R with RoPE dims ROPE_DIM.
    PREP: ``compress.prepare_layer``'s result for these arguments, when already computed."""
    prep = prepare_layer(w, m, method, rope_dim) if prep is None else prep
    plan, s2 = prep.plan, gram_energy(prep.gram)
    n_rows = 2 * w.num_kv_heads * w.head_dim - rope_dim
    spectrum = torch.zeros(n_rows, dtype=torch.float64)
    spectrum[: s2.shape[0]] = s2
    tail = torch.cat([spectrum.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])  # tail[r]
    return rope_error(plan, w, m, method.averages_phase) + tail


def log_error_curve(w: AttentionWeights, m: LayerMetrics, method: Method, rope_dim: int) -> torch.Tensor:
    """log of ``error_curve``: the planner's scale-free per-layer objective."""
    return log_curve(error_curve(w, m, method, rope_dim))


def log_curve(error: torch.Tensor) -> torch.Tensor:
    """log of an ``error_curve`` (floored far below its value at rank 0)."""
    return torch.log(error.clamp_min(error[0] * 1e-15 + 1e-300))


def kl_curve(w: AttentionWeights, m: LayerMetrics, method: Method, rope_dim: int) -> torch.Tensor:
    """Predicted KL divergence from the source (nats per token, second order) at r = 0 .. 2Gd - d_R:
    the layer's output error times half its measured loss sensitivity (``calibration.LayerStats``)."""
    if m.sensitivity is None:
        raise ValueError("the Fisher allocation needs each layer's loss sensitivity; calibrate with "
                         "sensitivity_samples > 0")
    return 0.5 * m.sensitivity * error_curve(w, m, method, rope_dim)


def plan_ranks(curves: list[torch.Tensor], rank_budget: int, min_rank: int = 4) -> list[int]:
    """Ranks per layer, sum <= rank_budget, minimising the summed CURVES (any per-layer cost of r)."""
    if rank_budget < min_rank * len(curves):
        raise ValueError(f"a latent budget of {rank_budget} is below {min_rank} per layer")

    def pick(lam: float) -> list[int]:
        out = []
        for err in curves:
            cost = err + lam * torch.arange(err.shape[0], dtype=torch.float64)
            cost[:min_rank] = float("inf")
            out.append(int(cost.argmin()))
        return out

    lo, hi, best = -12.0, 6.0, None  # log10 of the price of one cached value, in units of the curves
    for _ in range(60):
        mid = (lo + hi) / 2
        ranks = pick(10**mid)
        if sum(ranks) <= rank_budget:
            best, hi = ranks, mid
        else:
            lo = mid
    return spend_leftovers(curves, best if best is not None else [min_rank] * len(curves), rank_budget)


def spend_leftovers(curves: list[torch.Tensor], ranks: list[int], rank_budget: int) -> list[int]:
    """Give the values RANKS leave unspent, one at a time, where one more rank cuts its curve most."""
    ranks = list(ranks)
    left = rank_budget - sum(ranks)
    while left > 0:
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


def equal_share_ranks(num_kv_heads: int, head_dim: int, budget: int, rope_dims: list[int]) -> list[int]:
    """The ranks that give every layer the same share of BUDGET values per token (r + d_R = BUDGET // layers)
    where each layer has its own d_R in ROPE_DIMS, capped at full rank: ``uniform_ranks`` when they are equal."""
    return [min(2 * num_kv_heads * head_dim - d, budget // len(rope_dims) - d) for d in rope_dims]


FISHER_STEP = 0.5  # how far the fisher allocation moves from uniform ranks toward the KL-optimal ones


def allocate_ranks(ws: list[AttentionWeights], ms: list[LayerMetrics], method: Method, d_r: int, rank_budget: int,
                   allocation: str, progress=lambda it, desc: it, fisher_step: float = FISHER_STEP) -> list[int]:
    """Latent ranks per layer: the same rank everywhere (``uniform``), the log-error planner
    (``planned``), or the damped Fisher plan (``fisher``, see ``damped_ranks``). (``auto`` is
    resolved by the pipeline before this.)"""
    uniform = uniform_ranks(len(ws), ws[0].num_kv_heads, ws[0].head_dim, d_r, rank_budget)
    if allocation == "uniform":
        return uniform
    if allocation not in ("planned", "fisher"):
        raise ValueError(f"allocation {allocation!r} is not one of uniform, planned, fisher")
    errors = [error_curve(w, m, method, d_r) for w, m in progress(list(zip(ws, ms)), f"planning ranks ({allocation})")]
    return ranks_from_curves(errors, [m.sensitivity for m in ms], allocation, uniform, rank_budget, fisher_step)


def ranks_from_curves(errors: list[torch.Tensor], sensitivities: list[float | None], allocation: str,
                      uniform: list[int], rank_budget: int, fisher_step: float = FISHER_STEP) -> list[int]:
    """``planned`` or ``fisher`` ranks from each layer's ``error_curve`` (and, for fisher, its loss
    sensitivity: the predicted KL is ``kl_curve``'s). Both pipelines plan through this."""
    if allocation == "planned":
        return plan_ranks([log_curve(e) for e in errors], rank_budget)
    if any(s is None for s in sensitivities):
        raise ValueError("the Fisher allocation needs each layer's loss sensitivity; calibrate with "
                         "sensitivity_samples > 0")
    return damped_ranks([0.5 * s * e for e, s in zip(errors, sensitivities)], uniform, rank_budget, fisher_step)


def damped_ranks(curves: list[torch.Tensor], uniform: list[int], rank_budget: int, step: float) -> list[int]:
    """STEP of the way from UNIFORM ranks to the ranks that minimise the summed CURVES (predicted KL),
    rounded down, then leftovers spent greedily on the curves.

    Why damped: the KL prediction adds up each layer's error as if the others were exact, but every
    compressed layer also shifts the inputs the later ones were calibrated on. The full step beat
    uniform ranks only at the larger budgets, the half step at every budget measured
    (bench/quality_sweep.py; results in bench/results/quality_sweep/)."""
    if not 0 <= step <= 1:
        raise ValueError(f"the fisher step must be in [0, 1], got {step}")
    optimal = plan_ranks(curves, rank_budget)
    damped = [u + math.floor(step * (o - u)) for u, o in zip(uniform, optimal)]  # floor: the sum stays in budget
    return spend_leftovers(curves, damped, rank_budget)


def plan_budget(ws: list[AttentionWeights], ms: list[LayerMetrics], method: Method, budget: int,
                rope_dim: int | None = None, allocation: str = "uniform",
                progress=lambda it, desc: it, fisher_step: float = FISHER_STEP) -> tuple[list[MLAWeights], dict]:
    """Build every layer within BUDGET values per token (sum over layers of r + d_R), ranks chosen
    by ALLOCATION (``allocate_ranks``)."""
    w0 = ws[0]
    d_r, rank_budget = budget_layout(len(ws), w0.num_kv_heads, w0.head_dim, budget, rope_dim, method.stock_rope)
    ranks = allocate_ranks(ws, ms, method, d_r, rank_budget, allocation, progress, fisher_step)
    layers = [compress_layer(w, m, method, d_r, r) for w, m, r in progress(list(zip(ws, ms, ranks)), "converting")]
    return layers, {"rope_dim": d_r, "ranks": ranks}
