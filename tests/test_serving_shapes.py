"""The engine-free part of serving: which checkpoints fit, the exact zero padding, the refusals."""

from __future__ import annotations

import pytest
import torch

from mlakit.mla_model import MLAConfig, MLAForCausalLM
from mlakit.serving.served_config import MLAServedConfig
from mlakit.serving.served_shape import (
    ServingError,
    check_rope_type,
    check_window,
    pad_kv_a_proj,
    pad_kv_b_proj,
    pad_q_proj,
    plan_served_shape,
)
from mlakit.serving.vllm_version import check_vllm_version, vllm_version_supported
from tests.tiny_models import assert_close

_BODY = dict(
    vocab_size=64,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _native(**over) -> MLAConfig:
    fields = dict(
        _BODY,
        kv_lora_rank=[5, 12, 9],
        qk_rope_head_dim=[4, 0, 6],
        rope_freq_index=[[7, 2], [], [0, 0, 5]],
        q_proj_bias=True,
        kv_a_proj_bias=True,
        rope_parameters=dict(_LLAMA3),
        softmax_scale=0.3,
    )
    fields.update(over)
    return MLAConfig(**fields)


@torch.no_grad()
def test_zero_padding_to_the_served_shape_changes_no_logit():
    """Per-layer ranks, rope dims (one layer without rope), duplicate frequencies, biases, llama3 scaling."""
    torch.manual_seed(0)
    config = _native()
    native = MLAForCausalLM(config).eval()
    for p in native.parameters():
        p.normal_(0, 0.2)
    shape = plan_served_shape(config, kv_lora_rank=16, rope_dim=8)
    assert shape.padded and shape.rope_freq_index == ((7, 2, 0, 0), (0, 0, 0, 0), (0, 0, 5, 0))
    served_config = MLAConfig(
        **{
            **config.to_dict(),
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "rope_freq_index": [list(i) for i in shape.rope_freq_index],
        }
    )
    served = MLAForCausalLM(served_config).eval()
    state = native.state_dict()
    H, d = config.num_attention_heads, config.qk_nope_head_dim
    for i in range(config.num_hidden_layers):
        r, d_r = shape.native_kv_lora_rank[i], shape.native_rope_dim[i]
        pre = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            state[pre + "q_proj." + kind] = pad_q_proj(state[pre + "q_proj." + kind], H, d, d_r, 8)
            state[pre + "kv_a_proj_with_mqa." + kind] = pad_kv_a_proj(
                state[pre + "kv_a_proj_with_mqa." + kind], r, d_r, 16, 8
            )
        state[pre + "kv_b_proj.weight"] = pad_kv_b_proj(state[pre + "kv_b_proj.weight"], 16)
    served.load_state_dict(state, strict=True)
    ids = torch.randint(3, 64, (2, 23), generator=torch.Generator().manual_seed(1))
    want = native(ids).logits
    err = assert_close("padded logits", served(ids).logits, want, atol=1e-5 * float(want.abs().max()))
    gen_native = native.generate(ids[:1, :6], max_new_tokens=10, do_sample=False)  # absorbed decode path too
    assert torch.equal(served.generate(ids[:1, :6], max_new_tokens=10, do_sample=False), gen_native)
    print(f"padded vs native: max |dlogit| {err:.2e} (logits up to {float(want.abs().max()):.2f})")


def test_pad_rope_rows_keeps_half_split_pairs():
    rope = torch.arange(1.0, 7.0)  # pairs (1, 4), (2, 5), (3, 6)
    assert pad_kv_a_proj(rope, 0, 6, 0, 10).tolist() == [1, 2, 3, 0, 0, 4, 5, 6, 0, 0]


def test_plan_refuses_a_layer_above_the_engine_shape_and_names_the_fix():
    config = _native(kv_lora_rank=[5, 600, 9])
    with pytest.raises(ServingError, match=r"layer 1: 600 \+ 0.*--kv-lora-rank 512 --rope-dim 64"):
        plan_served_shape(config)
    wide = _native(head_dim=80, qk_rope_head_dim=[4, 0, 66], rope_freq_index=[[7, 2], [], list(range(33))])
    with pytest.raises(ServingError, match=r"layer 2: 9 \+ 66"):
        plan_served_shape(wide)


def test_served_config_presents_one_shape_and_round_trips():
    config = MLAServedConfig(**_native().to_dict())
    assert (config.kv_lora_rank, config.qk_rope_head_dim) == (512, 64)
    assert config.native_kv_lora_rank == [5, 12, 9] and config.native_qk_rope_head_dim == [4, 0, 6]
    assert config.rope_freq_index[2] == [0, 0, 5] + [0] * 29
    again = MLAServedConfig(**config.to_dict())
    assert again.served_shape() == config.served_shape()
    assert "zero-padded to r + d_R = 512 + 64" in config.served_shape().describe()
    with pytest.raises(ServingError, match="--kv-lora-rank 512"):
        MLAServedConfig(**_native(kv_lora_rank=[5, 513, 9]).to_dict())


def test_window_and_rope_refusals_name_the_fix():
    check_window(None, 4096)
    check_window(4096, 4096)
    with pytest.raises(ServingError, match="--max-model-len 1024"):
        check_window(1024, 4096)
    check_rope_type(_native())
    scalings = {
        "dynamic": {"factor": 2.0},
        "longrope": {
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 16,
        },
    }
    for kind, fields in scalings.items():
        with pytest.raises(ServingError, match=kind):
            check_rope_type(_native(rope_parameters={"rope_type": kind, "rope_theta": 1e4, **fields}))


def test_vllm_version_range():
    assert vllm_version_supported("0.32.0") and vllm_version_supported("0.32.3+cpu")
    for other in ("0.31.2", "0.33.0", "1.0.0", "dev"):
        assert not vllm_version_supported(other)
    with pytest.raises(RuntimeError, match=r"vLLM >= 0\.32, < 0\.33 and this is vLLM 0\.33\.1"):
        check_vllm_version("0.33.1")
