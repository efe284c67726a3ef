"""Each shared rope dim d_R's measured attention error after the value refit: can the calibration data pick d_R?

    cd bench && python experiments/rope_dim_measured.py --source /tmp/qwen2-small --kv-budget 0.3125
    cd bench && python experiments/rope_dim_measured.py --source default --kv-budget 0.3125 --calib-samples 128

d_R trades against the latent at a fixed budget: more rotary dims leave a smaller latent for the non-rotary
keys and the values. The closed form's own error model (experiments/rope_dim_predicted.py) does not see the
value refit, which gives the latent more to do. So here every layer is converted at each candidate d_R as the
default converts it: the fold measured at full rank (``fold_choice``), the latent at the uniform rank the
budget leaves (per-layer budget - d_R), then the value refit (``refit_values``) from moments on the first
--held sequences of the source stream. Its held-out (cross-validated) relative attention error is summed
over the layers, with the closed form's error before the refit (on the first batch of sequences, where the
refit's report measures it) and the refit's in-sample error beside it.
The d_R whose summed held-out error is least is what a measured rule would choose, to set beside the
perplexity bench/quality_ablation.py measures at each d_R (docs/results.md, "The rotary share").
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fold_measured import attention, held_ids, source_layers  # noqa: E402

from mlakit.arch.families import attention_shape  # noqa: E402
from mlakit.convert.assemble import mla_config, read_attention  # noqa: E402
from mlakit.convert.calibration import BATCH_SIZE  # noqa: E402
from mlakit.convert.compress import compress_layer  # noqa: E402
from mlakit.convert.fold_choice import choose_fold, fold_candidates  # noqa: E402
from mlakit.convert.layer_metrics import layer_metrics  # noqa: E402
from mlakit.convert.refine_values import ValueMoments, add_batch, refit_values  # noqa: E402
from mlakit.io.source import open_source  # noqa: E402
from mlakit.pipeline.api import ConvertOptions, method_of  # noqa: E402
from mlakit.pipeline.layer_runner import MLALayers  # noqa: E402
from mlakit.pipeline.settings import budget_values  # noqa: E402
from mlakit.pipeline.whole_model import calibrate  # noqa: E402


def batches(hidden: torch.Tensor):
    return ((s, hidden[s : s + BATCH_SIZE]) for s in range(0, hidden.shape[0], BATCH_SIZE))


def relative_error(block, run, hidden: torch.Tensor, target: torch.Tensor) -> float:
    return float((attention(block, run, hidden) - target).double().square().sum()) / float(
        target.double().square().sum())


def converted(source, shape, i: int, tensors: dict, w, metrics, method, rope_dim: int, fold: int, rank: int):
    """Layer I converted at ROPE_DIM, FOLD and RANK (float32), and the runner that runs it."""
    mla = compress_layer(w, metrics, replace(method, fold=fold), rope_dim, rank)
    n = source.config.num_hidden_layers
    infos = [SimpleNamespace(kv_lora_rank=rank, rope_dim=rope_dim, freq_index=list(mla.freq_index))] * n
    runner = MLALayers(mla_config(source.config, shape, infos, torch.float32))
    return runner.converted(i, mla, tensors, shape.qkv_bias), runner.run


def full_rank_error(at, full: int, hidden: torch.Tensor, target: torch.Tensor, fold: int) -> float:
    """The relative attention error of AT(FOLD, FULL): the layer at FOLD with the latent at full rank."""
    return relative_error(*at(fold, full), hidden, target)


def add_arguments(ap: argparse.ArgumentParser, calib_samples: int) -> None:
    ap.add_argument("--source", default="default")
    ap.add_argument("--kv-budget", type=float, default=0.3125)
    ap.add_argument("--candidates", default="", help="comma-separated d_R (default: multiples of 8 up to G d, "
                                                      "leaving a latent of at least 16)")
    ap.add_argument("--calib-samples", type=int, default=calib_samples)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--held", type=int, default=16, help="sequences the refit and the error are measured on")


def setup(args) -> SimpleNamespace:
    """The source, its options at --kv-budget, the candidate d_R and every layer's weights and statistics."""
    torch.manual_seed(0)
    source = open_source(args.source)
    shape = attention_shape(source.config)
    n = source.config.num_hidden_layers
    opts = ConvertOptions(kv_budget=args.kv_budget, calib_samples=args.calib_samples,
                          calib_seq_len=args.calib_seq_len, quiet=True)
    per_layer = budget_values(opts, shape, n) // n
    key_width = shape.num_kv_heads * shape.head_dim
    candidates = ([int(c) for c in args.candidates.split(",")] if args.candidates else
                  [c for c in range(8, key_width + 1, 8) if per_layer - c >= 16])
    ws = [read_attention(source, i, shape) for i in range(n)]
    ms = [layer_metrics(w, st) for w, st in zip(ws, calibrate(source, shape, opts))]
    return SimpleNamespace(source=source, shape=shape, opts=opts, per_layer=per_layer, candidates=candidates,
                           ws=ws, ms=ms, methods={c: method_of(replace(opts, rope_dim=c), shape) for c in candidates})


def refit_at(run_setup: SimpleNamespace, i: int, tensors: dict, c: int, hidden: torch.Tensor, target: torch.Tensor):
    """Layer I at d_R C as the default converts it: the fold measured at full rank on HIDDEN, the latent at the
    uniform rank, the value refit from moments on HIDDEN. Returns (fold, block, runner, refit report, the
    closed form's error, the refit's held-out error)."""
    st = run_setup
    at = partial(converted, st.source, st.shape, i, tensors, st.ws[i], st.ms[i], st.methods[c], c)
    full = 2 * st.shape.num_kv_heads * st.shape.head_dim - c
    fold, _ = choose_fold(fold_candidates(st.shape.head_dim, c), partial(full_rank_error, at, full, hidden, target))
    block, run = at(fold, st.per_layer - c)
    moments = ValueMoments()
    for s, x in batches(hidden):
        add_batch(moments, block, run, x, target[s : s + x.shape[0]], s)
    report = refit_values(block, moments)
    closed = moments.start_loss
    held = report.get("cv_loss_refit", closed) if report["kept"] == "values refit" else \
        report.get("cv_loss_start", closed)
    return fold, block, run, report, closed, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap, calib_samples=256)
    args = ap.parse_args()
    start = time.time()
    st = setup(args)
    candidates = st.candidates
    print(f"per-layer budget {st.per_layer}; candidates {candidates}; statistics {time.time() - start:.0f} s")

    totals = {c: [0.0, 0.0, 0.0] for c in candidates}  # closed form, refit in-sample, refit held-out
    print("layer | " + " | ".join(f"d_R {c}: fold, closed / refit / held-out" for c in candidates))
    for i, tensors, hidden, target in source_layers(st.source, st.shape, held_ids(st.source, st.opts, args.held)):
        cells = []
        for c in candidates:
            fold, _, _, report, closed, held = refit_at(st, i, tensors, c, hidden, target)
            for k, v in enumerate((closed, report["loss_after"], held)):
                totals[c][k] += v
            cells.append(f"{fold}, {closed:.4f} / {report['loss_after']:.4f} / {held:.4f}")
        print(f"{i} | " + " | ".join(cells), flush=True)
    print("sum | " + " | ".join(f"{t[0]:.4f} / {t[1]:.4f} / {t[2]:.4f}" for t in totals.values()))
    best = min(candidates, key=lambda c: totals[c][2])
    print(f"least summed held-out error: d_R {best}; {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
