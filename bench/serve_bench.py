"""vLLM serving: a GQA source with the Llama-3-8B attention shape against its 512 + 64 MLA conversion.

The source is random (no download): Llama-3-8B's attention (hidden 4096, 32 query heads, 8 KV
heads of 128 dims: 2048 cached values per token and layer) with few layers, a small MLP and a
small vocabulary, so that attention and its cache dominate. mlakit converts it at
``--kv-lora-rank 512 --rope-dim 64`` (576 values per token and layer, the shape vLLM's MLA
kernels take) and vLLM serves both, the conversion through mlakit's plugin, with the same KV
cache bytes: ``--kv-space-gib`` or ``--kv-space-mib``, passed to vLLM as the cache config's
``kv_cache_memory_bytes`` (what ``VLLM_CPU_KVCACHE_SPACE`` sets, in whole GiB only, on CPU). vLLM
divides those bytes into blocks itself; the bench checks its block count against the count
computed from each model's bytes per token. Measured per model:

- KV capacity as vLLM allocates it: cache tokens, tokens per GiB of cache space, and how many
  full sequences of 2K and 8K tokens and of the run's own context (prompt + new tokens) fit
  (whole cache blocks per sequence; vLLM's own "maximum concurrency" line is recorded too);
- generation throughput at each ``--concurrency``: that many prompts of ``--prompt-len``
  random tokens submitted at once, ``--new-tokens`` greedy tokens each (ignore_eos), output
  tokens per second of wall time over the whole ``generate`` call (prefill included), after one
  untimed warm-up call; and what vLLM's scheduler did meanwhile (steps, most requests running
  and waiting at once, preemptions), read from the in-process engine's scheduler.

Where the run's context fits fewer sequences in the source's cache than the concurrency, the
run is cache-bound for the source: vLLM queues and preempts its requests, and MLA's smaller
cache can show as throughput. ``--rounds N`` serves the two models interleaved N times
(source, MLA, source, MLA, ...), each in a fresh vLLM process, and reports every run and the
median of the per-round ratios.

vLLM runs in its own interpreter (``--vllm-python``, default ``.venv-vllm/bin/python``), one
child per model and round, in-process engine, ``--enforce-eager``, fp32. Timings on a shared
2-core machine are noisy: the report records load averages.

    python bench/serve_bench.py --out bench/results                     # 1 GiB: both batches fit
    python bench/serve_bench.py --out bench/results --name serve_bench_cache_bound \
        --kv-space-mib 96 --concurrency 32 --prompt-len 256 --new-tokens 128 --rounds 2
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
MIB = 1 << 20
FP32_BYTES = 4
VALUES_PER_TOKEN_LAYER = {"source": 2 * 8 * 128, "mla": 512 + 64}  # K and V of 8 heads x 128; 512 + 64 latent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="Directory for NAME.json and NAME.md")
    p.add_argument("--name", default="serve_bench", help="Stem of the report files (default serve_bench)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=1024)
    space = p.add_mutually_exclusive_group()
    space.add_argument("--kv-space-gib", type=int, default=None, help="KV cache bytes for each model, GiB (default 1)")
    space.add_argument("--kv-space-mib", type=int, default=None, help="KV cache bytes for each model, MiB")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="vLLM's max_model_len (default 8192, or prompt + new tokens where the source's cache holds less)",
    )
    p.add_argument("--rounds", type=int, default=1, help="Serve source and MLA interleaved this many times")
    p.add_argument(
        "--vllm-python", default=os.environ.get("MLAKIT_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
    )
    p.add_argument(
        "--work", type=Path, default=None, help="Keep the models here (default: a temporary directory)"
    )
    p.add_argument(
        "--worker", type=Path, default=None, help=argparse.SUPPRESS
    )  # internal: the vLLM child's job
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    args.kv_space_bytes = args.kv_space_mib * MIB if args.kv_space_mib is not None else (args.kv_space_gib or 1) << 30
    problems = [
        f"{flag} must be at least 1, got {value}"
        for flag, value in (
            ("--kv-space-mib", args.kv_space_mib),
            ("--kv-space-gib", args.kv_space_gib),
            ("--prompt-len", args.prompt_len),
            ("--new-tokens", args.new_tokens),
            ("--rounds", args.rounds),
        )
        if value is not None and value < 1
    ] + [f"--concurrency must be at least 1, got {n}" for n in args.concurrency if n < 1]
    if problems:
        p.error("; ".join(problems))
    context = args.prompt_len + args.new_tokens
    if args.max_model_len is None:
        source_tokens = args.kv_space_bytes // cache_bytes_per_token("source", args.layers)
        args.max_model_len = max(CONTEXTS) if source_tokens > max(CONTEXTS) else context
    if args.max_model_len < context:
        p.error(f"--max-model-len {args.max_model_len} is shorter than prompt + new tokens ({context})")
    return args


def cache_bytes_per_token(name: str, layers: int) -> int:
    """KV cache bytes one token takes in vLLM for the model NAME (fp32, every layer)."""
    return VALUES_PER_TOKEN_LAYER[name] * FP32_BYTES * layers


def fits(blocks: int, block: int, context: int) -> int:
    """Sequences of CONTEXT tokens that fit at once in BLOCKS cache blocks of BLOCK tokens.

    vLLM's block pool keeps one block back (its null block), so BLOCKS - 1 serve requests."""
    return (blocks - 1) // math.ceil(context / block)


# ---- the vLLM child ------------------------------------------------------------------------------


def trace_scheduler(llm) -> dict:
    """Count what the in-process engine's scheduler does: steps, requests running / waiting, preemptions.

    The counts come from wrapping the scheduler's own methods on this one instance, so they are
    vLLM's decisions, not a model of them."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
        schedule, preempt, step_fn = sched.schedule, sched._preempt_request, core.step_fn
    except AttributeError as err:  # another vLLM layout: say so rather than report zeros
        raise RuntimeError(
            f"cannot reach vLLM's scheduler ({err}); the bench needs the in-process engine of vLLM 0.32"
        ) from err
    trace = {}

    def reset():
        trace.update(steps=0, running_step_sum=0, max_running=0, max_waiting=0, preemptions=0)
        trace.update(decode_steps=0, decode_tokens=0, decode_s=0.0, prefill_steps=0, prefill_tokens=0, prefill_s=0.0)
        trace["kind"] = None

    def traced_schedule(*a, **k):
        out = schedule(*a, **k)
        scheduled = out.num_scheduled_tokens
        # a decode-only step schedules one token per request; any other carries prompt tokens
        trace["kind"] = (
            None if not scheduled else "decode" if out.total_num_scheduled_tokens == len(scheduled) else "prefill"
        )
        trace["tokens"] = out.total_num_scheduled_tokens
        running = len(sched.running)
        trace["steps"] += 1
        trace["running_step_sum"] += running
        trace["max_running"] = max(trace["max_running"], running)
        trace["max_waiting"] = max(trace["max_waiting"], len(sched.waiting))
        return out

    def traced_preempt(*a, **k):
        trace["preemptions"] += 1
        return preempt(*a, **k)

    def traced_step(*a, **k):  # the engine step: schedule, the model's forward, the scheduler's update
        trace["kind"] = None
        start = time.perf_counter()
        out = step_fn(*a, **k)
        kind = trace["kind"]
        if kind is not None:
            trace[f"{kind}_steps"] += 1
            trace[f"{kind}_tokens"] += trace["tokens"]
            trace[f"{kind}_s"] += time.perf_counter() - start
        return out

    sched.schedule, sched._preempt_request, core.step_fn = traced_schedule, traced_preempt, traced_step
    reset()
    trace["reset"] = reset
    return trace


def worker(job_path: Path) -> None:
    import random

    from vllm import LLM, SamplingParams

    job = json.loads(job_path.read_text())
    llm = LLM(
        job["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=job["max_model_len"],
        kv_cache_memory_bytes=job["kv_space_bytes"],
        enforce_eager=True,
        seed=0,
    )
    config = llm.llm_engine.vllm_config
    cache, sched_config = config.cache_config, config.scheduler_config
    blocks, block = int(cache.num_gpu_blocks), int(cache.block_size)
    context = job["prompt_len"] + job["new_tokens"]
    result = {
        "cache_blocks": blocks,
        "block_size": block,
        "cache_tokens": blocks * block,
        "tokens_per_gib": blocks * block / (job["kv_space_bytes"] / (1 << 30)),
        "vllm_max_concurrency": float(cache.kv_cache_max_concurrency),
        "sequences_that_fit": {str(c): blocks // math.ceil(c / block) for c in CONTEXTS},
        "run_context_sequences_that_fit": fits(blocks, block, context),
        "scheduler": {
            "max_num_seqs": sched_config.max_num_seqs,
            "max_num_batched_tokens": sched_config.max_num_batched_tokens,
            "chunked_prefill": bool(sched_config.enable_chunked_prefill),
            "prefix_caching": bool(cache.enable_prefix_caching),
        },
        "throughput": {},
    }
    trace = trace_scheduler(llm)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True)

    def prompts(n):
        return [
            {"prompt_token_ids": [rng.randrange(3, job["vocab"]) for _ in range(job["prompt_len"])]}
            for _ in range(n)
        ]

    llm.generate(prompts(2), params, use_tqdm=False)  # warm-up
    for n in job["concurrency"]:
        trace["reset"]()
        start, cpu_start = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts(n), params, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = trace["steps"]
        decode = trace["decode_steps"]
        result["throughput"][str(n)] = {
            "wall_s": round(wall, 2),
            "output_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
            "scheduler_steps": steps,
            "mean_running": round(trace["running_step_sum"] / max(steps, 1), 2),
            "max_running": trace["max_running"],
            "max_waiting": trace["max_waiting"],
            "preemptions": trace["preemptions"],
            # CPU seconds of the whole process (every thread): less sensitive than wall time to other load
            "cpu_s": round(cpu, 2),
            "cpu_ms_per_output_token": round(1000 * cpu / tokens, 2),
            "prefill_steps": trace["prefill_steps"],
            "prefill_tokens": trace["prefill_tokens"],
            "prefill_s": round(trace["prefill_s"], 2),
            "decode_steps": decode,
            "decode_s": round(trace["decode_s"], 2),
            "decode_mean_batch": round(trace["decode_tokens"] / max(decode, 1), 2),
            "decode_ms_per_token": round(1000 * trace["decode_s"] / max(trace["decode_tokens"], 1), 2),
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
    from mlakit.pipeline.api import ConvertOptions, convert

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
            refine="none",  # random calibration: the engine's speed, not the weights' quality, is measured
            verify=False,
            quiet=True,
        ),
    )
    return time.perf_counter() - start


def serve(model: Path, name: str, run: str, args, work: Path) -> dict:
    job = {
        "model": str(model),
        "kv_space_bytes": args.kv_space_bytes,
        "max_model_len": args.max_model_len,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "vocab": args.vocab,
        "result": str(work / f"{run}.result.json"),
    }
    (work / f"{run}.job.json").write_text(json.dumps(job))
    sys.path.insert(0, str(ROOT))
    from tests.vllm_runner import plugin_dist_info  # the plugin's entry point, from this tree

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(plugin_dist_info(work / "dist", ROOT)), str(ROOT)]),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
    )
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes with whole GiB
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(work / f"{run}.log", "w") as log:
        proc = subprocess.run(
            [args.vllm_python, __file__, "--out", str(args.out), "--worker", str(work / f"{run}.job.json")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{run}: vLLM child failed:\n{(work / f'{run}.log').read_text()[-4000:]}")
    result = json.loads((work / f"{run}.result.json").read_text())
    per_block = result["block_size"] * cache_bytes_per_token(name, args.layers)
    result.update(
        expected_cache_blocks=args.kv_space_bytes // per_block,
        cache_bytes_per_block=per_block,
        wall_s=round(time.perf_counter() - start, 1),
        load_avg_1m_before_after=[round(load, 2), round(os.getloadavg()[0], 2)],
    )
    return result


def space_text(nbytes: int) -> str:
    return f"{nbytes >> 30} GiB" if nbytes % (1 << 30) == 0 else f"{nbytes / MIB:g} MiB"


def regime(report: dict) -> str:
    """Which side of the cache each model's batch is on, at the largest concurrency of the run."""
    a, m = report["args"], report["models"]
    n, context = max(a["concurrency"]), a["prompt_len"] + a["new_tokens"]
    fit = {k: m[k]["run_context_sequences_that_fit"] for k in ("source", "mla")}
    side = {k: "all of them" if fit[k] >= n else f"{fit[k]} of them at once" for k in fit}
    kind = (
        "cache-bound for the source, not for MLA"
        if fit["source"] < n <= fit["mla"]
        else "cache-bound for both"
        if fit["mla"] < n
        else "both batches fit their caches (compute-bound)"
    )
    return (
        f"Regime at concurrency {n}, {context}-token contexts ({a['prompt_len']} prompt + {a['new_tokens']} new): "
        f"the source's cache holds {side['source']}, MLA's {side['mla']}: {kind}."
    )


def median(values: list[float]) -> float:
    v = sorted(values)
    return (v[len(v) // 2] + v[(len(v) - 1) // 2]) / 2


def markdown(report: dict) -> str:
    s, m = report["models"]["source"], report["models"]["mla"]
    a = report["args"]
    context = a["prompt_len"] + a["new_tokens"]
    vpt = report["values_per_token_layer"]
    lines = [
        "# vLLM serving: Llama-3-8B attention shape, GQA source vs MLA 512 + 64",
        "",
        f"{report['date']}, vLLM {report['vllm']}, CPU ({report['cpu']}), fp32, `--enforce-eager`, "
        f"{a['layers']} layers, hidden 4096, 32 query heads, 8 KV heads x 128, vocab {a['vocab']}, "
        f"MLP {a['intermediate']}. KV cache {space_text(a['kv_space_bytes'])} ({a['kv_space_bytes']:,} bytes, "
        f"vLLM's `kv_cache_memory_bytes`) for each model, max_model_len {a['max_model_len']}. "
        f"Command: `{report['command']}`.",
        "",
        regime(report),
        "",
        "| | source GQA | MLA 512 + 64 | MLA / source |",
        "|---|---|---|---|",
        f"| cached values per token and layer | {vpt['source']} | {vpt['mla']} | {vpt['mla'] / vpt['source']:.3f} |",
        f"| cache bytes per block ({s['block_size']} / {m['block_size']} tokens) | {s['cache_bytes_per_block']:,} | "
        f"{m['cache_bytes_per_block']:,} | {m['cache_bytes_per_block'] / s['cache_bytes_per_block']:.3f} |",
        f"| cache blocks, vLLM (from the bytes) | {s['cache_blocks']:,} ({s['expected_cache_blocks']:,}) | "
        f"{m['cache_blocks']:,} ({m['expected_cache_blocks']:,}) | {m['cache_blocks'] / s['cache_blocks']:.2f} |",
        f"| cache tokens | {s['cache_tokens']:,} | {m['cache_tokens']:,} | {m['cache_tokens'] / s['cache_tokens']:.2f} |",
        f"| tokens per GiB | {s['tokens_per_gib']:,.0f} | {m['tokens_per_gib']:,.0f} | "
        f"{m['tokens_per_gib'] / s['tokens_per_gib']:.2f} |",
    ]
    for c in CONTEXTS:
        fs, fm = s["sequences_that_fit"][str(c)], m["sequences_that_fit"][str(c)]
        ratio = f"{fm / fs:.2f}" if fs else "-"
        lines.append(f"| {c // 1024}K-token sequences that fit | {fs} | {fm} | {ratio} |")
    fs, fm = s["run_context_sequences_that_fit"], m["run_context_sequences_that_fit"]
    lines += [
        f"| {context}-token sequences that fit (null block kept back) | {fs} | {fm} | "
        + (f"{fm / fs:.2f} |" if fs else "- |"),
        f"| vLLM's max concurrency at {a['max_model_len']} tokens | {s['vllm_max_concurrency']:.2f} | "
        f"{m['vllm_max_concurrency']:.2f} | {m['vllm_max_concurrency'] / s['vllm_max_concurrency']:.2f} |",
        "",
        "Every run, in the order run (each a fresh vLLM process; scheduler counts from vLLM's own scheduler):",
        "",
        "| round | model | concurrency | output tok/s | wall s | CPU ms per output token | scheduler steps | "
        "mean / max running | max waiting | preemptions | prefill steps: tokens, s | decode steps: mean batch, "
        "s, ms per token | load avg 1 min before / after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        for n in a["concurrency"]:
            t = run["throughput"][str(n)]
            lines.append(
                f"| {run['round']} | {run['model']} | {n} | {t['tokens_per_s']:.1f} | {t['wall_s']:.1f} | "
                f"{t['cpu_ms_per_output_token']:.1f} | {t['scheduler_steps']} | {t['mean_running']:.1f} / "
                f"{t['max_running']} | {t['max_waiting']} | {t['preemptions']} | {t['prefill_steps']}: "
                f"{t['prefill_tokens']:,}, {t['prefill_s']:.1f} | {t['decode_steps']}: {t['decode_mean_batch']:.1f}, "
                f"{t['decode_s']:.1f}, {t['decode_ms_per_token']:.1f} | "
                f"{run['load_avg_1m_before_after'][0]} / {run['load_avg_1m_before_after'][1]} |"
            )
    lines += [
        "",
        "| concurrency | source tok/s, each round | MLA tok/s, each round | MLA / source, each round | median | "
        "source / MLA CPU time per output token, each round | median |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, row in report["summary"].items():
        lines.append(
            f"| {n} | {', '.join(f'{x:.1f}' for x in row['source'])} | {', '.join(f'{x:.1f}' for x in row['mla'])} | "
            f"{', '.join(f'{x:.2f}' for x in row['ratios'])} | **{row['median_ratio']:.2f}** | "
            f"{', '.join(f'{x:.2f}' for x in row['cpu_ratios'])} | **{row['median_cpu_ratio']:.2f}** |"
        )
    sc, mc = s["scheduler"], m["scheduler"]
    lines += [
        "",
        f"Throughput: {a['prompt_len']}-token random prompts, {a['new_tokens']} greedy tokens each, wall time of "
        "one `generate` call (prefill included). On CPU the MLA path runs vLLM's CPU MLA backend (SDPA prefill) "
        "with the plugin's batched decode (mlakit/serving/vllm_cpu_decode.py) and the source vLLM's CPU paged "
        "attention; these are CPU numbers and say nothing about GPU kernels.",
        f"Scheduler as vLLM configured it: source chunked prefill {sc['chunked_prefill']}, prefix caching "
        f"{sc['prefix_caching']}, {sc['max_num_batched_tokens']} tokens a step; MLA chunked prefill "
        f"{mc['chunked_prefill']}, prefix caching {mc['prefix_caching']}, {mc['max_num_batched_tokens']} tokens "
        "a step (vLLM 0.32 turns both off for MLA on CPU). A preempted request is put back in the queue and "
        "recomputed from its prompt.",
        "Conversion reused from --work."
        if report["convert_s"] is None
        else f"Conversion took {report['convert_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def summarize(runs: list[dict], concurrency: list[int]) -> dict:
    summary = {}
    for n in concurrency:
        tps = {k: [r["throughput"][str(n)]["tokens_per_s"] for r in runs if r["model"] == k] for k in ("source", "mla")}
        ratios = [mt / st for st, mt in zip(tps["source"], tps["mla"])]
        cpu = {k: [r["throughput"][str(n)]["cpu_ms_per_output_token"] for r in runs if r["model"] == k] for k in tps}
        cpu_ratios = [sc / mc for sc, mc in zip(cpu["source"], cpu["mla"])]  # > 1: MLA spends less CPU a token
        summary[str(n)] = dict(
            tps,
            ratios=[round(x, 3) for x in ratios],
            median_ratio=round(median(ratios), 3),
            cpu_ratios=[round(x, 3) for x in cpu_ratios],
            median_cpu_ratio=round(median(cpu_ratios), 3),
        )
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    if not Path(args.vllm_python).is_file():
        sys.exit(
            f"no vLLM interpreter at {args.vllm_python}: run `bash scripts/setup.sh --tests` or pass --vllm-python"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="serve_bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        source, mla = work / "source", work / "mla"
        if not (source / "config.json").exists():
            build_source(source, args)
        convert_s = None if (mla / "config.json").exists() else convert_source(source, mla)  # None: reused
        for r in range(1, args.rounds + 1):
            for name, model in (("source", source), ("mla", mla)):
                result = serve(model, name, f"{args.name}-{name}-{r}", args, work)
                runs.append(dict(result, round=r, model=name))
                print(f"round {r} {name}: " + json.dumps(result["throughput"]), flush=True)
    for name in ("source", "mla"):  # the allocation is deterministic: every run of a model the same
        blocks = {r["cache_blocks"] for r in runs if r["model"] == name}
        if len(blocks) != 1:
            raise RuntimeError(f"{name}: vLLM allocated different block counts across runs: {sorted(blocks)}")
    version = subprocess.run(
        [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "vllm": version,
        "cpu": cpu_name() or platform.machine(),
        "command": "python bench/serve_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
        "values_per_token_layer": VALUES_PER_TOKEN_LAYER,
        "convert_s": convert_s,
        "models": {name: next(r for r in runs if r["model"] == name) for name in ("source", "mla")},
        "runs": runs,
        "summary": summarize(runs, args.concurrency),
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
