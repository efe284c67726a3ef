"""Workaround for vLLM 0.32.x on CPU: the absorbed MLA projections as one batched GEMM each.

In vLLM 0.32's ``MLAAttention.forward_impl`` the decode path multiplies the per-head queries by
W_UK (``(N, B, P) x (N, P, L)``) and the attention output by W_UV (``(N, B, L) x (N, L, V)``) with
``torch.bmm(..., out=<a transposed view>)``. On CPU, torch computes a bmm whose output is not
contiguous as one small matrix product per head, each its own OpenMP parallel region; a batched
product into a contiguous buffer is one region. With idle cores the two cost about the same; on
cores that other processes also use, every region waits for all its threads to be scheduled and
the per-head form is orders of magnitude slower (``bench/results/serve_profile_before.md`` / ``_after.md``).

``batch_absorbed_products(attn)`` makes one of *our* model's ``MLAAttention`` layers use the
contiguous form, the same products in the same dtype:

- W_UK: vLLM's own branch for head-padding backends (``q_pad_num_heads``) writes the bmm into a
  contiguous (N, B, L) buffer and transposes the view; padding to the layer's own head count pads
  nothing. The CPU backend reads ``q_pad_num_heads`` nowhere else.
- W_UV: the layer's ``_v_up_proj`` is replaced, on this instance only, by a bmm into a fresh
  contiguous (N, B, V) tensor copied into vLLM's (B, N, V) output.

It applies only to vLLM 0.32.x, only to the CPU MLA backend, and only where vLLM would take its
plain bf16/fp32 bmm branch (no AMX, no ROCm aiter, no decode context parallelism). Anything else
is left as vLLM built it.
"""

from __future__ import annotations

import logging
import types

import torch

from .vllm_version import major_minor

__all__ = ["WORKAROUND_VLLM", "batch_absorbed_products", "v_up_proj_contiguous", "workaround_applies"]

logger = logging.getLogger(f"vllm.{__name__}")

WORKAROUND_VLLM = (0, 32)  # the (major, minor) series whose forward_impl this matches


def workaround_applies(
    version: str, *, cpu_backend: bool, amx_bmm: bool, aiter_bmm: bool, dcp_world_size: int, q_pad_num_heads
) -> bool:
    """Whether a layer with these properties takes the plain-bmm decode branch this workaround matches."""
    return (
        major_minor(version) == WORKAROUND_VLLM
        and cpu_backend
        and not amx_bmm
        and not aiter_bmm
        and dcp_world_size == 1
        and q_pad_num_heads is None
    )


def v_up_proj_contiguous(attn, x: torch.Tensor, out: torch.Tensor) -> None:
    """vLLM 0.32's ``MLAAttention._v_up_proj`` (plain branch) with the bmm into a contiguous tensor.

    x: (B, N * L) or (B, N, L) latent attention output; out: (B, N * V), written in place."""
    x = x.view(-1, attn.num_heads, attn.kv_lora_rank).transpose(0, 1)  # (N, B, L)
    out = out.view(-1, attn.num_heads, attn.v_head_dim)  # (B, N, V)
    out.copy_(torch.bmm(x, attn.W_UV).transpose(0, 1))  # (N, B, V) -> (B, N, V)


def batch_absorbed_products(attn) -> bool:
    """Apply the workaround to ATTN (a ``vllm...MLAAttention`` of this plugin's model); True if applied."""
    import vllm
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    applies = workaround_applies(
        vllm.__version__,
        cpu_backend=isinstance(attn.impl, CPUMLAImpl),
        amx_bmm=bool(getattr(attn, "is_amx_bmm_enabled", False)),
        aiter_bmm=bool(attn.is_aiter_triton_fp8_bmm_enabled or attn.is_aiter_triton_fp4_bmm_enabled),
        dcp_world_size=attn.impl.dcp_world_size,
        q_pad_num_heads=attn.q_pad_num_heads,
    )
    if applies:
        attn.q_pad_num_heads = attn.num_heads  # W_UK: vLLM's contiguous-buffer branch, no padding
        attn._v_up_proj = types.MethodType(v_up_proj_contiguous, attn)  # W_UV: this instance only
    return applies
