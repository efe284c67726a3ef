"""Which rotary components stay rotary (the shared key ``k_rope``) and how KV heads are mixed.

HF rotary layout: dims (j, j + d/2) of a head form one complex number rotating at frequency
j (j = 0 is the highest). Frequencies are grouped ``fold`` at a time (FreqFold; fold=1 is
exact). Within a group the G x fold complex key components a = (g, jl) may be mixed by a real
orthogonal U (rows: mixed components c, columns: a). Mixing changes no score: query head i
takes coefficient U[c, (g(i), jl)] on mixed component c. A plan keeps some mixed components
rotary, rotating at one representative source frequency; the rest lose their rotation and
join the latent. With fold=1 the kept part of RoPE is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RopePlan", "full_rope_plan", "high_frequency_plan"]


@dataclass
class RopePlan:
    """``mixing[grp]`` is U (G*fold x G*fold, orthogonal); ``kept`` lists (c, grp) pairs in k_rope order
    and ``freq_index`` the source frequency each kept component rotates at."""

    mixing: torch.Tensor  # (d/2/fold, G*fold, G*fold) float64
    kept: list[tuple[int, int]]
    freq_index: list[int]
    fold: int = 1

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.kept)

    @property
    def dropped(self) -> list[tuple[int, int]]:
        kept = set(self.kept)
        n_grp, n_comp = self.mixing.shape[0], self.mixing.shape[1]
        return [(c, g) for g in range(n_grp) for c in range(n_comp) if (c, g) not in kept]

    def __post_init__(self):
        n_grp, n_comp = self.mixing.shape[0], self.mixing.shape[1]
        if len(set(self.kept)) != len(self.kept):
            raise ValueError("a rotary component is kept twice")
        if len(self.freq_index) != len(self.kept):
            raise ValueError("every kept component needs one frequency")
        for (c, g), j in zip(self.kept, self.freq_index):
            if not (0 <= c < n_comp and 0 <= g < n_grp):
                raise ValueError(f"kept component {(c, g)} is outside {n_comp} components x {n_grp} groups")
            if not g * self.fold <= j < (g + 1) * self.fold:
                raise ValueError(f"kept component {(c, g)} rotates at frequency {j}, outside its group")


def identity_mixing(num_kv_heads: int, head_dim: int, fold: int = 1) -> torch.Tensor:
    n = num_kv_heads * fold
    return torch.eye(n, dtype=torch.float64).expand(head_dim // 2 // fold, n, n).clone()


def high_frequency_plan(num_kv_heads: int, head_dim: int, rope_dim: int) -> RopePlan:
    """Data-free choice: keep every head's components at the highest frequencies first
    (the ones whose loss of rotation costs most), without mixing heads."""
    full = num_kv_heads * head_dim
    if rope_dim % 2 or not 0 <= rope_dim <= full:
        raise ValueError(f"rope dim must be even and in [0, {full}], got {rope_dim}")
    order = [(c, j) for j in range(head_dim // 2) for c in range(num_kv_heads)][: rope_dim // 2]
    return RopePlan(identity_mixing(num_kv_heads, head_dim), order, [j for _, j in order])


def full_rope_plan(num_kv_heads: int, head_dim: int) -> RopePlan:
    """Keep every rotary component: the lossless construction."""
    return high_frequency_plan(num_kv_heads, head_dim, num_kv_heads * head_dim)
