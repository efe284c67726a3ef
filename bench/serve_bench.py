"""vLLM serving: a GQA source with the Llama-3-8B attention shape against its 512 + 64 MLA conversion.

The source is random (no download): Llama-3-8B's attention (hidden 4096, 32 query heads, 8 KV
heads of 128 dims: 2048 cached values per token and layer) with few layers, a small MLP and a
small vocabulary, so that attention and its cache dominate. mlakit converts it at
``--kv-lora-rank 512 --rope-dim 64`` (576 values per token and layer, the shape vLLM's MLA
kernels take) and vLLM serves both, the conversion through mlakit's plugin, with the same fixed
KV cache space (``VLLM_CPU_KVCACHE_SPACE`` GiB on CPU). Measured per model:

- KV capacity as vLLM allocates it: cache tokens, tokens per GiB of cache space, and how many
  full sequences of 2K and 8K tokens fit (whole cache blocks per sequence; vLLM's own
  "maximum concurrency" line for max_model_len = 8K is recorded too);
- generation throughput at concurrency 1, 8 and 32: that many prompts of ``--prompt-len``
  random tokens submitted at once, ``--new-tokens`` greedy tokens each (ignore_eos), output
  tokens per second of wall time over the whole ``generate`` call (prefill included), after one
  untimed warm-up call.

vLLM runs in its own interpreter (``--vllm-python``, default ``.venv-vllm/bin/python``), one
child per model, in-process engine, ``--enforce-eager``, fp32. Timings on a shared 2-core
machine are noisy: the report records load averages.

    python bench/serve_bench.py --out bench/results
    python bench/serve_bench.py --out /tmp/sb --layers 1 --new-tokens 8 --concurrency 1 8   # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from child_process import cpu_name

ROOT = Path(__file__).resolve().parent.parent
CONTEXTS = (2048, 8192)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", required=True, type=Path, help="Directory for serve_bench.json and serve_bench.md"
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument(
        "--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB) for both models"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--vllm-python", default=os.environ.get("MLAKIT_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
    )
    p.add_argument(
        "--work", type=Path, default=None, help="Keep the models here (default: a temporary directory)"
    )
    p.add_argument(
        "--worker", type=Path, default=None, help=argparse.SUPPRESS
    )  # internal: the vLLM child's job
    return p.parse_args(argv)


# ---- the vLLM child ------------------------------------------------------------------------------


def worker(job_path: Path) -> None:
    import random

    from vllm import LLM, SamplingParams

    job = json.loads(job_path.read_text())
    llm = LLM(
        job["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max(CONTEXTS),
        enforce_eager=True,
        seed=0,
    )
    cache = llm.llm_engine.vllm_config.cache_config
    blocks, block = int(cache.num_gpu_blocks), int(cache.block_size)
    result = {
        "cache_blocks": blocks,
        "block_size": block,
        "cache_tokens": blocks * block,
        "tokens_per_gib": blocks * block / job["kv_space_gib"],
        "vllm_max_concurrency_at_8k": float(cache.kv_cache_max_concurrency),
        "sequences_that_fit": {str(c): blocks // math.ceil(c / block) for c in CONTEXTS},
        "throughput": {},
    }
    rng = random.Random(0)
    params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True)

    def prompts(n):
        return [
            {"prompt_token_ids": [rng.randrange(3, job["vocab"]) for _ in range(job["prompt_len"])]}
            for _ in range(n)
        ]

    llm.generate(prompts(2), params, use_tqdm=False)  # warm-up
    for n in job["concurrency"]:
        start = time.perf_counter()
        outs = llm.generate(prompts(n), params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["throughput"][str(n)] = {
            "wall_s": round(wall, 2),
            "output_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
        }
    Path(job["result"]).write_text(json.dumps(result))


# ---- the orchestration (main environment) ---------------------------------------------------------


def build_source(directory: Path, args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=4096,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max(CONTEXTS),
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(str(directory))


def convert_source(source: Path, out: Path) -> float:
    from mlakit.convert.pipeline import ConvertOptions, convert

    start = time.perf_counter()
    convert(
        str(source),
        out,
        ConvertOptions(
            kv_lora_rank=512,
            rope_dim=64,
            dtype="float32",
            calib="random",
            calib_samples=8,
            calib_seq_len=64,
            verify=False,
            quiet=True,
        ),
    )
    return time.perf_counter() - start


def serve(model: Path, name: str, args, work: Path) -> dict:
    job = {
        "model": str(model),
        "kv_space_gib": args.kv_space_gib,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "vocab": args.vocab,
        "result": str(work / f"{name}.result.json"),
    }
    (work / f"{name}.job.json").write_text(json.dumps(job))
    sys.path.insert(0, str(ROOT))
    from tests.vllm_runner import plugin_dist_info  # the plugin's entry point, from this tree

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(plugin_dist_info(work / "dist", ROOT)), str(ROOT)]),
        VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
    )
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.run(
            [args.vllm_python, __file__, "--out", str(args.out), "--worker", str(work / f"{name}.job.json")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: vLLM child failed:\n{(work / f'{name}.log').read_text()[-4000:]}")
    result = json.loads((work / f"{name}.result.json").read_text())
    result.update(
        wall_s=round(time.perf_counter() - start, 1), load_avg_1m_before_after=[load, os.getloadavg()[0]]
    )
    return result


def markdown(report: dict) -> str:
    s, m = report["models"]["source"], report["models"]["mla"]
    a = report["args"]
    lines = [
        "# vLLM serving: Llama-3-8B attention shape, GQA source vs MLA 512 + 64",
        "",
        f"{report['date']}, vLLM {report['vllm']}, CPU ({report['cpu']}), fp32, `--enforce-eager`, "
        f"{a['layers']} layers, hidden 4096, 32 query heads, 8 KV heads x 128, vocab {a['vocab']}, "
        f"MLP {a['intermediate']}. KV cache space {a['kv_space_gib']} GiB for each model. Command: "
        f"`{report['command']}`.",
        "",
        "| | source GQA | MLA 512 + 64 | MLA / source |",
        "|---|---|---|---|",
        f"| cached values per token and layer | {report['values_per_token_layer']['source']} | "
        f"{report['values_per_token_layer']['mla']} | "
        f"{report['values_per_token_layer']['mla'] / report['values_per_token_layer']['source']:.3f} |",
        f"| cache tokens | {s['cache_tokens']:,} | {m['cache_tokens']:,} | {m['cache_tokens'] / s['cache_tokens']:.2f} |",
        f"| tokens per GiB | {s['tokens_per_gib']:,.0f} | {m['tokens_per_gib']:,.0f} | "
        f"{m['tokens_per_gib'] / s['tokens_per_gib']:.2f} |",
    ]
    for c in CONTEXTS:
        fs, fm = s["sequences_that_fit"][str(c)], m["sequences_that_fit"][str(c)]
        lines.append(f"| {c // 1024}K-token sequences that fit | {fs} | {fm} | {fm / fs:.2f} |")
    lines.append(
        f"| vLLM's max concurrency at 8K | {s['vllm_max_concurrency_at_8k']:.2f} | "
        f"{m['vllm_max_concurrency_at_8k']:.2f} | "
        f"{m['vllm_max_concurrency_at_8k'] / s['vllm_max_concurrency_at_8k']:.2f} |"
    )
    for n in a["concurrency"]:
        ts, tm = s["throughput"][str(n)]["tokens_per_s"], m["throughput"][str(n)]["tokens_per_s"]
        lines.append(f"| output tokens/s at concurrency {n} | {ts:.1f} | {tm:.1f} | {tm / ts:.2f} |")
    lines += [
        "",
        f"Throughput: {a['prompt_len']}-token random prompts, {a['new_tokens']} greedy tokens each, wall time of "
        "one `generate` call (prefill included). On CPU the MLA path runs vLLM's CPU MLA backend (SDPA prefill) "
        "with the plugin's batched decode (mlakit/serving/vllm_cpu_decode.py) and the source vLLM's CPU paged "
        "attention; these are CPU numbers "
        "and say nothing about GPU kernels.",
        f"Load average (1 min) before/after: source {s['load_avg_1m_before_after']}, MLA "
        f"{m['load_avg_1m_before_after']}. "
        + (
            "Conversion reused from --work."
            if report["convert_s"] is None
            else f"Conversion took {report['convert_s']:.0f} s."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    if not Path(args.vllm_python).is_file():
        sys.exit(
            f"no vLLM interpreter at {args.vllm_python}: run `bash scripts/setup.sh --tests` or pass --vllm-python"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="serve_bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        source, mla = work / "source", work / "mla"
        if not (source / "config.json").exists():
            build_source(source, args)
        convert_s = None if (mla / "config.json").exists() else convert_source(source, mla)  # None: reused
        models = {"source": serve(source, "source", args, work), "mla": serve(mla, "mla", args, work)}
    version = subprocess.run(
        [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "vllm": version,
        "cpu": cpu_name() or platform.machine(),
        "command": "python bench/serve_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
        "values_per_token_layer": {"source": 2 * 8 * 128, "mla": 512 + 64},
        "convert_s": convert_s,
        "models": models,
    }
    (args.out / "serve_bench.json").write_text(json.dumps(report, indent=1))
    (args.out / "serve_bench.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
