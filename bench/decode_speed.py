"""CPU decode speed: converted SmolLM2-135M (absorbed and expanded MLA decode) vs the source GQA model.

The source is the built-in default model (SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads of
64 dims, 384 cached values per token and layer). The conversion keeps r + d_R = 88 + 32 = 120
values per token and layer (68.75% less KV cache). Three decode paths are timed:

- ``source``       the source model (transformers Llama, SDPA over the GQA cache)
- ``mla-absorbed`` the converted model, single-token steps in absorbed form over the raw latent
                   (``mla_decode``: the torch reference on CPU)
- ``mla-expanded`` the same model with ``MLAAttention.absorb_decode = False``: every step
                   re-expands per-head K/V from the whole latent cache, then SDPA

Method, per (context C, batch B): the cache is built once per model at batch 1 and C_max
tokens (``--fill prefill``: seeded random tokens prefilled in chunks of ``--prefill-chunk``,
which for causal attention gives the same cache as one prefill; ``--fill random``: random
cache tensors of the right shapes and per-layer scale, since decode cost does not depend on
the values), cut to its first C - warmup - steps tokens and repeated to B rows. Then
``--warmup`` untimed and ``--steps`` timed greedy steps feed one token per row with a
(B, T) attention mask of ones, as ``generate`` does, through the model's own DynamicCache, so
each step also pays the cache concatenation. The timed steps generate the tokens at positions
C - steps .. C - 1: the context reaches C and stays within max_position_embeddings.
Tokens/s = B / median step time. Cache bytes per token are measured from the cache tensors.
Timings on a shared machine are noisy: the report records torch threads and load averages.

    python bench/decode_speed.py --out /tmp/decode_speed --converted /tmp/smollm2-r88-dR32 --threads 1
    python bench/decode_speed.py --out /tmp/ds --contexts 512 --batches 1 --fill random --steps 4  # quick

Without ``--converted`` the model is converted into a temporary directory (about 1.5 min on
2 cores) and removed at the end; with it, a conversion there is reused or written once.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from child_process import cpu_name

VARIANTS = ("source", "mla-absorbed", "mla-expanded")
LABELS = {"source": "source GQA", "mla-absorbed": "MLA absorbed", "mla-expanded": "MLA expanded"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", required=True, type=Path, help="Directory for decode_speed.json and decode_speed.md"
    )
    p.add_argument(
        "--source", default="default", help="Source model: 'default' (SmolLM2-135M), a directory or hub id"
    )
    p.add_argument(
        "--converted",
        type=Path,
        default=None,
        help="Converted model directory, reused if it holds a model, else converted from --source into it "
        "(default: a temporary directory, removed at the end)",
    )
    p.add_argument("--kv-lora-rank", type=int, default=88)
    p.add_argument("--rope-dim", type=int, default=32)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--warmup", type=int, default=3, help="Untimed decode steps before the timed ones")
    p.add_argument("--steps", type=int, default=16, help="Timed decode steps")
    p.add_argument(
        "--fill",
        choices=["prefill", "random"],
        default="prefill",
        help="How the cache is built (see the module docstring)",
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=1024, help="Tokens per prefill forward (--fill prefill)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice). On a machine shared with other "
        "jobs, fewer threads than cores avoids OpenMP oversubscription stalls",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.contexts) <= args.warmup + args.steps:
        p.error(f"every context must exceed --warmup + --steps = {args.warmup + args.steps}")
    if min(args.batches) < 1 or args.steps < 1 or args.warmup < 0 or args.prefill_chunk < 1:
        p.error("batches and --steps must be >= 1, --warmup >= 0, --prefill-chunk >= 1")
    return args


def cache_tensors(cache) -> list[list[torch.Tensor]]:
    from mlakit.eval.kv_accounting import cache_layer_tensors

    return cache_layer_tensors(cache)


def new_cache(model, layers: list[list[torch.Tensor]]):
    """A DynamicCache holding ``layers`` [[keys, values], ...] (copied into fresh contiguous tensors)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


@torch.inference_mode()
def build_base_cache(model, n_tokens: int, args) -> tuple[list[list[torch.Tensor]], float]:
    """Batch-1 cache tensors of ``n_tokens`` tokens and the seconds it took to build them."""
    from mlakit.eval.decode_bench import cache_kwarg
    from mlakit.eval.kv_accounting import get_cache

    name = cache_kwarg(model)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    if args.fill == "prefill":
        ids = torch.randint(0, int(model.config.vocab_size), (1, n_tokens), generator=gen)
        cache = None
        for start in range(0, n_tokens, args.prefill_chunk):
            out = model(
                input_ids=ids[:, start : start + args.prefill_chunk],
                use_cache=True,
                logits_to_keep=1,
                **({name: cache} if cache is not None else {}),
            )
            cache = get_cache(out)
        layers = [[t.clone() for t in layer] for layer in cache_tensors(cache)]
    else:  # random tensors shaped and scaled like a real cache (probed with a short prefill)
        ids = torch.randint(0, int(model.config.vocab_size), (1, 64), generator=gen)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        probe = cache_tensors(get_cache(out))
        layers = []
        for layer in probe:
            shapes = [(*t.shape[:-2], n_tokens, t.shape[-1]) for t in layer]
            layers.append(
                [
                    torch.randn(s, generator=gen, dtype=t.dtype) * t.float().std()
                    for s, t in zip(shapes, layer)
                ]
            )
    return layers, time.perf_counter() - t0


class DecodeCounter:
    """Counts calls of the MLA model's absorbed decode (proves which path a run took)."""

    def __init__(self):
        from mlakit.mla_model import modeling_mla

        self.module, self.calls = modeling_mla, 0
        self.original = modeling_mla.mla_decode

    def __enter__(self):
        def counted(*a, **k):
            self.calls += 1
            return self.original(*a, **k)

        self.module.mla_decode = counted
        return self

    def __exit__(self, *exc):
        self.module.mla_decode = self.original


@torch.inference_mode()
def time_decode(model, base: list[list[torch.Tensor]], context: int, batch: int, args) -> dict:
    from mlakit.eval.decode_bench import cache_kwarg

    n_cached = context - args.warmup - args.steps
    # (1, ..., T, C) -> (B, ..., n_cached, C): the cache update copies it into contiguous tensors
    cache = new_cache(
        model,
        [
            [t[..., :n_cached, :].expand(batch, *t.shape[1:-2], n_cached, t.shape[-1]) for t in layer]
            for layer in base
        ],
    )
    name = cache_kwarg(model)
    token = torch.randint(
        0, int(model.config.vocab_size), (batch, 1), generator=torch.Generator().manual_seed(1)
    )
    times = []
    with DecodeCounter() as counter:
        for step in range(args.warmup + args.steps):
            mask = torch.ones(batch, cache.get_seq_length() + 1, dtype=torch.long)
            t0 = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, use_cache=True, **{name: cache})
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
            if step == args.warmup - 1:
                counter.calls = 0
    cache_len = cache.get_seq_length()
    assert cache_len == context, f"cache holds {cache_len} tokens after the run, expected {context}"
    nbytes = sum(t.numel() * t.element_size() for layer in cache_tensors(cache) for t in layer)
    timed = times[args.warmup :]
    median = statistics.median(timed)
    del cache, out
    gc.collect()
    return {
        "context": context,
        "batch": batch,
        "step_s": timed,
        "median_step_s": median,
        "tokens_per_s": batch / median,
        "mean_tokens_per_s": batch * len(timed) / sum(timed),
        "cache_bytes_per_token": nbytes / (batch * context),
        "absorbed_calls_per_step": counter.calls / args.steps,
    }


def get_converted(args, scratch: Path) -> Path:
    from mlakit.pipeline.api import ConvertOptions, convert

    path = args.converted or scratch / f"converted-r{args.kv_lora_rank}-dR{args.rope_dim}"
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        got = (cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim"))
        if got != (args.kv_lora_rank, args.rope_dim):
            sys.exit(
                f"{path} holds a conversion with (kv_lora_rank, qk_rope_head_dim) = {got}, not "
                f"({args.kv_lora_rank}, {args.rope_dim}); pass another --converted directory"
            )
        print(f"using the conversion in {path}")
        return path
    print(f"converting {args.source} into {path} (r={args.kv_lora_rank}, d_R={args.rope_dim}, float32) ...")
    convert(
        args.source,
        path,
        ConvertOptions(kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim, dtype="float32", refine="none", quiet=True),
    )
    return path


def markdown(report: dict) -> str:
    s = report["settings"]
    variants = s["variants"]
    head = ["context", "batch"] + [f"{LABELS[v]} tok/s" for v in variants]
    head += [f"{LABELS[v]} / source" for v in variants if v != "source" and "source" in variants]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for point in report["points"]:
        res = point["results"]
        row = [str(point["context"]), str(point["batch"])] + [
            f"{res[v]['tokens_per_s']:.2f}" for v in variants
        ]
        if "source" in variants:
            row += [
                f"{res[v]['tokens_per_s'] / res['source']['tokens_per_s']:.2f}x"
                for v in variants
                if v != "source"
            ]
        lines.append("| " + " | ".join(row) + " |")
    kv = report["cache_bytes_per_token"]
    kv_line = ", ".join(f"{LABELS[v]} {b:.0f}" for v, b in kv.items())
    cache_note = (
        f"prefilled in chunks of {s['prefill_chunk']} tokens at batch 1, then repeated to the batch"
        if s["fill"] == "prefill"
        else "filled with random tensors of the right shapes and per-layer scale"
    )
    lines += [
        "",
        f"Cache bytes per token (measured, float32, all {report['num_layers']} layers): {kv_line}"
        + (
            f"; reduction {100 * report['kv_reduction']:.2f}%"
            if report.get("kv_reduction") is not None
            else ""
        ),
        f"Tokens/s = batch / median step over {s['steps']} timed greedy steps after {s['warmup']} warm-up step(s); "
        f"the timed steps end at the stated context. Cache {cache_note}.",
        f"CPU: {report['machine']['cpu']}, torch {report['machine']['torch']}, {s['threads']} thread(s), "
        f"load average {report['machine']['load_before'][0]:.2f} before / "
        f"{report['machine']['load_after'][0]:.2f} after; absorbed decode backend: {report['decode_backend']}.",
        f"Command: `{report['command']}`",
    ]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mlakit.eval.loading import load_converted_model, load_original_model
    from mlakit.kernels.decode_dispatch import resolve_backend
    from mlakit.mla_model.modeling_mla import MLAAttention

    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    cpu = torch.device("cpu")
    models, bases, build_s = {}, {}, {}
    n_base = max(args.contexts) - args.warmup - args.steps
    if "source" in args.variants:
        models["source"], _ = load_original_model(args.source, torch.float32, cpu)
    if any(v.startswith("mla") for v in args.variants):
        with tempfile.TemporaryDirectory(prefix="decode_speed_") as scratch:
            models["mla"] = load_converted_model(get_converted(args, Path(scratch)), torch.float32, cpu)
    for key, model in models.items():
        model.eval()
        print(f"building the {key} cache: {n_base} tokens ({args.fill}) ...", flush=True)
        bases[key], build_s[key] = build_base_cache(model, n_base, args)
        print(f"  {build_s[key]:.1f} s", flush=True)
    points = []
    for context in args.contexts:
        for batch in args.batches:
            results = {}
            for variant in args.variants:  # interleaved per point, so slow drifts hit every variant
                key = "source" if variant == "source" else "mla"
                MLAAttention.absorb_decode = variant != "mla-expanded"
                try:
                    res = time_decode(models[key], bases[key], context, batch, args)
                finally:
                    MLAAttention.absorb_decode = True
                expected = models[key].config.num_hidden_layers if variant == "mla-absorbed" else 0
                assert res["absorbed_calls_per_step"] == expected, (
                    f"{variant}: {res['absorbed_calls_per_step']} absorbed decode calls per step, expected {expected}"
                )
                results[variant] = res
                print(
                    f"context {context:>6} batch {batch:>3} {LABELS[variant]:>14}: "
                    f"{res['tokens_per_s']:8.2f} tok/s (median step {1e3 * res['median_step_s']:.1f} ms)",
                    flush=True,
                )
            points.append({"context": context, "batch": batch, "results": results})
    kv = {v: points[0]["results"][v]["cache_bytes_per_token"] for v in args.variants}
    mla_kv = kv.get("mla-absorbed", kv.get("mla-expanded"))
    report = {
        "kind": "decode_speed",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            ["python", "bench/decode_speed.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "settings": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "threads": torch.get_num_threads(),
        },
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
        "decode_backend": resolve_backend(cpu),
        "num_layers": next(iter(models.values())).config.num_hidden_layers,
        "cache_build_s": build_s,
        "cache_bytes_per_token": kv,
        "kv_reduction": (1 - mla_kv / kv["source"]) if "source" in kv and mla_kv else None,
        "points": points,
    }
    if cpu_name():  # the model name says more than the platform's terse processor string
        report["machine"]["cpu"] = f"{cpu_name()} ({os.cpu_count()} cores)"
    md = markdown(report)
    (args.out / "decode_speed.json").write_text(json.dumps(report, indent=2))
    (args.out / "decode_speed.md").write_text(md + "\n")
    print()
    print(md)
    print(f"\nwrote {args.out / 'decode_speed.json'} and {args.out / 'decode_speed.md'}")


if __name__ == "__main__":
    main()
