"""The vLLM 0.32 CPU MLA workaround, engine-free: when it applies, and that its W_UV product is vLLM's.

The engine tests (test_vllm_engine.py) check the whole decode path with it applied."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

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
