"""Conversion settings made concrete and checked against the source's attention shape.

Pure functions of the options (``pipeline.ConvertOptions``) and the source config: every value
the layer-wise driver needs (ranks, rope dims, budget, method, dtype, calibration ids) is
resolved here, before any layer runs, so a bad setting fails before any work.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..arch.families import AttentionShape
from ..choices import DTYPE_NAMES, MEASURED_ROPE_DIMS
from ..convert import calibration
from ..convert.compress import Method
from ..convert.rank_plan import ALLOCATIONS
from ..convert.rope_select import STOCK_ROPE_METHODS, check_stock_rope_dim

if TYPE_CHECKING:
    from ..io.source import Source
    from ..options import ConvertOptions

__all__ = [
    "AUTO_ALLOCATION", "AUTO_RRR_FROM", "DTYPES", "VALUE_REFITS", "ConversionError", "budget_values", "cached_share", "calibration_ids",
    "check_ranks", "effective_recipe", "fixed_rope_dim", "method_of", "needs_calibration", "needs_sensitivity",
    "refine_settings", "resolve_allocation", "resolve_dtype", "resolve_lowrank", "sensitivity_sequences",
]

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float16,
                                torch.float16)))


# what --allocation auto means; its cost against uniform is measured by bench/allocation_cost.py
AUTO_ALLOCATION = "fisher"


class ConversionError(ValueError):
    """A conversion setting does not fit the source model; the message names the allowed values."""


def resolve_dtype(name: str, source_config) -> torch.dtype:
    if name == "auto":
        src = getattr(source_config, "dtype", None) or getattr(source_config, "torch_dtype", None)
        if isinstance(src, torch.dtype):
            return src if src in DTYPES.values() else torch.float32
        return DTYPES.get(str(src).replace("torch.", ""), torch.float32)
    if name not in DTYPES:
        raise ConversionError(f"--dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def fixed_rope_dim(opts: ConvertOptions) -> int | None:
    """The d_R --rope-dim fixes within a --kv-budget (None: the budget's default share, or measured)."""
    return opts.rope_dim if isinstance(opts.rope_dim, int) else None


def check_ranks(opts: ConvertOptions, shape: AttentionShape) -> tuple[int, int]:
    """Resolve 'full' and check ranges: returns (kv_lora_rank, rope_dim). A measured d_R is chosen within a
    budget only (``options``), and stands for every rotary dim here, as 'full' does."""
    G, d = shape.num_kv_heads, shape.head_dim
    rope_full = G * d
    if opts.rope_dim in ("full", *MEASURED_ROPE_DIMS):
        rope_dim = rope_full
    else:
        rope_dim = int(opts.rope_dim)
        if not 0 <= rope_dim <= rope_full:
            raise ConversionError(f"--rope-dim must be 'full' or an even integer in [0, {rope_full}] "
                                  f"({G} KV heads x head_dim {d}); got {rope_dim}")
        if rope_dim % 2:
            raise ConversionError(f"--rope-dim must be even (rotary dims come in pairs); got {rope_dim}, "
                                  f"try {rope_dim - 1} or {rope_dim + 1}")
    if opts.stock_rope and opts.rope_method not in STOCK_ROPE_METHODS:
        raise ConversionError(f"--stock-rope works with --rope-method {' or '.join(STOCK_ROPE_METHODS)}; "
                              f"got {opts.rope_method!r}")
    if opts.stock_rope and not (opts.kv_budget is not None and opts.rope_dim == "full"):
        try:
            check_stock_rope_dim(d, rope_dim)
        except ValueError as exc:
            raise ConversionError(f"--stock-rope: {exc}") from exc
    rank_full = 2 * G * d - rope_dim
    if opts.kv_lora_rank == "full":
        return rank_full, rope_dim
    rank = int(opts.kv_lora_rank)
    if not 1 <= rank <= rank_full:
        raise ConversionError(f"--kv-lora-rank must be 'full' or an integer in [1, {rank_full}] "
                              f"(2 x {G} KV heads x head_dim {d} minus rope dim {rope_dim}); got {rank}")
    return rank, rope_dim


def resolve_allocation(opts: ConvertOptions) -> ConvertOptions:
    """OPTS with ``--allocation auto`` made concrete: ``AUTO_ALLOCATION``, the same for every source
    (every source goes through the one layer-wise driver, whose backward sweep gives fisher its
    sensitivities)."""
    if opts.allocation != "auto":
        return opts
    return replace(opts, allocation=AUTO_ALLOCATION)


# RRR weighs key and value errors by a first-order model of the output error. In the closed form alone it
# wins at large budgets and loses to TransMLA's energy-balanced metric (BKV-PCA) at small ones, most on text
# unlike the calibration's (bench/experiments/lowrank_domains.py): RRR keeps the keys exact at the values'
# expense. A value refit after it (what --refine auto runs wherever it fits) refits the value maps and o_proj
# to the latent it is given, so the latent that keeps the keys exact is the better start at every budget
# measured (docs/results.md, "Which latent under the value refit").
AUTO_RRR_FROM = 0.25  # --lowrank-method auto without a value refit: rrr from this share of the source's cached values
VALUE_REFITS = ("values", "values-per-head")  # in the order --refine auto tries them


def cached_share(opts: ConvertOptions, shape: AttentionShape) -> float:
    """The converted cache as a share of the source's: the budget, or (rank + rope dims) / (2 G d)."""
    if opts.kv_budget is not None:
        return float(opts.kv_budget)
    rank, rope_dim = check_ranks(opts, shape)
    return (rank + rope_dim) / (2 * shape.num_kv_heads * shape.head_dim)


def resolve_lowrank(opts: ConvertOptions, shape: AttentionShape) -> ConvertOptions:
    """OPTS with ``--lowrank-method auto`` made concrete: rrr where a value refit follows, else rrr from
    ``AUTO_RRR_FROM`` of the source's cache and bkv_pca below. ``--refine auto`` not yet resolved counts as the
    value refit it becomes wherever one fits (a conversion resolves it first: ``ConversionSetup``)."""
    if opts.lowrank_method != "auto":
        return opts
    refit = opts.refine in (*VALUE_REFITS, "auto")
    return replace(opts, lowrank_method="rrr" if refit or cached_share(opts, shape) >= AUTO_RRR_FROM else "bkv_pca")


def needs_sensitivity(opts: ConvertOptions) -> bool:
    """Whether the allocation of OPTS reads each layer's loss sensitivity (a backward pass)."""
    return opts.kv_budget is not None and resolve_allocation(opts).allocation == "fisher"


def sensitivity_sequences(opts: ConvertOptions, n_calib: int) -> int:
    """How many of N_CALIB calibration sequences the loss-sensitivity backward pass uses (0: none)."""
    return min(calibration.sensitivity_sequences(opts.calib_seq_len), n_calib) if needs_sensitivity(opts) else 0


def calibration_ids(source: Source, opts: ConvertOptions, vocab_size: int) -> torch.Tensor:
    """(calib_samples, calib_seq_len) token ids of the calibration set."""
    from ..data import calibration_batches

    if opts.calib == "random":  # structure tests on tokenizer-less tiny models
        gen = torch.Generator().manual_seed(opts.seed)
        return torch.randint(0, vocab_size, (opts.calib_samples, opts.calib_seq_len), generator=gen)
    tokenizer = source.tokenizer()
    if tokenizer is None:
        raise ConversionError(f"{source.spec} has no tokenizer files, so calibration text cannot be tokenized; "
                              f"add the tokenizer to the model directory")
    return calibration_batches(tokenizer, opts.calib, opts.calib_samples, opts.calib_seq_len, opts.seed, flag="--calib")


def budget_values(opts: ConvertOptions, shape: AttentionShape, n_layers: int) -> int:
    """Checked --kv-budget and --allocation: the budget in cached values per token over all layers."""
    if not 0 < opts.kv_budget <= 1:
        raise ConversionError(f"--kv-budget must be a fraction in (0, 1]; got {opts.kv_budget}")
    if opts.allocation not in ALLOCATIONS:
        raise ConversionError(f"allocation {opts.allocation!r} is not one of {', '.join(ALLOCATIONS)}")
    return int(opts.kv_budget * n_layers * 2 * shape.num_kv_heads * shape.head_dim)


def method_of(opts: ConvertOptions, shape: AttentionShape) -> Method:
    """The per-layer method of OPTS for a model of SHAPE; a bad combination is a ConversionError."""
    opts = resolve_lowrank(opts, shape)
    try:
        return Method(opts.rope_method, opts.lowrank_method, opts.fold, opts.mixing, opts.stock_rope)
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc


def needs_calibration(opts: ConvertOptions, shape: AttentionShape) -> bool:
    if opts.kv_budget is not None:
        return True
    rank, rope_dim = check_ranks(opts, shape)
    full = shape.num_kv_heads * shape.head_dim
    return not (rope_dim == full and rank == 2 * full - rope_dim)


def refine_settings(opts: ConvertOptions):
    """The ``refine.RefineSettings`` of OPTS (None: ``--refine none``); a bad value is a ConversionError."""
    from ..convert.refine import RefineSettings

    if opts.refine == "none":  # the options model admits only choices.REFINE_MODES
        return None
    try:
        return RefineSettings(method=opts.refine, inputs=opts.refine_inputs, compensate=opts.refine_compensate,
                              epochs=opts.refine_epochs, lr=opts.refine_lr, batch=opts.refine_batch,
                              sequences=opts.refine_sequences)
    except ValueError as exc:
        raise ConversionError(f"--refine-*: {exc}") from exc


def effective_recipe(opts: ConvertOptions, base=None):
    """The recipe that reproduces OPTS (saved beside the weights), named as BASE was."""
    from ..recipes import Recipe

    return Recipe.from_options(opts, getattr(base, "name", None), getattr(base, "description", None))


