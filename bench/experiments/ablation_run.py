"""Shared by the experiment wrappers that patch the converter and then run bench/quality_ablation.py:
importing it puts the repository and bench/ on sys.path (so ``mlakit`` and the bench's helpers import
from this checkout), and ``run_ablation`` hands the command line to the ablation."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
for path in (BENCH, BENCH.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def run_ablation() -> None:
    """bench/quality_ablation.py with this process's arguments, in this process (so patches apply)."""
    sys.argv = [str(BENCH / "quality_ablation.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
