"""KV-cache size per token: from the config, and measured from real cache tensors.

Config count per layer: ``kv_lora_rank + qk_rope_head_dim`` for an MLA config (either may
be a per-layer list), else ``2 * num_key_value_heads * head_dim`` (GQA/MHA).

Measured count: one forward pass with ``use_cache=True`` on a (B, S) batch, then for each
cache layer ``(keys.numel() + values.numel()) / (B * S)``; bytes multiply by the element
size of those tensors. The MLA model stores its latent ``c_kv`` as keys (B, 1, S, r) and
its rotary key as values (B, 1, S, d_R), so both counts agree for it; a model that
expands K/V into its cache (a stock DeepSeek-V3 export) shows the difference.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "KVAccount",
    "account_kv",
    "cache_layer_tensors",
    "config_kv_values_per_layer",
    "get_cache",
    "kv_reduction",
    "measure_kv_per_layer",
]

logger = logging.getLogger(__name__)


@dataclass
class KVAccount:
    """KV-cache cost per token of one model (values = cached scalars)."""

    config_values_per_layer: list[int]
    measured_values_per_layer: list[float]
    measured_bytes_per_layer: list[float]
    element_size: int  # bytes per cached scalar in the measured cache
    dtype: str

    @property
    def config_values_per_token(self) -> int:
        return int(sum(self.config_values_per_layer))

    @property
    def config_bytes_per_layer(self) -> list[int]:
        return [v * self.element_size for v in self.config_values_per_layer]

    @property
    def config_bytes_per_token(self) -> int:
        return self.config_values_per_token * self.element_size

    @property
    def values_per_token(self) -> float:
        return float(sum(self.measured_values_per_layer))

    @property
    def bytes_per_token(self) -> float:
        return float(sum(self.measured_bytes_per_layer))

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            config_bytes_per_layer=self.config_bytes_per_layer,
            config_values_per_token=self.config_values_per_token,
            config_bytes_per_token=self.config_bytes_per_token,
            values_per_token=self.values_per_token,
            bytes_per_token=self.bytes_per_token,
        )
        return out


def _per_layer(value, n_layers: int, name: str) -> list[int]:
    if isinstance(value, (list, tuple)):
        if len(value) != n_layers:
            raise ValueError(f"config.{name} lists {len(value)} layers, the model has {n_layers}")
        return [int(v) for v in value]
    return [int(value)] * n_layers


def config_kv_values_per_layer(config) -> list[int]:
    """Cached scalars per token for each layer, as the config describes the attention."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    n_layers = int(config.num_hidden_layers)
    if getattr(config, "kv_lora_rank", None) is not None:
        ranks = _per_layer(config.kv_lora_rank, n_layers, "kv_lora_rank")
        rope = _per_layer(getattr(config, "qk_rope_head_dim", 0) or 0, n_layers, "qk_rope_head_dim")
        return [r + d for r, d in zip(ranks, rope)]
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return [2 * n_kv * int(head_dim)] * n_layers


def get_cache(output):
    """The cache of a model output: ``.cache`` (transformers 5) or ``.past_key_values`` (4.x)."""
    for name in ("cache", "past_key_values"):
        cache = getattr(output, name, None)
        if cache is not None:
            return cache
    raise ValueError(
        f"the model output ({type(output).__name__}) carries no cache; the model must return one "
        "when called with use_cache=True"
    )


def cache_layer_tensors(cache) -> list[list[torch.Tensor]]:
    """The tensors each cache layer holds, for the cache layouts transformers has used."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56: Cache.layers[i].keys / .values
        return [
            [t for t in (getattr(lay, "keys", None), getattr(lay, "values", None)) if t is not None]
            for lay in layers
        ]
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):  # older DynamicCache
        return [[k, v] for k, v in zip(cache.key_cache, cache.value_cache)]
    if isinstance(cache, (tuple, list)):  # legacy tuple of (k, v) per layer
        return [[t for t in layer if isinstance(t, torch.Tensor)] for layer in cache]
    raise TypeError(f"unsupported cache type {type(cache).__name__}: expected a transformers Cache or tuples")


def _probe_ids(model, batch_size: int, seq_len: int) -> torch.Tensor:
    vocab = int(getattr(model.config, "vocab_size", 0) or 0) or 2
    ids = torch.arange(batch_size * seq_len, dtype=torch.long).reshape(batch_size, seq_len)
    return (ids * 7 + 3) % vocab  # deterministic, varied tokens


@torch.inference_mode()
def measure_kv_per_layer(
    model, batch_size: int = 2, seq_len: int = 16, device: str | torch.device = "cpu"
) -> tuple[list[float], list[float], torch.dtype]:
    """Measured (values per token, bytes per token) for each layer, and the cache dtype."""
    ids = _probe_ids(model, batch_size, seq_len).to(device)
    out = model(input_ids=ids, use_cache=True)
    layers = cache_layer_tensors(get_cache(out))
    tokens = batch_size * seq_len
    values, nbytes = [], []
    dtype = None
    for tensors in layers:
        values.append(sum(t.numel() for t in tensors) / tokens)
        nbytes.append(sum(t.numel() * t.element_size() for t in tensors) / tokens)
        if tensors and dtype is None:
            dtype = tensors[0].dtype
    if not layers or dtype is None:
        raise ValueError("the model's cache holds no tensors after a forward pass with use_cache=True")
    return values, nbytes, dtype


def account_kv(
    model, batch_size: int = 2, seq_len: int = 16, device: str | torch.device = "cpu"
) -> KVAccount:
    """Config and measured KV cost per token of ``model`` (already on ``device``)."""
    config_values = config_kv_values_per_layer(model.config)
    values, nbytes, dtype = measure_kv_per_layer(model, batch_size, seq_len, device)
    if len(values) != len(config_values):
        logger.warning("cache has %d layers, config describes %d", len(values), len(config_values))
    element_size = torch.empty((), dtype=dtype).element_size()
    return KVAccount(
        config_values_per_layer=config_values,
        measured_values_per_layer=values,
        measured_bytes_per_layer=nbytes,
        element_size=element_size,
        dtype=str(dtype).removeprefix("torch."),
    )


def kv_reduction(original_bytes: float, converted_bytes: float) -> float:
    """Fraction of the original cache saved: 1 - converted / original (0.75 = 75% smaller)."""
    if original_bytes <= 0:
        raise ValueError(f"original KV bytes per token must be > 0, got {original_bytes}")
    return 1.0 - converted_bytes / original_bytes
