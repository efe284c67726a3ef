"""Decode throughput and peak memory of a causal LM at several context lengths and batch sizes.

One run: a seeded random (B, context) prompt is prefilled with ``use_cache=True``, then
``new_tokens`` greedy decode steps feed one token per sequence through the model's own
cache. Decode tokens/s = B * new_tokens / decode seconds (prefill timed apart). Peak
memory is the extra memory of the whole run (see :mod:`mlakit.eval.memory`); the cache
size at the end is measured from the cache tensors.
"""

from __future__ import annotations

import gc
import inspect
import logging
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from .kv_accounting import cache_layer_tensors, get_cache
from .memory import PeakMemory

__all__ = ["BenchPoint", "benchmark_decode", "cache_kwarg", "decode_run"]

logger = logging.getLogger(__name__)


@dataclass
class BenchPoint:
    context_len: int
    batch_size: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    peak_memory_bytes: int | None
    memory_kind: str  # "cuda_allocated" or "cpu_rss"
    cache_bytes: int  # cache tensors after the last step

    def to_dict(self) -> dict:
        return asdict(self)


def _forward_params(model) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def cache_kwarg(model) -> str:
    """Name of the cache argument of ``model.forward``: ``cache`` (transformers 5) or ``past_key_values``."""
    params = _forward_params(model)
    return "cache" if "cache" in params else "past_key_values"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_run(
    model,
    context_len: int,
    batch_size: int,
    new_tokens: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> BenchPoint:
    """Prefill ``context_len`` tokens for ``batch_size`` sequences, then decode ``new_tokens`` steps."""
    if context_len < 1 or batch_size < 1 or new_tokens < 1:
        raise ValueError(
            f"context_len, batch_size and new_tokens must be >= 1, got {context_len}, {batch_size}, {new_tokens}"
        )
    device = torch.device(device)
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, context_len), generator=generator).to(device)
    params = _forward_params(model)
    cache_name = "cache" if "cache" in params else "past_key_values"
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    with PeakMemory(device) as mem:
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, **extra)
        cache = get_cache(out)
        token = out.logits[:, -1:].argmax(-1)  # (B, 1)
        _sync(device)
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(input_ids=token, use_cache=True, **{cache_name: cache})
            cache = get_cache(out)
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        t2 = time.perf_counter()
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache_layer_tensors(cache) for t in layer)
    del out, cache
    decode_s = t2 - t1
    return BenchPoint(
        context_len=context_len,
        batch_size=batch_size,
        new_tokens=new_tokens,
        prefill_s=t1 - t0,
        decode_s=decode_s,
        decode_tokens_per_s=batch_size * new_tokens / decode_s if decode_s > 0 else float("inf"),
        peak_memory_bytes=mem.peak_bytes,
        memory_kind=mem.kind,
        cache_bytes=int(cache_bytes),
    )


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def benchmark_decode(
    model,
    context_lengths: list[int],
    batch_sizes: list[int],
    new_tokens: int = 32,
    device: str | torch.device = "cpu",
    warmup: int = 1,
    seed: int = 0,
    progress: bool = True,
    desc: str = "bench",
) -> list[BenchPoint]:
    """One :class:`BenchPoint` per (context length, batch size), after ``warmup`` short runs."""
    device = torch.device(device)
    if hasattr(model, "eval"):
        model.eval()
    for _ in range(warmup):
        decode_run(model, min(8, min(context_lengths)), 1, 2, device, seed)
    _release(device)
    points = []
    grid = [(c, b) for c in context_lengths for b in batch_sizes]
    for context_len, batch_size in tqdm(grid, desc=desc, unit="run", disable=not progress, leave=False):
        point = decode_run(model, context_len, batch_size, new_tokens, device, seed)
        logger.info(
            "%s: context %d batch %d: %.1f tok/s, peak %s bytes",
            desc,
            context_len,
            batch_size,
            point.decode_tokens_per_s,
            point.peak_memory_bytes,
        )
        points.append(point)
        _release(device)
    return points
