"""How many sequences the fisher allocation's sensitivity pass needs: ranks from two disjoint
sets of 8 sequences against ranks from all 16 (SmolLM2-135M, builtin calibration text).

    python bench/experiments/sensitivity_samples.py        # about 3 minutes on 2 cores

Measures each of the first 16 calibration sequences' per-layer sensitivities on its own, takes
the second moments from the whole calibration set, and prints the fisher ranks at two budgets
from the mean over sequences 0-7, 8-15 and 0-15, and the largest per-layer difference.
"""

from __future__ import annotations

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
    source = open_source("default")
    shape = attention_shape(source.config)
    model = source.load_model(torch.float32)
    opts = ConvertOptions(lowrank_method="rrr")  # as when it was run (the ranks do not depend on it)
    ids = calibration_ids(source, opts, model.config.vocab_size)
    per_seq = torch.tensor([
        [s.sensitivity for s in calibration.collect_stats(model, ids[i : i + 1], shape, attention_samples=0,
                                                            sensitivity_samples=1, quiet=True, seed=i)]
        for i in range(16)
    ])  # (16 sequences, layers)
    stats = calibration.collect_stats(model, ids, shape, quiet=True)
    n = source.config.num_hidden_layers
    ws = [read_attention(source, i, shape) for i in range(n)]
    method = method_of(opts, shape)
    per_layer_src = 2 * shape.num_kv_heads * shape.head_dim
    for frac in (0.3125, 0.125):
        d_r, rank_budget = budget_layout(n, shape.num_kv_heads, shape.head_dim, int(frac * n * per_layer_src))
        ranks = {}
        for name, sens in (("all 16", per_seq.mean(0)), ("0-7", per_seq[:8].mean(0)), ("8-15", per_seq[8:].mean(0))):
            ms = [layer_metrics(w, dataclasses.replace(s, sensitivity=float(v))) for w, s, v in zip(ws, stats, sens)]
            ranks[name] = allocate_ranks(ws, ms, method, d_r, rank_budget, "fisher")
        print(f"budget {frac}: ranks from all 16 sequences {ranks['all 16']}")
        for name in ("0-7", "8-15"):
            diff = [a - b for a, b in zip(ranks[name], ranks["all 16"])]
            print(f"  sequences {name}: largest per-layer difference {max(map(abs, diff))}, differences {diff}")


if __name__ == "__main__":
    main()
