"""Turn a source checkpoint's tensors into an MLA state dict and config.

Every source tensor is either consumed (q/k/v/o projections) or copied under the same
name; every target tensor is checked against the shape the MLA model expects.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..arch import names
from ..arch.families import AttentionShape
from ..io.source import Source, SourceError
from ..mla_model.configuration_mla import MLAConfig
from .mla_layer import AttentionWeights, MLAWeights

__all__ = ["check_finite_tensors", "check_source_tensors", "mla_config", "mla_layer_tensors", "read_attention", "copied_tensors", "check_shapes", "model_shapes"]

_DROP_CONFIG_KEYS = (
    "architectures", "model_type", "auto_map", "quantization_config", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "transformers_version", "_name_or_path", "attention_bias", "dtype",
    "torch_dtype",
)


def _augmented(source: Source, layer: int, name: str, with_bias: bool) -> torch.Tensor:
    weight = source.tensor(names.attn_name(layer, name)).double()
    bias = source.tensor(names.attn_name(layer, name, "bias")).double() if with_bias else None
    if bias is None:
        bias = torch.zeros(weight.shape[0], dtype=torch.float64)
    return torch.cat([weight, bias[:, None]], dim=1)


def check_source_tensors(source: Source) -> None:
    """Fail before any work when SOURCE lacks a tensor its architecture has (loading would fill it
    with random values, and the conversion would fail only at the end), holds one the architecture
    does not know, or holds one of another shape than config.json implies."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(source.config).state_dict().items()}
    tied = getattr(source.config, "tie_word_embeddings", False)
    if tied:
        expected.pop(names.LM_HEAD, None)
    present = set(source.tensor_names())
    missing = sorted(set(expected) - present)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SourceError(f"{source.spec}: tensor {missing[0]} is missing from the checkpoint{more}; "
                          f"the checkpoint is incomplete, re-download or re-export it")
    unknown = sorted(n for n in present - set(expected) if not names.is_ignored_buffer(n) and not names.is_dropped_head(n, tied))
    if unknown:
        arch = type(source.config).__name__.removesuffix("Config")
        raise SourceError(
            f"{source.spec}: {len(unknown)} tensor(s) are not part of the {arch} architecture its config.json "
            f"describes: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}. mlakit does not know "
            f"where they belong; remove them from the checkpoint, or fix config.json"
        )
    for name, want in sorted(expected.items()):
        got = tuple(source.tensor_shape(name))
        if got != want:
            raise SourceError(
                f"{source.spec}: tensor {name} has shape {got}, but config.json implies {want}; the weights "
                f"and config.json do not belong together (re-download or re-export the checkpoint)"
            )


def check_finite_tensors(source: Source) -> None:
    """Read every source tensor once (one at a time): a NaN or infinity is a SourceError naming it."""
    for name in source.tensor_names():
        if not names.is_ignored_buffer(name):
            source.tensor(name)  # Source.tensor checks each tensor it returns


def read_attention(source: Source, layer: int, shape: AttentionShape) -> AttentionWeights:
    qkv_bias = shape.qkv_bias
    o_bias = source.tensor(names.attn_name(layer, names.O_PROJ, "bias")) if shape.o_bias else None
    return AttentionWeights(
        q=_augmented(source, layer, names.Q_PROJ, qkv_bias),
        k=_augmented(source, layer, names.K_PROJ, qkv_bias),
        v=_augmented(source, layer, names.V_PROJ, qkv_bias),
        o=source.tensor(names.attn_name(layer, names.O_PROJ)),
        o_bias=o_bias,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
    )


def mla_layer_tensors(layer: int, w: MLAWeights, dtype: torch.dtype, q_bias: bool, kv_a_bias: bool) -> dict:
    def name(module: str, kind: str = "weight") -> str:
        return names.attn_name(layer, module, kind)

    out = {
        name(names.Q_PROJ): w.q_proj[:, :-1],
        name(names.KV_A_PROJ): w.kv_a_proj_with_mqa[:, :-1],
        name(names.KV_B_PROJ): w.kv_b_proj,
        name(names.O_PROJ): w.o_proj,
    }
    if q_bias:
        out[name(names.Q_PROJ, "bias")] = w.q_proj[:, -1]
    if kv_a_bias:
        out[name(names.KV_A_PROJ, "bias")] = w.kv_a_proj_with_mqa[:, -1]
    if w.o_bias is not None:
        out[name(names.O_PROJ, "bias")] = w.o_bias
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def copied_tensors(source: Source, num_layers: int, tie_embeddings: bool) -> Iterable[str]:
    """Names of source tensors that pass through unchanged (everything but attention projections)."""
    consumed = {
        names.attn_name(i, proj, kind)
        for i in range(num_layers)
        for proj in names.SOURCE_ATTN_PROJ
        for kind in ("weight", "bias")
    }
    for name in source.tensor_names():
        if name in consumed or names.is_ignored_buffer(name):
            continue
        if names.is_dropped_head(name, tie_embeddings):
            continue
        yield name


def mla_config(source_config, shape: AttentionShape, layers: list[MLAWeights], dtype: torch.dtype) -> MLAConfig:
    base = {k: v for k, v in source_config.to_dict().items() if k not in _DROP_CONFIG_KEYS}
    base["head_dim"] = shape.head_dim
    ranks = [w.kv_lora_rank for w in layers]
    rope_dims = [w.rope_dim for w in layers]
    uniform = len(set(ranks)) == 1 and len(set(rope_dims)) == 1
    kv_a_bias = shape.qkv_bias
    config = MLAConfig(
        **base,
        kv_lora_rank=ranks[0] if uniform else ranks,
        qk_rope_head_dim=rope_dims[0] if uniform else rope_dims,
        qk_nope_head_dim=shape.head_dim,
        v_head_dim=shape.head_dim,
        rope_freq_index=[w.freq_index for w in layers],
        softmax_scale=shape.head_dim ** -0.5,
        q_proj_bias=shape.qkv_bias,
        kv_a_proj_bias=kv_a_bias,
        o_proj_bias=shape.o_bias,
        attention_window=shape.window,
    )
    config.architectures = ["MLAForCausalLM"]
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    return config


def model_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the MLA model for CONFIG (built on the meta device: no memory)."""
    from ..mla_model.modeling_mla import MLAForCausalLM

    with torch.device("meta"):
        model = MLAForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop(names.LM_HEAD, None)
    return shapes


def check_shapes(config: MLAConfig, state: dict) -> None:
    """Strict transfer: the state dict has exactly the model's tensors, with their shapes."""
    expected = model_shapes(config)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise RuntimeError(f"converted state dict does not match the MLA model: missing {missing[:5]}, extra {extra[:5]}")
    for name, shp in expected.items():
        if tuple(state[name].shape) != shp:
            raise RuntimeError(f"{name}: converted shape {tuple(state[name].shape)} != model shape {shp}")
