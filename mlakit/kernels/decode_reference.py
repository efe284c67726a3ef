"""Torch reference for absorbed MLA decode over the latent cache.

This is the CPU path of the MLA model and the oracle the Triton kernel is tested
against. It is self-contained (torch only) because it is copied beside converted
checkpoints for ``trust_remote_code`` loading.

Semantics (shared with the Triton kernel):

- ``q_lat``   (B, H, r)     query already absorbed through W_UK (fp32/bf16/fp16)
- ``q_rope``  (B, H, d_R)   rotated rope part of the query (d_R may be 0)
- ``c_kv``    contiguous (B, S_max, r) or paged (num_pages, page_size, r)
- ``k_rope``  contiguous (B, S_max, d_R) or paged (num_pages, page_size, d_R)
- ``lengths`` (B,) int      number of valid cached tokens of each row
- ``scale``   float         softmax scale applied to the full score
- ``block_table`` (B, max_pages) int32, only for the paged layout: token t of row b
  lives in page ``block_table[b, t // page_size]`` at offset ``t % page_size``
- ``starts``  (B,) int, optional: tokens before ``starts[b]`` are masked (left padding)

Returns ``out`` (B, H, r) in q_lat's dtype and ``lse`` (B, H) float32, the natural-log
sum of exp of the scaled scores. A row with no valid token gives zeros and lse = -inf.
"""

from __future__ import annotations

import torch

__all__ = ["mla_decode_reference", "gather_paged"]


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, max_len: int) -> torch.Tensor:
    """Gather a paged cache (num_pages, page, C) into a contiguous (B, max_len, C) view copy."""
    page = cache.shape[1]
    n_pages = -(-max_len // page) if max_len > 0 else 0
    pages = cache[block_table[:, :n_pages].long()]  # (B, n_pages, page, C)
    return pages.reshape(block_table.shape[0], n_pages * page, cache.shape[-1])[:, :max_len]


def mla_decode_reference(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_table: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, r = q_lat.shape
    max_len = int(lengths.max()) if lengths.numel() else 0
    if block_table is not None:
        c_kv = gather_paged(c_kv, block_table, max_len)
        k_rope = gather_paged(k_rope, block_table, max_len)
    else:
        c_kv, k_rope = c_kv[:, :max_len], k_rope[:, :max_len]
    ckv32, kr32 = c_kv.float(), k_rope.float()  # (B, S, r), (B, S, d_R)
    scores = torch.einsum("bhr,bsr->bhs", q_lat.float(), ckv32)
    if q_rope.shape[-1] > 0:
        scores = scores + torch.einsum("bhd,bsd->bhs", q_rope.float(), kr32)
    scores = scores * scale  # (B, H, S)
    pos = torch.arange(max_len, device=q_lat.device)
    valid = pos[None, :] < lengths.to(q_lat.device).long()[:, None]  # (B, S)
    if starts is not None:
        valid = valid & (pos[None, :] >= starts.to(q_lat.device).long()[:, None])
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H); -inf for empty rows
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float32).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("bhs,bsr->bhr", probs, ckv32)
    return out.to(q_lat.dtype), lse
