"""Tiny random source models for every supported family (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

__all__ = ["BLOCK_MLAKIT", "FAMILY_BUILDERS", "TINY_CONFIG", "assert_close", "build_tiny", "random_attention",
           "save_tiny_source"]

# First lines of a subprocess script that must work without mlakit: importing it raises.
BLOCK_MLAKIT = """\
import importlib.abc, sys
class _BlockMlakit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mlakit" or name.startswith("mlakit."):
            raise ImportError("mlakit is blocked in this test")
sys.meta_path.insert(0, _BlockMlakit())
"""

TINY_CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILY_BUILDERS = {
    "llama_gqa": lambda: LlamaForCausalLM(LlamaConfig(**TINY_CONFIG, num_key_value_heads=2, rope_theta=10000.0)),
    "llama_mha": lambda: LlamaForCausalLM(LlamaConfig(**TINY_CONFIG, num_key_value_heads=4, rope_theta=500.0)),
    "llama3_scaled": lambda: LlamaForCausalLM(LlamaConfig(
        **TINY_CONFIG, num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**TINY_CONFIG, num_key_value_heads=1, sliding_window=8,
                                                         head_dim=16, rope_theta=1e6)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG, num_key_value_heads=2, rope_theta=1e6,
                                                   tie_word_embeddings=True)),
}


def build_tiny(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = FAMILY_BUILDERS[family]().eval()
    with torch.no_grad():  # HF initialises biases and norms to constants; make them informative
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_tiny_source(family: str, directory: Path) -> Path:
    model = build_tiny(family)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(directory))
    return Path(directory)


def random_attention(H: int, G: int, d: int, D: int):
    """One attention layer's weights drawn at random (H query heads, G KV heads of size d, hidden D), with
    the bias column the converter's [x; 1] inputs read. mlakit is imported here, not above: this module also
    serves scripts that run without it."""
    from mlakit.convert.mla_layer import AttentionWeights

    return AttentionWeights(q=torch.randn(H * d, D + 1), k=torch.randn(G * d, D + 1), v=torch.randn(G * d, D + 1),
                            o=torch.randn(D, H * d), o_bias=None, num_heads=H, num_kv_heads=G, head_dim=d)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float = 0.0) -> float:
    """Assert |got - want| <= atol + rtol |want| everywhere; report the worst element. Returns max abs error."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs()
    excess = err - (atol + rtol * want.abs())
    worst = int(excess.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    assert float(excess.max()) <= 0, (
        f"{name}: max abs error {float(err.max()):.3e} exceeds atol={atol:g} rtol={rtol:g}; "
        f"worst at {idx}: got {float(got[idx]):.6g}, want {float(want[idx]):.6g}"
    )
    return float(err.max())
