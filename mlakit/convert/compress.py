"""One layer's compression decisions: rotary subspace, then latent factorisation.

``prepare_layer`` computes what the rank planner's error curve and the factorisation share (the
rotary plan and the metric's Gram matrix); a two-pass conversion computes it once, spills it with
the layer's metrics, and hands it to ``compress_layer``, which computes it itself otherwise."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..choices import MIXINGS
from .layer_metrics import LayerMetrics
from .low_rank import (
    LOWRANK_METHODS,
    bkv_metric,
    full_rank,
    metric_factor,
    metric_gram,
    output_metric,
    weight_svd,
)
from .mla_layer import AttentionWeights, MLAWeights, convert_attention, nope_value_map
from .rope_select import ROPE_METHODS, auto_fold, check_stock_rope_dim, select_rope
from .rope_split import RopePlan, high_frequency_plan

__all__ = ["LayerPrep", "Method", "compress_layer", "factorizer", "layer_plan", "prep_from_tensors", "prep_tensors",
           "prepare_layer"]


@dataclass(frozen=True)
class Method:
    rope: str = "scored"
    lowrank: str = "rrr"
    fold: int = 0  # FreqFold; 0 = auto: the layer driver measures the candidates (fold_choice); here, auto_fold's rule
    mixing: str = "pca"
    stock_rope: bool = False  # rope of the form stock DeepSeek-V3 code rotates (for the deepseek-v3 export)

    @property
    def averages_phase(self) -> bool:
        """Whether dropped rotary components are read by phase-averaged queries (``rope_select``'s
        docstring); TransMLA's split, reproduced as the reference, drops their rotation as it is."""
        return self.rope != "transmla"

    def __post_init__(self):
        if self.rope not in ROPE_METHODS:
            raise ValueError(f"rope method {self.rope!r} is not one of {', '.join(ROPE_METHODS)}")
        if self.lowrank not in LOWRANK_METHODS:
            raise ValueError(f"low-rank method {self.lowrank!r} is not one of {', '.join(LOWRANK_METHODS)}")
        if self.mixing not in MIXINGS:
            raise ValueError(f"mixing {self.mixing!r} is not one of {', '.join(MIXINGS)}")
        if self.fold < 0:
            raise ValueError("fold must be 0 (auto) or a positive divisor of head_dim/2")


def layer_plan(w: AttentionWeights, m: LayerMetrics | None, method: Method, rope_dim: int) -> RopePlan:
    full = w.num_kv_heads * w.head_dim
    if method.stock_rope:
        check_stock_rope_dim(w.head_dim, rope_dim)  # also refuses full rope with several KV heads
    if m is None or rope_dim == full:
        return high_frequency_plan(w.num_kv_heads, w.head_dim, rope_dim)
    fold = method.fold or auto_fold(w.head_dim // 2, rope_dim // 2)
    return select_rope(method.rope, w, m, rope_dim, fold=fold, mixing=method.mixing, stock=method.stock_rope)


@dataclass
class LayerPrep:
    """A calibrated layer's rotary plan and the ``metric_gram`` of its NoPE-key/value map under the
    output metric: the error curve needs both, and so does an ``rrr`` factorisation."""

    plan: RopePlan
    gram: torch.Tensor


def prepare_layer(w: AttentionWeights, m: LayerMetrics, method: Method, rope_dim: int) -> LayerPrep:
    plan = layer_plan(w, m, method, rope_dim)
    metric = output_metric(plan, m, w.num_heads, w.num_kv_heads, w.head_dim, method.averages_phase)
    return LayerPrep(plan, metric_gram(nope_value_map(w, plan), m.sigma_half, metric))


def prep_tensors(prep: LayerPrep) -> dict[str, torch.Tensor]:
    """PREP as a flat dict of CPU tensors (for ``torch.save``)."""
    p = prep.plan
    return {"plan_mixing": p.mixing.cpu(), "plan_kept": torch.tensor(p.kept, dtype=torch.long).view(-1, 2),
            "plan_freq_index": torch.tensor(p.freq_index, dtype=torch.long), "plan_fold": torch.tensor(p.fold),
            "gram": prep.gram.cpu()}


def prep_from_tensors(t: dict[str, torch.Tensor], device: str = "cpu") -> LayerPrep:
    """The inverse of ``prep_tensors`` (other keys in T are ignored), its tensors on DEVICE."""
    plan = RopePlan(t["plan_mixing"].to(device), [tuple(pair) for pair in t["plan_kept"].tolist()],
                    t["plan_freq_index"].tolist(), int(t["plan_fold"]))
    return LayerPrep(plan, t["gram"].to(device))


def factorizer(w: AttentionWeights, m: LayerMetrics | None, method: Method, plan: RopePlan, rank: int,
               gram: torch.Tensor | None = None):
    """The function W_y -> (down, up) for this layer's settings. GRAM: ``LayerPrep.gram`` for PLAN,
    when already computed (only ``rrr`` reads it)."""
    n_rows = 2 * w.num_kv_heads * w.head_dim - plan.rope_dim
    if rank == n_rows:
        return full_rank
    if m is None or method.lowrank == "svd":
        return lambda w_y: weight_svd(w_y, rank)
    if method.lowrank == "bkv_pca":
        n_key_rows = n_rows - w.num_kv_heads * w.head_dim
        return lambda w_y: metric_factor(w_y, m.sigma_half, bkv_metric(w_y, m.sigma, n_key_rows), rank)
    metric = output_metric(plan, m, w.num_heads, w.num_kv_heads, w.head_dim, method.averages_phase)
    return lambda w_y: metric_factor(w_y, m.sigma_half, metric, rank, gram)


def compress_layer(w: AttentionWeights, m: LayerMetrics | None, method: Method, rope_dim: int,
                   rank: int, prep: LayerPrep | None = None) -> MLAWeights:
    """The MLA layer at kv_lora_rank RANK; PREP: ``prepare_layer``'s result for these arguments."""
    if prep is None:
        plan, gram = layer_plan(w, m, method, rope_dim), None
    else:
        plan, gram = prep.plan, prep.gram
    query_map = m.dropped_query_map() if m is not None and method.averages_phase else None
    return convert_attention(w, plan, factorizer(w, m, method, plan, rank, gram), query_map)
