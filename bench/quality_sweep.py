"""Quality sweep: every method combination at several KV budgets, perplexity relative to the source.

    python bench/quality_sweep.py --out runs/quality_sweep            # SmolLM2-135M, offline text

Calibrates once (builtin calibration text, 128 x 256 tokens by default), then for every budget
and method row builds the converted model in memory and scores it on the builtin evaluation
text (disjoint from the calibration text) with the same token ids as the source. Every row
uses the default rope dims at that budget (``budget_rope_dim``; the stock-form row the nearest
rope dims it can express), so rows differ only in method. Each row's ratio comes with a 95%
interval from a bootstrap over the evaluation windows, and every row is compared with the
default row on the same windows (paired). Writes sweep.json, sweep.md and ppl_vs_budget.png
to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from window_bootstrap import ScoredText

from mlakit.arch.families import attention_shape
from mlakit.convert.assemble import mla_config, read_attention
from mlakit.convert.layer_metrics import layer_metrics
from mlakit.convert.rank_plan import FISHER_STEP, budget_rope_dim
from mlakit.data import load_text, tokenize_text
from mlakit.io.source import open_source
from mlakit.mla_model import MLAForCausalLM
from mlakit.pipeline.api import ConvertOptions
from mlakit.pipeline.whole_model import assemble_state, build_layers, calibrate

ROWS = {  # name -> (rope method, low-rank method, allocation, stock-form rope, fisher step)
    "TransMLA (RoRoPE+FreqFold, BKV-PCA), uniform": ("transmla", "bkv_pca", "uniform", False, None),
    "MHA2MLA (2-norm, joint SVD), uniform": ("norm", "svd", "uniform", False, None),
    "scored RoPE + BKV-PCA, uniform": ("scored", "bkv_pca", "uniform", False, None),
    "TransMLA RoPE + RRR, uniform": ("transmla", "rrr", "uniform", False, None),
    "mlakit default closed form (before --refine auto): scored RoPE + auto low rank, fisher ranks (half step)": ("scored", "auto", "fisher", False, FISHER_STEP),
    "scored RoPE + auto low rank, uniform ranks (--allocation uniform)": ("scored", "auto", "uniform", False, None),
    "scored RoPE + auto low rank, log-error ranks (--allocation planned)": ("scored", "auto", "planned", False, None),
    "scored RoPE + auto low rank, fisher ranks, full step (ablation)": ("scored", "auto", "fisher", False, 1.0),
    "scored RoPE + auto low rank, stock-form rope for the deepseek-v3 export (--stock-rope)": ("scored", "auto", "uniform", True, None),
    "scored RoPE + RRR at every budget, fisher ranks (--lowrank-method rrr)": ("scored", "rrr", "fisher", False, FISHER_STEP),
}
DEFAULT_ROW = "mlakit default closed form (before --refine auto): scored RoPE + auto low rank, fisher ranks (half step)"


def build_model(source, shape, layers):
    config = mla_config(source.config, shape, layers, torch.float32)
    model = MLAForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(assemble_state(source, shape, layers, torch.float32), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def write(out: Path, args, base: float, ids, windows: int, names: list[str], results: list[dict], seconds: int,
          complete: bool) -> str:
    """sweep.json and sweep.md of the rows measured so far (after every row, so a run stopped early keeps them);
    returns the table."""
    meta = {"source": args.source, "source_ppl": base, "eval_tokens": int(ids.numel()), "eval_data": args.eval_data,
            "seq_len": args.seq_len, "stride": args.stride, "calib_samples": args.calib_samples,
            "calib_seq_len": args.calib_seq_len, "seconds": seconds, "complete": complete}
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    budgets = sorted({r["budget"] for r in results}, reverse=True)
    lines = ["| method | " + " | ".join(f"{b:g} ({1 - b:.2%} less KV)" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for name in names:
        cells = []
        for b in budgets:
            row = next((r for r in results if r["budget"] == b and r["method"] == name), None)
            if row is None:  # not measured (yet)
                cells.append("–")
                continue
            best = min(r["ppl_ratio"] for r in results if r["budget"] == b)
            cell = f"{row['ppl_ratio']:.2f}"
            cell = f"**{cell}**" if math.isclose(row["ppl_ratio"], best) else cell
            if row.get("vs_default_ci95"):
                lo, hi = row["vs_default_ci95"]
                cell += f" ({row['vs_default']:.3f}× default, {lo:.3f}–{hi:.3f})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (out / "sweep.md").write_text(f"Perplexity ratio (converted / source, source ppl {base:.3f}); "
                                  f"{ids.numel()} eval tokens of {args.eval_data}, window {args.seq_len}, "
                                  f"stride {args.stride}. "
                                  f"In parentheses: perplexity relative to the default row on the same windows, "
                                  f"with a 95% interval from {args.bootstrap} bootstrap resamples of the "
                                  f"{windows} windows. Whole run {seconds} s"
                                  + ("." if complete else
                                     ", stopped or still running: only the rows measured so far.")
                                  + f"\n\n{table}\n")
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="default")
    ap.add_argument("--budgets", default="0.5,0.3125,0.1875,0.125")
    ap.add_argument("--rows", default="all", help="comma-separated row numbers (1-based) or 'all'")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--eval-data", default="builtin",
                    help="evaluation text: builtin (disjoint from the calibration text) or a local text file")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--out", default="runs/quality_sweep")
    ap.add_argument("--bootstrap", type=int, default=2000,
                    help="bootstrap resamples of the evaluation windows for the 95%% intervals (0 = none)")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    source = open_source(args.source)
    shape = attention_shape(source.config)
    tokenizer = source.tokenizer()
    ids = tokenize_text(tokenizer, load_text(args.eval_data, "eval"))[: args.eval_tokens]

    text = ScoredText(ids, args.seq_len, args.stride, args.bootstrap)
    window_sums, interval = text.sums, text.interval

    src_sums = window_sums(source.load_model(torch.float32))
    base = text.ratio(src_sums)
    print(f"source perplexity {base:.4f} on {ids.numel()} tokens", flush=True)
    opts = ConvertOptions(calib="builtin", calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len,
                          kv_budget=1.0, allocation="fisher", quiet=True)  # also measures the sensitivities
    ws = [read_attention(source, i, shape) for i in range(source.config.num_hidden_layers)]
    ms = [layer_metrics(w, st) for w, st in zip(ws, calibrate(source, shape, opts))]
    print(f"calibrated in {time.time() - t0:.0f} s", flush=True)

    names = list(ROWS)
    if args.rows != "all":
        names = [names[int(i) - 1] for i in args.rows.split(",")]
    per_layer_src = 2 * shape.num_kv_heads * shape.head_dim
    results, sum_by_row = [], {}
    # the default row runs first, so the others can be paired with it on the same windows
    run_order = sorted(names, key=lambda n: n != DEFAULT_ROW)
    for frac in [float(b) for b in args.budgets.split(",")]:
        per_layer = round(frac * per_layer_src)
        for name in run_order:
            rope, low, allocation, stock, step = ROWS[name]
            d_r = budget_rope_dim(shape.num_kv_heads, shape.head_dim, per_layer, stock)
            o = ConvertOptions(kv_budget=frac, allocation=allocation, rope_method=rope, lowrank_method=low,
                               stock_rope=stock)
            t = time.time()
            layers, _ = build_layers(ws, ms, shape, o, fisher_step=step or FISHER_STEP)
            sums = window_sums(build_model(source, shape, layers))
            p = text.ratio(sums)
            row = {"budget": frac, "values_per_token_per_layer": per_layer, "kv_reduction": round(1 - frac, 4),
                   "method": name, "rope_dim": d_r, "ranks": [lay.kv_lora_rank for lay in layers],
                   "ppl": p, "ppl_ratio": p / base, "ratio_ci95": interval(sums - src_sums),
                   "seconds": round(time.time() - t, 1)}
            if name != DEFAULT_ROW and DEFAULT_ROW in sum_by_row.get(frac, {}):
                # paired over the same windows: this row's perplexity / the default row's
                row["vs_default"] = p / text.ratio(sum_by_row[frac][DEFAULT_ROW])
                row["vs_default_ci95"] = interval(sums - sum_by_row[frac][DEFAULT_ROW])
            sum_by_row.setdefault(frac, {})[name] = sums
            results.append(row)
            print(f"{frac:<7} {name:48s} ppl {p:9.3f}  ratio {p / base:7.3f}  CI {row['ratio_ci95']}  "
                  f"vs default {row.get('vs_default')} CI {row.get('vs_default_ci95')}", flush=True)
            write(out, args, base, ids, len(text.windows), names, results, round(time.time() - t0), False)

    table = write(out, args, base, ids, len(text.windows), names, results, round(time.time() - t0), True)
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in names:
            pts = sorted((r["budget"], r["ppl_ratio"]) for r in results if r["method"] == name)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
        ax.set_xlabel("KV budget (fraction of source cache)")
        ax.set_ylabel("perplexity ratio")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "ppl_vs_budget.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
