"""`mla-convert convert SRC OUT`."""

from __future__ import annotations

import json

import click

from ..choices import ALLOCATIONS, DTYPE_NAMES, MIN_CALIB_SEQ_LEN, REFINE_MODES, TARGETS
from .common import byte_size_type, rank_option_type, user_errors, verbosity_options
from .export_cmd import export_options

__all__ = ["convert_command"]

# CLI option name -> ConvertOptions field; a flag given on the command line overrides the recipe.
_OVERRIDES = {
    "kv_lora_rank": "kv_lora_rank", "rope_dim": "rope_dim", "kv_budget": "kv_budget",
    "allocation": "allocation", "rope_method": "rope_method", "lowrank_method": "lowrank_method", "fold": "fold",
    "stock_rope": "stock_rope", "target": "target",
    "calib": "calib", "calib_samples": "calib_samples", "calib_seq_len": "calib_seq_len", "dtype": "dtype",
    "refine": "refine", "refine_epochs": "refine_epochs", "refine_lr": "refine_lr", "refine_batch": "refine_batch",
    "refine_sequences": "refine_sequences",
}


@click.command("convert")
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--recipe", help="Built-in recipe name or YAML file; flags below override its fields.")
@click.option("--kv-lora-rank", type=rank_option_type, help="Latent rank r of every layer, or 'full' (lossless).")
@click.option("--rope-dim", type=rank_option_type, help="Shared rotary key dims d_R (even), or 'full'.")
@click.option("--kv-budget", type=float,
              help="Fraction of the source's cached values per token (e.g. 0.3125 = 68.75% reduction), "
                   "allocated across layers; replaces --kv-lora-rank/--rope-dim.")
@click.option("--allocation", type=click.Choice(list(ALLOCATIONS)),
              help="With --kv-budget: the same rank in every layer (uniform), ranks that minimise the summed log "
                   "errors (planned), or ranks half-way from uniform toward those of least KL from the source, as "
                   "predicted from each layer's measured loss sensitivity (fisher; when streaming, a layer-by-layer "
                   "backward sweep). auto: fisher in memory, uniform when streaming or exporting to deepseek-v3 "
                   "[default: auto].")
@click.option("--rope-method", type=click.Choice(["scored", "transmla", "high", "uniform", "norm"]),
              help="How the rotary subspace is chosen [default: scored].")
@click.option("--lowrank-method", type=click.Choice(["auto", "rrr", "bkv_pca", "svd"]),
              help="How the latent is factorised. auto: rrr when the cache keeps at least a quarter of the "
                   "source's values, bkv_pca below (measured on three texts) [default: auto].")
@click.option("--fold", type=int,
              help="FreqFold for the scored method: adjacent frequencies mixed together; 0 = auto "
                   "(fold more when fewer rotary components are kept) [default: 0].")
@click.option("--stock-rope", is_flag=True, default=None,
              help="Keep rotary components only at every k-th source frequency, one per FreqFold group, so the "
                   "stock deepseek-v3 export can express the rope (implied by --format deepseek-v3).")
@click.option("--target", type=click.Choice(TARGETS),
              help="Serving engine the plan must fit. vllm: r = 512 latent + d_R = 64 rope dims in every layer, the "
                   "only shape vLLM's CPU, FlashMLA and CUTLASS MLA kernels take (its MLA layer refuses r + d_R "
                   "outside 320, 512, 576); replaces a recipe's budget, refuses conflicting flags and sources that "
                   "cache at most 576 values per layer (nothing to gain). With --format deepseek-v3 also refuses "
                   "what vLLM's DeepSeek model misreads. any: no engine constraint [default: any].")
@click.option("--refine", type=click.Choice(REFINE_MODES),
              help="After the closed form, refit each converted attention to the source layer's output from the "
                   "hidden states the converted layers below it produce (error-compensating, layer by layer): "
                   "o_proj by least squares, then --refine-epochs of Adam; never raises a layer's calibration "
                   "loss; the cache is unchanged [default: none].")
@click.option("--refine-epochs", type=click.FloatRange(0, 1000),
              help="Adam passes over the refinement sequences; 0 = the o_proj refit only [default: 0].")
@click.option("--refine-lr", type=click.FloatRange(0, 1, min_open=True, max_open=True),
              help="Adam step size relative to each weight's RMS [default: 0.001].")
@click.option("--refine-batch", type=click.IntRange(min=1), help="Sequences per Adam step [default: 4].")
@click.option("--refine-sequences", type=click.IntRange(min=1),
              help="Calibration sequences refined on (the first ones) [default: all].")
@click.option("--calib", help="Calibration text: builtin, a text file, or hf:NAME[:CONFIG[:SPLIT]] [default: builtin].")
@click.option("--calib-samples", type=click.IntRange(min=1), help="Calibration sequences [default: 128].")
@click.option("--calib-seq-len", type=click.IntRange(min=MIN_CALIB_SEQ_LEN),
              help="Tokens per calibration sequence [default: 256].")
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), help="Output dtype; auto keeps the source's.")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:N or auto (cuda when visible): where calibration, the per-layer math and "
                   "verification run.")
@click.option("--pipeline", type=click.Choice(["auto", "streaming", "in-memory"]), default="auto", show_default=True,
              help="streaming: layer by layer, memory set by one layer, resumable (safetensors directories); "
                   "in-memory: load the whole model. auto streams safetensors directories and loads GGUF/pickles.")
@click.option("--resume", is_flag=True,
              help="Streaming: continue the conversion an interrupted run left in .OUT.partial-streaming.")
@click.option("--max-memory", type=byte_size_type,
              help="Streaming: host RAM budget (e.g. 4GB, 3.5GiB); picks the calibration batch that fits, or "
                   "fails early naming what to change.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it is an earlier mlakit output or empty.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-verify", is_flag=True, help="Skip reloading OUT and comparing logits with the source.")
@click.option("--format", "fmt", type=click.Choice(["native", "deepseek-v3"]), default="native", show_default=True,
              help="native: mlakit's MLA model; deepseek-v3: also export it to stock DeepseekV3ForCausalLM at OUT.")
@export_options
@verbosity_options
@user_errors
def convert_command(src, out, recipe, device, overwrite, seed, no_verify, quiet, fmt, biases, rope_scaling,
                    clip_context, pipeline, resume, max_memory, **flags):
    """Convert SRC (model directory, .gguf file, hub id, or 'default') into an MLA checkpoint at OUT."""
    # imported here, not at the top: --help and usage errors answer without torch
    from ..convert.engine_target import fit_target
    from ..convert.pipeline import StreamOptions, resolve_device, run_conversion
    from ..recipes import Recipe, RecipeError

    try:
        base = Recipe.load(recipe) if recipe else Recipe()
    except RecipeError as exc:
        raise click.BadParameter(str(exc), param_hint="--recipe") from exc
    overrides = {_OVERRIDES[k]: v for k, v in flags.items() if v is not None}
    if ("kv_lora_rank" in overrides or "rope_dim" in overrides) and "kv_budget" not in overrides:
        overrides["kv_budget"] = None  # explicit shapes replace a recipe's budget
    device = resolve_device(device)
    opts = base.to_options(device=device, seed=seed, overwrite=overwrite, verify=not no_verify, quiet=quiet,
                           **overrides)
    # a recipe's values that the target or the export cannot hold are replaced (logged), explicit flags refused
    opts = fit_target(opts, explicit=overrides, stock_export=fmt == "deepseek-v3")
    named = base.model_copy(update={"name": base.name or recipe})
    if fmt == "native":
        stream = StreamOptions(resume=resume, max_memory=max_memory)
        report = run_conversion(src, out, opts, pipeline, stream, recipe=named)
    elif pipeline == "streaming" or resume or max_memory is not None:
        raise click.UsageError(f"--format {fmt} converts in memory before exporting; --pipeline streaming, --resume "
                               f"and --max-memory apply to --format native only")
    else:  # convert into a temporary native checkpoint, export it to OUT
        from ..export import ExportOptions, convert_to_format

        report = convert_to_format(fmt, src, out, opts, recipe=named, export_opts=ExportOptions(
            biases=biases, rope_scaling=rope_scaling, clip_context=clip_context, overwrite=overwrite,
            verify=not no_verify))
    per_layer = report["kv_values_per_token"] / len(report["layers"])
    summary = {
        "output": str(out),
        "kv_values_per_token_per_layer": per_layer,
        "source_kv_values_per_token_per_layer": report["source_kv_values_per_token_per_layer"],
        "kv_reduction": round(1 - report["kv_values_per_token"] / report["source_kv_values_per_token"], 4),
        "verify": report.get("verify"),
        "seconds": report["seconds"],
    }
    click.echo(json.dumps(summary, indent=2, allow_nan=False))
