"""Run single decoder layers, one at a time, with only that layer's weights resident.

The source side builds the family's own transformers modules from the source config on the
meta device (no weights allocated), so each layer is the exact module the full model would
run: its rotary table (rope scaling included), its attention implementation and its causal
or sliding-window mask. Weights are attached with ``load_state_dict(assign=True)`` and dropped
again after the layer has run. The MLA side does the same with ``MLADecoderLayer``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..arch import names
from ..convert.assemble import mla_layer_tensors

__all__ = ["MLALayers", "SourceLayers"]

# what from_pretrained picks on CPU and CUDA, so calibration matches the in-memory pipeline's
_ATTN_IMPLEMENTATION = "sdpa"


def _attach(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str, device) -> nn.Module:
    """Load MODULE's parameters from TENSORS[prefix + name] as float32 on DEVICE (strict)."""
    state = {
        name[len(prefix) :]: t.to(device=device, dtype=torch.float32)
        for name, t in tensors.items()
        if name.startswith(prefix)
    }
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


class SourceLayers:
    """The source model's decoder layers, built one at a time from the source CONFIG."""

    def __init__(self, config, window: int | None, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            self.skeleton = AutoModelForCausalLM.from_config(config, attn_implementation=_ATTN_IMPLEMENTATION)
        self.config = self.skeleton.config
        self.device = device
        self.window = window
        rotary = self.skeleton.model.rotary_emb
        # a real rotary table (rope scaling applied), not the meta one
        self.rotary = type(rotary)(config=self.config).to(device)
        self.inv_freq = self.rotary.inv_freq.detach().cpu()
        self._layer_cls = type(self.skeleton.model.layers[0])

    @torch.no_grad()
    def inputs(self, batch: int, seq_len: int):
        """(mask, position_embeddings) of a batch of SEQ_LEN-token sequences from position 0."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        probe = torch.empty(batch, seq_len, self.config.hidden_size, device=self.device)
        position_ids = torch.arange(seq_len, device=self.device)[None]
        make_mask = create_causal_mask if self.window is None else create_sliding_window_causal_mask
        # no cache, passed by position: transformers 5.x before 5.25 names that argument past_key_values, later
        # ones cache (a keyword fails on one or the other: a conversion under transformers 5.17 broke on it)
        mask = make_mask(self.config, probe, None, None, position_ids=position_ids)
        return mask, self.rotary(probe, position_ids)

    def layer(self, index: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
        """Decoder layer INDEX with weights from TENSORS (full checkpoint names), float32."""
        with torch.device("meta"):
            module = self._layer_cls(self.config, layer_idx=index)
        return _attach(module, tensors, names.layer_prefix(index), self.device)

    @torch.no_grad()
    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """LAYER applied to HIDDEN (B, L, D) float32 on the layer's device."""
        return self.forward(layer, hidden)

    def forward(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``run`` in the caller's grad mode (the sensitivity sweep backpropagates through it)."""
        mask, position_embeddings = self.inputs(hidden.shape[0], hidden.shape[1])
        return layer(hidden, attention_mask=mask, position_embeddings=position_embeddings, use_cache=False)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, tensors: dict[str, torch.Tensor], head: str) -> torch.Tensor:
        """Final norm (weights ``model.norm.*`` in TENSORS) and the LM head TENSORS[HEAD], float32 on CPU."""
        return self.head(tensors, head)(hidden).cpu()

    def head(self, tensors: dict[str, torch.Tensor], head: str):
        """hidden -> logits: the final norm (``model.norm.*`` in TENSORS) and the LM head TENSORS[HEAD],
        float32 on the layers' device, weights frozen."""
        with torch.device("meta"):
            norm = type(self.skeleton.model.norm)(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm = _attach(norm, tensors, names.FINAL_NORM_PREFIX, self.device).requires_grad_(False)
        weight = tensors[head].to(self.device, torch.float32)
        return lambda hidden: nn.functional.linear(norm(hidden), weight)


class MLALayers:
    """Decoder layers of the converted model, built one at a time (verification, sequential calibration)."""

    def __init__(self, config, device: str = "cpu"):
        from ..mla_model.modeling_mla import LlamaRotaryEmbedding

        self.config = config
        self.device = device
        self.rotary = LlamaRotaryEmbedding(config=config).to(device)

    def layer(self, index: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
        from ..mla_model.modeling_mla import MLADecoderLayer

        with torch.device("meta"):
            module = MLADecoderLayer(self.config, index)
        return _attach(module, tensors, names.layer_prefix(index), self.device)

    def converted(self, index: int, mla, source: dict[str, torch.Tensor], qkv_bias: bool) -> nn.Module:
        """Layer INDEX with MLA's float32 closed-form attention (not rounded to the output dtype) and the
        rest (norms, MLP) from SOURCE, the source layer's tensors."""
        attention = mla_layer_tensors(index, mla, torch.float32, q_bias=qkv_bias, kv_a_bias=qkv_bias)
        prefix = names.attn_prefix(index)
        return self.layer(index, attention | {k: t for k, t in source.items() if not k.startswith(prefix)})

    @torch.no_grad()
    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """LAYER applied to HIDDEN (B, L, D) float32 on the layer's device."""
        return self.forward(layer, hidden)

    def forward(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``run`` in the caller's grad mode (a layer-wise refinement backpropagates through it)."""
        from ..mla_model.modeling_mla import AttentionMask

        B, L, _ = hidden.shape
        position_ids = torch.arange(L, device=self.device)[None].expand(B, L)
        mask = AttentionMask(None, B, 0, L, self.config.attention_window, self.device)
        return layer(hidden, self.rotary(hidden, position_ids), mask, None)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, tensors: dict[str, torch.Tensor], head: str) -> torch.Tensor:
        from ..mla_model.modeling_mla import LlamaRMSNorm

        with torch.device("meta"):
            norm = LlamaRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm = _attach(norm, tensors, names.FINAL_NORM_PREFIX, self.device)
        return nn.functional.linear(norm(hidden), tensors[head].to(self.device, torch.float32)).cpu()
