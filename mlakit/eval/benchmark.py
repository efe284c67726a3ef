"""Benchmark decode speed and memory of an original model and its conversion; build the report dict."""

from __future__ import annotations

import gc
import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from .decode_bench import benchmark_decode
from .kv_accounting import account_kv, kv_reduction
from .loading import load_converted_model, load_original_model, read_conversion, resolve_device, resolve_dtype

__all__ = ["BenchSettings", "bench_figures", "run_bench"]

logger = logging.getLogger(__name__)


@dataclass
class BenchSettings:
    original: str
    converted: str
    context_lengths: list[int] = field(default_factory=lambda: [128, 512, 1024])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    new_tokens: int = 32
    device: str = "auto"
    dtype: str = "auto"
    warmup: int = 1
    seed: int = 0
    progress: bool = True


def _bench_one(model, label: str, path: str, s: BenchSettings, device) -> dict:
    max_pos = getattr(model.config, "max_position_embeddings", None)
    longest = max(s.context_lengths) + s.new_tokens
    if isinstance(max_pos, int) and longest > max_pos:
        raise ValueError(
            f"context {max(s.context_lengths)} + {s.new_tokens} new tokens exceeds the {label} model's "
            f"max_position_embeddings {max_pos}; lower --context-lengths or --new-tokens"
        )
    points = benchmark_decode(
        model,
        s.context_lengths,
        s.batch_sizes,
        s.new_tokens,
        device,
        s.warmup,
        s.seed,
        s.progress,
        f"bench {label}",
    )
    kv = account_kv(model, device=device)
    return {
        "label": label,
        "path": str(path),
        "architecture": type(model).__name__,
        "kv_bytes_per_token": kv.bytes_per_token,
        "kv_values_per_token": kv.values_per_token,
        "kv": kv.to_dict(),
        "results": [p.to_dict() for p in points],
    }


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_bench(s: BenchSettings) -> dict:
    if not s.context_lengths or not s.batch_sizes or min(s.context_lengths) < 1 or min(s.batch_sizes) < 1:
        raise ValueError("context lengths and batch sizes must be non-empty lists of integers >= 1")
    if s.new_tokens < 1:
        raise ValueError(f"new tokens must be >= 1, got {s.new_tokens}")
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    converted_path = Path(s.converted).expanduser()
    model, _ = load_original_model(s.original, dtype, device)
    original = _bench_one(model, "original", s.original, s, device)
    del model
    _free(device)
    model = load_converted_model(converted_path, dtype, device)
    converted = _bench_one(model, "converted", str(converted_path), s, device)
    del model
    _free(device)
    comparison = []
    for o, c in zip(original["results"], converted["results"]):
        comparison.append(
            {
                "context_len": o["context_len"],
                "batch_size": o["batch_size"],
                "original_tokens_per_s": o["decode_tokens_per_s"],
                "converted_tokens_per_s": c["decode_tokens_per_s"],
                "speedup": c["decode_tokens_per_s"] / o["decode_tokens_per_s"],
                "original_peak_memory_bytes": o["peak_memory_bytes"],
                "converted_peak_memory_bytes": c["peak_memory_bytes"],
                "original_cache_bytes": o["cache_bytes"],
                "converted_cache_bytes": c["cache_bytes"],
            }
        )
    reduction = kv_reduction(original["kv_bytes_per_token"], converted["kv_bytes_per_token"])
    return {
        "kind": "bench",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {**asdict(s), "device": str(device), "dtype": str(dtype).removeprefix("torch.")},
        "memory_kind": "cuda_allocated" if device.type == "cuda" else "cpu_rss",
        "original": original,
        "converted": converted,
        "kv_reduction": reduction,
        "kv_reduction_pct": 100.0 * reduction,
        "comparison": comparison,
        "conversion": read_conversion(converted_path),
        "plots": ["bench.png"],
    }


def bench_figures(report: dict) -> dict:
    from .plots import bench_figure

    return {
        "bench.png": bench_figure(
            {m["label"]: m["results"] for m in (report["original"], report["converted"])}
        )
    }
