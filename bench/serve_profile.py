"""Where a vLLM decode step spends its time on CPU: serve_bench's source and MLA models, torch.profiler.

Per model, in vLLM's interpreter (in-process engine, ``--enforce-eager``, fp32), after one
untimed warm-up: one ``generate`` of ``--concurrency`` prompts with 1 new token (prefill alone)
and one with ``1 + --steps`` new tokens, each timed; their difference over ``--steps`` is the
wall time of one decode step of the whole batch. The second call runs under torch.profiler;
the report lists the ops with the most self CPU time, per decode step (the prefill's share of
the second call is in the totals too: see the prefill-only wall time).

    python bench/serve_profile.py --work /tmp/sbw --out bench/results   # models from serve_bench --work

The models are serve_bench's (``--work`` reuses or builds them there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import serve_bench

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="Directory for serve_profile.json and .md")
    p.add_argument("--work", type=Path, required=True, help="serve_bench's model directory (built if empty)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="Decode steps in the profiled call")
    p.add_argument("--top", type=int, default=12, help="Ops listed per model")
    p.add_argument("--models", nargs="+", default=["source", "mla"], choices=["source", "mla"])
    p.add_argument(
        "--vllm-python", default=os.environ.get("MLAKIT_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
    )
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(job_path: Path) -> None:
    import random

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    job = json.loads(job_path.read_text())
    llm = LLM(
        job["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max(serve_bench.CONTEXTS),
        enforce_eager=True,
        seed=0,
    )
    rng = random.Random(0)

    def prompts():
        return [
            {"prompt_token_ids": [rng.randrange(3, job["vocab"]) for _ in range(job["prompt_len"])]}
            for _ in range(job["concurrency"])
        ]

    def timed(tokens, prof=None):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        if prof is None:
            llm.generate(prompts(), params, use_tqdm=False)
        else:
            with prof:
                llm.generate(prompts(), params, use_tqdm=False)
        return time.perf_counter() - start

    timed(2)  # warm-up
    prefill = timed(1)
    prof = profile(activities=[ProfilerActivity.CPU])
    total = timed(1 + job["steps"], prof)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    import mlakit

    result = {
        "mlakit": mlakit.__file__,  # the tree whose plugin served the model
        "torch_threads": torch.get_num_threads(),
        "prefill_s": round(prefill, 3),
        "profiled_s": round(total, 3),
        "decode_step_ms": round((total - prefill) / job["steps"] * 1e3, 1),
        "ops": [
            {"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1)}
            for e in ops[: job["top"]]
        ],
    }
    Path(job["result"]).write_text(json.dumps(result))


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [
        "# vLLM CPU decode profile: serve_bench's GQA source and MLA 512 + 64",
        "",
        f"{report['date']}, {a['layers']} layers, concurrency {a['concurrency']}, {a['prompt_len']}-token prompts, "
        f"{a['steps']} decode steps profiled. Command: `{report['command']}`.",
        "",
    ]
    for name, r in report["models"].items():
        lines += [
            f"## {name}: {r['decode_step_ms']} ms per decode step of the batch "
            f"(prefill alone {r['prefill_s']} s, profiled call {r['profiled_s']} s, {r['torch_threads']} threads)",
            "",
            "| op | calls | self CPU ms | per decode step ms |",
            "|---|---|---|---|",
        ]
        steps = a["steps"]
        lines += [
            f"| `{o['op']}` | {o['calls']} | {o['self_cpu_ms']} | {o['self_cpu_ms'] / steps:.1f} |"
            for o in r["ops"]
        ]
        lines.append("")
    lines.append(
        "Self CPU time of the whole profiled call (its prefill included) divided by the decode steps; "
        "the per-step wall time is (profiled call - prefill alone) / steps. Profiler overhead included."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    from datetime import datetime, timezone

    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    bench_args = serve_bench.parse_args(["--out", str(args.out), "--layers", str(args.layers)])
    if not (args.work / "source" / "config.json").exists():
        serve_bench.build_source(args.work / "source", bench_args)
    if not (args.work / "mla" / "config.json").exists():
        serve_bench.convert_source(args.work / "source", args.work / "mla")
    sys.path.insert(0, str(ROOT))
    from tests.vllm_runner import plugin_dist_info

    models = {}
    with tempfile.TemporaryDirectory(prefix="serve_profile-") as tmp:
        tmp = Path(tmp)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(plugin_dist_info(tmp / "dist", ROOT)), str(ROOT)]),
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            HF_HUB_OFFLINE="1",
        )
        for name in args.models:
            job = {
                "model": str(args.work / name),
                "concurrency": args.concurrency,
                "prompt_len": args.prompt_len,
                "steps": args.steps,
                "top": args.top,
                "vocab": bench_args.vocab,
                "result": str(tmp / f"{name}.json"),
            }
            (tmp / f"{name}.job.json").write_text(json.dumps(job))
            with open(tmp / f"{name}.log", "w") as log:
                proc = subprocess.run(
                    [args.vllm_python, __file__, "--out", str(args.out), "--work", str(args.work)]
                    + ["--worker", str(tmp / f"{name}.job.json")],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            if proc.returncode != 0:
                raise RuntimeError(f"{name}: vLLM child failed:\n{(tmp / f'{name}.log').read_text()[-4000:]}")
            models[name] = json.loads((tmp / f"{name}.json").read_text())
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/serve_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
        "models": models,
    }
    (args.out / "serve_profile.json").write_text(json.dumps(report, indent=1))
    (args.out / "serve_profile.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
