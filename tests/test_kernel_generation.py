"""Greedy generation of converted models through the Triton decode kernel equals the torch path.

Tiny compressed conversions (latent ranks that are not powers of two, biases, a sliding
window) generate a left-padded batch twice, each in a fresh subprocess: once with
``MLAKIT_DECODE=torch`` (the torch reference), once with ``TRITON_INTERPRET=1`` and
``MLAKIT_DECODE=triton`` (the Triton kernel in its interpreter; the variables must be set
before triton is first imported, which transformers does early). Both count the calls of
their decode function, so a run that silently fell back to the expanded path or to the other
backend fails. Tokens must be identical; the per-step logits must agree within
``LOGIT_ATOL`` (float32 models; the kernel matches the reference to ~2e-6 per call).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlakit.pipeline.api import ConvertOptions, convert
from tests.tiny_models import assert_close

pytest.importorskip("triton")

# (family, kv_lora_rank, rope_dim): r=24 (llama GQA), r=19 with q/k/v biases (qwen2),
# r=13 with an 8-token sliding window (mistral: decode starts move with the window).
CASES = [("llama_gqa", 24, 8), ("qwen2", 19, 6), ("mistral", 13, 4)]
PROMPT_LENS = [37, 9, 24]  # left-padded to 37 (> 32 tokens: the interpreter splits rows)
NEW_TOKENS = 16
LOGIT_ATOL = 1e-4
# The tiny sources have no tokenizer: calibrate on random tokens (speed, not quality, matters here).
CALIB = dict(calib="random", calib_samples=8, calib_seq_len=32, dtype="float32", quiet=True)
REPO_ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: loads each converted model, counts the calls of the chosen
# decode backend, generates greedily and prints one JSON line per model.
_GENERATE = r"""
import json, sys
import torch
import mlakit.kernels.decode_reference as ref_mod
import mlakit.kernels.decode_dispatch as dispatch
from mlakit.mla_model import load_converted

calls = {"triton": 0, "torch": 0}
def counted(name, fn):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper
try:
    import mlakit.kernels.decode_triton as tri_mod
    tri_mod.mla_decode_triton = counted("triton", tri_mod.mla_decode_triton)  # dispatch imports it per call
except ImportError:
    pass
dispatch.mla_decode_reference = counted("torch", dispatch.mla_decode_reference)

spec = json.loads(sys.argv[1])
for path in spec["models"]:
    calls.update(triton=0, torch=0)
    model = load_converted(path, dtype=torch.float32)
    out = model.generate(
        input_ids=torch.tensor(spec["input_ids"]), attention_mask=torch.tensor(spec["attention_mask"]),
        max_new_tokens=spec["new_tokens"], min_new_tokens=spec["new_tokens"], do_sample=False,
        pad_token_id=0, return_dict_in_generate=True, output_logits=True,
    )
    logits = torch.stack(out.logits, 1)  # raw logits (B, new_tokens, vocab)
    print(json.dumps({"path": path, "tokens": out.sequences.tolist(), "logits": logits.tolist(),
                      "calls": dict(calls), "layers": model.config.num_hidden_layers}))
"""


def _batch(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(1)
    width = max(PROMPT_LENS)
    ids, mask = [], []
    for n in PROMPT_LENS:
        row = torch.randint(3, vocab, (n,), generator=gen).tolist()
        ids.append([0] * (width - n) + row)
        mask.append([0] * (width - n) + [1] * n)
    return ids, mask


def _generate(models: list[Path], ids, mask, backend: str) -> list[dict]:
    env = {**os.environ, "MLAKIT_DECODE": backend, "HF_HUB_OFFLINE": "1"}
    if backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    spec = {
        "models": [str(m) for m in models],
        "input_ids": ids,
        "attention_mask": mask,
        "new_tokens": NEW_TOKENS,
    }
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE, json.dumps(spec)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{backend} generation subprocess failed:\n{proc.stderr[-4000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def converted(tiny_sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("kernel_generation")
    out = []
    for family, rank, rope in CASES:
        dest = root / f"{family}_r{rank}_dr{rope}"
        convert(
            tiny_sources[family],
            dest,
            ConvertOptions(kv_lora_rank=rank, rope_dim=rope, **CALIB),
        )
        out.append(dest)
    return out


def test_triton_generation_matches_torch(converted):
    ids, mask = _batch(vocab=96)
    results = {b: _generate(converted, ids, mask, b) for b in ("torch", "triton")}
    decode_steps = NEW_TOKENS - 1  # the first new token comes from the prefill
    for (family, rank, rope), want, got in zip(CASES, results["torch"], results["triton"]):
        name = f"{family} r={rank} d_R={rope}"
        expected_calls = decode_steps * want["layers"]
        assert want["calls"] == {"torch": expected_calls, "triton": 0}, (
            f"{name}: torch run calls {want['calls']}"
        )
        assert got["calls"] == {"triton": expected_calls, "torch": 0}, (
            f"{name}: triton run calls {got['calls']}, expected {expected_calls} Triton decode calls"
        )
        assert got["tokens"] == want["tokens"], f"{name}: greedy tokens differ between triton and torch"
        new = torch.tensor(want["tokens"])[:, len(ids[0]) :]
        assert new.shape == (len(PROMPT_LENS), NEW_TOKENS)
        err = assert_close(
            f"{name} logits", torch.tensor(got["logits"]), torch.tensor(want["logits"]), LOGIT_ATOL
        )
        print(f"{name}: {NEW_TOKENS} tokens x {len(PROMPT_LENS)} rows identical; max logit diff {err:.2e}")
