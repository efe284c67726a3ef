"""Ablation: closed form only, + sequential calibration, + layer-wise refinement (convert/refine.py).

    nice -n 5 python bench/experiments/refine_layerwise.py --calib-samples 32 --out runs/refine_explore
    nice -n 5 python bench/experiments/refine_layerwise.py                       # 128 x 256, writes bench/results

SmolLM2-135M (``default``) at --kv-budget (0.3125: 68.75% less KV). The ranks and rope dims of
every row are those of the default conversion (``calibrate`` + ``build_layers`` with default
options, fisher allocation), which is also the first row. The other rows run layer by layer
with ``SourceLayers`` / ``MLALayers``, keeping the source-path and each row's converted-path
hidden states in RAM:

- sequential calibration: layer l's statistics (E[x x^T], lag profile) are taken from the
  hidden states the converted layers 0..l-1 produce, not the source's;
- refinement: ``refine_layer`` with the row's settings, inputs on the row's converted path,
  targets on the source path (error-compensating).

Each row is scored by perplexity relative to the source on the builtin evaluation text and on
/usr/share/common-licenses/GPL-3 (the same windows for every row), and timed: the bare decoder
forward of the source over the same calibration tokens is measured in the same run, and each
row's cost is what a conversion doing that row would spend (see ``cost`` in the json).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch

from mlakit.arch.families import attention_shape
from mlakit.arch.names import LAYER_PREFIX
from mlakit.convert.assemble import mla_config, mla_layer_tensors, read_attention
from mlakit.convert.calibration import BATCH_SIZE, attention_sequences, layer_accumulator
from mlakit.convert.compress import compress_layer
from mlakit.convert.layer_metrics import layer_metrics
from mlakit.convert.refine import RefineSettings, attention_residual, refine_layer
from mlakit.data import load_text, tokenize_text
from mlakit.eval.perplexity import sliding_windows, window_nll
from mlakit.io.source import open_source
from mlakit.mla_model import MLAForCausalLM
from mlakit.pipeline.api import ConvertOptions, calibration_ids, method_of
from mlakit.pipeline.layer_runner import MLALayers, SourceLayers
from mlakit.pipeline.whole_model import assemble_state, build_layers, calibrate

# name -> (sequential calibration, refinement settings or None)
ROWS = {
    "closed form only (default conversion)": (False, None),
    "+ sequential calibration": (True, None),
    "+ sequential calibration + o_proj refit (attention target)": (True, RefineSettings(epochs=0)),
    "source statistics + o_proj refit (attention target)": (False, RefineSettings(epochs=0)),
    "+ sequential calibration + refit + Adam (attention target)": (True, RefineSettings(epochs=4.0)),
    "+ sequential calibration + Adam (block target)": (True, RefineSettings(loss="block", refit_o_proj=False, epochs=4.0)),
}


def chunks(n, size=BATCH_SIZE):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-budget", type=float, default=0.3125)
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--rows", default="all", help="comma-separated row numbers (1-based) or 'all'")
    ap.add_argument("--lr", type=float, default=None, help="override the refinement lr of every row")
    ap.add_argument("--epochs", type=float, default=None, help="override the refinement epochs of every row")
    ap.add_argument("--sequences", type=int, default=None, help="override the refinement sequences of every row")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="refine_layerwise")
    args = ap.parse_args()
    torch.manual_seed(0)
    names = list(ROWS) if args.rows == "all" else [list(ROWS)[int(i) - 1] for i in args.rows.split(",")]
    rows = {}
    for name in names:
        seq, st = ROWS[name]
        if st is not None:
            over = {k: v for k, v in (("lr", args.lr), ("epochs", args.epochs), ("sequences", args.sequences))
                    if v is not None and not (k != "sequences" and st.epochs == 0)}
            st = RefineSettings(**(asdict(st) | over))
        rows[name] = (seq, st)

    source = open_source("default")
    shape = attention_shape(source.config)
    model = source.load_model(torch.float32)
    opts = ConvertOptions(kv_budget=args.kv_budget, calib_samples=args.calib_samples,
                          calib_seq_len=args.calib_seq_len, quiet=True)
    ids = calibration_ids(source, opts, model.config.vocab_size)
    n_calib, n_layers = ids.shape[0], source.config.num_hidden_layers

    # the bare decoder forward over the calibration tokens (what the cost budget is relative to)
    with torch.no_grad():
        model.model(input_ids=ids[:1], use_cache=False)  # warm-up
        tick = time.time()
        for a, b in chunks(n_calib):
            model.model(input_ids=ids[a:b], use_cache=False)
        bare = time.time() - tick
    print(f"bare decoder forward over {n_calib} x {args.calib_seq_len} tokens: {bare:.1f} s", flush=True)

    # the default conversion: its ranks and rope dims fix every row's cache
    tick = time.time()
    stats = calibrate(source, shape, opts)
    t_calibrate = time.time() - tick
    ws = [read_attention(source, i, shape) for i in range(n_layers)]
    tick = time.time()
    ms = [layer_metrics(w, st) for w, st in zip(ws, stats)]
    default_layers, plan = build_layers(ws, ms, shape, opts)
    t_build = time.time() - tick
    del ms, stats
    ranks, rope_dim = plan["ranks"], plan["rope_dim"]
    method = method_of(opts, shape)
    print(f"default conversion: calibrate {t_calibrate:.1f} s, build {t_build:.1f} s; rope {rope_dim}, "
          f"ranks {ranks}", flush=True)

    # layer by layer, every row in lockstep
    src = SourceLayers(source.config, shape.window)
    emb = source.tensor("model.embed_tokens.weight").float()
    h_src = torch.nn.functional.embedding(ids, emb)
    layer_rows = [n for n in names if n != next(iter(ROWS))]
    h_conv = {n: h_src.clone() for n in layer_rows}
    kept = {n: {} for n in layer_rows}  # converted layer tensors
    infos = {n: [] for n in layer_rows}
    seconds = {n: {"stats": 0.0, "compress": 0.0, "refine": 0.0, "forward": 0.0} for n in layer_rows}
    reports = {n: [] for n in layer_rows}
    t_source_path = 0.0
    need = max([st.used(n_calib) for _, st in rows.values() if st is not None] + [0])
    for i in range(n_layers):
        layer_tick = time.time()
        prefix = LAYER_PREFIX.format(i=i)
        tensors = {k: source.tensor(k) for k in source.tensor_names() if k.startswith(prefix)}
        layer = src.layer(i, tensors)
        w = read_attention(source, i, shape)
        tick = time.time()
        with torch.no_grad():  # source path: the block targets, and the attention targets of the refined sequences
            att_target = torch.cat([attention_residual(layer, src.run, h_src[a:b]) for a, b in chunks(min(need, n_calib))]) \
                if need else None
            out_src = torch.cat([src.run(layer, h_src[a:b]) for a, b in chunks(n_calib)])
        t_source_path += time.time() - tick
        for name in layer_rows:
            sequential, settings = rows[name]
            sec = seconds[name]
            tick = time.time()
            if sequential:
                acc = layer_accumulator(layer.self_attn, src.inv_freq, shape)
                handles = acc.attach()
                try:
                    hidden = h_conv[name] if sequential else h_src
                    for a, b in chunks(n_calib):
                        acc.with_attention = a < attention_sequences(args.calib_seq_len)
                        attention_residual(layer, src.run, hidden[a:b])  # stats need the attention only
                finally:
                    for h in handles:
                        h.remove()
                stats = acc.result()
                sec["stats"] += time.time() - tick
            tick = time.time()
            # source statistics: the default conversion's own layer (the same closed form)
            mla = compress_layer(w, layer_metrics(w, stats), method, rope_dim, ranks[i]) if sequential \
                else default_layers[i]
            sec["compress"] += time.time() - tick if sequential else 0.0
            config = mla_config(source.config, shape, [SimpleNamespace(kv_lora_rank=r, rope_dim=rope_dim,
                                freq_index=list(mla.freq_index)) for r in ranks], torch.float32)
            runner = MLALayers(config)
            out = mla_layer_tensors(i, mla, torch.float32, q_bias=shape.qkv_bias, kv_a_bias=shape.qkv_bias)
            out |= {k: t for k, t in tensors.items() if ".self_attn." not in k}
            block = runner.layer(i, out)
            if settings is not None:
                tick = time.time()
                target = att_target if settings.loss == "attention" else out_src
                n = settings.used(n_calib)
                rep = refine_layer(block, runner.forward, h_conv[name][:n], target[:n], settings, seed=i)
                sec["refine"] += time.time() - tick
                reports[name].append({k: v for k, v in rep.items() if k != "settings"})
            tick = time.time()
            with torch.no_grad():
                h_conv[name] = torch.cat([runner.run(block, h_conv[name][a:b]) for a, b in chunks(n_calib)])
            sec["forward"] += time.time() - tick
            kept[name] |= {prefix + k: v.detach().clone() for k, v in block.state_dict().items()}
            infos[name].append(SimpleNamespace(kv_lora_rank=ranks[i], rope_dim=rope_dim, freq_index=list(mla.freq_index)))
        h_src = out_src
        last = {n: reports[n][-1] for n in layer_rows if reports[n]}
        print(f"layer {i} ({time.time() - layer_tick:.0f} s): " + "; ".join(f"{n[:40]} {r['loss_before']:.4f}->{r['loss_after']:.4f} ({r['kept']})"
                                         for n, r in last.items()), flush=True)

    # perplexity on two texts
    tokenizer = source.tokenizer()
    texts = {"builtin": load_text("builtin", "eval"), "GPL-3": Path("/usr/share/common-licenses/GPL-3").read_text()}
    evals = {k: tokenize_text(tokenizer, t)[: args.eval_tokens] for k, t in texts.items()}

    def ppl(m):
        m.eval()
        res = {}
        for k, e in evals.items():
            win = sliding_windows(int(e.numel()), 512, 256)
            nll = torch.cat([window_nll(m, e, win[j : j + 4], "cpu") for j in range(0, len(win), 4)])
            res[k] = math.exp(float(nll.sum()) / sum(w.n_scored for w in win))
        return res

    base = ppl(model)
    glob = {k: source.tensor(k) for k in source.tensor_names() if not k.startswith("model.layers.")}
    results = []
    for name in names:
        if name == next(iter(ROWS)):
            config = mla_config(source.config, shape, default_layers, torch.float32)
            state = assemble_state(source, shape, default_layers, torch.float32)
        else:
            config = mla_config(source.config, shape, infos[name], torch.float32)
            state = kept[name] | {k: v.float() for k, v in glob.items()}
        m = MLAForCausalLM(config).eval()
        missing, unexpected = m.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        m.tie_weights()
        p = ppl(m)
        sequential, settings = rows[name]
        if name == next(iter(ROWS)):
            cost = t_calibrate + t_build
            parts = {"calibrate": t_calibrate, "build": t_build}
        else:
            # a conversion doing this row: the default's first pass (statistics, sensitivities, plan),
            # then per layer the source path (targets) and this row's work
            parts = {"first pass (default calibrate + build)": t_calibrate + t_build, "source path": t_source_path}
            parts |= seconds[name]
            cost = sum(parts.values())
        row = {"method": name, "sequential_calibration": sequential,
               "refine": None if settings is None else asdict(settings) | {"params": list(settings.params)},
               "ppl": p, "ppl_ratio": {k: p[k] / base[k] for k in p},
               "cost_seconds": round(cost, 1), "cost_vs_bare_forward": round(cost / bare, 2),
               "cost_parts": {k: round(v, 1) for k, v in parts.items()}}
        if reports.get(name):
            row["layer_loss"] = [{k: r[k] for k in ("loss_before", "loss_after", "kept", "steps", "seconds")}
                                 for r in reports[name]]
        results.append(row)
        print(f"{name:55s} " + "  ".join(f"{k} {v:.3f}" for k, v in row["ppl_ratio"].items())
              + f"  cost {row['cost_vs_bare_forward']}x", flush=True)

    meta = {"source": "default (SmolLM2-135M)", "kv_budget": args.kv_budget, "calib": "builtin",
            "calib_samples": n_calib, "calib_seq_len": args.calib_seq_len, "eval_tokens": args.eval_tokens,
            "eval_window": 512, "eval_stride": 256, "source_ppl": base, "bare_forward_seconds": round(bare, 1),
            "rope_dim": rope_dim, "ranks": ranks, "threads": torch.get_num_threads()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [f"SmolLM2-135M at kv_budget {args.kv_budget} ({1 - args.kv_budget:.2%} less KV), default ranks "
             f"(fisher) and rope dims {rope_dim}; calibration builtin {n_calib} x {args.calib_seq_len}; "
             f"perplexity ratio over the first {args.eval_tokens} tokens (window 512, stride 256); source ppl "
             + ", ".join(f"{k} {v:.3f}" for k, v in base.items())
             + f". Cost: conversion seconds / bare decoder forward over the calibration tokens ({bare:.1f} s), "
               "same run.\n",
             "| row | builtin | GPL-3 | cost (x bare forward) |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['ppl_ratio']['builtin']:.3f} | {r['ppl_ratio']['GPL-3']:.3f} | "
                     f"{r['cost_vs_bare_forward']} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
