"""Architecture knowledge as data: ``AttentionShape`` from each family's config, and the tensor-name
rules every reader and writer takes from ``mlakit.arch.names``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from mlakit.arch import AttentionShape, UnsupportedModelError, attention_shape, names
from mlakit.convert.assemble import mla_layer_tensors
from mlakit.mla_model import MLAForCausalLM
from mlakit.mla_model.configuration_mla import MLAConfig
from tests.tiny_models import FAMILY_BUILDERS, build_tiny

_COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)


def _cfg(cls, **kw):
    cfg = cls(**_COMMON, **kw)
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return cfg


@pytest.mark.parametrize(
    ("config", "want"),
    [
        (
            _cfg(LlamaConfig, num_key_value_heads=2),
            AttentionShape("LlamaForCausalLM", 4, 2, 16, 64, False, False, None),
        ),
        (
            _cfg(LlamaConfig, attention_bias=True),
            AttentionShape("LlamaForCausalLM", 4, 4, 16, 64, True, True, None),
        ),
        (
            _cfg(MistralConfig, num_key_value_heads=1, head_dim=8, sliding_window=32),
            AttentionShape("MistralForCausalLM", 4, 1, 8, 64, False, False, 32),
        ),
        (  # Qwen2: biases on q/k/v only; its window applies only when use_sliding_window is set
            _cfg(Qwen2Config, num_key_value_heads=2, sliding_window=32, use_sliding_window=False),
            AttentionShape("Qwen2ForCausalLM", 4, 2, 16, 64, True, False, None),
        ),
    ],
)
def test_attention_shape_reads_each_family_from_its_config(config, want):
    assert attention_shape(config) == want


def test_attention_shape_is_frozen_and_typed():
    shape = attention_shape(_cfg(LlamaConfig, num_key_value_heads=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.head_dim = 8
    hints = {f.name: f.type for f in dataclasses.fields(AttentionShape)}
    assert hints == {
        "family": "str",
        "num_heads": "int",
        "num_kv_heads": "int",
        "head_dim": "int",
        "hidden_size": "int",
        "qkv_bias": "bool",
        "o_bias": "bool",
        "window": "int | None",
    }
    assert dataclasses.replace(shape, qkv_bias=True).qkv_bias and not shape.qkv_bias


def test_attention_shape_refuses_what_no_latent_reproduces():
    with pytest.raises(UnsupportedModelError, match="not a multiple of num_key_value_heads"):
        attention_shape(_cfg(LlamaConfig, num_key_value_heads=3))
    with pytest.raises(UnsupportedModelError, match="use_sliding_window=true"):
        attention_shape(_cfg(Qwen2Config, use_sliding_window=True))


@pytest.mark.parametrize("family", sorted(FAMILY_BUILDERS))
def test_source_names_are_the_names_transformers_gives_each_family(family):
    model = build_tiny(family)
    got = set(model.state_dict())
    n = model.config.num_hidden_layers
    for i in range(n):
        for proj in names.SOURCE_ATTN_PROJ:
            assert names.attn_name(i, proj) in got
        for proj in names.MLP_PROJ:
            assert names.layer_prefix(i) + names.mlp(proj) in got
        for norm in (names.INPUT_NORM, names.POST_ATTN_NORM):
            assert names.layer_prefix(i) + names.norm(norm) in got
    assert {names.EMBED, names.FINAL_NORM} <= got
    in_layers = {k for k in got if k.startswith(names.LAYERS_PREFIX)}
    assert all(any(k.startswith(names.layer_prefix(i)) for i in range(n)) for k in in_layers)
    tied = model.config.tie_word_embeddings
    assert names.head_weight(got, tied) == (names.EMBED if tied else names.LM_HEAD)


def test_native_names_are_the_mla_models():
    cfg = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        kv_lora_rank=4,
        qk_rope_head_dim=2,
        qk_nope_head_dim=8,
        v_head_dim=8,
        rope_freq_index=[[0]],
    )
    with torch.device("meta"):
        got = set(MLAForCausalLM(MLAConfig(**cfg)).state_dict())
    want = {names.attn_name(0, proj) for proj in names.MLA_ATTN_PROJ}
    assert want <= got
    assert not any(names.attn_prefix(0) + proj in k for k in got for proj in (names.K_PROJ, names.V_PROJ))


def test_mla_layer_tensors_writes_the_native_names():
    w = type("W", (), {})()
    w.q_proj, w.kv_a_proj_with_mqa = torch.zeros(6, 5), torch.zeros(4, 5)
    w.kv_b_proj, w.o_proj, w.o_bias = torch.zeros(8, 3), torch.zeros(4, 4), torch.zeros(4)
    out = mla_layer_tensors(3, w, torch.float32, q_bias=True, kv_a_bias=True)
    assert list(out) == [
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.bias",
        "model.layers.3.self_attn.o_proj.bias",
    ]


def test_name_rules():
    assert names.layer_prefix(12) == "model.layers.12."
    assert names.attn_prefix(0) == "model.layers.0.self_attn."
    assert names.attn_name(2, names.KV_B_PROJ, "bias") == "model.layers.2.self_attn.kv_b_proj.bias"
    assert names.is_ignored_buffer("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert not names.is_ignored_buffer(names.EMBED)
    # the tied-head rule: a tied checkpoint reads (and need not store) the embedding as its head
    assert names.head_weight([names.EMBED], tied=False) == names.EMBED
    assert names.head_weight([names.EMBED, names.LM_HEAD], tied=True) == names.EMBED
    assert names.head_weight([names.EMBED, names.LM_HEAD], tied=False) == names.LM_HEAD
    assert names.is_dropped_head(names.LM_HEAD, tied=True) and not names.is_dropped_head(
        names.LM_HEAD, tied=False
    )
    pattern = names.mla_attn_pattern((names.Q_PROJ, names.KV_B_PROJ))
    assert pattern.match("model.layers.7.self_attn.kv_b_proj.weight").groups() == ("7", "kv_b_proj", "weight")
    assert pattern.match("model.layers.7.self_attn.o_proj.weight") is None
    assert pattern.match("model.layers.7.self_attn.q_proj.weight.x") is None
