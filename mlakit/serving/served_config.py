"""The native config as an engine reads it: one latent rank and one rotary width for all layers.

vLLM reads ``kv_lora_rank`` and ``qk_rope_head_dim`` off the config as single integers (cache
spec, head size, backend choice). ``MLAServedConfig`` is the native ``MLAConfig`` with those two
set to the served (padded) shape; the per-layer native values move to ``native_*`` fields, which
the engine model reads to pad the weights. Loading refuses, naming the fix, a checkpoint that
does not fit or whose rope scaling cannot be served exactly.
"""

from __future__ import annotations

from ..mla_model.configuration_mla import MLAConfig
from .served_shape import ServedShape, check_rope_type, plan_served_shape

__all__ = ["MLAServedConfig"]


class MLAServedConfig(MLAConfig):
    def __init__(
        self, native_kv_lora_rank=None, native_qk_rope_head_dim=None, native_rope_freq_index=None, **kwargs
    ):
        # Rebuilt from a served config's own dict (to_dict, from_dict): restore the native fields.
        if native_kv_lora_rank is not None:
            kwargs.update(
                kv_lora_rank=native_kv_lora_rank,
                qk_rope_head_dim=native_qk_rope_head_dim,
                rope_freq_index=native_rope_freq_index,
            )
        super().__init__(**kwargs)
        shape = plan_served_shape(self)
        check_rope_type(self)
        self.native_kv_lora_rank = list(shape.native_kv_lora_rank)
        self.native_qk_rope_head_dim = list(shape.native_rope_dim)
        self.native_rope_freq_index = [list(idx) for idx in self.rope_freq_index]
        self.kv_lora_rank = shape.kv_lora_rank
        self.qk_rope_head_dim = shape.rope_dim
        self.rope_freq_index = [list(idx) for idx in shape.rope_freq_index]

    def served_shape(self) -> ServedShape:
        return ServedShape(
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            tuple(self.native_kv_lora_rank),
            tuple(self.native_qk_rope_head_dim),
            tuple(tuple(idx) for idx in self.rope_freq_index),
        )
