"""The vLLM 0.32 CPU MLA workaround, engine-free: when it applies, and that its W_UV product is vLLM's.

The engine tests (test_vllm_engine.py) check the whole decode path with it applied."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mlakit.serving.vllm_cpu_decode import GATHER_BYTES, paged_latent_decode, request_chunks
from mlakit.serving.vllm_cpu_mla import v_up_proj_contiguous, workaround_applies
from tests.tiny_models import assert_close

_PLAIN = dict(cpu_backend=True, amx_bmm=False, aiter_bmm=False, dcp_world_size=1, q_pad_num_heads=None)


def test_workaround_applies_only_to_vllm_032_cpu_plain_bmm():
    assert workaround_applies("0.32.0", **_PLAIN)
    assert workaround_applies("0.32.3+cpu", **_PLAIN)
    for version in ("0.31.9", "0.33.0", "1.32.0", "dev"):
        assert not workaround_applies(version, **_PLAIN), version
    for field, value in (
        ("cpu_backend", False),
        ("amx_bmm", True),
        ("aiter_bmm", True),
        ("dcp_world_size", 2),
        ("q_pad_num_heads", 128),
    ):
        assert not workaround_applies("0.32.0", **{**_PLAIN, field: value}), field


@pytest.mark.parametrize("batch", [1, 5])
def test_v_up_proj_contiguous_matches_vllm_bmm_into_transposed_view(batch):
    torch.manual_seed(0)
    N, L, P, V = 4, 24, 8, 12
    # vLLM 0.32 builds W_UV as a view of kv_b_proj's (N * (P + V), L) weight: (L, N, V) -> (N, L, V).
    weight = torch.randn(N * (P + V), L)
    W_UV = weight.T.view(L, N, P + V).split([P, V], dim=-1)[1].transpose(0, 1)
    attn = SimpleNamespace(num_heads=N, kv_lora_rank=L, v_head_dim=V, W_UV=W_UV)
    x = torch.randn(batch, N, L)
    want = torch.full((batch, N * V), float("nan"))
    # vLLM 0.32's plain branch: (N, B, L) x (N, L, V) written into the (N, B, V) view of (B, N, V).
    torch.bmm(x.transpose(0, 1), W_UV, out=want.view(batch, N, V).transpose(0, 1))
    got = torch.full((batch, N * V), float("nan"))
    v_up_proj_contiguous(attn, x, got)
    err = assert_close("v_up_proj", got, want, atol=1e-5, rtol=1e-5)
    print(f"batch {batch}: max abs error {err:.1e} (bound 1e-5 + 1e-5 |want|)")
    assert_close("v_up_proj vs einsum", got, torch.einsum("bnl,nlv->bnv", x, W_UV).reshape(batch, -1), 1e-4)


def _paged(seq_lens, block_size, width, dtype, seed=0):
    """A shuffled page pool holding each request's WIDTH-wide cache rows, and its block table."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(pages) + 3, generator=gen)  # 3 pages nobody owns
    cache = torch.randn(len(order), block_size, width, generator=gen).to(dtype)
    table = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int32)  # unused tail: -1
    taken = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[taken : taken + n].to(torch.int32)
        taken += n
    return cache, table


def _plain_decode(q, cache, table, seq_lens, scale, rank):
    """Per request: its cache rows in order, softmax(scale q . rows) @ rows[:, :rank] (float64)."""
    out = []
    block = cache.shape[1]
    for b, n in enumerate(seq_lens):
        rows = torch.cat([cache[int(p)] for p in table[b, : -(-n // block)]])[:n].double()
        weights = torch.softmax(scale * q[b].double() @ rows.T, dim=-1)
        out.append(weights @ rows[:, :rank])
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("gather_bytes", [GATHER_BYTES, 1])  # 1: every request its own chunk
def test_paged_latent_decode_matches_plain_attention_per_request(dtype, tol, gather_bytes):
    torch.manual_seed(0)
    seq_lens, block, rank, rope, heads = [1, 16, 17, 40, 5], 16, 24, 8, 3
    cache, table = _paged(seq_lens, block, rank + rope, dtype)
    q = torch.randn(len(seq_lens), heads, rank + rope).to(dtype)
    got = paged_latent_decode(q, cache, table, torch.tensor(seq_lens), 0.3, rank, gather_bytes=gather_bytes)
    assert got.shape == (len(seq_lens), heads, rank) and got.dtype == dtype
    want = _plain_decode(q, cache, table, seq_lens, 0.3, rank)
    err = assert_close("paged decode", got.double(), want, atol=tol, rtol=tol)
    print(f"{dtype}, gather {gather_bytes} B: max abs error {err:.1e}")


def test_paged_latent_decode_chunks_bound_the_gather():
    lens_in_pages = [1, 4, 4, 2, 9, 1]
    chunks = list(request_chunks(lens_in_pages, 10, 80))  # at most 8 padded pages per chunk
    assert [c for c in chunks] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    for start, stop in chunks:
        assert stop - start == 1 or max(lens_in_pages[start:stop]) * (stop - start) * 10 <= 80
