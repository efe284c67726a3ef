"""Perplexity of a converted checkpoint served by vLLM (plugin) against the same checkpoint in transformers.

The same token windows go through both: mlakit's ``MLAForCausalLM`` (transformers, float32) and
vLLM serving the native checkpoint through mlakit's plugin (``.venv-vllm``, float32, prompt
logprobs). Windows are consecutive, non-overlapping chunks of ``--seq-len`` tokens of the
evaluation text; every token after a window's first is scored, so both perplexities cover the
same tokens with the same context. Without ``--converted`` the built-in default model is
converted with the ``smollm2-135m`` recipe first (the README's main job, in a temp directory).

    python bench/serve_ppl.py                              # converts the default model first
    python bench/serve_ppl.py --converted runs/smollm2-mla --windows 16 --seq-len 512

Results: bench/results/serve_ppl.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def native_nll(converted: Path, windows: list[list[int]]) -> list[float]:
    """Per window, the summed NLL of tokens 1..L-1 under mlakit's model in transformers (float32)."""
    from mlakit.eval.loading import load_converted_model

    model = load_converted_model(converted, torch.float32, torch.device("cpu"))
    sums = []
    with torch.no_grad():
        for ids in windows:
            x = torch.tensor([ids])
            logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), dim=-1)
            sums.append(-logp.gather(1, x[0, 1:, None]).sum().item())
    return sums


def served_nll(converted: Path, windows: list[list[int]], work: Path) -> tuple[list[float], dict]:
    """Per window, the summed NLL from vLLM's prompt logprobs (tests/vllm_runner.py in the vLLM venv)."""
    python = os.environ.get("MLAKIT_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        sys.exit(f"no vLLM venv at {python}: run `bash scripts/setup.sh --tests` (or set MLAKIT_VLLM_PYTHON)")
    jobs, results = work / "jobs.json", work / "results.json"
    length = max(len(w) for w in windows)
    jobs.write_text(
        json.dumps(
            [
                {
                    "name": "served",
                    "model": str(converted),
                    "prompts": windows,
                    "max_tokens": 1,
                    "max_model_len": length + 1,
                }
            ]
        )
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log = work / "vllm.log"
    with open(log, "w") as sink:
        code = subprocess.call(
            [python, str(ROOT / "tests" / "vllm_runner.py"), str(jobs), str(results)],
            stdout=sink,
            stderr=sink,
            env=env,
        )
    if code != 0:
        raise RuntimeError(f"vLLM run failed ({code}):\n{log.read_text()[-3000:]}")
    (result,) = json.loads(results.read_text())
    if "error" in result:
        raise RuntimeError(f"vLLM refused the checkpoint: {result['error']}")
    served_shape = [line for line in log.read_text().splitlines() if "served" in line and "r + d_R" in line]
    sums = [-sum(out["prefill_logprobs"]) for out in result["outputs"]]
    return sums, {"start_s": result["start_s"], "generate_s": result["generate_s"], "log": served_shape[-1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--converted", type=Path, help="a native checkpoint (default: convert the default model)")
    ap.add_argument("--data", default="builtin", help="evaluation text (mlakit data spec)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    from mlakit.data import load_text, tokenize_text
    from mlakit.eval.loading import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="serve-ppl-") as tmp:
        work = Path(tmp)
        converted = args.converted
        if converted is None:
            converted = work / "mla"
            cmd = [
                sys.executable,
                "-c",
                "from mlakit.cli import main; main()",
                "convert",
                "default",
                str(converted),
            ]
            subprocess.run([*cmd, "--recipe", "smollm2-135m", "-q"], check=True)
        tokenizer = load_tokenizer([converted])
        ids = tokenize_text(tokenizer, load_text(args.data, "eval")).tolist()
        n = min(args.windows, len(ids) // args.seq_len)
        windows = [ids[i * args.seq_len : (i + 1) * args.seq_len] for i in range(n)]
        native = native_nll(converted, windows)
        served, info = served_nll(converted, windows, work)
        conversion = json.loads((converted / "conversion.json").read_text())

    scored = sum(len(w) - 1 for w in windows)
    ppl_native, ppl_served = math.exp(sum(native) / scored), math.exp(sum(served) / scored)
    worst = max(abs(a - b) / (len(w) - 1) for a, b, w in zip(native, served, windows))
    row = {
        "command": "python bench/serve_ppl.py " + " ".join(sys.argv[1:]),
        "converted": str(args.converted or "default model, recipe smollm2-135m"),
        "cache_values_per_layer": conversion.get("cache_values_per_token_per_layer")
        or conversion.get("kv_values_per_token_per_layer"),
        "windows": n,
        "seq_len": args.seq_len,
        "scored_tokens": scored,
        "ppl_transformers": ppl_native,
        "ppl_vllm": ppl_served,
        "relative_difference": ppl_served / ppl_native - 1,
        "worst_window_mean_nll_difference": worst,
        "vllm": info,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_ppl.json").write_text(json.dumps(row, indent=2))
    md = [
        "# Served perplexity: vLLM (mlakit plugin) against transformers, same checkpoint",
        "",
        f"`{row['command']}`; checkpoint: {row['converted']}; {n} windows of {args.seq_len} tokens of `{args.data}` "
        f"evaluation text ({scored} scored tokens), float32 on both sides.",
        "",
        "| transformers (MLAForCausalLM) | vLLM (plugin) | relative difference | worst window, mean NLL difference |",
        "|---|---|---|---|",
        f"| {ppl_native:.4f} | {ppl_served:.4f} | {row['relative_difference']:+.2e} | {worst:.2e} nats |",
        "",
        f"vLLM's log: {' '.join(info['log']) or '(no served-shape line)'}",
        "",
    ]
    (args.out / "serve_ppl.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
