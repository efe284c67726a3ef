#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one short run (a lent GPU machine's time is scarce):
#   1. the kernel benchmark (bench/kernel_bench.py);
#   2. the Triton decode kernel, compiled, against the torch reference over the test grid, and
#      generation through it (tests/test_decode_kernel.py, tests/test_kernel_generation.py);
#   3. conversions on the GPU (--device cuda: calibration, closed form, value refits) against the same
#      conversions on the CPU (bench/gpu_conversion_check.py).
# Writes each step's log and the benchmark's JSON to OUT_DIR (default: ./gpu_checks). A step that fails
# is reported and the next one still runs; the exit status is the number of failed steps. STEP names
# (kernel_bench, kernel_tests, conversion) run only those.
#
#     bash bench/gpu_checks.sh [OUT_DIR [STEP...]]
set -u -o pipefail
out="${1:-${OUT:-gpu_checks}}"
shift $(($# > 0 ? 1 : 0))
wanted="${*:-kernel_bench kernel_tests conversion}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
step() {  # NAME SECONDS COMMAND...: run COMMAND under a time limit, its output to OUT_DIR/NAME.txt
  local name=$1 limit=$2
  shift 2
  [[ $name == environment || " $wanted " == *" $name "* ]] || return 0
  echo "== $name"
  if ! timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"; then
    echo "== $name FAILED (or ran past ${limit} s)"
    failed=$((failed + 1))
  fi
}
step environment 30 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch, triton, transformers; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, \"cuda\", torch.cuda.is_available())"'
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== no CUDA device here: nothing more to check"
  exit 0
fi
step kernel_bench 240 python3 bench/kernel_bench.py --out "$out/kernel_bench.json"
step kernel_tests 330 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernel.py tests/test_kernel_generation.py
step conversion 90 python3 bench/gpu_conversion_check.py
echo "== $failed step(s) failed"
exit "$failed"
