"""Every tensor name mlakit reads or writes, in one place.

Three layouts share one skeleton (``model.layers.{i}.`` + module + ``.weight`` / ``.bias``, then
the embedding, the final norm and the LM head): the Llama-style source (q/k/v/o projections), the
native MLA checkpoint (DeepSeek's attention names, so readers of DeepSeek code recognise them), and
the stock ``deepseek_v3`` export (the native names plus its latent norms and, for biases, the
q_a/q_b route). The MLP and layer norms pass through every conversion under the same names.

``mla_model/modeling_mla.py`` spells the native names as module attributes itself: it is copied
next to checkpoints for ``trust_remote_code`` and must not import mlakit.
"""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = [
    "DOWN_PROJ",
    "EMBED",
    "FINAL_NORM",
    "FINAL_NORM_PREFIX",
    "GATE_PROJ",
    "IGNORED_BUFFERS",
    "INPUT_NORM",
    "KV_A_NORM",
    "KV_A_PROJ",
    "KV_B_PROJ",
    "K_PROJ",
    "LAYER_PREFIX",
    "LAYERS_PREFIX",
    "LM_HEAD",
    "MLA_ATTN_PROJ",
    "MLP",
    "MLP_PROJ",
    "O_PROJ",
    "POST_ATTN_NORM",
    "Q_A_NORM",
    "Q_A_PROJ",
    "Q_B_PROJ",
    "Q_PROJ",
    "SELF_ATTN",
    "SOURCE_ATTN_PROJ",
    "UP_PROJ",
    "V_PROJ",
    "attn",
    "attn_name",
    "attn_prefix",
    "head_weight",
    "is_dropped_head",
    "is_ignored_buffer",
    "layer_prefix",
    "mla_attn_pattern",
    "mlp",
    "norm",
]

# -- skeleton -------------------------------------------------------------------------------------
LAYERS_PREFIX = "model.layers."
LAYER_PREFIX = LAYERS_PREFIX + "{i}."
SELF_ATTN = "self_attn"  # the attention module of a decoder layer
MLP = "mlp"

# -- attention projections ----------------------------------------------------------------------
Q_PROJ, K_PROJ, V_PROJ, O_PROJ = "q_proj", "k_proj", "v_proj", "o_proj"
SOURCE_ATTN_PROJ = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ)  # what a conversion consumes
KV_A_PROJ = "kv_a_proj_with_mqa"  # x -> [c_kv; k_rope]
KV_B_PROJ = "kv_b_proj"  # c_kv -> per-head [k_nope; v]
MLA_ATTN_PROJ = (Q_PROJ, KV_A_PROJ, KV_B_PROJ, O_PROJ)  # what a native checkpoint holds per layer
# stock deepseek_v3 only: the latent norm, and the q_lora route that carries q biases (export)
KV_A_NORM = "kv_a_layernorm"
Q_A_PROJ, Q_A_NORM, Q_B_PROJ = "q_a_proj", "q_a_layernorm", "q_b_proj"

# -- copied unchanged by every conversion --------------------------------------------------------
GATE_PROJ, UP_PROJ, DOWN_PROJ = "gate_proj", "up_proj", "down_proj"
MLP_PROJ = (GATE_PROJ, UP_PROJ, DOWN_PROJ)
INPUT_NORM, POST_ATTN_NORM = "input_layernorm", "post_attention_layernorm"

# -- outside the layers ---------------------------------------------------------------------------
EMBED = "model.embed_tokens.weight"
FINAL_NORM_PREFIX = "model.norm."
FINAL_NORM = FINAL_NORM_PREFIX + "weight"
LM_HEAD = "lm_head.weight"

# Buffers some checkpoints carry that the model recomputes (older HF Llama exports save each
# layer's rotary table): read by no conversion, written by none.
IGNORED_BUFFERS = ("rotary_emb.inv_freq",)


def layer_prefix(i: int) -> str:
    """``model.layers.{i}.``: the start of every tensor name of decoder layer I."""
    return LAYER_PREFIX.format(i=i)


def attn(module: str, kind: str = "weight") -> str:
    """An attention tensor's name relative to its layer: ``self_attn.{module}.{kind}``."""
    return f"{SELF_ATTN}.{module}.{kind}"


def mlp(module: str, kind: str = "weight") -> str:
    """An MLP tensor's name relative to its layer: ``mlp.{module}.{kind}``."""
    return f"{MLP}.{module}.{kind}"


def norm(module: str) -> str:
    """A layer norm's weight name relative to its layer (INPUT_NORM or POST_ATTN_NORM)."""
    return f"{module}.weight"


def attn_prefix(i: int) -> str:
    """``model.layers.{i}.self_attn.``: the start of every attention tensor name of layer I."""
    return f"{layer_prefix(i)}{SELF_ATTN}."


def attn_name(i: int, module: str, kind: str = "weight") -> str:
    """The full name of attention tensor MODULE.KIND of layer I."""
    return layer_prefix(i) + attn(module, kind)


def is_ignored_buffer(name: str) -> bool:
    return name.endswith(IGNORED_BUFFERS)


def is_dropped_head(name: str, tied: bool) -> bool:
    """Whether NAME is an LM head a tied checkpoint need not carry (the embedding is the head)."""
    return tied and name == LM_HEAD


def head_weight(names: Collection[str], tied: bool) -> str:
    """The tensor the LM head reads: the embedding when the head is tied or the checkpoint stores no
    separate head (tied checkpoints usually omit it), else ``lm_head.weight``."""
    return LM_HEAD if LM_HEAD in names and not tied else EMBED


def mla_attn_pattern(modules: Collection[str]) -> re.Pattern:
    """Matches native attention weights and biases of MODULES; groups: layer index, module, kind."""
    alternatives = "|".join(re.escape(m) for m in modules)
    layers = re.escape(LAYERS_PREFIX)
    return re.compile(rf"{layers}(\d+)\.{re.escape(SELF_ATTN)}\.({alternatives})\.(weight|bias)$")
