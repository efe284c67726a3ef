"""One attention layer, GQA/MHA -> MLA: pure tensor functions (float64 inside).

Source maps are bias-augmented: W~ = [W | b] acts on x~ = [x; 1].

- mixed keys  m_c = sum_a U[c, a] k_a over a = (g, jl) in one frequency group (see rope_split)
- k_rope      = kept mixed components, rotated at their representative frequency
- y           = [dropped mixed components (real, imag); v]  -> c_kv = down x~, y ~= up c_kv
- q_rope_i    = sum_jl U[c, (g(i), jl)] q_{i, jl} for every kept c (scores unchanged: U is orthogonal)
- k_nope_i[j] = sum over dropped c of U[c, (g(i), j)] m_c  (read by the unrotated q_i, optionally
                scaled per frequency by the mean of the phase the dropped rotation would have had)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .rope_split import RopePlan

__all__ = ["AttentionWeights", "MLAWeights", "convert_attention", "grouped_keys", "nope_key_coefficients", "nope_value_map"]


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
    g = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return c, g


def grouped_keys(w: AttentionWeights, fold: int) -> torch.Tensor:
    """Key rows regrouped by frequency group: (groups, G*fold components a = (g, jl), re/im, D+1)."""
    G, d = w.num_kv_heads, w.head_dim
    n_grp = d // 2 // fold
    return w.k.double().view(G, 2, n_grp, fold, -1).permute(2, 0, 3, 1, 4).reshape(n_grp, G * fold, 2, -1)


def _mixed_keys(w: AttentionWeights, plan: RopePlan) -> torch.Tensor:
    """Mixed key components per frequency group: (groups, G*fold, re/im, D+1)."""
    return torch.einsum("nca,nahx->nchx", plan.mixing.double(), grouped_keys(w, plan.fold))


def _rows(mixed: torch.Tensor, pairs) -> torch.Tensor:
    c, g = _index(pairs)
    picked = mixed[g, c]  # (n, 2, D+1)
    return picked.transpose(0, 1).reshape(2 * len(pairs), mixed.shape[-1])  # real parts, then imaginary parts


def nope_value_map(w: AttentionWeights, plan: RopePlan) -> torch.Tensor:
    """W_y: the map from x~ to y = [dropped mixed key components; v], (2Gd - d_R, D+1)."""
    return torch.cat([_rows(_mixed_keys(w, plan), plan.dropped), w.v.double()], dim=0)


def _coefficients(plan: RopePlan, pairs, num_kv_heads: int) -> torch.Tensor:
    """U[grp, c, (g, jl)] for each pair, as (n, G, fold)."""
    c, g = _index(pairs)
    return plan.mixing.double()[g, c].view(len(pairs), num_kv_heads, plan.fold)


def nope_key_coefficients(plan: RopePlan, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """C (G, d/2, n_drop): KV head g's unrotated key at frequency j is sum_q C[g, j, q] m_q over dropped
    components (real and imaginary parts alike)."""
    dropped, f = plan.dropped, plan.fold
    C = torch.zeros(num_kv_heads, head_dim // 2, len(dropped), dtype=torch.float64)
    if dropped:
        _, dg = _index(dropped)
        rows = dg[:, None] * f + torch.arange(f)  # (n_drop, fold): source frequency of each part
        C[:, rows, torch.arange(len(dropped))[:, None]] = _coefficients(plan, dropped, num_kv_heads).permute(1, 0, 2)
    return C


def convert_attention(
    w: AttentionWeights,
    plan: RopePlan,
    factorize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    query_map: torch.Tensor | None = None,
) -> MLAWeights:
    """Build the MLA layer; ``factorize(W_y) -> (down, up)`` chooses the latent. QUERY_MAP (H, d, d),
    optional: applied to each head's unrotated query, which reads only the dropped components
    (``LayerMetrics.dropped_query_map``); the rotary queries stay the source's."""
    H, G, d, f = w.num_heads, w.num_kv_heads, w.head_dim, plan.fold
    n_grp = d // 2 // plan.fold
    group = torch.arange(H) // (H // G)  # KV head read by each query head
    dropped = plan.dropped
    n_drop = len(dropped)

    down, up = factorize(nope_value_map(w, plan))
    down, up = down.double(), up.double()
    r = down.shape[0]

    # queries: the unrotated part is the source q_i; the rotary part of kept component (c, grp)
    # is sum over jl of U[grp, c, (g(i), jl)] q_i at frequency grp*fold + jl
    cols = w.q.shape[1]
    _, kg = _index(plan.kept)
    coef = _coefficients(plan, plan.kept, G)[:, group].permute(1, 0, 2)  # (H, n_kept, fold)
    q5 = w.q.double().view(H, 2, n_grp, f, cols)[:, :, kg]  # (H, 2, n_kept, fold, D+1)
    q_rope = torch.einsum("ipl,ihplx->ihpx", coef, q5).reshape(H, plan.rope_dim, cols)
    q_nope = w.q.double().view(H, d, cols)
    if query_map is not None and n_drop:
        q_nope = query_map.double() @ q_nope
    q_proj = torch.cat([q_nope, q_rope], dim=1).reshape(H * (d + plan.rope_dim), cols)

    # kv_b: NoPE key rows of KV head g gather the dropped components through C[g] (d/2 x n_drop);
    # value rows select the head's group
    C = nope_key_coefficients(plan, G, d)
    up_k, up_v = up[: 2 * n_drop], up[2 * n_drop :]
    k_nope = torch.cat([C @ up_k[:n_drop], C @ up_k[n_drop:]], dim=1)  # (G, d, r): real rows, imaginary rows
    kv_b = torch.cat([k_nope[group], up_v.reshape(G, d, r)[group]], dim=1).reshape(H * 2 * d, r)

    kv_a = torch.cat([down, _rows(_mixed_keys(w, plan), plan.kept)], dim=0)  # (r + d_R, D+1)
    return MLAWeights(
        q_proj=q_proj,
        kv_a_proj_with_mqa=kv_a,
        kv_b_proj=kv_b,
        o_proj=w.o,
        o_bias=w.o_bias,
        kv_lora_rank=r,
        rope_dim=plan.rope_dim,
        freq_index=list(plan.freq_index),
    )
