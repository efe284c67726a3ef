"""Learning-rate schedule and the choice of trainable parameters."""

from __future__ import annotations

import math

import torch

from ..arch.names import MLA_ATTN_PROJ
from ..choices import HEAL_TRAIN_CHOICES as TRAIN_CHOICES

__all__ = ["ATTENTION_PARAMS", "TRAIN_CHOICES", "cosine_with_warmup", "select_trainable"]

# MLA attention projections (DeepSeek names); their weights and biases are what `--train attention` trains.
ATTENTION_PARAMS = MLA_ATTN_PROJ
MIN_LR_RATIO = 0.1  # the cosine ends at this fraction of the peak learning rate


def cosine_with_warmup(optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over WARMUP_STEPS optimizer steps (the first step already uses lr/warmup),
    then a cosine from the peak down to MIN_LR_RATIO of it at TOTAL_STEPS."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _is_attention(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ATTENTION_PARAMS and parts[-1] in ("weight", "bias")


def select_trainable(model: torch.nn.Module, which: str) -> list[str]:
    """Set requires_grad for WHICH ('attention' or 'all'); returns the trained parameter names."""
    if which not in TRAIN_CHOICES:
        raise ValueError(f"--train {which!r} is not one of {', '.join(TRAIN_CHOICES)}")
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(which == "all" or _is_attention(name))
        if p.requires_grad:
            names.append(name)
    if not names:
        raise ValueError(
            f"--train {which}: the model has no parameters named like {', '.join(ATTENTION_PARAMS)}; "
            "is it an mlakit MLA checkpoint? Fix: pass the output directory of `mla-convert convert`, "
            "or use --train all."
        )
    return names
