"""Which rotary components stay rotary (the shared key ``k_rope``) and how KV heads are mixed.

HF rotary layout: dims (j, j + d/2) of a head form one complex number rotating at
frequency j (j = 0 is the highest). For every frequency j the G key heads' components may
be mixed by a real orthogonal U_j (G x G) without changing any score (DESIGN.md, math 2);
a plan keeps some mixed components (c, j) rotary and lets the rest lose their rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RopePlan", "full_rope_plan", "high_frequency_plan"]


@dataclass
class RopePlan:
    """``mixing[j]`` is U_j (rows: mixed components c, columns: source KV heads g);
    ``kept`` lists the (c, j) pairs kept rotary, in the order of the k_rope dims."""

    mixing: torch.Tensor  # (d/2, G, G) float64, orthogonal per frequency
    kept: list[tuple[int, int]]

    @property
    def num_kv_heads(self) -> int:
        return self.mixing.shape[1]

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.kept)

    @property
    def freq_index(self) -> list[int]:
        return [j for _, j in self.kept]

    @property
    def dropped(self) -> list[tuple[int, int]]:
        kept = set(self.kept)
        half, G = self.mixing.shape[0], self.mixing.shape[1]
        return [(c, j) for j in range(half) for c in range(G) if (c, j) not in kept]

    def __post_init__(self):
        half, G = self.mixing.shape[0], self.mixing.shape[1]
        if len(set(self.kept)) != len(self.kept):
            raise ValueError("a rotary component is kept twice")
        for c, j in self.kept:
            if not (0 <= c < G and 0 <= j < half):
                raise ValueError(f"kept component {(c, j)} is outside {G} heads x {half} frequencies")


def _identity(G: int, head_dim: int) -> torch.Tensor:
    return torch.eye(G, dtype=torch.float64).expand(head_dim // 2, G, G).clone()


def high_frequency_plan(num_kv_heads: int, head_dim: int, rope_dim: int) -> RopePlan:
    """Data-free choice: keep every head's components at the highest frequencies first
    (the ones whose loss of rotation costs most), without mixing heads."""
    full = num_kv_heads * head_dim
    if rope_dim % 2 or not 0 <= rope_dim <= full:
        raise ValueError(f"rope dim must be even and in [0, {full}], got {rope_dim}")
    order = [(c, j) for j in range(head_dim // 2) for c in range(num_kv_heads)]
    return RopePlan(_identity(num_kv_heads, head_dim), order[: rope_dim // 2])


def full_rope_plan(num_kv_heads: int, head_dim: int) -> RopePlan:
    """Keep every rotary component: the lossless construction."""
    return high_frequency_plan(num_kv_heads, head_dim, num_kv_heads * head_dim)
