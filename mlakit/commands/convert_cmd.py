"""`mla-convert convert SRC OUT`."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from ..choices import MEASURED_ROPE_DIMS
from ..options import RECIPE_FIELDS
from .common import byte_size_type, user_errors, verbosity_options
from .export_cmd import export_flags
from .option_flags import given_options, option_flags

__all__ = ["convert_command"]


@click.command("convert")
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--recipe", help="Built-in recipe name or YAML file; the conversion flags given override its fields."
)
@option_flags()
@click.option(
    "--pipeline",
    type=click.Choice(["auto", "streaming", "in-memory"]),
    default="auto",
    show_default=True,
    help="streaming: layer by layer, memory set by one layer, resumable (safetensors directories); "
    "in-memory: load the whole model. auto streams safetensors directories and loads GGUF/pickles.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Streaming: continue the conversion an interrupted run left in .OUT.partial-streaming.",
)
@click.option(
    "--max-memory",
    type=byte_size_type,
    help="Streaming: host RAM budget (e.g. 4GB, 3.5GiB); picks the calibration batch that fits, or "
    "fails early naming what to change.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["native", "deepseek-v3"]),
    default="native",
    show_default=True,
    help="native: mlakit's MLA model; deepseek-v3: also export it to stock DeepseekV3ForCausalLM at OUT.",
)
@export_flags
@verbosity_options
@user_errors
def convert_command(
    src, out, recipe, quiet, fmt, biases, rope_scaling, clip_context, pipeline, resume, max_memory, **flags
):
    """Convert SRC (model directory, .gguf file, hub id, or 'default') into an MLA checkpoint at OUT."""
    # torch-free: a bad recipe or value is refused before torch loads
    from ..recipes import Recipe, RecipeError

    try:
        base = Recipe.load(recipe) if recipe else Recipe()
    except RecipeError as exc:
        raise click.BadParameter(str(exc), param_hint="--recipe") from exc
    overrides = given_options({k: v for k, v in flags.items() if k in RECIPE_FIELDS})
    # explicit shapes replace a recipe's budget; a measured --rope-dim chooses within it, so keeps it
    fixed_rope = "rope_dim" in overrides and overrides["rope_dim"] not in MEASURED_ROPE_DIMS
    if ("kv_lora_rank" in overrides or fixed_rope) and "kv_budget" not in overrides:
        overrides["kv_budget"] = None
    if "kv_budget" in overrides and "kv_lora_rank" not in overrides:
        # and an explicit budget a recipe's rank (a given --rope-dim stays)
        overrides["kv_lora_rank"] = "full"
    run = {k: v for k, v in flags.items() if k not in RECIPE_FIELDS}  # device, seed, overwrite, verify
    # every value checked (OptionsError names the flag)
    opts = base.to_options(**run, quiet=quiet, **overrides)
    if fmt == "deepseek-v3":  # the export's values too, against the conversion's target
        from ..export_options import ExportOptions

        export_opts = ExportOptions(
            biases=biases,
            rope_scaling=rope_scaling,
            clip_context=clip_context,
            target=opts.target,
            overwrite=opts.overwrite,
            verify=opts.verify,
        )
    # imported here, not at the top: --help and usage errors answer without torch
    from ..convert.engine_target import fit_target
    from ..pipeline.api import StreamOptions, resolve_device, run_conversion

    opts = replace(opts, device=resolve_device(opts.device))
    # a recipe's values that the target or the export cannot hold are replaced (logged), explicit flags refused
    opts = fit_target(opts, explicit=overrides, stock_export=fmt == "deepseek-v3")
    named = base.model_copy(update={"name": base.name or recipe})
    stream = StreamOptions(resume=resume, max_memory=max_memory)
    if fmt == "native":
        report = run_conversion(src, out, opts, pipeline, stream, recipe=named)
    elif resume:
        raise click.UsageError(
            f"--format {fmt} converts into a temporary native checkpoint that a failed run removes, so there "
            f"is nothing to resume; for a resumable run convert with --format native, then `mla-convert export`"
        )
    else:  # convert into a temporary native checkpoint, export it to OUT
        from ..export import convert_to_format

        report = convert_to_format(fmt, src, out, opts, recipe=named, export_opts=export_opts, pipeline=pipeline,
                                   stream=stream)
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
