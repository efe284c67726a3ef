"""mlakit: convert GQA/MHA checkpoints into Multi-head Latent Attention (MLA) models."""

from __future__ import annotations

from .mla_model import MLAConfig, MLAForCausalLM, load_converted, register_auto_classes

__version__ = "0.1.0"
__all__ = ["MLAConfig", "MLAForCausalLM", "__version__", "load_converted"]

register_auto_classes()
