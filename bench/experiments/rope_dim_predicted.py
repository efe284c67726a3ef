"""The closed form's predicted KL at each shared rope dim d_R, per budget: what a rule reading the calibration
statistics alone would choose, to set beside the measured ratios (docs/results.md, "A second model family").

    python bench/experiments/rope_dim_predicted.py --source default                 # SmolLM2-135M
    python bench/experiments/rope_dim_predicted.py --source /tmp/qwen2-small        # bench/train_qwen2.py's model
    python bench/experiments/rope_dim_predicted.py --source /tmp/qwen2-small --fold 4 --budgets 0.3125

For every candidate d_R (multiples of 8 up to the key width G d, at most 80) the latent budget left is split
over the layers as the fisher planner splits it (``plan_ranks`` on ``kl_curve``: undamped), and the summed
predicted KL is printed, with the part the rotary split alone costs (each curve at the full latent). These
are closed-form predictions: they do not see the value refit the default runs after the closed form. --fold
sets FreqFold for every d_R (default 0: the auto fold of each), to set the model's view of the fold beside the
measured one (docs/results.md, "The fold rule").
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from mlakit.arch.families import attention_shape
from mlakit.convert.assemble import read_attention
from mlakit.convert.layer_metrics import layer_metrics
from mlakit.convert.rank_plan import kl_curve, plan_ranks
from mlakit.io.source import open_source
from mlakit.pipeline.api import ConvertOptions, budget_values, method_of
from mlakit.pipeline.whole_model import calibrate

MIN_RANK = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="default")
    ap.add_argument("--budgets", default="0.5,0.3125,0.1875,0.125")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--fold", type=int, default=0, help="FreqFold of every d_R (default 0: auto)")
    args = ap.parse_args()
    source = open_source(args.source)
    shape = attention_shape(source.config)
    opts = ConvertOptions(kv_budget=1.0, allocation="fisher", quiet=True, calib_samples=args.calib_samples,
                          calib_seq_len=args.calib_seq_len, fold=args.fold)
    n = source.config.num_hidden_layers
    ws = [read_attention(source, i, shape) for i in range(n)]
    ms = [layer_metrics(w, st) for w, st in zip(ws, calibrate(source, shape, opts))]
    method = method_of(opts, shape)
    candidates = list(range(8, min(shape.num_kv_heads * shape.head_dim, 80) + 1, 8))
    curves = {c: [kl_curve(w, m, method, c) for w, m in zip(ws, ms)] for c in candidates}
    print("budget | d_R: predicted KL (of which the rotary split)")
    for frac in (float(b) for b in args.budgets.split(",")):
        budget = budget_values(replace(opts, kv_budget=frac), shape, n)
        cells = []
        for c in candidates:
            if budget - n * c < MIN_RANK * n:
                continue
            ranks = plan_ranks(curves[c], budget - n * c, min_rank=MIN_RANK)
            total = sum(float(curve[r]) for curve, r in zip(curves[c], ranks))
            rope = sum(float(curve[-1]) for curve in curves[c])
            cells.append(f"{c}: {total:.4f} ({rope:.4f})")
        print(f"{frac} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
