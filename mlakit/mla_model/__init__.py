"""mlakit's MLA model: config, modeling and loading helpers."""

from __future__ import annotations

from .configuration_mla import MLAConfig
from .modeling_mla import MLAForCausalLM, MLAModel

__all__ = ["MLAConfig", "MLAForCausalLM", "MLAModel", "load_converted", "register_auto_classes"]


def register_auto_classes() -> None:
    """Make AutoConfig / AutoModelForCausalLM resolve ``model_type: mlakit_mla``."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    try:
        AutoConfig.register(MLAConfig.model_type, MLAConfig)
        AutoModel.register(MLAConfig, MLAModel)
        AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM)
    except ValueError:  # already registered
        pass


register_auto_classes()  # importing the model code is importing transformers: register now


def load_converted(path, dtype=None, device: str = "cpu") -> MLAForCausalLM:
    """Load an mlakit MLA checkpoint directory as an eval-mode model."""
    import torch

    model = MLAForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32)
    return model.to(device).eval()
