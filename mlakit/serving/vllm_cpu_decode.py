"""Decode attention over vLLM's paged latent cache as batched matrix products (vLLM 0.32.x, CPU).

vLLM's CPU MLA backend decodes with ``torch.ops._C.mla_decode_kvcache_cpu``, which its own module
docstring describes as reference quality, for functional checks rather than speed. In
``bench/serve_profile.py``'s decode profile that kernel is most of the time by which the
converted model's decode step trails the GQA source's (``bench/results/serve_profile_after.md``).

After weight absorption, MLA decode is multi-query attention over the cached latent: for each
request b with ``seq_lens[b]`` cached tokens, whose cache rows ``[c; k_R]`` (width L + R) lie in
the pages ``block_table[b]``,

    scores[b, h, t] = scale * q[b, h] . cache_b[t]        (q: the absorbed query, width L + R)
    out[b, h]       = softmax_t(scores[b, h]) @ cache_b[:, :L]

``paged_latent_decode`` gathers each request's pages into a dense (T, L + R) block, padded to the
longest request of a chunk and masked there, and runs both products as one batched GEMM per
chunk of requests (BLAS instead of the reference kernel's per-token loops). Chunks bound the
gathered copy (``GATHER_BYTES``). Softmax is taken in float32 whatever the cache dtype.

``batched_paged_decode(attn)`` makes one of this plugin's ``MLAAttention`` layers decode this way,
under the same conditions as ``vllm_cpu_mla``'s workaround (vLLM 0.32.x, CPU MLA backend, plain
bmm branch, no decode context parallelism); otherwise the layer keeps vLLM's kernel.
"""

from __future__ import annotations

import types

import torch

__all__ = ["GATHER_BYTES", "batched_paged_decode", "paged_latent_decode", "request_chunks"]

# Upper bound on one chunk's gathered pages: enough for 32 requests of 2K tokens at 576 fp32
# values per token in one GEMM, small next to the KV cache space itself.
GATHER_BYTES = 256 * 1024**2


def request_chunks(pages: list[int], page_bytes: int, budget: int):
    """Consecutive [start, stop) request ranges whose gather, padded to the chunk's most PAGES,
    stays within BUDGET bytes (a single request is always a chunk, however long)."""
    start, longest = 0, 0
    for b, n in enumerate(pages):
        longest_with_b = max(longest, n)
        if b > start and longest_with_b * (b + 1 - start) * page_bytes > budget:
            yield start, b
            start, longest_with_b = b, n
        longest = longest_with_b
    yield start, len(pages)


def paged_latent_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    gather_bytes: int = GATHER_BYTES,
) -> torch.Tensor:
    """Absorbed MLA decode, one query token per request.

    q: (B, H, L + R); cache: (num_blocks, block_size, L + R); block_table: (B, max_blocks) page
    indices; seq_lens: (B,) cached tokens per request (>= 1). Returns (B, H, L) in q's dtype."""
    B, H, width = q.shape
    block_size = cache.shape[1]
    lens = [int(n) for n in seq_lens.tolist()]
    out = q.new_empty(B, H, kv_lora_rank)
    page_bytes = block_size * width * cache.element_size()
    for start, stop in request_chunks([-(-n // block_size) for n in lens], page_bytes, gather_bytes):
        longest = max(lens[start:stop])
        pages = -(-longest // block_size)
        rows = block_table[start:stop, :pages].long()
        kv = cache[rows].reshape(stop - start, pages * block_size, width)[:, :longest]  # (b, T, L + R)
        scores = torch.bmm(q[start:stop].to(kv.dtype), kv.transpose(1, 2)).float() * scale  # (b, H, T)
        positions = torch.arange(longest, device=q.device)
        limit = torch.tensor(lens[start:stop], device=q.device)
        scores.masked_fill_((positions[None, :] >= limit[:, None])[:, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(kv.dtype)
        out[start:stop] = torch.bmm(weights, kv[..., :kv_lora_rank]).to(out.dtype)
    return out


def _forward_mqa(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer):
    """``CPUMLAImpl.forward_mqa`` of vLLM 0.32 with ``paged_latent_decode`` in place of its kernel."""
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    decode = attn_metadata.decode
    out = paged_latent_decode(
        q, kv_c_and_k_pe_cache, decode.block_table, decode.seq_lens, impl.scale, impl.kv_lora_rank
    )
    return out, None  # no log-sum-exp: vLLM reads it only with decode context parallelism, which is off


def batched_paged_decode(attn) -> None:
    """Make ATTN (an ``MLAAttention`` whose ``vllm_cpu_mla.batch_absorbed_products`` applied) decode
    with ``paged_latent_decode``; this instance only."""
    attn.impl.forward_mqa = types.MethodType(_forward_mqa, attn.impl)
