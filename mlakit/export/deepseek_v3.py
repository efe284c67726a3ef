"""Map a native mlakit MLA checkpoint onto stock ``DeepseekV3ForCausalLM`` (pure tensor math + checks).

Stock DeepSeek-V3 attention (transformers ``deepseek_v3``; vLLM and SGLang read the same config)
differs from our native model in six places; each is bridged exactly or refused:

1. RoPE. Stock rotates d_R dims at ``g(b^(-2s/d_R))``, s = 0..d_R/2-1 (g: the rope scaling, the
   identity for ``default``), pairs interleaved (2s, 2s+1) with ``rope_interleave: true`` (the
   layout vLLM and SGLang always assume). Ours rotates pair p (dims p, p + d_R/2) at the source
   frequency ``g(θ^(-2 idx_p/d))``. The export is exact iff every layer keeps the frequencies
   {0, k, 2k, ..., (d_R/2 - 1)k} of the source table (any order) for one stride k: then
   b = θ^(k d_R/d) and the same g. Which conversions give that: ``--rope-method transmla
   --rope-dim <head_dim>`` (one component per frequency, any number of KV heads); with one KV
   head (Mistral-style), ``--rope-method high`` at any rope dim, and the lossless full-rope
   conversion. ``scored`` (the default), ``uniform``, ``norm`` and full rope with several KV
   heads keep some frequency twice or leave gaps, which one stock table cannot express.
2. ``kv_a_layernorm``: stock normalises the latent, ours does not. Scaling the latent rows of
   ``kv_a_proj_with_mqa`` by a tiny α makes eps dominate the mean square, and a norm weight of
   √eps/α undoes the scale (relative error α²·E[c²]/(2 eps), bounded from the weights below 2^-24).
   fp16 cannot hold α·c, so it is refused.
3. rms eps: transformers builds ``kv_a_layernorm`` with eps 1e-6 whatever the config says, vLLM and
   SGLang with ``rms_norm_eps``, so ``rms_norm_eps`` is pinned to 1e-6. The source's own norms then
   see a smaller eps; scaling the whole residual stream by s = √(1e-6/eps_src) (embeddings,
   ``o_proj``, ``down_proj``) makes them compute exactly what they did with eps_src.
4. Softmax scale: stock uses 1/√(d_nope + d_R); q is pre-scaled so the product is ours.
5. Biases (Qwen2 q/k/v): stock has no ``q_proj`` bias, and vLLM/SGLang's DeepSeek models have no
   attention biases at all (vLLM drops them silently). Refused by default; ``drop`` removes them
   (lossy), ``hf-exact`` keeps them with ``attention_bias`` and routes q through ``q_lora_rank`` =
   D + 1 with an identity norm (exact in transformers only).
6. Sliding window (Mistral): stock has none. Exact only for sequences within the window, so
   refused unless ``clip_context``, which sets ``max_position_embeddings`` to the window.

The export is dense (``first_k_dense_replace`` = number of layers), ``q_lora_rank: null`` unless
biases need it, embeddings untied (engines differ in how they tie).

Rope as engines read it: vLLM's DeepSeek model rewrites any rope scaling (linear, llama3) to its
DeepSeek-YaRN, so a scaled rope is refused unless ``rope_scaling="hf-exact"`` (transformers only);
its CPU rotary kernel mishandles the strided MLA views with ``rope_type: default``, so the default
rope is written as a YaRN that changes nothing (``noop_yarn``): factor 1 makes the interpolated and
extrapolated tables equal, and every mscale/attention factor of factor 1 is 1 (transformers 4.x and
5.x and vLLM all return 1.0 for a scale <= 1).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch

from ..arch.names import (
    DOWN_PROJ,
    GATE_PROJ,
    KV_A_NORM,
    KV_A_PROJ,
    KV_B_PROJ,
    O_PROJ,
    Q_A_NORM,
    Q_A_PROJ,
    Q_B_PROJ,
    Q_PROJ,
    UP_PROJ,
    attn,
    mlp,
)
from .engine_rules import ExportError, check_biases, check_rope_scaling

__all__ = [
    "EXPORT_DTYPES",
    "ExportPlan",
    "check_dtype",
    "identity_norm_scale",
    "latent_norm_bound",
    "layer_tensors",
    "legacy_rope_fields",
    "noop_yarn",
    "plan_export",
    "residual_scale",
    "rope_row_order",
    "stock_config",
    "stock_latent_norm_eps",
    "stock_rope_parameters",
    "stock_rope_stride",
    "uniform",
]

EXPORT_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
NORM_TARGET = 2.0**-24  # bound on the relative error of an identity-by-eps RMSNorm


def stock_latent_norm_eps() -> float:
    """The eps transformers gives ``kv_a_layernorm`` (it passes none, so the RMSNorm default)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    return float(inspect.signature(DeepseekV3RMSNorm.__init__).parameters["eps"].default)


def check_dtype(name: str, native_dtype: torch.dtype) -> torch.dtype:
    """Resolve the export dtype ('auto' keeps the native checkpoint's); fp16 is refused."""
    if name == "auto":
        if native_dtype in (torch.float32, torch.bfloat16):
            return native_dtype
        name = str(native_dtype).replace("torch.", "")
    if name in ("float16", "fp16"):
        raise ExportError(
            "--dtype float16 cannot hold the deepseek-v3 export: the identity kv_a_layernorm scales the "
            "latent by a tiny alpha (below float16's range); use --dtype bfloat16 or --dtype float32"
        )
    if name not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {name!r} is not one of auto, {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def uniform(values: list[int], name: str) -> int:
    """The one value every layer shares, or an error naming the fix."""
    if len(set(values)) != 1:
        raise ExportError(
            f"{name} differs across layers ({values}); deepseek-v3 has one {name} for all layers. "
            f"Re-convert with the same shape in every layer: --allocation uniform with --kv-budget (and --rope-dim "
            f"a number, or left to the budget's share: not measured-per-layer), or --kv-lora-rank N --rope-dim N"
        )
    return values[0]


def stock_rope_stride(freq_index: list[list[int]], head_dim: int) -> int:
    """The stride k with every layer keeping source frequencies {0, k, ..., (n-1)k}; ExportError otherwise."""
    n = len(freq_index[0])
    if n == 0:
        return 1
    first = sorted(freq_index[0])
    stride = first[1] if n > 1 else 1
    want = [stride * s for s in range(n)]
    for i, idx in enumerate(freq_index):
        if sorted(idx) != want or stride < 1:
            raise ExportError(
                f"layer {i} keeps rotary frequencies {sorted(idx)} of the source table (0..{head_dim // 2 - 1}); "
                f"stock deepseek-v3 rotates every layer at one table theta_(k*s), s = 0..{n - 1}, each frequency "
                f"once, e.g. {want if stride >= 1 else list(range(n))}. Re-convert with --stock-rope (scored or "
                f"transmla rope method; `convert --format deepseek-v3` sets it), or, for a model with one KV "
                f"head, --rope-method high; without --stock-rope the rope methods keep a frequency twice or "
                f"leave gaps, and full rope with several KV heads keeps every frequency once per head"
            )
    return stride


def noop_yarn(theta: float, max_positions: int) -> dict:
    """YaRN parameters whose table and scales equal plain rope at THETA (see the module docstring)."""
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": 1.0,
        "original_max_position_embeddings": max_positions,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }


def stock_rope_parameters(
    rope: dict, head_dim: int, rope_dim: int, stride: int, max_positions: int, rope_scaling: str = "refuse"
) -> dict:
    """Stock rope parameters whose d_R-dim table equals the kept part of the source's.

    The default rope becomes ``noop_yarn``; a scaled one keeps its type (``check_rope_scaling``)."""
    rope_type = rope.get("rope_type", "default")
    check_rope_scaling(rope_type, rope_scaling)
    theta = float(rope["rope_theta"])
    theta = theta ** (stride * rope_dim / head_dim) if rope_dim else theta
    if rope_type == "default":
        return noop_yarn(theta, max_positions)
    return dict(rope) | {"rope_theta": theta}


def rope_row_order(freq_index: list[int], stride: int) -> list[int]:
    """Native rope rows (pair p = dims p and p + n) in stock interleaved order: pair s -> (2s, 2s+1)."""
    n = len(freq_index)
    where = {j: p for p, j in enumerate(freq_index)}
    order = []
    for s in range(n):
        p = where[stride * s]
        order += [p, p + n]
    return order


def identity_norm_scale(mean_square_bound: float, eps: float) -> tuple[float, float]:
    """(alpha, weight) making RMSNorm(alpha*x) * weight == x up to NORM_TARGET for mean(x^2) <= the bound.

    The weight is a power of two (exact in every dtype); alpha = sqrt(eps)/weight goes into the
    producing projection, which is rounded once anyway."""
    eps32 = float(torch.tensor(eps, dtype=torch.float32))  # the eps the norm adds in float32
    alpha_max = math.sqrt(2 * eps32 * NORM_TARGET / max(mean_square_bound, 1e-30))
    weight = 2.0 ** math.ceil(math.log2(math.sqrt(eps32) / alpha_max))
    return math.sqrt(eps32) / weight, weight


def latent_norm_bound(w: torch.Tensor, bias: torch.Tensor | None, input_norm_weight: torch.Tensor) -> float:
    """Upper bound of mean(c^2) for c = W x + b, x the output of an RMSNorm with INPUT_NORM_WEIGHT
    (|x| <= max|weight| * sqrt(D), as the normalised vector has norm below sqrt(D))."""
    x_max = float(input_norm_weight.double().abs().max()) * math.sqrt(w.shape[1])
    bound = w.double().norm(dim=1) * x_max
    if bias is not None:
        bound = bound + bias.double().abs()
    return float(bound.square().mean())


def residual_scale(source_eps: float, stock_eps: float) -> float:
    """s with RMSNorm(s*h; stock_eps) == RMSNorm(h; source_eps)."""
    return math.sqrt(stock_eps / source_eps)


@dataclass
class ExportPlan:
    """Everything the per-layer mapping needs, decided once from the native config."""

    num_heads: int
    d_nope: int
    d_v: int
    rank: int
    rope_dim: int
    stride: int
    q_scale: float  # native softmax scale / stock softmax scale
    residual: float  # s
    eps: float  # pinned rms eps
    biases: str  # policy
    present_biases: list[str] = field(default_factory=list)

    @property
    def keep_biases(self) -> bool:
        return bool(self.present_biases) and self.biases == "hf-exact"

    @property
    def q_through_lora(self) -> bool:
        return self.keep_biases and "q_proj_bias" in self.present_biases


def plan_export(
    native, biases: str = "refuse", rope_scaling: str = "refuse", max_positions: int | None = None
) -> tuple[ExportPlan, dict]:
    """Check NATIVE (an MLAConfig) against the stock format; returns the plan and the stock rope parameters.

    MAX_POSITIONS: the export's max_position_embeddings (default: the native one)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    n = native.num_hidden_layers
    rank = uniform([native.layer_kv_lora_rank(i) for i in range(n)], "kv_lora_rank")
    rope_dim = uniform([native.layer_rope_dim(i) for i in range(n)], "qk_rope_head_dim")
    present = check_biases(native.to_dict(), biases)
    stride = stock_rope_stride(native.rope_freq_index, native.head_dim)
    max_positions = native.max_position_embeddings if max_positions is None else max_positions
    rope = stock_rope_parameters(
        dict(native.rope_parameters), native.head_dim, rope_dim, stride, max_positions, rope_scaling
    )
    d_nope = native.qk_nope_head_dim
    stock_scale = yarn_apply_mscale(rope, (d_nope + rope_dim) ** -0.5)
    eps = stock_latent_norm_eps()
    plan = ExportPlan(
        num_heads=native.num_attention_heads,
        d_nope=d_nope,
        d_v=native.v_head_dim,
        rank=rank,
        rope_dim=rope_dim,
        stride=stride,
        q_scale=native.softmax_scale / stock_scale,
        residual=residual_scale(native.rms_norm_eps, eps),
        eps=eps,
        biases=biases,
        present_biases=present,
    )
    return plan, rope


def _q_rows(plan: ExportPlan, order: list[int]) -> torch.Tensor:
    """Row permutation of q_proj: per head the nope rows, then the rope rows in stock order."""
    per_head = plan.d_nope + plan.rope_dim
    head = list(range(plan.d_nope)) + [plan.d_nope + r for r in order]
    return torch.tensor([h * per_head + j for h in range(plan.num_heads) for j in head])


def layer_tensors(
    plan: ExportPlan, t: dict, freq_index: list[int], input_norm: torch.Tensor, prefix: str
) -> tuple[dict, dict]:
    """Stock tensors of one layer from native tensors T (names relative to PREFIX's self_attn/mlp, float64).

    Returns (tensors, facts for the report)."""
    r, s = plan.rank, plan.residual
    order = rope_row_order(freq_index, plan.stride)
    q_w = t[attn(Q_PROJ)][_q_rows(plan, order)] * plan.q_scale
    q_b = t.get(attn(Q_PROJ, "bias"))
    kv_w, kv_b = t[attn(KV_A_PROJ)], t.get(attn(KV_A_PROJ, "bias"))
    if not plan.keep_biases:
        kv_b = None
    alpha, weight = identity_norm_scale(
        latent_norm_bound(kv_w[:r], None if kv_b is None else kv_b[:r], input_norm), plan.eps
    )
    kv_rows = list(range(r)) + [r + j for j in order]
    row_scale = torch.cat(
        [torch.full((r,), alpha, dtype=torch.float64), torch.ones(plan.rope_dim, dtype=torch.float64)]
    )
    out = {
        prefix + attn(KV_A_PROJ): kv_w[kv_rows] * row_scale[:, None],
        prefix + attn(KV_A_NORM): torch.full((r,), weight, dtype=torch.float64),
        prefix + attn(KV_B_PROJ): t[attn(KV_B_PROJ)],
        prefix + attn(O_PROJ): t[attn(O_PROJ)] * s,
        prefix + mlp(GATE_PROJ): t[mlp(GATE_PROJ)],
        prefix + mlp(UP_PROJ): t[mlp(UP_PROJ)],
        prefix + mlp(DOWN_PROJ): t[mlp(DOWN_PROJ)] * s,
    }
    facts = {"latent_alpha": alpha, "kv_a_layernorm_weight": weight}
    if plan.keep_biases:
        out[prefix + attn(KV_A_PROJ, "bias")] = kv_b[kv_rows] * row_scale
        o_b = t.get(attn(O_PROJ, "bias"))
        out[prefix + attn(O_PROJ, "bias")] = (
            o_b if o_b is not None else torch.zeros(q_w.shape[1], dtype=torch.float64)
        ) * s
    if plan.q_through_lora:  # q = [W_q | b_q] [x; 1] through an identity q_a_layernorm
        hidden = q_w.shape[1]
        x_max2 = float(input_norm.double().abs().max()) ** 2 * hidden
        q_alpha, q_weight = identity_norm_scale((x_max2 + 1) / (hidden + 1), plan.eps)
        eye = torch.cat([torch.eye(hidden, dtype=torch.float64), torch.zeros(1, hidden, dtype=torch.float64)])
        out[prefix + attn(Q_A_PROJ)] = eye * q_alpha
        out[prefix + attn(Q_A_PROJ, "bias")] = torch.cat(
            [torch.zeros(hidden, dtype=torch.float64), torch.tensor([q_alpha], dtype=torch.float64)]
        )
        out[prefix + attn(Q_A_NORM)] = torch.full((hidden + 1,), q_weight, dtype=torch.float64)
        q_bias = q_b[_q_rows(plan, order)] * plan.q_scale
        out[prefix + attn(Q_B_PROJ)] = torch.cat([q_w, q_bias[:, None]], dim=1)
        facts |= {"q_alpha": q_alpha, "q_a_layernorm_weight": q_weight}
    else:
        out[prefix + attn(Q_PROJ)] = q_w
    return out, facts


_KEEP_CONFIG = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_act",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
)


def stock_config(native, plan: ExportPlan, rope: dict, max_positions: int, dtype: torch.dtype) -> dict:
    """config.json fields of the stock DeepseekV3ForCausalLM: dense layers only, one expert so MoE fields validate."""
    cfg = {k: getattr(native, k) for k in _KEEP_CONFIG}
    n = native.num_hidden_layers
    cfg |= {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": native.num_attention_heads,  # K/V are expanded per head from the latent
        "kv_lora_rank": plan.rank,
        "q_lora_rank": native.hidden_size + 1 if plan.q_through_lora else None,
        "qk_rope_head_dim": plan.rope_dim,
        "qk_nope_head_dim": plan.d_nope,
        "v_head_dim": plan.d_v,
        "first_k_dense_replace": n,
        "moe_layer_freq": 1,
        "moe_intermediate_size": native.intermediate_size,
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": plan.eps,
        "rope_parameters": rope,  # the legacy rope_theta/rope_scaling are added to config.json (legacy_rope_fields)
        "rope_interleave": True,
        "attention_bias": plan.keep_biases,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "dtype": str(dtype).replace("torch.", ""),
    }
    return cfg


def legacy_rope_fields(rope: dict) -> dict:
    """The top-level ``rope_theta`` and ``rope_scaling`` transformers 4.x reads (5.x reads
    ``rope_parameters`` and drops these two when it builds the config, so they are written after it)."""
    return {
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"},
    }
