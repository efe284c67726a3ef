"""Run in vLLM's interpreter (not the test process): serve each job's checkpoint, write tokens and logprobs.

    python tests/vllm_runner.py JOBS.json RESULTS.json

JOBS.json: a list of {"name", "model", "prompts": [[ids]], "max_tokens", "max_model_len"}. Each
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


def _chosen(logprobs) -> list[float]:
    return [next(iter(step.values())).logprob for step in logprobs]


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

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
