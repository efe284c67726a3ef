"""Heal a converted MLA model: distillation from the original model (``mla-convert heal``)."""

from __future__ import annotations

from .data import RANDOM_SPEC, PackedSequences, open_training_data
from .loss import DistillLoss, distill_loss
from .trainer import HealError, HealOptions, heal

__all__ = [
    "DistillLoss",
    "HealError",
    "HealOptions",
    "PackedSequences",
    "RANDOM_SPEC",
    "distill_loss",
    "heal",
    "open_training_data",
]
