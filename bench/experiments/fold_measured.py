"""Each FreqFold's measured attention error, layer by layer: can the calibration data pick the fold?

    cd bench && python experiments/fold_measured.py --source /tmp/qwen2-small --kv-budget 0.3125
    cd bench && python experiments/fold_measured.py --source default --kv-budget 0.1875 --calib-samples 128

The default conversion's ranks and shared d_R are taken at --kv-budget (fisher allocation, the closed form).
Then every layer is converted again at each candidate fold (the divisors of head_dim/2 up to --max-fold),
at its planned rank and at the full latent rank, and each conversion's attention output is compared with the
source attention's on the first --held sequences of the source stream (sequences the statistics were taken
from too, as a rule in the converter would see them): the relative error sum ||a' - a||^2 / sum ||a||^2.
Printed per layer and summed; the fold whose summed error is least is what a measured rule would choose,
to set beside the perplexity that bench/quality_ablation.py measures at each fold (docs/results.md, "The fold
rule"). Closed form only: the value refit the default runs after it is not applied here.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlakit.arch.families import attention_shape  # noqa: E402
from mlakit.arch.names import LAYER_PREFIX  # noqa: E402
from mlakit.convert.assemble import mla_config, read_attention  # noqa: E402
from mlakit.convert.calibration import BATCH_SIZE  # noqa: E402
from mlakit.convert.compress import compress_layer  # noqa: E402
from mlakit.convert.layer_metrics import layer_metrics  # noqa: E402
from mlakit.convert.refine import attention_output  # noqa: E402
from mlakit.convert.rope_select import auto_fold  # noqa: E402
from mlakit.io.source import open_source  # noqa: E402
from mlakit.pipeline.api import ConvertOptions, calibration_ids, method_of  # noqa: E402
from mlakit.pipeline.layer_runner import MLALayers, SourceLayers  # noqa: E402
from mlakit.pipeline.whole_model import build_layers, calibrate  # noqa: E402


@torch.no_grad()
def attention(block, run, hidden: torch.Tensor) -> torch.Tensor:
    return torch.cat([attention_output(block, run, hidden[s : s + BATCH_SIZE])
                      for s in range(0, hidden.shape[0], BATCH_SIZE)])


@torch.no_grad()
def source_layers(source, shape, ids: torch.Tensor):
    """Per layer I of SOURCE: (I, its tensors, its input on the sequences IDS (sequences, tokens), the source
    attention's output on that input); the source stream advances through the layer after each."""
    src = SourceLayers(source.config, shape.window)
    hidden = torch.nn.functional.embedding(ids, source.tensor("model.embed_tokens.weight").float())
    for i in range(source.config.num_hidden_layers):
        prefix = LAYER_PREFIX.format(i=i)
        tensors = {k: source.tensor(k) for k in source.tensor_names() if k.startswith(prefix)}
        layer = src.layer(i, tensors)
        yield i, tensors, hidden, attention(layer, src.run, hidden)
        hidden = torch.cat([src.run(layer, hidden[s : s + BATCH_SIZE]) for s in range(0, hidden.shape[0], BATCH_SIZE)])


def held_ids(source, opts, held: int) -> torch.Tensor:
    """The first HELD calibration sequences of OPTS: those a rule in the converter measures on."""
    return calibration_ids(source, opts, source.config.vocab_size)[:held]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="default")
    ap.add_argument("--kv-budget", type=float, default=0.3125)
    ap.add_argument("--calib-samples", type=int, default=256)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--held", type=int, default=16, help="sequences the attention error is measured on")
    ap.add_argument("--max-fold", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    source = open_source(args.source)
    shape = attention_shape(source.config)
    opts = ConvertOptions(kv_budget=args.kv_budget, calib_samples=args.calib_samples,
                          calib_seq_len=args.calib_seq_len, quiet=True)
    n = source.config.num_hidden_layers
    ws = [read_attention(source, i, shape) for i in range(n)]
    ms = [layer_metrics(w, st) for w, st in zip(ws, calibrate(source, shape, opts))]
    _, plan = build_layers(ws, ms, shape, opts)
    ranks, rope_dim = plan["ranks"], plan["rope_dim"]
    method = method_of(opts, shape)
    half = shape.head_dim // 2
    folds = [f for f in range(1, min(args.max_fold, half) + 1) if half % f == 0]
    print(f"d_R {rope_dim}, auto fold {auto_fold(half, rope_dim // 2)}; ranks {ranks}")

    full_rank = 2 * shape.num_kv_heads * shape.head_dim - rope_dim
    totals = {(f, r): 0.0 for f in folds for r in ("planned", "full")}
    print("layer | " + " | ".join(f"fold {f} planned / full" for f in folds))
    for i, tensors, hidden, target in source_layers(source, shape, held_ids(source, opts, args.held)):
        ref = float(target.double().square().sum())
        cells = []
        for f in folds:
            errs = []
            for kind, rank in (("planned", ranks[i]), ("full", full_rank)):
                mla = compress_layer(ws[i], ms[i], replace(method, fold=f), rope_dim, rank)
                infos = [SimpleNamespace(kv_lora_rank=rank if j == i else ranks[j], rope_dim=rope_dim,
                                         freq_index=list(mla.freq_index)) for j in range(n)]
                runner = MLALayers(mla_config(source.config, shape, infos, torch.float32))
                block = runner.converted(i, mla, tensors, shape.qkv_bias)
                err = float((attention(block, runner.run, hidden) - target).double().square().sum()) / ref
                totals[f, kind] += err
                errs.append(f"{err:.4f}")
            cells.append(" / ".join(errs))
        print(f"{i} | " + " | ".join(cells), flush=True)
    print("sum | " + " | ".join(f"{totals[f, 'planned']:.4f} / {totals[f, 'full']:.4f}" for f in folds))


if __name__ == "__main__":
    main()
