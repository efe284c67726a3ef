"""The conversion options, declared once: types, defaults, bounds, cross-field rules and help.

``ConvertOptions`` is a frozen, validated pydantic dataclass. The same fields are read by

- the Python API (``mlakit.pipeline.api.convert(src, out, ConvertOptions(...))``);
- the CLI: ``commands/option_flags.py`` makes each field a click flag (name, type, default,
  choices, range and help come from here);
- recipes: a recipe is these fields serialised (``mlakit.recipes.Recipe``).

A bad value is an ``OptionsError`` naming the field, its flag and the allowed values, raised when
the options are made: before a source is opened (``option_schema.py``: the machinery every options
model shares; ``export_options.py``: the export's). Torch-free, so ``mla-convert --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from .choices import (
    ALLOCATIONS,
    DTYPE_NAMES,
    LOWRANK_METHODS,
    MEASURED_ROPE_DIMS,
    MIN_CALIB_SEQ_LEN,
    MIXINGS,
    REFINE_FIXED_INPUTS,
    REFINE_INPUTS,
    REFINE_MODES,
    ROPE_METHODS,
    STOCK_ROPE_METHODS,
    TARGETS,
)
from .option_schema import OptionsError, strict_init

__all__ = ["RECIPE_FIELDS", "ConvertOptions", "OptionsError"]

# Fields that say how to convert (saved in recipe.yaml); the others say how this run goes.
RECIPE_FIELDS = (
    "kv_lora_rank", "rope_dim", "kv_budget", "allocation", "rope_method", "lowrank_method", "fold", "mixing",
    "stock_rope", "target", "refine", "refine_inputs", "refine_compensate", "refine_epochs", "refine_lr",
    "refine_batch", "refine_sequences",
    "calib", "calib_samples", "calib_seq_len", "dtype",
)  # fmt: skip

# the two aims of the converted-stream refit weighed alike: the one share that bounds both aims' excess losses
# alike in every layer (refine_values.compensating_target says why)
_DEFAULT_COMPENSATE = 0.5
_RUN = {"recipe": False}  # json_schema_extra of the fields not in RECIPE_FIELDS (checked below)
_NO_FLAG = {"recipe": False, "flag": None}  # quiet comes from the shared -q/--quiet


Rank = Annotated[int, Field(ge=1)] | Literal["full"]
RopeDim = Annotated[int, Field(ge=0)] | Literal[("full", *MEASURED_ROPE_DIMS)]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ConvertOptions:
    kv_lora_rank: Annotated[
        Rank,
        Field(
            description="Latent rank r of every layer, or 'full' (lossless).",
            json_schema_extra={"accepts": "must be 'full' or an integer >= 1"},
        ),
    ] = "full"
    rope_dim: Annotated[
        RopeDim,
        Field(
            description="Shared rotary key dims d_R (even), or 'full'. With --kv-budget, 'full' leaves d_R to the "
            "default share of the budget, and 'measured' chooses it from the calibration data: the d_R whose "
            "converted layers come nearest the source attention on held-out sequences (a two-pass allocation); "
            "'measured-per-layer' chooses each layer's d_R the same way from that layer's errors alone.",
            json_schema_extra={"accepts": "must be 'full', 'measured', 'measured-per-layer' or an even integer >= 0"},
        ),
    ] = "full"
    kv_budget: Annotated[
        float | None,
        Field(
            gt=0,
            le=1,
            description="Fraction of the source's cached values per token (e.g. 0.3125 = 68.75% reduction), "
            "allocated across layers; replaces --kv-lora-rank (--rope-dim, if given, fixes the rotary dims).",
            json_schema_extra={"accepts": "must be a fraction in (0, 1] (or unset)"},
        ),
    ] = None
    allocation: Annotated[
        Literal[ALLOCATIONS],
        Field(
            description="With --kv-budget: the same rank in every layer (uniform), ranks that minimise the summed "
            "log errors (planned), or ranks half-way from uniform toward those of least KL from the source, as "
            "predicted from each layer's measured loss sensitivity (fisher; when streaming, a layer-by-layer "
            "backward sweep). auto: fisher for every source and pipeline, uniform with --format deepseek-v3 (one rank for all layers)."
        ),
    ] = "auto"
    rope_method: Annotated[Literal[ROPE_METHODS], Field(description="How the rotary subspace is chosen.")] = (
        "scored"
    )
    lowrank_method: Annotated[
        Literal[("auto", *LOWRANK_METHODS)],
        Field(
            description="How the latent is factorised. auto: rrr where a value refit follows (--refine auto, values, "
            "values-per-head); without one, rrr when the cache keeps at least a quarter of the source's values and "
            "bkv_pca below (pipeline.AUTO_RRR_FROM names the bench)."
        ),
    ] = "auto"
    fold: Annotated[
        int,
        Field(
            ge=0,
            description="FreqFold for the scored method: adjacent frequencies mixed together; 0 = auto: per "
            "layer, of the folds from 1 to the least that lets every group keep a rotary component, the one whose "
            "converted attention comes nearest the source's on the first calibration sequences.",
        ),
    ] = 0
    mixing: Annotated[
        Literal[MIXINGS],
        Field(description="Rotary mixing within a FreqFold group: pca (RoRoPE) or none."),
    ] = "pca"
    stock_rope: Annotated[
        bool,
        Field(
            description="Keep rotary components only at every k-th source frequency, one per FreqFold group, so "
            "the stock deepseek-v3 export can express the rope (implied by --format deepseek-v3)."
        ),
    ] = False
    target: Annotated[
        Literal[TARGETS],
        Field(
            description="Serving engine the plan must fit. vllm: r = 512 latent + d_R = 64 rope dims in every "
            "layer, the only shape vLLM's CPU, FlashMLA and CUTLASS MLA kernels take (its MLA layer refuses "
            "r + d_R outside 320, 512, 576); replaces a recipe's budget, refuses conflicting flags and sources "
            "that cache at most 576 values per layer (nothing to gain). With --format deepseek-v3 also refuses "
            "what vLLM's DeepSeek model misreads. any: no engine constraint."
        ),
    ] = "any"
    # layer-wise refinement after the closed form (convert/refine.py); the defaults are
    # refine.RefineSettings' (tests/test_refine_driver.py checks they agree)
    refine: Annotated[
        Literal[REFINE_MODES],
        Field(
            description="After the closed form, refit each converted attention to the source layer's attention "
            "output; never raises a layer's calibration loss; the cache is unchanged. layer: from the hidden states "
            "the converted layers below it produce (error-compensating), o_proj by least squares, then "
            "--refine-epochs of Adam. values: each head's value map and o_proj jointly, by least squares from "
            "moments gathered on the stream --refine-inputs names. values-per-head: the same head by head on the "
            "source's stream, then o_proj (two passes; small moments at any model size). auto: values where "
            "the conversion compresses and one layer's joint solve fits the memory limit and costs at most 1.5x the "
            "layer's calibration forward in arithmetic, else values-per-head on the same terms, else none (logged)."
        ),
    ] = "auto"
    refine_inputs: Annotated[
        Literal[REFINE_INPUTS],
        Field(
            description="The hidden states a refinement reads. converted: those the converted layers below "
            "produce, fitted toward the source's attention output plus the error they left (a share of it with "
            "--refine values: --refine-compensate), so each layer compensates it (one more forward of the "
            "converted layer over the refit's sequences). source: the source's own (values and values-per-head; "
            "no converted forward, less exact on the converted model). "
            "auto: converted for layer and values, source for values-per-head."
        ),
    ] = "auto"
    refine_compensate: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="The share of the error the converted layers below left that the value refit on the "
            "converted stream fits each layer to undo (--refine values, --refine-inputs converted). Its target is "
            "the source attention on the converted input, f = attn_src(x'), plus this share of the remaining gap "
            "to the source's residual stream, x + attn_src(x) - x' - f: the least-squares fit weighs the two aims "
            "(reproduce the source's function; restore the source's stream) by 1 - share and share. 1: undo all "
            "of it (the only target before this option); 0: function matching only; 0.5: both aims weighed alike. "
            "Below 1 it runs the source attention on half the calibration sequences (f enters the fit through a "
            "cross moment, estimated there against the source's own output as a control variate).",
            json_schema_extra={"accepts": "must be a share in [0, 1]"},
        ),
    ] = _DEFAULT_COMPENSATE
    refine_epochs: Annotated[
        float,
        Field(
            ge=0,
            le=1000,
            description="Adam passes over the refinement sequences (--refine layer); 0 = the o_proj refit only.",
        ),
    ] = 0.0
    refine_lr: Annotated[
        float, Field(gt=0, lt=1, description="Adam step size relative to each weight's RMS.")
    ] = 1e-3
    refine_batch: Annotated[int, Field(ge=1, description="Sequences per Adam step.")] = 4
    refine_sequences: Annotated[
        int | None, Field(ge=1, description="Calibration sequences refined on (the first ones; unset: all).")
    ] = None
    calib: Annotated[
        str,
        Field(
            min_length=1,
            description="Calibration text: builtin, a text file, hf:NAME[:CONFIG[:SPLIT]], a mix SPEC,SPEC,... "
            "(equal shares of the sequences, e.g. builtin,my_domain.txt), or random (token ids; "
            "for tokenizer-less test models).",
        ),
    ] = "builtin"
    # 512 tokens rather than 256: the converted attention fits the positions its calibration saw best. 256
    # sequences rather than 64: the input statistics settle by 64, but the value refit's held-out error is
    # bounded by its data, and every text measured gained from 4x the sequences; the conversion's fixed
    # per-layer work is then spread over more tokens (bench/results/quality_ablation_values/README.md,
    # bench/results/convert_cost.md)
    calib_samples: Annotated[int, Field(ge=1, description="Calibration sequences.")] = 256
    calib_seq_len: Annotated[
        int,
        # choices.MIN_CALIB_SEQ_LEN says why one token cannot rank rotary components
        Field(ge=MIN_CALIB_SEQ_LEN, description="Tokens per calibration sequence."),
    ] = 512
    dtype: Annotated[
        Literal[("auto", *DTYPE_NAMES)], Field(description="Output dtype; auto keeps the source's.")
    ] = "auto"
    device: Annotated[
        str,
        Field(
            pattern=r"^(cpu|auto|cuda(:\d+)?)$",
            description="cpu, cuda, cuda:N or auto (cuda when visible): where calibration, the per-layer math "
            "and verification run.",
            json_schema_extra=_RUN | {"accepts": "must be one of cpu, cuda, cuda:N, auto"},
        ),
    ] = "cpu"
    seed: Annotated[
        int, Field(description="Seed of the calibration sampling and of torch.", json_schema_extra=_RUN)
    ] = 0
    overwrite: Annotated[
        bool,
        Field(description="Replace OUT if it is an earlier mlakit output or empty.", json_schema_extra=_RUN),
    ] = False
    verify: Annotated[
        bool,
        Field(
            description="Reload OUT and compare its logits with the source's (--no-verify skips it).",
            json_schema_extra=_RUN,
        ),
    ] = True
    quiet: Annotated[bool, Field(description="No progress bars.", json_schema_extra=_NO_FLAG)] = False

    @model_validator(mode="after")
    def _cross_field_rules(self):
        if self.rope_dim in MEASURED_ROPE_DIMS and (self.kv_budget is None or self.stock_rope):
            raise ValueError(
                f"--rope-dim {self.rope_dim} chooses the rotary dims within a --kv-budget, among any even d_R; "
                + ("give --kv-budget as well" if self.kv_budget is None else
                   "--stock-rope allows only a few: give --rope-dim as a number or drop --stock-rope")
            )
        if isinstance(self.rope_dim, int) and self.rope_dim % 2:
            raise ValueError(
                f"--rope-dim must be even (rotary dims come in pairs); got {self.rope_dim}, "
                f"use {self.rope_dim - 1} or {self.rope_dim + 1}"
            )
        if self.stock_rope and self.rope_method not in STOCK_ROPE_METHODS:
            raise ValueError(
                f"--stock-rope works with --rope-method {' or '.join(STOCK_ROPE_METHODS)}; got "
                f"{self.rope_method!r}: pick one of those or drop --stock-rope"
            )
        if self.kv_budget is not None and self.kv_lora_rank != "full":
            raise ValueError(
                f"--kv-budget {self.kv_budget} and --kv-lora-rank {self.kv_lora_rank} both set the latent rank: "
                f"give one (a budget plans each layer's rank)"
            )
        if self.refine not in ("none", "layer") and self.refine_epochs:
            raise ValueError(
                f"--refine-epochs {self.refine_epochs} sets Adam passes of --refine layer; --refine {self.refine} "
                f"is {'at most a' if self.refine == 'auto' else 'a'} closed-form refit: drop --refine-epochs or "
                f"use --refine layer"
            )
        if self.refine_inputs != "auto":
            clash = {"none": "--refine none refines nothing", "layer": "--refine layer always reads the converted "
                     "stream", "values-per-head": "--refine values-per-head fits each source head's own output, "
                     "which has no residual error to compensate: it reads the source stream"}
            if self.refine == "none" or REFINE_FIXED_INPUTS.get(self.refine, self.refine_inputs) != self.refine_inputs:
                raise ValueError(f"--refine-inputs {self.refine_inputs} with --refine {self.refine}: "
                                 f"{clash[self.refine]}; drop --refine-inputs or pick another --refine")
        if self.refine_compensate != _DEFAULT_COMPENSATE and (
                self.refine in ("none", "layer", "values-per-head") or self.refine_inputs == "source"):
            raise ValueError(f"--refine-compensate {self.refine_compensate:g} sets the target of --refine values on "
                             f"the converted stream; --refine {self.refine} --refine-inputs {self.refine_inputs} "
                             f"does not fit one: drop --refine-compensate or use --refine values (or auto) with "
                             f"--refine-inputs converted (or auto)")
        return self


_FIELDS = ConvertOptions.__pydantic_fields__
assert set(RECIPE_FIELDS) == {
    n for n, f in _FIELDS.items() if (f.json_schema_extra or {}).get("recipe", True)
}

# Python callers (and dataclasses.replace) get an OptionsError that names the flag, not pydantic's text.
strict_init(ConvertOptions, "conversion")
