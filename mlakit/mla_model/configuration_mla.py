"""Configuration of mlakit's MLA model.

Self-contained (transformers only): copied beside converted checkpoints so they load with
``trust_remote_code=True`` where mlakit is not installed.

The Llama body (hidden size, MLP, norms, vocabulary, rotary frequencies and their scaling)
is the source model's. Attention follows DeepSeek's names:

- ``kv_lora_rank``       latent rank r, an int or one int per layer
- ``qk_rope_head_dim``   rotary key dims d_R shared by all heads, an int or one per layer
- ``qk_nope_head_dim``   per-head dims of the unrotated query/key part (the source head_dim)
- ``v_head_dim``         per-head value dims (the source head_dim)
- ``rope_freq_index``    per layer, d_R/2 indices into the source's rotary frequency table:
                         kept rotary component p rotates at the frequency of source pair
                         ``rope_freq_index[layer][p]``, so the kept part of RoPE is exact
- ``softmax_scale``      the source's 1/sqrt(head_dim)
- ``attention_window``   the source's sliding window (Mistral), applied by the mask; the
                         cache keeps every token
"""

from __future__ import annotations

from transformers import LlamaConfig

__all__ = ["MLAConfig"]


def _per_layer(value, n_layers: int, name: str) -> list[int]:
    if isinstance(value, int):
        return [value] * n_layers
    values = [int(v) for v in value]
    if len(values) != n_layers:
        raise ValueError(f"{name} has {len(values)} entries but the model has {n_layers} layers")
    return values


class MLAConfig(LlamaConfig):
    model_type = "mlakit_mla"

    def __init__(
        self,
        kv_lora_rank=64,
        qk_rope_head_dim=0,
        qk_nope_head_dim=None,
        v_head_dim=None,
        rope_freq_index=None,
        softmax_scale=None,
        q_proj_bias=False,
        kv_a_proj_bias=False,
        o_proj_bias=False,
        attention_window=None,
        **kwargs,
    ):
        # transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters: both are written
        # (see to_dict); drop the legacy pair when the modern one is present.
        if kwargs.get("rope_parameters") is not None and _uses_rope_parameters():
            kwargs.pop("rope_theta", None)
            kwargs.pop("rope_scaling", None)
        kwargs.pop("sliding_window", None)  # the window lives in attention_window
        super().__init__(**kwargs)
        n = self.num_hidden_layers
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_nope_head_dim = qk_nope_head_dim or self.head_dim
        self.v_head_dim = v_head_dim or self.head_dim
        ranks = _per_layer(kv_lora_rank, n, "kv_lora_rank")
        rope_dims = _per_layer(qk_rope_head_dim, n, "qk_rope_head_dim")
        if rope_freq_index is None:
            rope_freq_index = [list(range(d // 2)) for d in rope_dims]
        self.rope_freq_index = [[int(j) for j in layer] for layer in rope_freq_index]
        for i, (d_r, idx) in enumerate(zip(rope_dims, self.rope_freq_index)):
            if d_r % 2 or len(idx) != d_r // 2:
                raise ValueError(f"layer {i}: qk_rope_head_dim={d_r} needs {d_r // 2} rope_freq_index entries")
            if any(j < 0 or j >= self.head_dim // 2 for j in idx):
                raise ValueError(f"layer {i}: rope_freq_index entries must lie in [0, {self.head_dim // 2})")
        if min(ranks) < 1:
            raise ValueError("kv_lora_rank must be at least 1 in every layer")
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5
        self.q_proj_bias = q_proj_bias
        self.kv_a_proj_bias = kv_a_proj_bias
        self.o_proj_bias = o_proj_bias
        self.attention_window = attention_window
        self.sliding_window = None

    def layer_kv_lora_rank(self, layer_idx: int) -> int:
        return _per_layer(self.kv_lora_rank, self.num_hidden_layers, "kv_lora_rank")[layer_idx]

    def layer_rope_dim(self, layer_idx: int) -> int:
        return _per_layer(self.qk_rope_head_dim, self.num_hidden_layers, "qk_rope_head_dim")[layer_idx]

    def cache_values_per_token(self) -> list[int]:
        """Values cached per token in each layer: r + d_R."""
        return [self.layer_kv_lora_rank(i) + self.layer_rope_dim(i) for i in range(self.num_hidden_layers)]

    def to_dict(self):
        out = super().to_dict()
        rope = out.get("rope_parameters") or getattr(self, "rope_parameters", None)
        if rope:  # legacy fields so transformers 4.x does not fall back to its default theta
            out["rope_theta"] = rope.get("rope_theta", out.get("rope_theta"))
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        return out


def _uses_rope_parameters() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5
