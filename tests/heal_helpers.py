"""The heal tests' model pair, shared by the single- and multi-process heal tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mlakit.pipeline.api import ConvertOptions, convert
from tests.tiny_models import build_tiny

ATTENTION = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def make_heal_pair(root: Path, **convert_options) -> tuple[Path, Path]:
    """(teacher dir, student dir): a tiny Llama with weights scaled x4 (peaked next-token
    distributions), converted to MLA without compression, whose attention projections are then
    perturbed by noise of 30% of their scale: a student with a real gap that training can close.
    CONVERT_OPTIONS: more ConvertOptions fields (default: float32, the default method)."""
    model = build_tiny("llama_gqa")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(str(root / "teacher"))
    options = {"dtype": "float32", "quiet": True} | convert_options
    convert(str(root / "teacher"), root / "student", ConvertOptions(**options))
    student = weights(root / "student")
    gen = torch.Generator().manual_seed(5)
    for name, w in student.items():
        if name.split(".")[-2] in ATTENTION:
            w += 0.3 * w.std() * torch.randn(w.shape, generator=gen)
    save_file(student, str(root / "student" / "model.safetensors"), metadata={"format": "pt"})
    return root / "teacher", root / "student"
