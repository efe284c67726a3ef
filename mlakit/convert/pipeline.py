"""Orchestration of one conversion: open source -> plan -> factorize -> assemble -> write -> verify."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..choices import DTYPE_NAMES, MIN_CALIB_SEQ_LEN
from ..options import ConvertOptions
from .assemble import (
    check_finite_tensors,
    check_shapes,
    check_source_tensors,
    copied_tensors,
    mla_config,
    mla_layer_tensors,
    read_attention,
)
from .calibration import SENSITIVITY_SAMPLES, collect_stats
from .compress import Method, compress_layer
from .engine_target import check_target_shape, fit_target
from .families import attention_shape
from .layer_metrics import layer_metrics
from .output_dir import check_output, claim_output, local_paths
from .rank_plan import ALLOCATIONS, FISHER_STEP, plan_budget
from .rope_select import STOCK_ROPE_METHODS, check_stock_rope_dim
from .source import Source, open_source, resolve_source
from .stream_memory import return_free_memory
from .writer import AUTO_MAP, save_state_dict, write_json, write_modeling_code

__all__ = [
    "ConversionError", "ConvertOptions", "assemble_state", "build_layers", "calibrate",
    "check_calibration", "check_ranks", "convert", "logit_report",
    "budget_values", "cached_share", "calibration_ids", "method_of", "needs_calibration", "needs_sensitivity",
    "resolve_allocation", "sensitivity_sequences", "resolve_dtype", "resolve_lowrank", "verify_token_ids",
]

log = logging.getLogger(__name__)

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float16,
                                torch.float16)))


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


def check_ranks(opts: ConvertOptions, shape: dict) -> tuple[int, int]:
    """Resolve 'full' and check ranges: returns (kv_lora_rank, rope_dim)."""
    G, d = shape["num_kv_heads"], shape["head_dim"]
    rope_full = G * d
    if opts.rope_dim == "full":
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


def check_calibration(opts: ConvertOptions) -> None:
    """Calibration sizes, checked before any work (the CLI's ranges say the same)."""
    if int(opts.calib_samples) < 1:
        raise ConversionError(f"--calib-samples must be >= 1 (calibration sequences); got {opts.calib_samples}")
    if int(opts.calib_seq_len) < MIN_CALIB_SEQ_LEN:
        raise ConversionError(
            f"--calib-seq-len must be >= {MIN_CALIB_SEQ_LEN} tokens per calibration sequence; got "
            f"{opts.calib_seq_len}"
        )


def _progress(iterable, desc: str, quiet: bool, total: int | None = None):
    return tqdm(iterable, desc=desc, total=total, disable=quiet, leave=False)


def resolve_allocation(opts: ConvertOptions, streaming: bool = False) -> ConvertOptions:
    """OPTS with ``--allocation auto`` made concrete: ``fisher`` in memory, ``uniform`` when streaming
    (the streaming pipeline cannot run the whole-model backward pass the sensitivities need)."""
    if opts.allocation != "auto":
        return opts
    return replace(opts, allocation="uniform" if streaming else "fisher")


# RRR weighs key and value errors by a first-order model of the output error. It wins at large
# budgets and loses to TransMLA's energy-balanced metric (BKV-PCA) at small ones
# (bench/experiments/lowrank_domains.py, SmolLM2-135M: on the two evaluation texts unlike the
# calibration's, RRR is ahead in 4 of 4 cases at 0.5 and 0.3125 of the source cache, BKV-PCA in
# 3 of 4 at 0.1875 and 0.125). A measured switch point on one model, not a derivation.
AUTO_RRR_FROM = 0.25  # --lowrank-method auto: rrr from this share of the source's cached values, bkv_pca below


def cached_share(opts: ConvertOptions, shape: dict) -> float:
    """The converted cache as a share of the source's: the budget, or (rank + rope dims) / (2 G d)."""
    if opts.kv_budget is not None:
        return float(opts.kv_budget)
    rank, rope_dim = check_ranks(opts, shape)
    return (rank + rope_dim) / (2 * shape["num_kv_heads"] * shape["head_dim"])


def resolve_lowrank(opts: ConvertOptions, shape: dict) -> ConvertOptions:
    """OPTS with ``--lowrank-method auto`` made concrete (``AUTO_RRR_FROM``)."""
    if opts.lowrank_method != "auto":
        return opts
    return replace(opts, lowrank_method="rrr" if cached_share(opts, shape) >= AUTO_RRR_FROM else "bkv_pca")


def needs_sensitivity(opts: ConvertOptions) -> bool:
    """Whether the allocation of OPTS (in memory) reads each layer's loss sensitivity (a backward pass)."""
    return opts.kv_budget is not None and resolve_allocation(opts).allocation == "fisher"


def sensitivity_sequences(opts: ConvertOptions, n_calib: int) -> int:
    """How many of N_CALIB calibration sequences the loss-sensitivity backward pass uses (0: none)."""
    return min(SENSITIVITY_SAMPLES, n_calib) if needs_sensitivity(opts) else 0


def calibrate(source: Source, shape: dict, opts: ConvertOptions):
    """Per-layer statistics from the calibration text."""
    model = source.load_model(torch.float32, opts.device)
    ids = calibration_ids(source, opts, model.config.vocab_size)
    return collect_stats(model, ids, shape, sensitivity_samples=sensitivity_sequences(opts, ids.shape[0]), device=opts.device, quiet=opts.quiet,
                         seed=opts.seed)


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


def budget_values(opts: ConvertOptions, shape: dict, n_layers: int) -> int:
    """Checked --kv-budget and --allocation: the budget in cached values per token over all layers."""
    if not 0 < opts.kv_budget <= 1:
        raise ConversionError(f"--kv-budget must be a fraction in (0, 1]; got {opts.kv_budget}")
    if opts.allocation not in ALLOCATIONS:
        raise ConversionError(f"allocation {opts.allocation!r} is not one of {', '.join(ALLOCATIONS)}")
    return int(opts.kv_budget * n_layers * 2 * shape["num_kv_heads"] * shape["head_dim"])


def method_of(opts: ConvertOptions, shape: dict) -> Method:
    """The per-layer method of OPTS for a model of SHAPE; a bad combination is a ConversionError."""
    opts = resolve_lowrank(opts, shape)
    try:
        return Method(opts.rope_method, opts.lowrank_method, opts.fold, opts.mixing, opts.stock_rope)
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc


def build_layers(ws, ms, shape: dict, opts: ConvertOptions, quiet: bool = True, fisher_step: float = FISHER_STEP):
    """MLA layers from source attention weights WS and per-layer metrics MS (None: data-free).
    FISHER_STEP: how far ``--allocation fisher`` moves from uniform ranks (``rank_plan.allocate_ranks``).

    Returns (layers, plan report)."""
    n_layers = len(ws)
    method = method_of(opts, shape)
    opts = resolve_allocation(opts)
    if opts.kv_budget is not None:
        budget = budget_values(opts, shape, n_layers)
        fixed_rope = None if opts.rope_dim == "full" else int(opts.rope_dim)
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


def needs_calibration(opts: ConvertOptions, shape: dict) -> bool:
    if opts.kv_budget is not None:
        return True
    rank, rope_dim = check_ranks(opts, shape)
    full = shape["num_kv_heads"] * shape["head_dim"]
    return not (rope_dim == full and rank == 2 * full - rope_dim)


def assemble_state(source: Source, shape: dict, layers, dtype) -> dict:
    """The MLA state dict: converted attention plus every other source tensor unchanged."""
    config = source.config
    state = {}
    for i, mla in enumerate(layers):
        state.update(mla_layer_tensors(i, mla, dtype, q_bias=shape["qkv_bias"], kv_a_bias=shape["qkv_bias"]))
    tie = bool(getattr(config, "tie_word_embeddings", False))
    for name in copied_tensors(source, config.num_hidden_layers, tie):
        state[name] = source.tensor(name).to(dtype).contiguous()
    return state


def effective_recipe(opts: ConvertOptions, base=None):
    """The recipe that reproduces OPTS (saved beside the weights)."""
    from ..recipes import Calibration, MethodSpec, Recipe

    budget = opts.kv_budget is not None
    return Recipe(
        name=getattr(base, "name", None),
        description=getattr(base, "description", None),
        kv_budget=opts.kv_budget,
        allocation=opts.allocation,
        kv_lora_rank=None if budget else opts.kv_lora_rank,
        rope_dim=None if budget else opts.rope_dim,
        method=MethodSpec(rope=opts.rope_method, lowrank=opts.lowrank_method, fold=opts.fold, mixing=opts.mixing,
                          stock_rope=opts.stock_rope),
        target=opts.target,
        calibration=Calibration(data=opts.calib, samples=opts.calib_samples, seq_len=opts.calib_seq_len,
),
        dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(opts.dtype, opts.dtype),
    )


def convert(src: str, out: str | Path, opts: ConvertOptions | None = None, recipe=None, precheck=None) -> dict:
    """Convert SRC into an MLA checkpoint at OUT; returns the conversion report.

    RECIPE (optional) only names the recipe the options came from, for the saved copy. PRECHECK
    (optional) is called with the source config and its ``attention_shape`` before any calibration;
    it raises to refuse the source (the deepseek-v3 export checks biases and rope there)."""
    try:
        opts = resolve_allocation(fit_target(opts or ConvertOptions()))
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc
    check_calibration(opts)
    torch.manual_seed(opts.seed)
    start = time.time()
    check_output(out, opts.overwrite, local_paths(src))  # before the source is resolved (a hub id downloads)
    _, src_path = resolve_source(src)
    with claim_output(out, opts.overwrite, sources=[src_path]) as claim:
        return _convert(claim, src, opts, recipe, precheck, start)


def _convert(claim, src: str, opts: ConvertOptions, recipe, precheck, start: float) -> dict:
    source = open_source(src)
    phases = {"open": time.time() - start}
    shape = attention_shape(source.config)
    check_target_shape(opts, shape)
    if precheck is not None:
        precheck(source.config, shape)
    check_ranks(opts if opts.kv_budget is None else replace(opts, kv_lora_rank="full"), shape)  # fail early
    opts = resolve_lowrank(opts, shape)  # the report and the saved recipe name the method used
    dtype = resolve_dtype(opts.dtype, source.config)
    n_layers = source.config.num_hidden_layers
    check_source_tensors(source)  # fail before calibrating
    check_finite_tensors(source)
    stats = None
    if needs_calibration(opts, shape):
        stats = calibrate(source, shape, opts)
        return_free_memory()  # the backward pass's activations
    # the float64 attention weights are made after the calibration, whose backward pass sets the peak memory
    ws = [read_attention(source, i, shape) for i in range(n_layers)]
    ms = [layer_metrics(w, st) for w, st in zip(ws, stats)] if stats is not None else [None] * n_layers
    phases["calibrate"] = time.time() - start - sum(phases.values())
    layers, plan_report = build_layers(ws, ms, shape, opts, opts.quiet)
    phases["build"] = time.time() - start - sum(phases.values())
    del ws, ms
    reference = _reference_logits(source, opts.device) if opts.verify else None
    state = assemble_state(source, shape, layers, dtype)
    config = mla_config(source.config, shape, layers, dtype)
    check_shapes(config, state)
    config.auto_map = dict(AUTO_MAP)
    report = {
        "source": str(src),
        "source_architecture": shape["family"],
        "settings": asdict(opts) | {"dtype": str(dtype).replace("torch.", "")},
        "source_kv_values_per_token_per_layer": 2 * shape["num_kv_heads"] * shape["head_dim"],
        "plan": plan_report,
        "layers": [
            {"layer": i, "kv_lora_rank": w.kv_lora_rank, "qk_rope_head_dim": w.rope_dim, "rope_freq_index": w.freq_index}
            for i, w in enumerate(layers)
        ],
    }
    report["kv_values_per_token"] = sum(w.kv_lora_rank + w.rope_dim for w in layers)
    report["source_kv_values_per_token"] = report["source_kv_values_per_token_per_layer"] * len(layers)
    with claim.staging() as tmp:
        save_state_dict(state, tmp)
        del state, layers  # the converted weights are on disk now; verification reloads them
        source.release()
        return_free_memory()
        config.to_json_file(str(tmp / "config.json"), use_diff=False)
        write_modeling_code(tmp)
        (tmp / "recipe.yaml").write_text(effective_recipe(opts, recipe).to_yaml())
        _write_tokenizer_files(source, config, tmp)
        if opts.verify:
            report["verify"] = verify(reference, tmp, opts.device)
        phases["write_and_verify"] = time.time() - start - sum(phases.values())
        report["seconds"] = round(time.time() - start, 2)
        report["phase_seconds"] = {k: round(v, 2) for k, v in phases.items()}
        write_json(tmp / "conversion.json", report)
    log.info("wrote %s in %.1f s", claim.out, time.time() - start)
    return report


def _write_tokenizer_files(source: Source, config, directory: Path) -> None:
    from transformers import GenerationConfig

    tokenizer = source.tokenizer()
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    gen_path = source.directory / "generation_config.json" if source.directory else None
    if gen_path is not None and gen_path.is_file():
        GenerationConfig.from_pretrained(str(source.directory)).save_pretrained(str(directory))
    else:
        GenerationConfig.from_model_config(config).save_pretrained(str(directory))


_VERIFY_TOKENS = 32


@torch.no_grad()
def _reference_logits(source: Source, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed token ids and the source's float32 logits on them."""
    original = source.load_model(torch.float32, device)
    ids = verify_token_ids(original.config.vocab_size).to(device)
    return ids, original(ids).logits.cpu()


def verify_token_ids(vocab_size: int) -> torch.Tensor:
    """The fixed (1, 32) token ids both pipelines verify on."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, _VERIFY_TOKENS), generator=gen)


@torch.no_grad()
def verify(reference: tuple[torch.Tensor, torch.Tensor], converted_dir: Path, device: str = "cpu") -> dict:
    """Compare the converted model's logits with the source's REFERENCE (ids, logits)."""
    from ..mla_model import load_converted

    ids, want = reference
    got = load_converted(converted_dir, torch.float32, device)(ids).logits.cpu()
    return logit_report(got, want)


def logit_report(got: torch.Tensor, want: torch.Tensor) -> dict:
    """The verification entries of both pipelines; a non-finite converted logit is a ConversionError."""
    bad = int((~torch.isfinite(got)).sum())
    if bad:
        raise ConversionError(
            f"verification failed: {bad} of {got.numel()} converted logits are NaN or infinite (the source's "
            f"{'are' if torch.isfinite(want).all() else 'are not'} all finite); the converted model is broken, "
            f"nothing was published. Check the source weights and the dtype (float16 overflows: try bfloat16)"
        )
    diff = (got - want).abs()
    return {"tokens": got.shape[1], "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
            "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean())}
