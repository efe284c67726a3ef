"""Fast conversion settings and a CLI runner shared by the reliability tests."""

from __future__ import annotations

from click.testing import CliRunner

from mlakit.cli import cli

# A tiny compressed conversion with random calibration: seconds per run.
FAST = dict(
    kv_lora_rank=20, rope_dim=8, calib="random", calib_samples=4, calib_seq_len=8, dtype="float32", quiet=True
)


def run(*args):
    """`mla-convert convert ARGS -q` in-process: (exit code, output plus the exception's text)."""
    result = CliRunner().invoke(cli, ["convert", *map(str, args), "-q"])
    return result.exit_code, result.output + (str(result.exception) if result.exception else "")


def fast_args() -> list:
    """FAST as convert's command-line flags."""
    return [
        "--kv-lora-rank", 20, "--rope-dim", 8, "--calib", "random", "--calib-samples", 4,
        "--calib-seq-len", 8, "--dtype", "float32",
    ]  # fmt: skip
