"""`mla-convert convert SRC OUT`."""

from __future__ import annotations

import json

import click

from ..convert.pipeline import DTYPES, ConvertOptions, convert
from .common import rank_option_type, user_errors, verbosity_options

__all__ = ["convert_command"]


@click.command("convert")
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--kv-lora-rank", type=rank_option_type, default="full", show_default=True,
              help="Latent rank r per layer, or 'full' (lossless).")
@click.option("--rope-dim", type=rank_option_type, default="full", show_default=True,
              help="Shared rotary key dims d_R (even), or 'full' (every rotary component).")
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True,
              help="Output dtype; auto keeps the source's.")
@click.option("--device", default="cpu", show_default=True, help="Device for verification forward passes.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-verify", is_flag=True, help="Skip reloading OUT and comparing logits with the source.")
@verbosity_options
@user_errors
def convert_command(src, out, kv_lora_rank, rope_dim, dtype, device, overwrite, seed, no_verify, quiet):
    """Convert SRC (model directory, .gguf file, hub id, or 'default') into an MLA checkpoint at OUT."""
    opts = ConvertOptions(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, dtype=dtype, device=device, seed=seed,
                          overwrite=overwrite, verify=not no_verify, quiet=quiet)
    report = convert(src, out, opts)
    per_layer = report["kv_values_per_token"] / len(report["layers"])
    summary = {
        "output": str(out),
        "kv_values_per_token_per_layer": per_layer,
        "source_kv_values_per_token_per_layer": report["source_kv_values_per_token_per_layer"],
        "kv_reduction": round(1 - report["kv_values_per_token"] / report["source_kv_values_per_token"], 4),
        "verify": report.get("verify"),
        "seconds": report["seconds"],
    }
    click.echo(json.dumps(summary, indent=2))
