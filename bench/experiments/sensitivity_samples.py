"""How many sequences the fisher allocation's sensitivity pass needs: ranks from two disjoint
sets of as many sequences as the pass reads (``calibration.sensitivity_sequences``: 8 of 256
tokens, 4 of 512) against ranks from both sets together (SmolLM2-135M, builtin calibration text).

    python bench/experiments/sensitivity_samples.py --calib-samples 64               # 64 x 512 (session 21)
    python bench/experiments/sensitivity_samples.py --calib-samples 128 --calib-seq-len 256

Measures each of the first 2n calibration sequences' per-layer sensitivities on its own, takes
the second moments from the whole calibration set, and prints the fisher ranks at two budgets
from the mean over the first n, the next n and all 2n, and the largest per-layer difference.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from mlakit.arch.families import attention_shape
from mlakit.convert import calibration
from mlakit.convert.assemble import read_attention
from mlakit.convert.layer_metrics import layer_metrics
from mlakit.convert.rank_plan import allocate_ranks, budget_layout
from mlakit.io.source import open_source
from mlakit.pipeline.api import ConvertOptions, calibration_ids, method_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib-samples", type=int, default=None, help="default: the options model's")
    ap.add_argument("--calib-seq-len", type=int, default=None, help="default: the options model's")
    args = ap.parse_args()
    sizes = {k: v for k, v in (("calib_samples", args.calib_samples), ("calib_seq_len", args.calib_seq_len)) if v}
    source = open_source("default")
    shape = attention_shape(source.config)
    model = source.load_model(torch.float32)
    opts = ConvertOptions(lowrank_method="rrr", **sizes)  # rrr as when it was first run (the ranks do not depend on it)
    ids = calibration_ids(source, opts, model.config.vocab_size)
    k = calibration.sensitivity_sequences(opts.calib_seq_len)
    per_seq = torch.tensor([
        [s.sensitivity for s in calibration.collect_stats(model, ids[i : i + 1], shape, attention_samples=0,
                                                            sensitivity_samples=1, quiet=True, seed=i)]
        for i in range(2 * k)
    ])  # (2k sequences, layers)
    print(f"calibration {opts.calib_samples} x {opts.calib_seq_len}: two sets of {k} sequences")
    stats = calibration.collect_stats(model, ids, shape, quiet=True)
    n = source.config.num_hidden_layers
    ws = [read_attention(source, i, shape) for i in range(n)]
    method = method_of(opts, shape)
    per_layer_src = 2 * shape.num_kv_heads * shape.head_dim
    for frac in (0.3125, 0.125):
        d_r, rank_budget = budget_layout(n, shape.num_kv_heads, shape.head_dim, int(frac * n * per_layer_src))
        ranks = {}
        sets = {"all": per_seq.mean(0), "first": per_seq[:k].mean(0), "second": per_seq[k:].mean(0)}
        for name, sens in sets.items():
            ms = [layer_metrics(w, dataclasses.replace(s, sensitivity=float(v))) for w, s, v in zip(ws, stats, sens)]
            ranks[name] = allocate_ranks(ws, ms, method, d_r, rank_budget, "fisher")
        print(f"budget {frac}: ranks from all {2 * k} sequences {ranks['all']}")
        for name in ("first", "second"):
            diff = [a - b for a, b in zip(ranks[name], ranks["all"])]
            print(f"  {name} {k}: largest per-layer difference {max(map(abs, diff))}, differences {diff}")


if __name__ == "__main__":
    main()
