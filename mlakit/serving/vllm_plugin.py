"""vLLM general plugin (entry point group ``vllm.general_plugins``): serve ``MLAForCausalLM`` checkpoints.

vLLM calls ``register()`` in every process it starts, before it reads a model's config. It
registers three things, all idempotent:

- the model class, in lazy ``module:Class`` form (nothing of the model is imported until a
  checkpoint with ``architectures: ["MLAForCausalLM"]`` is served);
- ``MLAServedConfig`` as the transformers config of ``model_type: mlakit_mla`` in this process,
  so vLLM sees one served latent rank and rotary width (no ``--trust-remote-code`` needed);
- an architecture convertor that tells vLLM the model is MLA (vLLM keeps a fixed list of MLA
  model types), so it allocates the latent paged cache and picks an MLA attention backend.

On a vLLM outside the tested range it logs a warning and skips the convertor (vLLM internals);
the model class's constructor then raises an error naming the tested range. A plugin that
raised here would break vLLM for every other model too.
"""

from __future__ import annotations

import logging

from .vllm_version import vllm_version_supported

__all__ = ["MODEL_CLASS", "register"]

logger = logging.getLogger(__name__)

MODEL_CLASS = "mlakit.serving.vllm_model:MLAKitForCausalLM"
_MODEL_TYPE = "mlakit_mla"


def register() -> None:
    import vllm
    from transformers import AutoConfig
    from vllm import ModelRegistry

    import mlakit  # noqa: F401  (registers MLAConfig first; the served config then replaces it here)

    from .served_config import MLAServedConfig

    ModelRegistry.register_model("MLAForCausalLM", MODEL_CLASS)
    AutoConfig.register(_MODEL_TYPE, MLAServedConfig, exist_ok=True)
    if not vllm_version_supported(vllm.__version__):
        # The model class's constructor raises the error naming the tested range.
        logger.warning(
            "mlakit's vLLM plugin is not tested with vLLM %s; serving its checkpoints will fail",
            vllm.__version__,
        )
        return
    from .vllm_arch import MLAKitArchConvertor, register_convertor

    register_convertor(_MODEL_TYPE, MLAKitArchConvertor)
