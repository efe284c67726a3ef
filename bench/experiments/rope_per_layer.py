"""Rope dims per layer chosen from the fisher KL curves, against the default shared d_R
(SmolLM2-135M, perplexity ratio to the source on an evaluation text).

    python bench/experiments/rope_per_layer.py --eval-data /usr/share/common-licenses/GPL-3 --budgets 0.125

For each budget, three conversions from one calibration:
- default: shared d_R (``budget_rope_dim``) and the damped fisher ranks;
- per-layer d_R at the default's totals: each layer keeps its r + d_R and takes the d_R, from
  8 up to twice the default, whose predicted KL is least;
- envelope: each layer's best-d_R curve over its total values, the damped fisher step from the
  uniform totals toward the KL optimum of those curves.
Scored as in bench/quality_sweep.py (8192 tokens, window 512, stride 448). The latent is RRR at
every budget, as when this ran (before ``--lowrank-method auto``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quality_sweep import build_model  # noqa: E402

from mlakit.arch.families import attention_shape  # noqa: E402
from mlakit.convert.assemble import read_attention  # noqa: E402
from mlakit.convert.compress import compress_layer  # noqa: E402
from mlakit.convert.layer_metrics import layer_metrics  # noqa: E402
from mlakit.convert.rank_plan import FISHER_STEP, kl_curve, plan_ranks, spend_leftovers  # noqa: E402
from mlakit.data import load_text, tokenize_text  # noqa: E402
from mlakit.eval.perplexity import sliding_windows, window_nll  # noqa: E402
from mlakit.io.source import open_source  # noqa: E402
from mlakit.pipeline.api import ConvertOptions, method_of  # noqa: E402
from mlakit.pipeline.whole_model import build_layers, calibrate  # noqa: E402


def envelope(curves: dict[int, torch.Tensor], v_max: int, min_rank: int = 4):
    """Least predicted KL at each total v = d_R + r over the candidate d_R, and the d_R that gives it."""
    best = torch.full((v_max + 1,), math.inf, dtype=torch.float64)
    arg = [None] * (v_max + 1)
    for d_r, curve in curves.items():
        for r in range(min_rank, curve.shape[0]):
            if d_r + r <= v_max and float(curve[r]) < float(best[d_r + r]):
                best[d_r + r], arg[d_r + r] = curve[r], d_r
    finite = torch.isfinite(best)
    return torch.where(finite, best, 10 * best[finite].max()), arg  # unreachable totals: never worth a value


def best_rope_at(curves: dict[int, torch.Tensor], total: int) -> int:
    """The candidate d_R of least predicted KL when d_R + r = TOTAL."""
    fits = [c for c, curve in curves.items() if 0 <= total - c < curve.shape[0]]
    return min(fits, key=lambda c: float(curves[c][total - c]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-data", default="builtin")
    ap.add_argument("--budgets", default="0.125,0.3125")
    args = ap.parse_args()
    torch.manual_seed(0)
    source = open_source("default")
    shape = attention_shape(source.config)
    ids = tokenize_text(source.tokenizer(), load_text(args.eval_data, "eval"))[:8192]
    windows = sliding_windows(int(ids.numel()), 512, 448)
    scored = sum(w.n_scored for w in windows)

    def ppl(model):
        model.eval()
        nll = torch.cat([window_nll(model, ids, windows[i : i + 4], "cpu") for i in range(0, len(windows), 4)])
        return math.exp(float(nll.sum()) / scored)

    base = ppl(source.load_model(torch.float32))
    opts = ConvertOptions(calib="builtin", kv_budget=1.0, allocation="fisher", quiet=True)
    n = source.config.num_hidden_layers
    ws = [read_attention(source, i, shape) for i in range(n)]
    ms = [layer_metrics(w, st) for w, st in zip(ws, calibrate(source, shape, opts))]
    method = method_of(opts, shape)
    v_max = 2 * shape.num_kv_heads * shape.head_dim
    for frac in (float(b) for b in args.budgets.split(",")):
        budget = int(frac * n * v_max)
        layers, plan = build_layers(ws, ms, shape, ConvertOptions(kv_budget=frac, lowrank_method="rrr"))
        d0, ranks = plan["rope_dim"], plan["ranks"]
        candidates = list(range(8, min(2 * d0, budget // n), 8))
        curves = {c: [kl_curve(w, m, method, c) for w, m in zip(ws, ms)] for c in candidates}

        fixed = [best_rope_at({c: curves[c][i] for c in candidates}, r + d0) for i, r in enumerate(ranks)]
        fixed_layers = [compress_layer(w, m, method, c, r + d0 - c) for w, m, c, r in zip(ws, ms, fixed, ranks)]
        envs = [envelope({c: curves[c][i] for c in candidates}, v_max) for i in range(n)]
        uniform = [d0 + (budget - n * d0) // n] * n
        optimal = plan_ranks([e for e, _ in envs], budget, min_rank=12)
        totals = spend_leftovers([e for e, _ in envs],
                                 [u + math.floor(FISHER_STEP * (o - u)) for u, o in zip(uniform, optimal)], budget)
        picked = [arg[v] for (_, arg), v in zip(envs, totals)]
        env_layers = [compress_layer(w, m, method, c, v - c) for w, m, c, v in zip(ws, ms, picked, totals)]
        print(f"budget {frac}: default (d_R {d0}) {ppl(build_model(source, shape, layers)) / base:.3f} | "
              f"per-layer d_R at the default's totals {ppl(build_model(source, shape, fixed_layers)) / base:.3f} "
              f"{fixed} | envelope, damped {ppl(build_model(source, shape, env_layers)) / base:.3f} {picked}",
              flush=True)


if __name__ == "__main__":
    main()
