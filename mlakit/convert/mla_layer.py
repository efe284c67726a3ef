"""One attention layer, GQA/MHA -> MLA: pure tensor functions (float64 inside).

Source maps are bias-augmented: W~ = [W | b] acts on x~ = [x; 1].

- mixed keys  m_{c,j} = sum_g U_j[c, g] k_{g,j}            (per frequency j, complex)
- k_rope      = kept mixed components, rotated at their own frequency
- y           = [dropped mixed components (real, imag); v]  -> c_kv = down x~, y ~= up c_kv
- q_rope_i    = U_j[c, g(i)] q_{i,j} for every kept (c, j)  (scores unchanged since U_j is orthogonal)
- k_nope_i[j] = sum over dropped (c, j) of U_j[c, g(i)] m_{c,j} (read by the unrotated q_i)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .rope_split import RopePlan

__all__ = ["AttentionWeights", "MLAWeights", "convert_attention", "nope_value_map"]


@dataclass
class AttentionWeights:
    """A source layer's attention, bias-augmented: q (H*d, D+1), k and v (G*d, D+1), o (D, H*d)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    o_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class MLAWeights:
    q_proj: torch.Tensor  # (H*(d+d_R), D+1)
    kv_a_proj_with_mqa: torch.Tensor  # (r+d_R, D+1)
    kv_b_proj: torch.Tensor  # (H*2d, r)
    o_proj: torch.Tensor  # (D, H*d)
    o_bias: torch.Tensor | None
    kv_lora_rank: int
    rope_dim: int
    freq_index: list[int]


def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    c = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    j = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return c, j


def _mixed_keys(w: AttentionWeights, plan: RopePlan) -> torch.Tensor:
    G, d = w.num_kv_heads, w.head_dim
    k4 = w.k.double().view(G, 2, d // 2, -1)  # (G, re/im, d/2, D+1)
    return torch.einsum("jcg,ghjx->chjx", plan.mixing.double(), k4)  # (G comps, 2, d/2, D+1)


def _rows(mixed: torch.Tensor, pairs) -> torch.Tensor:
    c, j = _index(pairs)
    picked = mixed[c, :, j]  # (n, 2, D+1)
    return picked.transpose(0, 1).reshape(2 * len(pairs), mixed.shape[-1])  # real parts, then imaginary parts


def nope_value_map(w: AttentionWeights, plan: RopePlan) -> torch.Tensor:
    """W_y: the map from x~ to y = [dropped mixed key components; v], (2Gd - d_R, D+1)."""
    return torch.cat([_rows(_mixed_keys(w, plan), plan.dropped), w.v.double()], dim=0)


def convert_attention(
    w: AttentionWeights,
    plan: RopePlan,
    factorize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> MLAWeights:
    """Build the MLA layer; ``factorize(W_y) -> (down, up)`` chooses the latent."""
    H, G, d = w.num_heads, w.num_kv_heads, w.head_dim
    half = d // 2
    group = torch.arange(H) // (H // G)  # KV head read by each query head
    mixing = plan.mixing.double()
    mixed = _mixed_keys(w, plan)
    dropped = plan.dropped
    n_drop = len(dropped)

    down, up = factorize(nope_value_map(w, plan))
    down, up = down.double(), up.double()
    r = down.shape[0]

    # queries: unrotated part is the source q_i; rotary part scaled by U_j[c, g(i)]
    kc, kj = _index(plan.kept)
    q4 = w.q.double().view(H, 2, half, -1)
    coef = mixing[kj, kc][:, group].T  # (H, n_kept)
    cols = w.q.shape[1]
    q_rope = (coef[:, None, :, None] * q4[:, :, kj, :]).reshape(H, plan.rope_dim, cols)
    q_proj = torch.cat([w.q.double().view(H, d, cols), q_rope], dim=1).reshape(H * (d + plan.rope_dim), cols)

    # kv_b: per head, NoPE key rows gather the dropped components it reads; value rows select its group
    dc, dj = _index(dropped)
    up_k, up_v = up[: 2 * n_drop], up[2 * n_drop :]
    k_nope = torch.zeros(H, 2, half, r, dtype=torch.float64)
    if n_drop:
        dcoef = mixing[dj, dc][:, group].T  # (H, n_drop)
        k_nope[:, 0].index_add_(1, dj, dcoef[:, :, None] * up_k[:n_drop][None])
        k_nope[:, 1].index_add_(1, dj, dcoef[:, :, None] * up_k[n_drop:][None])
    values = up_v.reshape(G, d, r)[group]  # (H, d, r)
    kv_b = torch.cat([k_nope.reshape(H, d, r), values], dim=1).reshape(H * 2 * d, r)

    kv_a = torch.cat([down, _rows(mixed, plan.kept)], dim=0)  # (r + d_R, D+1)
    return MLAWeights(
        q_proj=q_proj,
        kv_a_proj_with_mqa=kv_a,
        kv_b_proj=kv_b,
        o_proj=w.o,
        o_bias=w.o_bias,
        kv_lora_rank=r,
        rope_dim=plan.rope_dim,
        freq_index=plan.freq_index,
    )
