"""Run in vLLM's interpreter (not the test process): serve each job's checkpoint, write tokens and logprobs.

    python tests/vllm_runner.py JOBS.json RESULTS.json

JOBS.json: a list of {"name", "model", "prompts": [[ids]], "max_tokens", "max_model_len"} and,
optionally, "vllm_version": the version vLLM reports to the plugin's model (the version check). Each
result holds per prompt the greedy tokens, the logprob of each generated token (decode) and of
each prompt token after the first (prefill), or, for a job the engine refused, the error text.
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): one start per job, no
engine-core child to spawn.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path


def plugin_dist_info(directory: Path, root: Path) -> Path:
    """A ``mlakit`` dist-info under DIRECTORY whose entry points are ROOT/pyproject.toml's; returns DIRECTORY.

    First on an interpreter's path, it makes vLLM load the plugin of the tree ROOT, whatever mlakit
    that interpreter has installed (or none)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = directory / f"mlakit-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mlakit\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return directory


def _chosen(logprobs) -> list[float]:
    return [next(iter(step.values())).logprob for step in logprobs]


def run_job(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    real_version = vllm.__version__
    vllm.__version__ = job.get("vllm_version", real_version)
    start = time.perf_counter()
    try:
        llm = LLM(
            job["model"],
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=job["max_model_len"],
            enforce_eager=True,
            seed=0,
        )
    except Exception as exc:  # the refusal tests read the message
        return {"name": job["name"], "error": f"{type(exc).__name__}: {exc}"}
    finally:
        vllm.__version__ = real_version
    started = time.perf_counter()
    params = SamplingParams(
        max_tokens=job["max_tokens"], temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    finished = time.perf_counter()
    results = []
    for out in outputs:
        gen = out.outputs[0]
        results.append(
            {
                "tokens": list(gen.token_ids),
                "decode_logprobs": _chosen(gen.logprobs),
                "prefill_logprobs": _chosen(out.prompt_logprobs[1:]),
            }
        )
    del llm
    gc.collect()
    return {
        "name": job["name"],
        "outputs": results,
        "start_s": started - start,
        "generate_s": finished - started,
    }


def main(jobs_path: str, results_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = [run_job(job) for job in jobs]
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
