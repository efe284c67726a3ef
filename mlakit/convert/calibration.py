"""Calibration: one pass over calibration text, keeping only per-layer statistics.

For every layer we keep
- ``sigma``  E[x~ x~^T] of the attention input x~ = [x; 1] (float64, (D+1) x (D+1)): every K, V
  and Q second moment the conversion needs is a linear image of it;
- ``lag_p2`` (H, L) E[p_{t, t-lag}^2] summed over keys at each lag: where each head looks and how
  sharply. Its sum is E[sum_s p_s^2]; weighted by 1 - cos(theta lag) it says how much a head
  loses when a frequency theta stops rotating (or rotates at a slightly wrong frequency);
- ``inv_freq`` (d/2,) the source's rotary frequencies (after any rope scaling).
No activation is stored: memory is bounded by the statistics, not by the calibration set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

__all__ = ["ATTENTION_SAMPLES", "BATCH_SIZE", "LayerStats", "collect_stats", "layer_accumulator"]

log = logging.getLogger(__name__)

BATCH_SIZE = 8  # calibration sequences per forward pass
ATTENTION_SAMPLES = 32  # sequences whose attention lag profile is measured (it converges quickly)


@dataclass
class LayerStats:
    sigma: torch.Tensor  # (D+1, D+1) float64, normalised by the token count
    lag_p2: torch.Tensor  # (H, L) float64, per query
    inv_freq: torch.Tensor  # (d/2,) float64
    tokens: int


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class _Accumulator:
    def __init__(self, attn, inv_freq: torch.Tensor, n_heads: int, n_kv: int, head_dim: int):
        self.attn, self.inv_freq = attn, inv_freq.double()
        self.H, self.G, self.d = n_heads, n_kv, head_dim
        self.sigma = None
        self.tokens = 0
        self.lag_p2 = None
        self.queries = 0
        self.with_attention = True

    def __call__(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        B, L, D = x.shape
        flat = x.reshape(-1, D).double()
        aug = torch.cat([flat, torch.ones(flat.shape[0], 1, dtype=flat.dtype, device=flat.device)], dim=1)
        moment = (aug.T @ aug).cpu()
        self.sigma = moment if self.sigma is None else self.sigma + moment
        self.tokens += flat.shape[0]
        if self.with_attention:
            self._attention_stats(x, kwargs["position_embeddings"])

    @torch.no_grad()
    def _attention_stats(self, x, position_embeddings):
        B, L, _ = x.shape
        H, G, d = self.H, self.G, self.d
        q = self.attn.q_proj(x).view(B, L, H, d).transpose(1, 2).float()
        k = self.attn.k_proj(x).view(B, L, G, d).transpose(1, 2).float()
        cos, sin = (t.float()[:, None] for t in position_embeddings)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k = k.repeat_interleave(H // G, dim=1)
        scores = (q @ k.transpose(-1, -2)) * d**-0.5
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        p2 = scores.masked_fill(~causal, float("-inf")).softmax(-1).square().sum(0).double()  # (H, L, L)
        pos = torch.arange(L, device=x.device)
        lag = (pos[:, None] - pos[None]).clamp_min(0).flatten()  # masked entries are zero anyway
        prof = torch.zeros(H, L, dtype=torch.float64, device=x.device).index_add_(1, lag, p2.reshape(H, -1)).cpu()
        if self.lag_p2 is None or self.lag_p2.shape[1] < L:
            grown = torch.zeros(H, L, dtype=torch.float64)
            if self.lag_p2 is not None:
                grown[:, : self.lag_p2.shape[1]] = self.lag_p2
            self.lag_p2 = grown
        self.lag_p2[:, :L] += prof
        self.queries += B * L

    def result(self) -> LayerStats:
        q = max(self.queries, 1)
        lag = self.lag_p2 if self.lag_p2 is not None else torch.zeros(self.H, 1, dtype=torch.float64)
        return LayerStats(self.sigma / self.tokens, lag / q, self.inv_freq, self.tokens)


def layer_accumulator(attn, inv_freq: torch.Tensor, shape: dict) -> _Accumulator:
    """Statistics of one attention module ATTN; register it with
    ``attn.register_forward_pre_hook(acc, with_kwargs=True)``, set ``acc.with_attention`` per batch,
    and read ``acc.result()`` after the last batch."""
    return _Accumulator(attn, inv_freq, shape["num_heads"], shape["num_kv_heads"], shape["head_dim"])


@torch.no_grad()
def collect_stats(model, batches: torch.Tensor, shape: dict, batch_size: int = BATCH_SIZE,
                  attention_samples: int = ATTENTION_SAMPLES,
                  device: str = "cpu", quiet: bool = False) -> list[LayerStats]:
    """Run MODEL (a transformers Llama-family causal LM) over BATCHES (N, L) and return per-layer stats.

    Attention statistics (lag_p2) use the first ``attention_samples`` sequences only: they
    converge quickly and cost O(L^2) per sequence.
    """
    layers = model.model.layers
    inv_freq = model.model.rotary_emb.inv_freq.detach().cpu()
    accs = [layer_accumulator(layer.self_attn, inv_freq, shape) for layer in layers]
    handles = [layer.self_attn.register_forward_pre_hook(acc, with_kwargs=True) for layer, acc in zip(layers, accs)]
    try:
        done = 0
        for start in tqdm(range(0, batches.shape[0], batch_size), desc="calibrating", disable=quiet, leave=False):
            chunk = batches[start : start + batch_size].to(device)
            for acc in accs:
                acc.with_attention = done < attention_samples
            model.model(input_ids=chunk, use_cache=False)  # the LM head is not needed
            done += chunk.shape[0]
    finally:
        for h in handles:
            h.remove()
    return [acc.result() for acc in accs]
