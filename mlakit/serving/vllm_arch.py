"""Tell vLLM that ``model_type: mlakit_mla`` is an MLA model (imports vLLM; used by the plugin only).

vLLM decides MLA (latent paged cache of r + d_R values per token, MLA backend, head size
r + d_R) from a fixed list of DeepSeek-like model types inside its architecture convertor;
an out-of-tree model type needs its own convertor, registered under that model type.
"""

from __future__ import annotations

from vllm.transformers_utils import model_arch_config_convertor as _convertors
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

__all__ = ["MLAKitArchConvertor", "register_convertor"]


class MLAKitArchConvertor(ModelArchConfigConvertorBase):
    def is_deepseek_mla(self) -> bool:
        return True

    def get_head_size(self) -> int:
        # The served (padded) shape of MLAServedConfig; vLLM's own rule would re-read
        # qk_rope_head_dim from config.json, where the native (per-layer) value lives.
        return self.hf_text_config.kv_lora_rank + self.hf_text_config.qk_rope_head_dim


def register_convertor(model_type: str, convertor: type[ModelArchConfigConvertorBase]) -> None:
    _convertors.MODEL_ARCH_CONFIG_CONVERTORS[model_type] = convertor
