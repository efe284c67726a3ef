"""Cost of one layer's float64 conversion math, by allocation, side by side in one run.

At large shapes with a small calibration the per-layer math (metrics from sigma, rotary selection,
the metric's Gram matrix, its eigendecomposition) rather than the forward passes sets the cost of a
conversion. Uniform allocation does it once per layer (``layer_metrics`` + ``compress_layer``);
planned and fisher allocation also need each layer's error curve before any rank is chosen, in a
statistics pass, and convert in a second pass. This bench times, on one random layer of the given
shape (random weights, a random second moment; the cost does not depend on the values):

- uniform: ``layer_metrics`` then ``compress_layer``;
- two-pass, recomputing: ``layer_metrics`` + ``error_curve``, then ``layer_metrics`` +
  ``compress_layer`` again (what the streaming driver did before it spilled its per-layer work);
- two-pass, reusing: ``layer_metrics`` + ``prepare_layer`` + ``error_curve`` from it, then
  ``compress_layer`` from the same metrics and preparation (what the driver does now; the spill to
  disk and back is not timed).

Rounds interleave the variants; the report gives medians and their ratios to uniform.

    python bench/layer_math_cost.py                  # Llama-2-7B attention shape (MHA, 32 x 128)
    python bench/layer_math_cost.py --kv-heads 8     # Llama-3-8B's GQA shape
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from child_process import cpu_name

from mlakit.convert.calibration import LayerStats
from mlakit.convert.compress import Method, compress_layer, prepare_layer
from mlakit.convert.layer_metrics import layer_metrics
from mlakit.convert.mla_layer import AttentionWeights
from mlakit.convert.rank_plan import error_curve

RESULTS = Path(__file__).resolve().parent / "results"


def random_layer(hidden: int, heads: int, kv_heads: int, head_dim: int, lags: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    X = hidden + 1

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=gen, dtype=torch.float64) / cols**0.5

    w = AttentionWeights(q=mat(heads * head_dim, X), k=mat(kv_heads * head_dim, X), v=mat(kv_heads * head_dim, X),
                         o=mat(hidden, heads * head_dim), o_bias=None, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim)
    a = mat(2 * X, X)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    lag_p2 = torch.rand(heads, lags, generator=gen, dtype=torch.float64) / lags
    return w, LayerStats(a.T @ a, lag_p2, inv_freq, 2 * X)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--lowrank", default="rrr", choices=["rrr", "bkv_pca"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--results-name", default="layer_math_cost")
    ap.add_argument("--no-write-results", action="store_true")
    args = ap.parse_args()
    w, stats = random_layer(args.hidden, args.heads, args.kv_heads, args.head_dim, lags=256)
    method, d_r, rank = Method(lowrank=args.lowrank), args.rope_dim, args.rank

    def uniform():
        compress_layer(w, layer_metrics(w, stats), method, d_r, rank)

    def recomputing():
        error_curve(w, layer_metrics(w, stats), method, d_r)
        compress_layer(w, layer_metrics(w, stats), method, d_r, rank)

    def reusing():
        m = layer_metrics(w, stats)
        prep = prepare_layer(w, m, method, d_r)
        error_curve(w, m, method, d_r, prep)
        compress_layer(w, m, method, d_r, rank, prep)

    variants = {"uniform": uniform, "two-pass, recomputing": recomputing, "two-pass, reusing": reusing}
    seconds = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            tick = time.perf_counter()
            fn()
            seconds[name].append(round(time.perf_counter() - tick, 2))
            print(name, seconds[name][-1], flush=True)
    median = {name: round(statistics.median(v), 2) for name, v in seconds.items()}
    ratio = {name: round(v / median["uniform"], 3) for name, v in median.items()}
    result = {"setup": {k: v for k, v in vars(args).items() if k != "no_write_results"}
              | {"cpu": cpu_name(), "machine": platform.machine(), "cpus": os.cpu_count(),
                 "torch_threads": torch.get_num_threads()},
              "seconds": seconds, "median": median, "ratio_to_uniform": ratio}
    print(json.dumps({"median": median, "ratio_to_uniform": ratio}))
    if args.no_write_results:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.results_name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# One layer's float64 conversion math, by allocation",
        "",
        f"Random layer: hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV) of {args.head_dim}, "
        f"--rope-dim {args.rope_dim}, rank {args.rank}, {args.lowrank}; {torch.get_num_threads()} torch threads "
        f"on {os.cpu_count()} CPUs, {args.rounds} interleaved rounds.",
        "Command: `python bench/layer_math_cost.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| variant | seconds per round | median | ratio to uniform |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {name} | {', '.join(map(str, v))} | {median[name]} | {ratio[name]} |" for name, v in seconds.items()]
    (RESULTS / f"{args.results_name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
