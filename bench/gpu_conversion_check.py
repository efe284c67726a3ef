"""Conversion on a CUDA GPU (``--device cuda``) against the same conversion on the CPU.

For each tiny random source family (``tests/tiny_models.py``): a full-rank conversion on the GPU must
reproduce the source's logits, and compressed ones (KV budget 0.4, fisher ranks, the joint and the
per-head value refit, random calibration), streamed on the GPU, must pick the same ranks as in memory
on the CPU and give logits close to the CPU conversion's (the float64 math and the float32 layers run
on another device, so not bit for bit).
Prints one line per check, with the seconds each conversion took, and exits non-zero on a failure.
Needs CUDA; without it, it says so and exits 0.

    python bench/gpu_conversion_check.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mlakit import load_converted  # noqa: E402
from mlakit.pipeline.api import ConvertOptions, convert, convert_streaming  # noqa: E402
from tests.tiny_models import FAMILY_BUILDERS, save_tiny_source  # noqa: E402

# enough sequences that the refit's held-out check keeps it in most layers
CALIB = dict(calib="random", calib_samples=64, calib_seq_len=32, dtype="float32", quiet=True)
COMPRESSED = dict(kv_budget=0.4, allocation="fisher")
REFITS = ("values", "values-per-head")
FULL_RANK_ATOL = 1e-4  # logits of order 1; float32 layers
CPU_GPU_RTOL = 1e-2  # of the logits' spread: the refit's float64 solves round differently on the GPU


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def _full_rank(src_dir: Path, root: Path, family: str, ids) -> bool:
    """The full-rank conversion on the GPU against the source's logits."""
    source = _logits(AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32).eval(), ids)
    tick = time.time()
    convert(str(src_dir), root, ConvertOptions(device="cuda", **CALIB))
    seconds = time.time() - tick
    err = float((_logits(load_converted(root), ids) - source).abs().max())
    ok = err <= FULL_RANK_ATOL
    print(f"{family:14s} full rank on cuda: max |dlogit| {err:.2e} (bound {FULL_RANK_ATOL}) "
          f"{'ok' if ok else 'FAILED'} ({seconds:.1f} s)")
    return ok


def _compare(src_dir: Path, root: Path, family: str, refine: str, ids) -> bool:
    """The compressed conversion with --refine REFINE streamed on the GPU against it in memory on the CPU."""
    reports, logits, seconds = {}, {}, {}
    for device, run in (("cuda", convert_streaming), ("cpu", convert)):
        tick = time.time()
        reports[device] = run(str(src_dir), root / device, ConvertOptions(device=device, refine=refine, **COMPRESSED, **CALIB))
        seconds[device] = time.time() - tick
        logits[device] = _logits(load_converted(root / device), ids)
    ranks = {d: [lay["kv_lora_rank"] for lay in r["layers"]] for d, r in reports.items()}
    kept = [lay.get("refine", {}).get("kept") for lay in reports["cuda"]["layers"]]
    bound = CPU_GPU_RTOL * float(logits["cpu"].std())
    err = float((logits["cuda"] - logits["cpu"]).abs().max())
    ok = ranks["cuda"] == ranks["cpu"] and err <= bound
    print(f"{family:14s} budget 0.4, --refine {refine}: ranks cuda {ranks['cuda']} cpu {ranks['cpu']}, kept {kept}, "
          f"max |dlogit| cuda vs cpu {err:.2e} (bound {bound:.2e}) {'ok' if ok else 'FAILED'} "
          f"({seconds['cuda']:.1f} s cuda, {seconds['cpu']:.1f} s cpu)")
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_conversion_check: no CUDA device; nothing to check")
        return 0
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(5))
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for family in sorted(FAMILY_BUILDERS):
            torch.manual_seed(0)
            src_dir = save_tiny_source(family, Path(tmp) / family / "src")
            failures += not _full_rank(src_dir, Path(tmp) / family / "full", family, ids)
            for refine in REFITS:
                failures += not _compare(src_dir, Path(tmp) / family / refine, family, refine, ids)
    print(f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
