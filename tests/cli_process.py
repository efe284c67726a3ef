"""The CLI in a fresh interpreter: what a command imported before it gave up (torch-free itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_CODE = (
    "import sys\n"
    "from mlakit.cli import cli\n"
    "try:\n"
    "    cli(sys.argv[1:])\n"
    "except SystemExit as exc:\n"
    "    print(exc.code, 'torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)\n"
)


def cli_in_fresh_interpreter(args: list[str]) -> str:
    """Run ``mla-convert ARGS`` in a new interpreter (mlakit from this checkout) and return its
    stderr, which ends with "CODE TORCH TRANSFORMERS": the exit code, and whether torch and
    transformers had been imported when the command gave up."""
    proc = subprocess.run([sys.executable, "-c", _CODE, *args], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    return proc.stderr
