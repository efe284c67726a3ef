"""mlakit's native MLA checkpoints as a vLLM model: vLLM's MLA attention and latent paged cache,
mlakit's rope, biases, scale and per-layer ranks.

Imported by vLLM (lazily, through ``vllm_plugin.register``) when it serves a checkpoint with
``architectures: ["MLAForCausalLM"]``. The config it receives is ``MLAServedConfig``: one served
shape r + d_R (512 + 64) for all layers; each layer's native weights are zero-padded to it at
load time (``served_shape``), which changes no score.

What this model does itself rather than through vLLM's DeepSeek code, and why:
- rope: cos/sin of the source's rotary table (transformers' own rope init, any static scaling,
  attention factor included), gathered per layer at its ``rope_freq_index``, applied in plain
  torch in half-split layout. vLLM's DeepSeek path rewrites scalings to DeepSeek-YaRN and its
  CPU rotary kernel is wrong on the strided q/k views of MLA (see DESIGN.md, "Formats and serving").
- no latent norm: the raw latent goes to ``MLAAttention`` (the DeepSeek wrapper always applies
  ``kv_a_layernorm``), with the checkpoint's ``softmax_scale``;
- q_proj / kv_a_proj_with_mqa / o_proj biases when the checkpoint has them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import vllm
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaMLP

from ..arch import names
from .served_config import MLAServedConfig
from .served_shape import ServingError, check_window, pad_kv_a_proj, pad_kv_b_proj, pad_q_proj
from .vllm_cpu_decode import batched_paged_decode
from .vllm_cpu_mla import batch_absorbed_products
from .vllm_version import check_vllm_version

__all__ = ["MLAKitForCausalLM"]

# A child of vLLM's "vllm" logger, which has vLLM's handlers: the served shape shows in vLLM's own log.
logger = logging.getLogger(f"vllm.{__name__}")

# native attention tensors whose shape the served shape changes (o_proj's does not)
_ATTN_WEIGHT = names.mla_attn_pattern((names.Q_PROJ, names.KV_A_PROJ, names.KV_B_PROJ))
_STACKED_MLP = ((names.GATE_PROJ, 0), (names.UP_PROJ, 1))  # checkpoint name -> shard of vLLM's gate_up_proj


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _SourceRope:
    """cos/sin of the source's rotary table at the tokens' positions: (N, head_dim / 2) each.

    The inverse frequencies and attention factor come from transformers' rope init for the
    config's scaling (the same table the native model uses); the angle is one float32 product
    per entry, as in transformers.
    """

    def __init__(self, config: MLAServedConfig):
        table = LlamaRotaryEmbedding(config=config)
        self.inv_freq = table.inv_freq.detach().float().clone()
        self.scaling = float(table.attention_scaling)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (N, head_dim / 2)
        return angles.cos() * self.scaling, angles.sin() * self.scaling


class MLAKitAttention(nn.Module):
    def __init__(self, config: MLAServedConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        H, D = config.num_attention_heads, config.hidden_size
        if H % tp:
            raise ServingError(
                f"{H} attention heads do not split over tensor parallel size {tp}; pick a divisor"
            )
        self.num_heads = H // tp
        self.d_nope, self.d_v = config.qk_nope_head_dim, config.v_head_dim
        self.rank, self.d_rope = config.kv_lora_rank, config.qk_rope_head_dim  # served shape
        quant = vllm_config.quant_config
        self.q_proj = ColumnParallelLinear(
            D,
            H * (self.d_nope + self.d_rope),
            bias=config.q_proj_bias,
            quant_config=quant,
            prefix=f"{prefix}.{names.Q_PROJ}",
        )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            D,
            self.rank + self.d_rope,
            bias=config.kv_a_proj_bias,
            quant_config=quant,
            prefix=f"{prefix}.{names.KV_A_PROJ}",
        )
        self.kv_b_proj = ColumnParallelLinear(
            self.rank,
            H * (self.d_nope + self.d_v),
            bias=False,
            quant_config=quant,
            prefix=f"{prefix}.{names.KV_B_PROJ}",
        )
        self.o_proj = RowParallelLinear(
            H * self.d_v, D, bias=config.o_proj_bias, quant_config=quant, prefix=f"{prefix}.{names.O_PROJ}"
        )
        self.attn = MLAAttention(
            num_heads=self.num_heads,
            scale=config.softmax_scale,
            qk_nope_head_dim=self.d_nope,
            qk_rope_head_dim=self.d_rope,
            v_head_dim=self.d_v,
            q_lora_rank=None,
            kv_lora_rank=self.rank,
            kv_b_proj=self.kv_b_proj,
            cache_config=vllm_config.cache_config,
            quant_config=quant,
            prefix=f"{prefix}.attn",
        )
        # vLLM 0.32's CPU decode computes the absorbed W_UK / W_UV products head by head (see
        # vllm_cpu_mla) and its attention over the paged latent with a reference kernel (vllm_cpu_decode).
        if batch_absorbed_products(self.attn):
            batched_paged_decode(self.attn)
            if layer_idx == 0:
                logger.info("mlakit: vLLM %s CPU MLA absorbed products and paged decode run as batched GEMMs",
                            vllm.__version__)
        # Columns of the half table for the served rotary pairs: kept pairs first, padding (index 0,
        # zero weights) after. A plain tensor attribute, not a buffer: the weight loader sees no extra tensor.
        self.freq_index = torch.tensor(config.rope_freq_index[layer_idx], dtype=torch.long)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        N = hidden_states.shape[0]
        if self.freq_index.device != cos.device:
            self.freq_index = self.freq_index.to(cos.device)
        cols = self.freq_index
        cos = cos.index_select(-1, cols).repeat(1, 2).to(hidden_states.dtype)  # (N, d_R), half-split layout
        sin = sin.index_select(-1, cols).repeat(1, 2).to(hidden_states.dtype)
        q = self.q_proj(hidden_states)[0].view(N, self.num_heads, self.d_nope + self.d_rope)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        q = torch.cat([q_nope, _rotate(q_rope, cos[:, None], sin[:, None])], dim=-1)  # (N, H, d + d_R)
        c_kv, k_rope = self.kv_a_proj_with_mqa(hidden_states)[0].split([self.rank, self.d_rope], dim=-1)
        k_rope = _rotate(k_rope, cos, sin)[:, None]  # (N, 1, d_R)
        out = self.attn(q, c_kv.contiguous(), k_rope, output_shape=(N, self.num_heads * self.d_v))
        return self.o_proj(out)[0]


class MLAKitDecoderLayer(nn.Module):
    def __init__(self, config: MLAServedConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.self_attn = MLAKitAttention(config, layer_idx, vllm_config, f"{prefix}.{names.SELF_ATTN}")
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            quant_config=vllm_config.quant_config,
            bias=getattr(config, "mlp_bias", False),
            prefix=f"{prefix}.{names.MLP}",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, residual, cos, sin):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MLAKitModel(nn.Module):
    def __init__(self, config: MLAServedConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            MLAKitDecoderLayer(config, i, vllm_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = _SourceRope(config)

    def forward(self, input_ids, positions, inputs_embeds=None):
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rope(positions)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos, sin)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class MLAKitForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        check_vllm_version(vllm.__version__)
        config = vllm_config.model_config.hf_config
        if not isinstance(config, MLAServedConfig):
            raise ServingError(
                f"expected the served mlakit config, got {type(config).__name__}: is mlakit's vLLM plugin "
                f"loaded? (`pip install mlakit` in vLLM's environment registers it; VLLM_PLUGINS must not exclude it)"
            )
        check_window(config.attention_window, vllm_config.model_config.max_model_len)
        shape = config.served_shape()
        # Padding costs cache memory the user may not expect: worth a warning, not a debug line.
        (logger.warning if shape.padded else logger.info)("mlakit MLA checkpoint %s", shape.describe())
        self.config = config
        self.shape = shape
        self.model = MLAKitModel(config, vllm_config, "model" if not prefix else f"{prefix}.model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def _pad(self, layer: int, module: str, tensor: torch.Tensor) -> torch.Tensor:
        """A native attention weight of LAYER, zero-padded to the served shape (exact: see served_shape)."""
        c, s = self.config, self.shape
        rank, d_rope = s.native_kv_lora_rank[layer], s.native_rope_dim[layer]
        if module == names.Q_PROJ:
            return pad_q_proj(tensor, c.num_attention_heads, c.qk_nope_head_dim, d_rope, s.rope_dim)
        if module == names.KV_A_PROJ:
            return pad_kv_a_proj(tensor, rank, d_rope, s.kv_lora_rank, s.rope_dim)
        return pad_kv_b_proj(tensor, s.kv_lora_rank)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if names.is_dropped_head(name, self.config.tie_word_embeddings):
                continue  # the head is the embedding
            if match := _ATTN_WEIGHT.match(name):
                tensor = self._pad(int(match[1]), match[2], tensor)
            shard = None
            for checkpoint_name, shard_id in _STACKED_MLP:
                if f".{names.MLP}.{checkpoint_name}." in name:
                    name, shard = name.replace(checkpoint_name, "gate_up_proj"), shard_id
                    break
            if name not in params:
                raise ServingError(
                    f"checkpoint tensor {name!r} has no place in the served model: is this "
                    f"checkpoint an mlakit native (model_type mlakit_mla) one?"
                )
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(name)
        return loaded
