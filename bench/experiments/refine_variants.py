"""Which refinement steps pay for themselves: loss and seconds of refine_layer's variants on single layers.

    nice -n 5 python bench/experiments/refine_variants.py --layers 8,20 \
        --ranks-from bench/results/refine_layerwise_32x256.json

SmolLM2-135M (``default``); for each chosen layer: the source path up to it over the first
--calib-samples calibration sequences, the closed-form layer from its own statistics at the rank
and rope dims of the default conversion (read from a refine_layerwise result), then every
variant below from the same start. Reports the calibration loss each variant reaches on its own
target and on the other one (attention target: the residual stream after the attention; block
target: the layer's output, MLP included), and its seconds. Writes refine_variants.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch

from mlakit.arch.families import attention_shape
from mlakit.arch.names import LAYER_PREFIX
from mlakit.convert.assemble import mla_config, mla_layer_tensors, read_attention
from mlakit.convert.calibration import layer_accumulator
from mlakit.convert.compress import compress_layer
from mlakit.convert.layer_metrics import layer_metrics
from mlakit.convert.refine import RefineSettings, attention_residual, layer_loss, refine_layer
from mlakit.io.source import open_source
from mlakit.pipeline.api import ConvertOptions, calibration_ids, method_of
from mlakit.pipeline.layer_runner import MLALayers, SourceLayers

ADAM = dict(epochs=4.0, batch=4)  # 4 passes over the sequences, 4 per step
VARIANTS = {
    "o_proj refit": RefineSettings(epochs=0),
    "refit + Adam lr 1e-3": RefineSettings(**ADAM),
    "refit + Adam lr 3e-4": RefineSettings(**ADAM, lr=3e-4),
    "refit + Adam (q, kv only) lr 1e-3": RefineSettings(**ADAM, params=("q_proj", "kv_a_proj_with_mqa", "kv_b_proj")),
    "Adam lr 1e-3 (no refit)": RefineSettings(**ADAM, refit_o_proj=False),
    "Adam lr 3e-3 (no refit)": RefineSettings(**ADAM, refit_o_proj=False, lr=3e-3),
    "block target: Adam lr 1e-3": RefineSettings(**ADAM, loss="block", refit_o_proj=False),
    "block target: Adam lr 3e-3": RefineSettings(**ADAM, loss="block", refit_o_proj=False, lr=3e-3),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,20")
    ap.add_argument("--ranks-from", required=True, help="a refine_layerwise json (its meta has ranks and rope_dim)")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    meta = json.loads(Path(args.ranks_from).read_text())["meta"]
    ranks, rope_dim = meta["ranks"], meta["rope_dim"]
    source = open_source("default")
    shape = attention_shape(source.config)
    opts = ConvertOptions(kv_budget=meta["kv_budget"], calib_samples=args.calib_samples)
    method = method_of(opts, shape)
    ids = calibration_ids(source, opts, source.config.vocab_size)
    src = SourceLayers(source.config, shape.window)
    hidden = torch.nn.functional.embedding(ids, source.tensor("model.embed_tokens.weight").float())

    def tensors_of(i):
        return {k: source.tensor(k) for k in source.tensor_names() if k.startswith(LAYER_PREFIX.format(i=i))}

    results, done = [], 0
    for k in sorted(int(x) for x in args.layers.split(",")):
        with torch.no_grad():
            for i in range(done, k):
                hidden = src.run(src.layer(i, tensors_of(i)), hidden)
        done = k
        tensors = tensors_of(k)
        layer = src.layer(k, tensors)
        acc = layer_accumulator(layer.self_attn, src.inv_freq, shape)
        handles = acc.attach()
        with torch.no_grad():
            targets = {"attention": attention_residual(layer, src.run, hidden)}
        for h in handles:
            h.remove()
        with torch.no_grad():
            targets["block"] = src.run(layer, hidden)
        w = read_attention(source, k, shape)
        mla = compress_layer(w, layer_metrics(w, acc.result()), method, rope_dim, ranks[k])
        layers = [SimpleNamespace(kv_lora_rank=r, rope_dim=rope_dim, freq_index=list(mla.freq_index)) for r in ranks]
        runner = MLALayers(mla_config(source.config, shape, layers, torch.float32))
        out = mla_layer_tensors(k, mla, torch.float32, q_bias=shape.qkv_bias, kv_a_bias=shape.qkv_bias)
        out |= {n: t for n, t in tensors.items() if ".self_attn." not in n}
        for name, settings in VARIANTS.items():
            block = runner.layer(k, dict(out))
            tick = time.time()
            rep = refine_layer(block, runner.forward, hidden, targets[settings.loss], settings)
            seconds = time.time() - tick
            row = {"layer": k, "rank": ranks[k], "variant": name, "settings": asdict(settings) | {"params": list(settings.params)},
                   "seconds": round(seconds, 1), "steps": rep["steps"], "kept": rep["kept"]}
            for loss in ("attention", "block"):
                if loss == settings.loss:
                    row[f"{loss}_loss_before"], row[f"{loss}_loss_after"] = rep["loss_before"], rep["loss_after"]
                else:
                    row[f"{loss}_loss_after"] = layer_loss(block, runner.run, hidden, targets[loss], loss)
            results.append(row)
            print(json.dumps({k2: v for k2, v in row.items() if k2 != "settings"}), flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "refine_variants.json").write_text(json.dumps({"meta": {
        "source": "default (SmolLM2-135M)", "kv_budget": meta["kv_budget"], "rope_dim": rope_dim,
        "calib_samples": args.calib_samples, "calib_seq_len": 256, "threads": torch.get_num_threads(),
        "inputs": "source path (no compensation): the variants differ in the optimiser only"}, "results": results},
        indent=2))
    lines = [f"SmolLM2-135M at kv_budget {meta['kv_budget']}, default ranks, rope dims {rope_dim}; "
             f"{args.calib_samples} x 256 calibration tokens on the source path. Losses: relative squared error "
             "of the layer's update (refine.py); the closed form's losses are the start of every variant.\n",
             "| layer (rank) | variant | attention loss | block loss | seconds |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['layer']} ({r['rank']}) | {r['variant']} | {r['attention_loss_after']:.4f} | "
                     f"{r['block_loss_after']:.4f} | {r['seconds']} |")
    starts = {}
    for r in results:
        for loss in ("attention", "block"):
            if f"{loss}_loss_before" in r:
                starts.setdefault(r["layer"], {})[loss] = r[f"{loss}_loss_before"]
    lines.append("\nclosed form (start): " + "; ".join(
        f"layer {k}: attention {v.get('attention', float('nan')):.4f}, block {v.get('block', float('nan')):.4f}"
        for k, v in starts.items()))
    (out_dir / "refine_variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
