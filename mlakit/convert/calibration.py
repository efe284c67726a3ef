"""Calibration: one pass over calibration text, keeping only per-layer statistics.

For every layer we keep
- ``sigma``  E[x~ x~^T] of the attention input x~ = [x; 1] (float64, (D+1) x (D+1)): every K, V
  and Q second moment the conversion needs is a linear image of it. Each batch's product is taken
  in float32 over at most ``_MOMENT_ROWS`` tokens (faster than float64 on a CPU; the calibration's
  time is the "calibrate" phase of bench/convert_cost.py, results in bench/results/) and summed
  in float64: every entry keeps a relative error near 1e-6 of the sum of its terms' magnitudes,
  far below the calibration set's own sampling error;
- ``lag_p2`` (H, L) E[p_{t, t-lag}^2] summed over keys at each lag: where each head looks and how
  sharply. Its sum is E[sum_s p_s^2]; weighted by 1 - cos(theta lag) it says how much a head
  loses when a frequency theta stops rotating (or rotates at a slightly wrong frequency);
- ``inv_freq`` (d/2,) the source's rotary frequencies (after any rope scaling);
- ``sensitivity`` (optional) how much the model's output distribution reacts to an error in
  this layer's attention output: E_t ||d loss_t / d a_t||^2 / D over the first
  ``sensitivity_samples`` sequences, with the labels sampled from the model's own prediction
  (a Monte-Carlo estimate of the Fisher information, so that an output error e of squared norm
  E||e||^2 costs about sensitivity * E||e||^2 / 2 nats of KL divergence per token, to second order).
No activation is stored: memory is bounded by the statistics, not by the calibration set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..arch.families import AttentionShape

__all__ = ["ATTENTION_SAMPLES", "ATTENTION_TOKENS", "BATCH_SIZE", "LOGIT_ROWS", "SENSITIVITY_SAMPLES", "SENSITIVITY_TOKENS",
           "LayerStats", "attention_sequences", "collect_stats", "layer_accumulator", "logit_gradient", "sample_rows",
           "sensitivity_sequences"]

log = logging.getLogger(__name__)

BATCH_SIZE = 8  # calibration sequences per forward pass
# Two measurements read only the first calibration sequences: at most so many sequences and at most about so many
# tokens (``_first_sequences``). Both converge with the tokens they see, and their cost grows with the tokens (the
# backward) or faster (the lag profile is quadratic in the sequence length), so longer sequences mean fewer of them.
ATTENTION_SAMPLES, ATTENTION_TOKENS = 32, 8192  # the attention lag profile (it converges quickly)
SENSITIVITY_SAMPLES, SENSITIVITY_TOKENS = 8, 2048  # the sensitivity backward pass (bench/experiments/sensitivity_samples.py)
_SENSITIVITY_BATCH = 1  # sequences per backward pass (bounds the memory of the saved activations)
LOGIT_ROWS = 256  # positions per LM-head chunk in the backward pass (bounds the memory of the logits)
_QUERY_BLOCK = 64  # queries per block of the attention statistics (a block skips the keys after it)
_MOMENT_ROWS = 2048  # tokens per float32 product of the second moment (bounds its rounding error)
_MOMENT_BLOCKS = 4  # column blocks of the second moment: only the upper triangle of blocks is multiplied


@dataclass
class LayerStats:
    sigma: torch.Tensor  # (D+1, D+1) float64, normalised by the token count
    lag_p2: torch.Tensor  # (H, L) float64, per query
    inv_freq: torch.Tensor  # (d/2,) float64
    tokens: int
    sensitivity: float | None = None  # E ||d loss / d attention output||^2 / D per token (None: not measured)


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
        self._seen = {}  # this batch's queries, keys and rotary table, as the attention module computed them
        self.grad_energy, self.grad_values = 0.0, 0

    def attach(self) -> list:
        """Register the hooks on the attention module; returns their handles (``.remove()`` each).
        The second moment is taken from the module's input; the attention statistics from the
        queries and keys its own projections compute (nothing is projected twice)."""
        attn = self.attn
        return [attn.register_forward_pre_hook(self, with_kwargs=True),
                attn.q_proj.register_forward_hook(self._keep("q")),
                attn.k_proj.register_forward_hook(self._keep("k")),
                attn.register_forward_hook(self._after_attention)]

    def _keep(self, name: str):
        def hook(module, args, output):
            if self.with_attention:
                self._seen[name] = output.detach()
        return hook

    def _after_attention(self, module, args, output):
        if self.with_attention:
            seen, self._seen = self._seen, {}
            self._attention_stats(seen["q"], seen["k"], seen["rotary"])

    def __call__(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None).detach()
        D = x.shape[-1]
        flat = x.reshape(-1, D)
        if self.sigma is None:
            self.sigma = torch.zeros(D + 1, D + 1, dtype=torch.float64)
        edges = [D * i // _MOMENT_BLOCKS for i in range(_MOMENT_BLOCKS + 1)]
        for rows in flat.split(_MOMENT_ROWS):  # float32 products of a few rows each, summed in float64
            rows = rows.float()
            for a, b in zip(edges, edges[1:]):  # the upper triangle of blocks; result() mirrors it
                self.sigma[a:b, a:D] += (rows[:, a:b].T @ rows[:, a:]).cpu().double()
            total = rows.double().sum(0).cpu()
            self.sigma[:D, D] += total
            self.sigma[D, :D] += total
        self.sigma[D, D] += flat.shape[0]
        self.tokens += flat.shape[0]
        if self.with_attention:
            self._seen["rotary"] = kwargs["position_embeddings"]

    @torch.no_grad()
    def _attention_stats(self, q, k, position_embeddings):
        """Add the lag profile of one batch from its projected queries Q (B, L, H d) and keys K (B, L, G d)."""
        B, L, _ = q.shape
        H, G, d = self.H, self.G, self.d
        q = q.view(B, L, H, d).transpose(1, 2).float()
        k = k.view(B, L, G, d).transpose(1, 2).float()
        cos, sin = (t.float()[:, None] for t in position_embeddings)
        q, k = _rotate(q, cos * d**-0.5, sin * d**-0.5), _rotate(k, cos, sin)
        q = q.view(B, G, H // G, L, d)  # the H // G query heads of a group read the same keys
        prof = torch.zeros(H, L, dtype=torch.float64, device=q.device)
        pos = torch.arange(L, device=q.device)
        for a in range(0, L, _QUERY_BLOCK):  # causal: queries a..b-1 read keys 0..b-1 only
            b = min(a + _QUERY_BLOCK, L)
            scores = (q[:, :, :, a:b].reshape(B, G, -1, d) @ k[:, :, :b].transpose(-1, -2)).view(B, H, b - a, b)
            future = torch.ones(b - a, b, dtype=torch.bool, device=q.device).triu_(a + 1)
            p2 = scores.masked_fill_(future, float("-inf")).softmax(-1).square_().sum(0)  # (H, b - a, b)
            lag = (pos[a:b, None] - pos[None, :b]).clamp_min(0).flatten()  # masked entries are zero anyway
            prof.index_add_(1, lag, p2.reshape(H, -1).double())
        prof = prof.cpu()
        if self.lag_p2 is None or self.lag_p2.shape[1] < L:
            grown = torch.zeros(H, L, dtype=torch.float64)
            if self.lag_p2 is not None:
                grown[:, : self.lag_p2.shape[1]] = self.lag_p2
            self.lag_p2 = grown
        self.lag_p2[:, :L] += prof
        self.queries += B * L

    def probe_gradient(self, module, args, output):
        """Forward hook on the attention module: accumulate ||d loss / d output||^2 in the backward pass."""
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(self._add_gradient)

    def sensitivity(self) -> float | None:
        """E ||d loss / d output||^2 / D per token from the gradients seen so far (None: none seen)."""
        return self.grad_energy / self.grad_values if self.grad_values else None

    def _add_gradient(self, grad):
        self.grad_energy += float(grad.detach().double().square().sum())
        self.grad_values += grad.numel()  # tokens * D

    def result(self) -> LayerStats:
        q = max(self.queries, 1)
        lag = self.lag_p2 if self.lag_p2 is not None else torch.zeros(self.H, 1, dtype=torch.float64)
        D = self.sigma.shape[0] - 1
        upper = self.sigma[:D, :D].triu()
        sigma = self.sigma.clone()
        sigma[:D, :D] = upper + upper.triu(1).T
        return LayerStats(sigma / self.tokens, lag / q, self.inv_freq, self.tokens, self.sensitivity())


def layer_accumulator(attn, inv_freq: torch.Tensor, shape: AttentionShape) -> _Accumulator:
    """Statistics of one attention module ATTN: register its hooks with ``acc.attach()``, set
    ``acc.with_attention`` per batch, and read ``acc.result()`` after the last batch."""
    return _Accumulator(attn, inv_freq, shape.num_heads, shape.num_kv_heads, shape.head_dim)


def _sensitivity_pass(model, chunk: torch.Tensor, generator: torch.Generator) -> None:
    """Forward and backward over CHUNK with labels sampled from the model's own prediction; the
    gradient probes of the accumulators pick up d loss / d attention output on the way back.
    Only activations carry gradients (the weights are frozen for the pass)."""
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    handle = model.get_input_embeddings().register_forward_hook(lambda mod, args, out: out.requires_grad_())
    try:
        with torch.enable_grad():
            hidden = model.model(input_ids=chunk, use_cache=False).last_hidden_state  # (B, L, D)
            hidden.backward(logit_gradient(model.get_output_embeddings(), hidden, generator))
    finally:
        handle.remove()
        for p, flag in frozen:
            p.requires_grad_(flag)


def logit_gradient(head, hidden: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """d loss / d HIDDEN (B, L, D) of the cross-entropy of HEAD(hidden) against labels sampled from
    its own prediction (one draw per position, in order, from GENERATOR). HEAD runs on
    ``LOGIT_ROWS`` positions at a time, so the logits never exist for all of HIDDEN at once, and the
    gradient with respect to the logits, softmax(z) - onehot(label), is formed in place of an
    autograd graph through the loss."""
    top = hidden.detach().requires_grad_()
    with torch.enable_grad():
        for rows in top.flatten(0, 1).split(LOGIT_ROWS):
            logits = head(rows)  # (rows, V)
            with torch.no_grad():
                grad = logits.detach().float().softmax(-1)
                grad[torch.arange(grad.shape[0]), sample_rows(grad, generator)] -= 1
            logits.backward(grad.to(logits.dtype))
    return top.grad


def sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of PROBS (rows, V) drawn from that row's distribution (inverse CDF)."""
    cdf = probs.double().cumsum(-1).cpu()
    u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1).clamp_max(cdf.shape[1] - 1).to(probs.device)


class _StatsComplete(Exception):
    """Raised in the last layer once nothing after it feeds the statistics."""


def _stop_forward(*_):
    raise _StatsComplete


def _forward_for_stats(model, ids: torch.Tensor, through_attention: bool) -> None:
    """The decoder forward over IDS as far as the last layer's attention input, or its output when
    THROUGH_ATTENTION (the batch measures attention), after that layer's accumulator hooks
    (registered earlier, so they run first); the rest of the last layer, the final norm and the LM
    head are skipped."""
    attn = model.model.layers[-1].self_attn
    register = attn.register_forward_hook if through_attention else attn.register_forward_pre_hook
    handle = register(_stop_forward)
    try:
        model.model(input_ids=ids, use_cache=False)
    except _StatsComplete:
        pass
    finally:
        handle.remove()


def _first_sequences(most: int, tokens: int, seq_len: int) -> int:
    return max(1, min(most, tokens // seq_len))


def attention_sequences(seq_len: int) -> int:
    """How many calibration sequences of SEQ_LEN tokens measure the attention lag profile."""
    return _first_sequences(ATTENTION_SAMPLES, ATTENTION_TOKENS, seq_len)


def sensitivity_sequences(seq_len: int) -> int:
    """How many calibration sequences of SEQ_LEN tokens run the loss-sensitivity backward pass."""
    return _first_sequences(SENSITIVITY_SAMPLES, SENSITIVITY_TOKENS, seq_len)


@torch.no_grad()
def collect_stats(model, batches: torch.Tensor, shape: AttentionShape, batch_size: int = BATCH_SIZE,
                  attention_samples: int | None = None, sensitivity_samples: int = 0,
                  device: str = "cpu", quiet: bool = False, seed: int = 0) -> list[LayerStats]:
    """Run MODEL (a transformers Llama-family causal LM) over BATCHES (N, L) and return per-layer stats.

    Attention statistics (lag_p2) use the first ``attention_samples`` sequences only (default:
    ``attention_sequences``): they converge quickly and cost O(L^2) per sequence. The first ``sensitivity_samples`` sequences
    also run backward (with the LM head) to measure each layer's ``sensitivity``; 0 skips it.
    """
    if attention_samples is None:
        attention_samples = attention_sequences(batches.shape[1])
    layers = model.model.layers
    inv_freq = model.model.rotary_emb.inv_freq.detach().cpu()
    accs = [layer_accumulator(layer.self_attn, inv_freq, shape) for layer in layers]
    handles = [h for acc in accs for h in acc.attach()]
    if sensitivity_samples:
        handles += [layer.self_attn.register_forward_hook(acc.probe_gradient) for layer, acc in zip(layers, accs)]
    generator = torch.Generator().manual_seed(seed)
    try:
        done = 0
        for start in tqdm(range(0, batches.shape[0], batch_size), desc="calibrating", disable=quiet, leave=False):
            chunk = batches[start : start + batch_size].to(device)
            step = _SENSITIVITY_BATCH if done < sensitivity_samples else chunk.shape[0]
            for part in chunk.split(step):
                with_attention = done < attention_samples
                for acc in accs:
                    acc.with_attention = with_attention
                if done < sensitivity_samples:
                    _sensitivity_pass(model, part, generator)
                else:
                    _forward_for_stats(model, part, with_attention)
                done += part.shape[0]
    finally:
        for h in handles:
            h.remove()
    return [acc.result() for acc in accs]
