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
    dev = q_lat.device
    lengths = lengths.to(dev)
    starts = None if starts is None else starts.to(dev)
    # One host sync: the longest row, and whether any slot below it is masked.
    if lengths.numel():
        max_start = lengths.new_zeros(()) if starts is None else starts.max().to(lengths.dtype)
        max_len, min_len, max_start = torch.stack([lengths.max(), lengths.min(), max_start]).tolist()
    else:
        max_len = min_len = max_start = 0
    if max_len <= 0:  # nothing cached in any row
        return torch.zeros_like(q_lat), torch.full((B, H), float("-inf"), device=dev)
    if block_table is not None:
        c_kv = gather_paged(c_kv, block_table, max_len)
        k_rope = gather_paged(k_rope, block_table, max_len)
    else:
        c_kv, k_rope = c_kv[:, :max_len], k_rope[:, :max_len]
    # Few passes over the (B, S, *) cache and the (B, H, S) scores (on CPU decode is bound by
    # memory traffic, and at short contexts by the number of ops): the scale is folded into
    # the (B, H, *) queries, the rope scores are the accumulator of the latent ones, the mask
    # is only built when some slot is invalid, the exponentials overwrite the scores, and the
    # output is normalised after P @ c_kv, on (B, H, r) instead of (B, H, S).
    ckv32, kr32 = c_kv.float(), k_rope.float()  # (B, S, r), (B, S, d_R)
    q32 = q_lat.float() * scale
    if q_rope.shape[-1] > 0:
        scores = torch.bmm(q_rope.float() * scale, kr32.transpose(1, 2))
        scores = scores.baddbmm_(q32, ckv32.transpose(1, 2))
    else:
        scores = torch.bmm(q32, ckv32.transpose(1, 2))  # (B, H, S), scaled
    if min_len < max_len or max_start > 0:
        pos = torch.arange(max_len, device=dev)
        valid = pos[None, :] < lengths.long()[:, None]  # (B, S)
        if starts is not None:
            valid = valid & (pos[None, :] >= starts.long()[:, None])
        scores = scores.masked_fill_(~valid[:, None, :], float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)  # (B, H, 1)
        m = m.masked_fill_(m == float("-inf"), 0.0)  # empty rows: exp(-inf - 0) = 0 below
    else:
        m = scores.amax(dim=-1, keepdim=True)
    probs = scores.sub_(m).exp_()  # unnormalised; each non-empty row holds exp(0) = 1 at its max
    total = probs.sum(dim=-1, keepdim=True)  # (B, H, 1): >= 1, or 0 for an empty row
    lse = (m + total.log())[..., 0]  # (B, H); -inf for empty rows
    out = torch.bmm(probs, ckv32).div_(total.clamp_min_(1.0))  # empty rows: 0 / 1
    return out.to(q_lat.dtype), lse
