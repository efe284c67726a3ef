"""mlakit's MLA causal LM: the Llama body with DeepSeek-style latent attention.

Self-contained (torch + transformers, works on transformers 4.x and 5.x): this file,
``configuration_mla.py`` and the decode kernels are copied beside converted checkpoints so
they load with ``trust_remote_code=True`` where mlakit is not installed.

Per layer the cache holds only the latent ``c_kv`` (B, 1, S, r) as the cache layer's keys
and the rotated shared key ``k_rope`` (B, 1, S, d_R) as its values: r + d_R values per token.
Prefill expands per-head K/V from the latent and runs SDPA; a single-token decode step
runs in absorbed form over the raw latent (``mla_decode``: Triton on CUDA, torch elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from ..kernels.decode_dispatch import mla_decode
from .configuration_mla import MLAConfig

if TYPE_CHECKING:
    # Never run. transformers 4.x, loading remote code from a local directory, copies only the
    # files the modeling file imports itself; naming the kernel files here makes it copy them.
    from ..kernels.decode_reference import mla_decode_reference  # noqa: F401
    from ..kernels.decode_triton import mla_decode_triton  # noqa: F401

try:
    from transformers.modeling_layers import GradientCheckpointingLayer as _LayerBase
except ImportError:  # transformers < 4.52
    _LayerBase = nn.Module

__all__ = ["AttentionMask", "MLAAttention", "MLADecoderLayer", "MLAForCausalLM", "MLAModel", "MLAPreTrainedModel"]

_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def _output(cls, cache, **fields):
    """Build a model output whatever this transformers version calls the cache field."""
    key = "cache" if "cache" in cls.__dataclass_fields__ else "past_key_values"
    return cls(**{key: cache}, **fields)


class MLAAttention(nn.Module):
    absorb_decode = True  # single-token steps over the raw latent; False forces the expanded path

    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.layer_kv_lora_rank(layer_idx)
        self.qk_rope_head_dim = config.layer_rope_dim(layer_idx)
        self.scaling = config.softmax_scale
        self.attention_window = config.attention_window
        hidden, H = config.hidden_size, self.num_heads
        self.q_proj = nn.Linear(hidden, H * (self.qk_nope_head_dim + self.qk_rope_head_dim), bias=config.q_proj_bias)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.kv_a_proj_bias
        )
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, hidden, bias=config.o_proj_bias)
        idx = list(config.rope_freq_index[layer_idx])
        # cos/sin of the source rotary table (B, S, head_dim) are gathered at these columns. A plain
        # list, not a buffer: from_pretrained may leave non-persistent buffers uninitialised.
        self.rope_columns = idx + [j + config.head_dim // 2 for j in idx]

    def _rotate(self, x, cos, sin):
        return x * cos + rotate_half(x) * sin

    def _project(self, hidden_states, position_embeddings):
        """q_nope (B, H, S, d), rotated q_rope (B, H, S, d_R), c_kv (B, S, r), rotated k_rope (B, S, d_R)."""
        B, S, _ = hidden_states.shape
        H, d_nope, d_rope, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q = self.q_proj(hidden_states).view(B, S, H, d_nope + d_rope).transpose(1, 2)  # (B, H, S, d+d_R)
        q_nope, q_rope = q.split([d_nope, d_rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([r, d_rope], dim=-1)  # (B, S, r), (B, S, d_R)
        cos, sin = position_embeddings
        cols = torch.tensor(self.rope_columns, dtype=torch.long, device=cos.device)
        cos, sin = cos.index_select(-1, cols), sin.index_select(-1, cols)  # (B, S, d_R)
        return q_nope, self._rotate(q_rope, cos[:, None], sin[:, None]), c_kv, self._rotate(k_rope, cos, sin)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        B, S, _ = hidden_states.shape
        q_nope, q_rope, c_kv, k_rope = self._project(hidden_states, position_embeddings)
        if cache is not None:
            c_kv, k_rope = cache.update(c_kv[:, None], k_rope[:, None], self.layer_idx)
            c_kv, k_rope = c_kv[:, 0], k_rope[:, 0]  # (B, T, r), (B, T, d_R): views, no copy
        if S == 1 and self.absorb_decode and attention_mask is not None and attention_mask.decode_bounds is not None:
            out = self._absorbed(q_nope[:, :, 0], q_rope[:, :, 0], c_kv, k_rope, *attention_mask.decode_bounds)
            out = out.reshape(B, 1, self.num_heads * self.v_head_dim)
        else:
            out = self._expanded(q_nope, q_rope, c_kv, k_rope, attention_mask)
        return self.o_proj(out), None

    def _expanded(self, q_nope, q_rope, c_kv, k_rope, mask):
        B, H, S, _ = q_nope.shape
        T = c_kv.shape[1]
        kv = self.kv_b_proj(c_kv).view(B, T, H, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # (B, H, T, d)
        k = torch.cat([k_nope, k_rope[:, None].expand(B, H, T, self.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, S, d + d_R)
        bias = None if mask is None else mask.additive(q.dtype)
        # the fused kernels (CPU's, CUDA's flash) take one head size for q, k and v; with a narrower v, sdpa
        # falls back to its unfused path. Zero columns of v give zero output columns, dropped after.
        pad = q.shape[-1] - self.v_head_dim
        if pad > 0:
            v = F.pad(v, (0, pad))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=False, scale=self.scaling)
        return out[..., : self.v_head_dim].transpose(1, 2).reshape(B, S, H * self.v_head_dim)

    def _absorbed(self, q_nope, q_rope, c_kv, k_rope, lengths, starts):
        H, d_nope = self.num_heads, self.qk_nope_head_dim
        w = self.kv_b_proj.weight.view(H, d_nope + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, :d_nope], w[:, d_nope:]  # (H, d, r)
        # Per-head bmm with heads as the batch: the same contractions as einsum "bhd,hdr->bhr" and
        # "bhr,hdr->bhd" without einsum's dispatch overhead, which shows at short contexts.
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (B, H, r)
        o_lat, _ = mla_decode(q_lat, q_rope, c_kv, k_rope, lengths, self.scaling, starts=starts)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (B, H, d)


class AttentionMask:
    """Causal + padding (+ sliding window) mask of one forward call.

    ``decode_bounds`` is (lengths, starts) when each row attends to one contiguous range of
    the cache (always so for causal decoding with left padding): the absorbed kernel's form.
    """

    def __init__(self, padding_mask, batch: int, past: int, q_len: int, window: int | None, device):
        T = past + q_len
        q_idx = torch.arange(past, T, device=device)[:, None]
        k_idx = torch.arange(T, device=device)[None, :]
        allowed = k_idx <= q_idx
        if window is not None:
            allowed = allowed & (k_idx > q_idx - window)
        allowed = allowed[None, None]  # (1, 1, S, T)
        if padding_mask is not None:
            allowed = allowed & padding_mask[:, None, None, :T].bool()
        self.allowed = allowed
        self.decode_bounds = None
        if q_len == 1:
            if padding_mask is None:
                starts = torch.zeros(batch, dtype=torch.int32, device=device)
            else:
                pm = padding_mask[:, :T].bool()
                starts = (pm.cumsum(-1) == 0).sum(-1).to(torch.int32)  # leading padding
                contiguous = pm.sum(-1) == (T - starts)
                if not bool(contiguous.all()):
                    return  # holes inside a row: only the expanded path can honour them
            if window is not None:
                starts = starts.clamp_min(T - window)
            self.decode_bounds = (torch.full((batch,), T, dtype=torch.int32, device=device), starts)

    def additive(self, dtype):
        zero = torch.zeros((), dtype=dtype, device=self.allowed.device)
        return torch.where(self.allowed, zero, torch.finfo(dtype).min)


class MLADecoderLayer(_LayerBase):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MLAAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        attn, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache)
        return self.after_attention(hidden_states, attn)

    def after_attention(self, hidden_states, attn):
        """The layer's output from its input HIDDEN_STATES and its attention's output ATTN: the residual, then the MLP."""
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MLAPreTrainedModel(PreTrainedModel):
    config_class = MLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MLADecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        if _TRANSFORMERS_5:  # the base class also restores rotary tables after meta-device loading
            return super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, LlamaRMSNorm):
            module.weight.data.fill_(1.0)


class MLAModel(MLAPreTrainedModel):
    def __init__(self, config: MLAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MLADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        past_key_values=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config) if _TRANSFORMERS_5 else DynamicCache()
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError("cache must be a transformers Cache (e.g. DynamicCache); legacy tuples are not supported")
        past = cache.get_seq_length() if cache is not None else 0
        B, S = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = (torch.arange(S, device=inputs_embeds.device) + past)[None].expand(B, S)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("MLA models take a 2-D (batch, tokens) padding mask, not a prepared 4-D mask")
        mask = AttentionMask(attention_mask, B, past, S, self.config.attention_window, inputs_embeds.device)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask, cache)
        hidden_states = self.norm(hidden_states)
        return _output(BaseModelOutputWithPast, cache if use_cache else None, last_hidden_state=hidden_states)


class MLAForCausalLM(MLAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"} if _TRANSFORMERS_5 else ["lm_head.weight"]

    def __init__(self, config: MLAConfig):
        super().__init__(config)
        self.model = MLAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        past_key_values=None,
        **kwargs,
    ):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden_states = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        cache_out = out.cache if hasattr(out, "cache") else out.past_key_values
        return _output(CausalLMOutputWithPast, cache_out, loss=loss, logits=logits)
