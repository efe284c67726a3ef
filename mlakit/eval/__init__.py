"""Evaluation of converted models: perplexity, KV-cache accounting, decode benchmark, reports.

Pieces usable on their own (``perplexity``, ``account_kv``, ``benchmark_decode``,
``greedy_continuations``) and the two orchestrations behind ``mla-convert eval`` and
``mla-convert bench`` (``run_eval``, ``run_bench``), whose report dicts
``write_report_dir`` writes with ``eval_markdown`` / ``bench_markdown`` and the figures.
"""

from __future__ import annotations

from .benchmark import BenchSettings, bench_figures, run_bench
from .decode_bench import BenchPoint, benchmark_decode
from .evaluate import EvalSettings, eval_figures, run_eval
from .kv_accounting import (
    KVAccount,
    account_kv,
    config_kv_values_per_layer,
    kv_reduction,
    measure_kv_per_layer,
)
from .markdown import bench_markdown, eval_markdown
from .perplexity import PerplexityResult, Window, sliding_window_perplexity, sliding_windows
from .report import write_report_dir
from .samples import DEFAULT_PROMPTS, greedy_continuations

__all__ = [
    "BenchPoint",
    "BenchSettings",
    "DEFAULT_PROMPTS",
    "EvalSettings",
    "KVAccount",
    "PerplexityResult",
    "Window",
    "account_kv",
    "bench_figures",
    "bench_markdown",
    "benchmark_decode",
    "config_kv_values_per_layer",
    "eval_figures",
    "eval_markdown",
    "greedy_continuations",
    "kv_reduction",
    "measure_kv_per_layer",
    "sliding_window_perplexity",
    "run_bench",
    "run_eval",
    "sliding_windows",
    "write_report_dir",
]
