"""Host-memory estimate of one streaming step, and the calibration batch that fits ``--max-memory``.

The estimate counts the tensors one layer step holds at once (from the config's shapes), on top
of the process's resident memory when the conversion starts:
- the layer's source tensors (source dtype) and its float32 module for the forward pass;
- per calibration batch: hidden states in and out, the MLP intermediates, q/k/v, the attention
  probabilities (materialised by the CPU attention and again by the lag-profile statistics) and
  the float64 bias-augmented input of the moment accumulator;
- the float64 conversion math: E[x~ x~^T] and its Cholesky factor, the (D+1)^2 Gram matrix of
  the low-rank step with its eigendecomposition, the bias-augmented q/k/v maps, the joint
  key/value map W_y and its products, and the output metric's blocks (``low_rank``);
- the converted layer's output tensors;
- the inputs and source attention outputs the measured fold reads (``fold_steps``), while a layer's
  forward runs over them.
With ``--allocation fisher`` the backward sweep (``streaming``) holds, apart from one layer: the
LM head as read and in float32, one chunk of logits with its softmax gradient and float64 CDF,
the kept inputs of the sensitivity sequences with their gradients, and one sequence's
activations saved for the backward pass (``estimate_sweep_bytes``).
It is an estimate for choosing a batch size and refusing hopeless settings early; the bench
(bench/scale_bench.py) reports it beside the measured peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

import torch

from ..arch.families import AttentionShape
from ..convert.fold_choice import FOLD_TOKENS

__all__ = [
    "check_values_refit",
    "choose_batch_size",
    "current_rss",
    "estimate_step_bytes",
    "estimate_sweep_bytes",
    "return_free_memory",
    "values_refit_bytes",
]

_F32, _F64 = 4, 8


def current_rss() -> int:
    """Resident set size of this process now, in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def return_free_memory() -> None:
    """Collect garbage and hand the allocator's free pages back to the system (glibc only), so that
    the next big allocation does not add to a peak made of memory that is already free."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None:
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def _dtype_bytes(config) -> int:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), torch.float32)
    return torch.empty((), dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32).element_size()


def estimate_step_bytes(config, shape: AttentionShape, seq_len: int, batch: int, device: str = "cpu") -> dict:
    """Bytes held by one layer step, by part (see the module docstring)."""
    D, H, G, d = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    inter = config.intermediate_size
    params = 2 * D * H * d + 2 * D * G * d + 3 * D * inter + 2 * D
    X, rows = D + 1, 2 * G * d
    tokens = batch * seq_len
    parts = {
        "layer_tensors": params * _dtype_bytes(config),
        "output_tensors": params * _dtype_bytes(config),
        "forward_module": params * _F32,
        "forward_activations": _F32
        * (4 * tokens * D + 3 * tokens * inter + tokens * (H + 2 * G) * d + 3 * batch * H * seq_len * seq_len)
        + 2 * _F64 * tokens * X,
        # sigma, its Cholesky factor, the (X, X) Gram matrix, its eigenvectors and eigh workspace; the
        # float64 q/k/v maps; W_y, W_y R and one metric block's product; the metric's blocks
        "conversion_math": _F64
        * (6 * X * X + (H * d + 2 * G * d) * X + 3 * rows * X + (G * d) ** 2 + G * d * d),
        "fold_measure": 2 * _F32 * -(-FOLD_TOKENS // seq_len) * seq_len * D,
    }
    if device != "cpu":  # forward passes and the float64 math run on the accelerator
        parts["forward_module"] = parts["forward_activations"] = parts["conversion_math"] = 0
        parts["fold_measure"] = 0
    forward = parts["forward_module"] + parts["forward_activations"] + parts["fold_measure"]
    parts["step_peak"] = (
        parts["layer_tensors"] + parts["output_tensors"] + max(forward, parts["conversion_math"])
    )
    return parts


def estimate_sweep_bytes(config, shape: AttentionShape, seq_len: int, sequences: int, logit_rows: int,
                         device: str = "cpu") -> dict:
    """Bytes held by the fisher backward sweep at its peak (the last layer, with the LM head), by part."""
    D, V = shape.hidden_size, config.vocab_size
    one = estimate_step_bytes(config, shape, seq_len, 1, device)
    rows = min(logit_rows, seq_len)
    parts = {
        "head": V * D * (_dtype_bytes(config) + _F32),
        "logit_chunk": rows * V * (2 * _F32 + _F64),
        "kept_inputs": 3 * sequences * seq_len * D * _F32,  # inputs, their gradients, the gradients from above
        "layer": one["layer_tensors"] + one["forward_module"] + 2 * one["forward_activations"],
    }
    if device != "cpu":
        parts["logit_chunk"] = parts["kept_inputs"] = 0
        parts["head"] = V * D * _dtype_bytes(config)
        parts["layer"] = one["layer_tensors"]
    parts["sweep_peak"] = sum(parts.values())
    return parts


def values_refit_bytes(shape: AttentionShape, rank: int, method: str = "values") -> int:
    """Float64 bytes one layer's refit holds at rank RANK, for each of its ridge-fitted stages of p inputs and
    D outputs (``_stage_bytes``). values: p = H r + 1, then o_proj's q = H d + 1. values-per-head: each head's
    (r + d)^2 moments in two folds and summed, then o_proj's stage."""
    H, r, d, D = shape.num_heads, rank, shape.head_dim, shape.hidden_size
    o_proj = _stage_bytes(H * d + 1, D)
    if method == "values-per-head":
        return _F64 * 3 * H * (r * r + r * d + d * d) + o_proj
    return _stage_bytes(H * r + 1, D) + o_proj


def _stage_bytes(p: int, outputs: int) -> int:
    """A ridge-fitted stage: the p x p and p x OUTPUTS moments of two folds, both mirrored and summed (5 p^2,
    3 p OUTPUTS), one fit's factorisation and system (2 p^2, 2 p OUTPUTS) and its held-out error's product
    (p OUTPUTS): about 2 GiB at a 7B shape's o_proj (p = 4097)."""
    return _F64 * (7 * p * p + 6 * p * outputs)


# --refine auto runs a value refit only where its arithmetic stays within this share of the decoder
# forward's over the same layer and tokens. Issue #19's budget is 3x the bare forward and the closed form
# takes about 2x (bench/results/convert_cost_closed.md), which leaves 1x; the default allows half as much
# again for the refit's quality (docs/results.md, "The joint value / o_proj refit"). Not counted here:
# the work of the refit's inputs and targets rather than of its fit: carrying the converted stream on through
# the refitted layer (its value maps, o_proj and MLP, from the refit's latents) when the refit reads that
# stream (the default), and the source attention its target runs on half that stream's sequences below full
# compensation (the default); bench/convert_cost.py times the whole conversion.
REFIT_WORK_SHARE = 1.5
_REFIT_SOLVES = 9  # ridge fits of one stage: about 4 ridges on each of 2 folds, then the final fit
_FLOAT64_COST = 2  # a float64 product's time in float32 ones (half the SIMD lanes): the solves are float64


def _fit_flops(p: int, outputs: int) -> float:
    """One ridge fit of OUTPUTS targets on p inputs from moments and its held-out error: the Cholesky
    factorisation (p^3 / 3), two triangular solves with OUTPUTS right-hand sides (4 p^2 outputs) and the
    error's W Sigma product (2 p^2 outputs)."""
    return p**3 / 3 + 6 * p * p * outputs


def values_refit_work(config, shape: AttentionShape, rank: int, rope_dim: int, seq_len: int, tokens: int,
                      refit_tokens: int, method: str = "values") -> float:
    """One layer's value-refit arithmetic (flops) at RANK and rotary dims ROPE_DIM over REFIT_TOKENS tokens
    (sequences of SEQ_LEN), relative to the decoder layer's forward (its projections and MLP) over the TOKENS
    of the calibration. Both refits read the attention-weighted latents (the converted queries, the latent,
    and per head the absorbed scores over up to SEQ_LEN keys and their weighted latents): values once, then
    the moments of a (p^2 a token for the half-work Gram of Sigma_aa, 2 p D for Sigma_ay, p = H r + 1) and
    its ridge fits (``_fit_flops``: p x p solves with D right-hand sides, then o_proj's with q = H d + 1
    inputs), which grow with (H r)^2 and (H r)^3 where the forward grows with D^2. values-per-head reads the
    latents twice, with per-head moments (2 H (r + d)^2 a token), o_proj's (q^2 + 2 q D) and the closed
    form's loss (4 q D), and fits H heads of r inputs and d outputs, then o_proj. About ``_REFIT_SOLVES``
    fits a layer, at ``_FLOAT64_COST``. Data movement (the kept inputs, the softmax) is not counted, so the
    time share is larger than this ratio."""
    H, G, d, D, r = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size, rank
    latents = 2 * (D * (H * (d + rope_dim) + r + rope_dim) + H * d * r + H * seq_len * (2 * r + rope_dim))
    q = H * d + 1
    if method == "values-per-head":
        per_token = 2 * latents + 2 * H * (r + d) ** 2 + q * q + 6 * q * D
        fits = H * _fit_flops(r, d) + _fit_flops(q, D)
    else:
        p = H * r + 1
        per_token = latents + p * p + 2 * p * D
        fits = _fit_flops(p, D) + _fit_flops(q, D)
    layer = 2 * D * d * (H + G) + 3 * D * config.intermediate_size
    return (refit_tokens * per_token + _FLOAT64_COST * _REFIT_SOLVES * fits) / (2 * tokens * layer)


def check_values_refit(shape: AttentionShape, rank: int, max_memory: int | None, method: str = "values") -> None:
    """Refuse a value refit (METHOD) before any work when one layer's solve at RANK needs more than MAX_MEMORY
    bytes (unset: half of this machine's physical memory). The joint one solves over every head's latent at once."""
    need = values_refit_bytes(shape, rank, method)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        physical = 0
    limit, named = (max_memory, "--max-memory") if max_memory is not None else (physical // 2, "half of this machine's memory")
    if limit and need > limit:
        what = (f"--refine values solves for all {shape.num_heads} heads' latents at once: at kv_lora_rank {rank} one "
                f"layer's float64 moments" if method == "values" else
                f"--refine {method} at kv_lora_rank {rank}: one layer's float64 moments")
        fix = "--refine values-per-head (head by head), --refine layer" if method == "values" else "--refine layer"
        raise ValueError(
            f"{what} take about {need / 2**30:.1f} GiB, more than {named} ({limit / 2**30:.1f} GiB). "
            f"Use {fix} (per-layer gradient refinement), or a smaller --kv-budget or --kv-lora-rank."
        )


def choose_batch_size(
    config, shape: AttentionShape, seq_len: int, batch_max: int, max_memory: int | None, device: str = "cpu",
    sweep: dict | None = None,
) -> int:
    """The largest calibration batch (<= BATCH_MAX sequences) whose estimated peak fits MAX_MEMORY bytes.
    SWEEP: ``estimate_sweep_bytes`` of a fisher backward sweep, which must fit too."""
    if max_memory is None:
        return batch_max
    base = current_rss()
    if sweep is not None and base + sweep["sweep_peak"] > max_memory:
        need = base + sweep["sweep_peak"]
        raise ValueError(
            f"--max-memory {max_memory / 2**30:.2f} GiB is below the estimated {need / 2**30:.2f} GiB the "
            f"--allocation fisher backward sweep needs (process {base / 2**30:.2f} GiB + the LM head "
            f"{sweep['head'] / 2**30:.2f} GiB + one layer and its logits); raise --max-memory, use --allocation "
            f"uniform or planned, or use --device cuda"
        )
    for batch in range(batch_max, 0, -1):
        if base + estimate_step_bytes(config, shape, seq_len, batch, device)["step_peak"] <= max_memory:
            return batch
    need = base + estimate_step_bytes(config, shape, seq_len, 1, device)["step_peak"]
    raise ValueError(
        f"--max-memory {max_memory / 2**30:.2f} GiB is below the estimated {need / 2**30:.2f} GiB one layer step "
        f"needs even with one calibration sequence per batch (process {base / 2**30:.2f} GiB + one layer's tensors "
        f"and float64 math); raise --max-memory, lower --calib-seq-len, or use --device cuda"
    )
