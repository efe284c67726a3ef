"""Whole-model helpers for the experiment benches (bench/quality_sweep.py, bench/experiments/):
calibrate a loaded model in one forward/backward pass, convert every layer from its metrics, and
assemble the state dict in memory. The converter itself runs layer by layer (``driver``); these
let a bench try many settings on one calibration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from ..arch.families import AttentionShape
from ..choices import MEASURED_ROPE_DIMS
from ..convert.assemble import copied_tensors, mla_layer_tensors
from ..convert.calibration import collect_stats
from ..convert.compress import compress_layer
from ..convert.rank_plan import FISHER_STEP, plan_budget
from ..io.source import Source
from .settings import (
    ConversionError,
    budget_values,
    calibration_ids,
    check_ranks,
    fixed_rope_dim,
    method_of,
    resolve_allocation,
    sensitivity_sequences,
)

if TYPE_CHECKING:
    from ..options import ConvertOptions

__all__ = ["assemble_state", "build_layers", "calibrate"]


def _progress(iterable, desc: str, quiet: bool, total: int | None = None):
    return tqdm(iterable, desc=desc, total=total, disable=quiet, leave=False)


def calibrate(source: Source, shape: AttentionShape, opts: ConvertOptions):
    """Per-layer statistics from the calibration text."""
    model = source.load_model(torch.float32, opts.device)
    ids = calibration_ids(source, opts, model.config.vocab_size)
    return collect_stats(model, ids, shape, sensitivity_samples=sensitivity_sequences(opts, ids.shape[0]), device=opts.device, quiet=opts.quiet,
                         seed=opts.seed)


def build_layers(ws, ms, shape: AttentionShape, opts: ConvertOptions, quiet: bool = True, fisher_step: float = FISHER_STEP):
    """MLA layers from source attention weights WS and per-layer metrics MS (None: data-free).
    FISHER_STEP: how far ``--allocation fisher`` moves from uniform ranks (``rank_plan.allocate_ranks``).

    Returns (layers, plan report)."""
    n_layers = len(ws)
    method = method_of(opts, shape)
    opts = resolve_allocation(opts)
    if opts.kv_budget is not None:
        budget = budget_values(opts, shape, n_layers)
        if opts.rope_dim in MEASURED_ROPE_DIMS:
            raise ConversionError(f"--rope-dim {opts.rope_dim} is chosen in a conversion's statistics pass; here give "
                                  "--rope-dim as a number, or leave it to the budget's default share")
        fixed_rope = fixed_rope_dim(opts)
        try:
            layers, report = plan_budget(ws, ms, method, budget, rope_dim=fixed_rope, allocation=opts.allocation,
                                         progress=lambda it, desc: _progress(it, desc, quiet),
                                         fisher_step=fisher_step)
        except ValueError as exc:
            raise ConversionError(str(exc)) from exc
        return layers, report | {"allocation": opts.allocation, "budget_values_per_token": budget}
    rank, rope_dim = check_ranks(opts, shape)
    layers = [compress_layer(w, m, method, rope_dim, rank)
              for w, m in _progress(list(zip(ws, ms)), "converting layers", quiet)]
    return layers, {}


def assemble_state(source: Source, shape: AttentionShape, layers, dtype) -> dict:
    """The MLA state dict: converted attention plus every other source tensor unchanged."""
    config = source.config
    state = {}
    for i, mla in enumerate(layers):
        state.update(mla_layer_tensors(i, mla, dtype, q_bias=shape.qkv_bias, kv_a_bias=shape.qkv_bias))
    tie = bool(getattr(config, "tie_word_embeddings", False))
    for name in copied_tensors(source, config.num_hidden_layers, tie):
        state[name] = source.tensor(name).to(dtype).contiguous()
    return state
