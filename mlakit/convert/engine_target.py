"""Plans a serving engine's MLA kernels take (``--target``), and the one-rank rule of the stock export.

vLLM 0.32 (read from its installed source, ``model_executor/layers/attention/mla_attention.py`` and
``v1/attention/backends/mla/``): every MLA backend refuses a latent + rope width r + d_R outside
{320, 512, 576} (``MLACommonMetadata``: "Head dimension N is not supported by MLA"); the CPU backend,
FlashMLA and CUTLASS MLA take only 576 = 512 + 64; the Triton MLA backend (GPU) also takes 320 and
512. One rank serves every layer. So ``--target vllm`` plans 512 + 64 in every layer, the one shape
every backend takes.

Options reach a conversion from three places (defaults, a recipe, explicit flags or arguments). A
target or a stock export that needs a value a recipe set differently replaces it with a logged note;
an explicit conflicting value is refused, naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import fields, replace

from ..arch.families import AttentionShape
from ..choices import TARGETS

__all__ = [
    "TARGETS",
    "TargetError",
    "VLLM_MLA_RANK",
    "VLLM_MLA_ROPE_DIM",
    "VLLM_MLA_WIDTHS",
    "check_target_shape",
    "explicit_fields",
    "fit_target",
]

log = logging.getLogger(__name__)

VLLM_MLA_RANK = 512
VLLM_MLA_ROPE_DIM = 64
VLLM_MLA_WIDTHS = (
    320,
    512,
    576,
)  # r + d_R that vLLM's MLA layer accepts at all (576 only, off the Triton backend)
_ONE_RANK = (
    "uniform",
    "auto",
)  # allocations that give every layer the same rank once a target or export asks


class TargetError(ValueError):
    """The options contradict the serving target or the export format; the message names the fix."""


def explicit_fields(opts) -> set[str]:
    """The fields of OPTS (a ConvertOptions) that differ from their defaults: what a Python caller set."""
    return {f.name for f in fields(opts) if getattr(opts, f.name) != f.default}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fit_target(opts, explicit: Collection[str] | None = None, stock_export: bool = False):
    """OPTS (a ConvertOptions) made to fit ``opts.target`` and, with STOCK_EXPORT, the deepseek-v3 export.

    EXPLICIT names the fields the user set directly (CLI flags); the others came from a recipe or the
    defaults and may be replaced. None: every non-default field counts as explicit (Python callers).
    - ``target vllm``: r = 512 and d_R = 64 in every layer, no budget, uniform allocation;
    - stock export: one rank in every layer (``auto`` or a recipe's per-layer allocation becomes
      ``uniform``) and stock-form rope for the methods that have it."""
    if opts.target not in TARGETS:
        raise TargetError(f"--target {opts.target!r} is not one of {', '.join(TARGETS)}")
    explicit = explicit_fields(opts) if explicit is None else set(explicit)
    changes = {}
    if opts.target == "vllm":
        want = {"kv_budget": None, "kv_lora_rank": VLLM_MLA_RANK, "rope_dim": VLLM_MLA_ROPE_DIM}
        for name, value in want.items():
            have = getattr(opts, name)
            if have == value:
                continue
            if name in explicit:
                raise TargetError(
                    f"{_flag(name)} {have} contradicts --target vllm, which plans r = {VLLM_MLA_RANK} and d_R = "
                    f"{VLLM_MLA_ROPE_DIM} in every layer (the only latent shape vLLM's CPU, FlashMLA and CUTLASS "
                    f"MLA kernels take); drop {_flag(name)}, or drop --target vllm for another shape (served by "
                    f"mlakit's vLLM plugin with zero-padding to {VLLM_MLA_RANK} + {VLLM_MLA_ROPE_DIM})"
                )
            if have != _default(opts, name):
                log.warning(
                    "--target vllm: the recipe's %s %s is replaced by r = %d + d_R = %d in every layer",
                    name,
                    have,
                    VLLM_MLA_RANK,
                    VLLM_MLA_ROPE_DIM,
                )
            changes[name] = value
    per_layer = opts.allocation not in _ONE_RANK
    if (opts.target == "vllm" or stock_export) and (per_layer or opts.allocation == "auto"):
        why = "vLLM's MLA kernels do not take" if opts.target == "vllm" else "deepseek-v3 cannot hold"
        budget = changes.get("kv_budget", opts.kv_budget)
        if per_layer and "allocation" in explicit and (budget is not None or opts.target == "vllm"):
            raise TargetError(
                f"--allocation {opts.allocation} gives each layer its own rank, which {why}; use "
                f"--allocation uniform (or auto) with "
                f"{'--target vllm' if opts.target == 'vllm' else '--format deepseek-v3'}"
            )
        if per_layer and budget is not None:
            log.warning(
                "the recipe's allocation %s gives each layer its own rank, which %s: using uniform",
                opts.allocation,
                why,
            )
        changes["allocation"] = "uniform"
    if stock_export and not opts.stock_rope:
        from .rope_select import STOCK_ROPE_METHODS

        if opts.rope_method in STOCK_ROPE_METHODS:
            changes["stock_rope"] = True  # one stock rope table; other methods are checked by the export
    return replace(opts, **changes) if changes else opts


def _default(opts, name: str):
    return next(f.default for f in fields(opts) if f.name == name)


def check_target_shape(opts, shape: AttentionShape) -> None:
    """Refuse ``target vllm`` for a source whose cache is no larger than 512 + 64 (before any work)."""
    if opts.target != "vllm":
        return
    G, d = shape.num_kv_heads, shape.head_dim
    source = 2 * G * d
    width = VLLM_MLA_RANK + VLLM_MLA_ROPE_DIM
    if source <= width:
        raise TargetError(
            f"--target vllm: this {shape.family} caches {source} values per token per layer ({G} KV heads x "
            f"head_dim {d}, keys and values), and vLLM's MLA kernels take exactly {width} ({VLLM_MLA_RANK} latent + "
            f"{VLLM_MLA_ROPE_DIM} rope; the GPU Triton backend also takes r + d_R = 320 or 512), so MLA cannot "
            f"save KV memory for it in vLLM. Serve the source model itself with vLLM (its cache is the smaller "
            f"one), or drop --target and serve the native checkpoint with mlakit's vLLM plugin (`vllm serve OUT`), "
            f"which zero-pads every layer to {width} values: {width / source:.2f}x the source's cache"
        )
    if shape.hidden_size + 1 < VLLM_MLA_RANK:  # the latent is a projection of [x; 1]
        raise TargetError(
            f"--target vllm: the latent is a projection of the hidden state, so with hidden_size "
            f"{shape.hidden_size} no layer can use more than {shape.hidden_size + 1} of vLLM's "
            f"{VLLM_MLA_RANK} latent dims; drop --target and serve the native checkpoint with mlakit's vLLM "
            f"plugin (`vllm serve OUT`), which zero-pads the latent to {VLLM_MLA_RANK}"
        )
