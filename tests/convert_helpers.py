"""Fast conversion settings, a CLI runner, checkpoint comparisons and an interrupting ``on_layer``
hook shared by the conversion tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

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


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory PATH, from all its safetensors shards."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """GOT holds WANT's tensors (equal values and dtypes, any sharding) and the same config."""
    a, b = checkpoint_tensors(got), checkpoint_tensors(want)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())


def assert_same_bytes(got: Path, want: Path) -> None:
    """Every weight file and config of GOT is byte for byte the one in WANT."""
    files = sorted(p.name for p in want.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    assert files and files == sorted(
        p.name for p in got.iterdir() if p.suffix == ".safetensors" or p.name == "config.json"
    )
    for name in files:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


def layer_records(report: dict) -> list[dict]:
    """REPORT's per-layer records without the refinement's wall time (two runs differ only there)."""
    return [r | ({"refine": {k: v for k, v in r["refine"].items() if k != "seconds"}} if "refine" in r else {})
            for r in report["layers"]]


def stop_at(phase: str, index: int, exc=None):
    """An ``on_layer`` hook raising EXC (default ``Interrupt``) before layer INDEX of PHASE."""

    def hook(at_phase, at_index):
        if (at_phase, at_index) == (phase, index):
            raise (exc or Interrupt)()

    return hook


class Interrupt(Exception):
    """What ``stop_at`` raises by default: a crash in the middle of a conversion."""
