"""Architecture knowledge as data: which source families convert, how their attention biases and
windows are spelt in their configs, and the attention shape a config implies. Every supported
family shares the Llama tensor layout, whose names live in ``names``.

Imports neither torch nor transformers (``tests/test_package_layout.py`` checks it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "AttentionShape", "Family", "UnsupportedModelError", "attention_shape", "family_for"]


class UnsupportedModelError(ValueError):
    """The source checkpoint is not one mlakit can convert."""


@dataclass(frozen=True)
class Family:
    architecture: str
    qkv_bias: str | bool  # config attribute that switches q/k/v biases on, or a constant
    o_bias: str | bool
    window: str | None = None  # config attribute holding a sliding window applied to every layer
    window_switch: str | None = None  # config attribute that must be true for the window to apply


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("LlamaForCausalLM", qkv_bias="attention_bias", o_bias="attention_bias"),
        Family("MistralForCausalLM", qkv_bias=False, o_bias=False, window="sliding_window"),
        Family(
            "Qwen2ForCausalLM",
            qkv_bias=True,
            o_bias=False,
            window="sliding_window",
            window_switch="use_sliding_window",
        ),
    )
}


@dataclass(frozen=True)
class AttentionShape:
    """The attention of a supported source config, as every conversion step reads it."""

    family: str  # the config's architecture, a key of FAMILIES
    num_heads: int  # query heads n_h
    num_kv_heads: int  # key/value heads G (= num_heads for MHA)
    head_dim: int  # d, even (rotary pairs)
    hidden_size: int  # D
    qkv_bias: bool  # q/k/v projections carry biases
    o_bias: bool  # o_proj carries a bias
    window: int | None  # sliding window applied to every layer, or None


def _flag(config, rule) -> bool:
    return bool(getattr(config, rule, False)) if isinstance(rule, str) else bool(rule)


def family_for(config) -> Family:
    archs = list(getattr(config, "architectures", None) or [])
    supported = ", ".join(FAMILIES)
    if not archs:
        raise UnsupportedModelError(f"the config names no architecture; supported: {supported}")
    arch = archs[0]
    if arch not in FAMILIES:
        hint = ""
        if arch.startswith("Qwen3"):
            hint = " (Qwen3 normalises q and k per head, which an MLA latent cannot reproduce)"
        raise UnsupportedModelError(f"architecture {arch} is not supported{hint}; supported: {supported}")
    fam = FAMILIES[arch]
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise UnsupportedModelError(f"{arch} with partial_rotary_factor != 1 is not supported")
    if fam.window_switch and _flag(config, fam.window_switch):
        raise UnsupportedModelError(
            f"{arch} with {fam.window_switch}=true (per-layer sliding windows) is not supported; "
            f"set it to false in config.json if the checkpoint was trained without it"
        )
    if _flag(config, "mlp_bias") and arch != "LlamaForCausalLM":
        raise UnsupportedModelError(f"{arch} with mlp_bias is not supported")
    return fam


def attention_shape(config) -> AttentionShape:
    """Head counts, dims and bias/window flags of a supported source config."""
    fam = family_for(config)
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    if n_heads % n_kv:
        raise UnsupportedModelError(
            f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}"
        )
    if head_dim % 2:
        raise UnsupportedModelError(f"head_dim={head_dim} is odd; rotary pairs need an even head_dim")
    window = getattr(config, fam.window, None) if fam.window else None
    if fam.window_switch and not _flag(config, fam.window_switch):
        window = None
    return AttentionShape(
        family=fam.architecture,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        qkv_bias=_flag(config, fam.qkv_bias),
        o_bias=_flag(config, fam.o_bias),
        window=window,
    )
