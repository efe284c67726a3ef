"""KV cache per token from configs and from real cache tensors; decode benchmark plumbing."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mlakit.eval.decode_bench import benchmark_decode, cache_kwarg, decode_run
from mlakit.eval.kv_accounting import (
    account_kv,
    cache_layer_tensors,
    config_kv_values_per_layer,
    get_cache,
    kv_reduction,
    measure_kv_per_layer,
)
from mlakit.eval.memory import current_rss_bytes
from tests.eval_helpers import tiny_llama, tiny_llama_config


def test_config_count_gqa_and_mha():
    assert config_kv_values_per_layer(tiny_llama_config()) == [2 * 2 * 16] * 2  # 2 KV heads x head_dim 16
    mha = tiny_llama_config(num_key_value_heads=4, num_hidden_layers=3)
    assert config_kv_values_per_layer(mha) == [2 * 4 * 16] * 3
    explicit = tiny_llama_config(head_dim=8)
    assert config_kv_values_per_layer(explicit) == [2 * 2 * 8] * 2


def test_config_count_mla_int_and_per_layer():
    cfg = SimpleNamespace(num_hidden_layers=3, kv_lora_rank=[16, 32, 48], qk_rope_head_dim=8)
    assert config_kv_values_per_layer(cfg) == [24, 40, 56]
    cfg = SimpleNamespace(num_hidden_layers=2, kv_lora_rank=64, qk_rope_head_dim=[0, 4])
    assert config_kv_values_per_layer(cfg) == [64, 68]
    with pytest.raises(ValueError, match="kv_lora_rank lists 2 layers, the model has 3"):
        config_kv_values_per_layer(
            SimpleNamespace(num_hidden_layers=3, kv_lora_rank=[1, 2], qk_rope_head_dim=0)
        )


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_measured_matches_config_for_llama(dtype, size):
    model = tiny_llama(seed=0).to(dtype)
    acc = account_kv(model, batch_size=3, seq_len=5)
    assert acc.measured_values_per_layer == [64.0, 64.0]
    assert acc.measured_bytes_per_layer == [64.0 * size] * 2
    assert acc.values_per_token == 128 and acc.bytes_per_token == 128 * size
    assert acc.config_bytes_per_token == 128 * size and acc.element_size == size
    assert acc.dtype == str(dtype).removeprefix("torch.")
    d = acc.to_dict()
    assert d["bytes_per_token"] == 128 * size and d["config_values_per_token"] == 128
    assert d["config_bytes_per_layer"] == [64 * size] * 2


class _Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class FakeMLA(torch.nn.Module):
    """Caches a latent (B, 1, S, r) as keys and a rotary key (B, 1, S, d_R) as values, like mlakit's MLA model."""

    def __init__(self, ranks, rope):
        super().__init__()
        self.ranks, self.rope = ranks, rope
        self.config = SimpleNamespace(
            num_hidden_layers=len(ranks), kv_lora_rank=ranks, qk_rope_head_dim=rope, vocab_size=32
        )

    def forward(self, input_ids, use_cache=False, **kwargs):
        b, s = input_ids.shape
        layers = [
            _Layer(
                torch.zeros(b, 1, s, r, dtype=torch.bfloat16),
                torch.zeros(b, 1, s, self.rope, dtype=torch.bfloat16),
            )
            for r in self.ranks
        ]
        return SimpleNamespace(logits=torch.zeros(b, s, 32), cache=SimpleNamespace(layers=layers))


def test_measured_mla_cache_layout():
    acc = account_kv(FakeMLA([8, 24], 4), batch_size=2, seq_len=7)
    assert acc.measured_values_per_layer == [12.0, 28.0]
    assert acc.config_values_per_layer == [12, 28]
    assert acc.bytes_per_token == 2 * 40 and acc.element_size == 2


def test_cache_layouts_of_older_transformers():
    k = torch.zeros(1, 2, 3, 4)
    legacy = ((k, k), (k, k))
    assert [len(x) for x in cache_layer_tensors(legacy)] == [2, 2]
    old_dynamic = SimpleNamespace(key_cache=[k, k, k], value_cache=[k, k, k])
    assert len(cache_layer_tensors(old_dynamic)) == 3
    with pytest.raises(TypeError, match="unsupported cache type"):
        cache_layer_tensors(object())
    assert get_cache(SimpleNamespace(past_key_values=legacy)) is legacy
    with pytest.raises(ValueError, match="no cache"):
        get_cache(SimpleNamespace(logits=None))


def test_empty_cache_is_an_error():
    class NoCache(torch.nn.Module):
        config = SimpleNamespace(vocab_size=4)

        def forward(self, input_ids, **kwargs):
            return SimpleNamespace(cache=SimpleNamespace(layers=[]))

    with pytest.raises(ValueError, match="holds no tensors"):
        measure_kv_per_layer(NoCache())


def test_kv_reduction():
    assert kv_reduction(512, 128) == pytest.approx(0.75)
    assert kv_reduction(100, 100) == 0.0
    with pytest.raises(ValueError, match="> 0"):
        kv_reduction(0, 1)


def test_decode_run_counts_the_cache():
    model = tiny_llama(seed=0)
    assert cache_kwarg(model) in ("cache", "past_key_values")
    point = decode_run(model, context_len=10, batch_size=2, new_tokens=3)
    # prefill 10 tokens + 3 decode steps, each appending one token: 13 cached tokens per sequence
    assert point.cache_bytes == 2 * 13 * 128 * 4
    assert point.decode_tokens_per_s > 0 and point.prefill_s > 0
    assert point.memory_kind == "cpu_rss"
    with pytest.raises(ValueError, match=">= 1"):
        decode_run(model, 0, 1, 1)


def test_decode_matches_generate():
    """The benchmark's decode loop really uses the cache: its greedy tokens equal a full recompute."""
    model = tiny_llama(seed=5)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, tok, got = get_cache(out), out.logits[:, -1:].argmax(-1), []
        for _ in range(4):
            got.append(int(tok))
            out = model(input_ids=tok, use_cache=True, **{cache_kwarg(model): cache})
            cache, tok = get_cache(out), out.logits[:, -1:].argmax(-1)
        seq, want = ids, []
        for _ in range(4):
            nxt = model(input_ids=seq).logits[:, -1:].argmax(-1)
            want.append(int(nxt))
            seq = torch.cat([seq, nxt], dim=1)
    assert got == want


def test_benchmark_grid():
    points = benchmark_decode(tiny_llama(seed=0), [4, 8], [1, 2], new_tokens=2, progress=False)
    assert [(p.context_len, p.batch_size) for p in points] == [(4, 1), (4, 2), (8, 1), (8, 2)]


_PEAK_SCRIPT = """
import time, torch
from mlakit.eval.memory import PeakMemory
with PeakMemory("cpu", interval=0.001) as mem:
    big = torch.ones(256, 2**20, dtype=torch.uint8)  # 256 MiB, touched
    big.add_(1)
    time.sleep(0.2)  # let the sampler see it
    del big
print(mem.peak_bytes)
"""


def test_peak_memory_cpu():
    """In a fresh process: in the full test run, memory that earlier tests' threads free during the
    block can cancel the growth it measures (seen once as a 4096-byte peak)."""
    if current_rss_bytes() is None:
        pytest.skip("no /proc/self/statm on this platform")
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, check=True)
    peak = int(out.stdout.split()[-1])
    assert peak >= 128 * 2**20, peak
