"""Which native checkpoints an engine can serve, and the exact zero padding that makes them fit.

Pure torch (no vLLM import), so the checks and the padding math are tested in the main
environment. vLLM's MLA layer takes one latent rank r and one rotary width d_R for the whole
model, and its CPU decode kernel (like FlashMLA and CUTLASS MLA) only r + d_R = 512 + 64. A
native layer with r_l <= 512 and d_R_l <= 64 is padded to that shape without changing a score:

- latent: extra rows of ``kv_a_proj_with_mqa`` (and its bias) are zero, so the extra latent
  entries of every token are zero, and the matching columns of ``kv_b_proj`` are zero, so
  nothing reads them;
- rotary part: d_R_l = 2m dims in half-split layout (pair p is dims p and p + m) become 64 dims
  with pair p at dims p and p + 32; the m kept pairs keep their frequencies, the 32 - m new
  pairs have zero query and key weights (and biases), so their product is zero at any angle.

The cost is cache memory: every token caches 576 values in every layer, whatever r_l + d_R_l.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ENGINE_KV_LORA_RANK",
    "ENGINE_ROPE_DIM",
    "POSITION_DEPENDENT_ROPE",
    "ServedShape",
    "ServingError",
    "check_rope_type",
    "check_window",
    "pad_kv_a_proj",
    "pad_kv_b_proj",
    "pad_q_proj",
    "plan_served_shape",
    "rope_type_of",
]

ENGINE_KV_LORA_RANK = 512
ENGINE_ROPE_DIM = 64

# Scalings whose frequencies change with the longest sequence of a forward call: an engine
# batching many requests into one call cannot reproduce the per-request frequencies.
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


class ServingError(ValueError):
    """A native checkpoint the engine cannot serve exactly; the message names the fix."""


@dataclass(frozen=True)
class ServedShape:
    """The engine-side attention shape of a native checkpoint and the per-layer native one."""

    kv_lora_rank: int
    rope_dim: int
    native_kv_lora_rank: tuple[int, ...]
    native_rope_dim: tuple[int, ...]
    rope_freq_index: tuple[tuple[int, ...], ...]  # per layer, rope_dim // 2 source pairs (padding: 0)

    @property
    def padded(self) -> bool:
        return any(r != self.kv_lora_rank for r in self.native_kv_lora_rank) or any(
            d != self.rope_dim for d in self.native_rope_dim
        )

    def describe(self) -> str:
        native = sorted({(r, d) for r, d in zip(self.native_kv_lora_rank, self.native_rope_dim)})
        shapes = ", ".join(f"{r} + {d}" for r, d in native)
        served = f"{self.kv_lora_rank} + {self.rope_dim}"
        if not self.padded:
            return f"served at its own shape r + d_R = {served} in all {len(self.native_rope_dim)} layers"
        mean = sum(r + d for r, d in zip(self.native_kv_lora_rank, self.native_rope_dim)) / len(
            self.native_rope_dim
        )
        return (
            f"served zero-padded to r + d_R = {served} (native per-layer shapes: {shapes}); the engine caches "
            f"{self.kv_lora_rank + self.rope_dim} values per token per layer instead of {mean:.1f} on average"
        )


def plan_served_shape(
    config, kv_lora_rank: int = ENGINE_KV_LORA_RANK, rope_dim: int = ENGINE_ROPE_DIM
) -> ServedShape:
    """The served shape of an ``MLAConfig``; raises ``ServingError`` naming the fix when it does not fit."""
    n = config.num_hidden_layers
    ranks = tuple(config.layer_kv_lora_rank(i) for i in range(n))
    rope_dims = tuple(config.layer_rope_dim(i) for i in range(n))
    too_big = [
        (i, r, d) for i, (r, d) in enumerate(zip(ranks, rope_dims)) if r > kv_lora_rank or d > rope_dim
    ]
    if too_big:
        listed = ", ".join(f"layer {i}: {r} + {d}" for i, r, d in too_big[:4])
        more = f" and {len(too_big) - 4} more" if len(too_big) > 4 else ""
        raise ServingError(
            f"the engine's MLA layer takes at most r = {kv_lora_rank} latent dims and d_R = {rope_dim} rotary "
            f"dims per layer; this checkpoint has {listed}{more}. Convert again with "
            f"`--kv-lora-rank {kv_lora_rank} --rope-dim {rope_dim}` (or a --kv-budget whose per-layer ranks stay "
            f"within r <= {kv_lora_rank}, d_R <= {rope_dim})"
        )
    half = rope_dim // 2
    index = tuple(tuple(config.rope_freq_index[i]) + (0,) * (half - d // 2) for i, d in enumerate(rope_dims))
    return ServedShape(kv_lora_rank, rope_dim, ranks, rope_dims, index)


def rope_type_of(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def check_rope_type(config) -> None:
    kind = rope_type_of(config)
    if kind in POSITION_DEPENDENT_ROPE:
        raise ServingError(
            f"rope scaling {kind!r} changes its frequencies with the longest sequence of each forward call, "
            f"which an engine batching requests cannot reproduce; serve this checkpoint with transformers "
            f"(`generate`), or convert a source whose rope type is one of default, linear, llama3, yarn"
        )


def check_window(attention_window: int | None, max_model_len: int) -> None:
    """A sliding window is exact only when no sequence outgrows it (vLLM's CPU MLA has no window)."""
    if attention_window is not None and attention_window < max_model_len:
        raise ServingError(
            f"this checkpoint attends over a sliding window of {attention_window} tokens and the engine's MLA "
            f"attention has no window, so sequences longer than the window would attend too far; serve it "
            f"with `--max-model-len {attention_window}` (LLM(..., max_model_len={attention_window})) or less "
            f"(asked for {max_model_len})"
        )


def _pad_rope_rows(rope: torch.Tensor, target: int) -> torch.Tensor:
    """(d_R, ...) rows in half-split layout -> (target, ...): pair p moves from (p, p + m) to (p, p + target/2)."""
    m, half = rope.shape[0] // 2, target // 2
    out = rope.new_zeros((target, *rope.shape[1:]))
    out[:m] = rope[:m]
    out[half : half + m] = rope[m:]
    return out


def pad_q_proj(t: torch.Tensor, num_heads: int, d_nope: int, d_rope: int, target_rope: int) -> torch.Tensor:
    """q_proj weight (H (d + d_R), D) or bias (H (d + d_R),) -> (H (d + target_rope), ...)."""
    per_head = t.reshape(num_heads, d_nope + d_rope, *t.shape[1:])
    parts = [torch.cat([h[:d_nope], _pad_rope_rows(h[d_nope:], target_rope)]) for h in per_head]
    return torch.stack(parts).reshape(num_heads * (d_nope + target_rope), *t.shape[1:])


def pad_kv_a_proj(
    t: torch.Tensor, rank: int, d_rope: int, target_rank: int, target_rope: int
) -> torch.Tensor:
    """kv_a_proj_with_mqa weight (r + d_R, D) or bias (r + d_R,) -> (target_rank + target_rope, ...)."""
    latent = t.new_zeros((target_rank, *t.shape[1:]))
    latent[:rank] = t[:rank]
    return torch.cat([latent, _pad_rope_rows(t[rank:], target_rope)])


def pad_kv_b_proj(weight: torch.Tensor, target_rank: int) -> torch.Tensor:
    """kv_b_proj weight (H (d + d_v), r) -> (H (d + d_v), target_rank): the extra latent dims are read by nothing."""
    out = weight.new_zeros((weight.shape[0], target_rank))
    out[:, : weight.shape[1]] = weight
    return out
