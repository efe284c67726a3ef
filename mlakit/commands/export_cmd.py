"""`mla-convert export OUT DEST --format deepseek-v3`."""

from __future__ import annotations

import json

import click

from ..choices import BIAS_POLICIES, ROPE_SCALING_POLICIES, TARGETS
from .common import user_errors, verbosity_options

__all__ = ["export_command", "export_options"]


def export_options(fn):
    """Options shared by `export` and `convert --format deepseek-v3`."""
    for option in reversed(
        (
            click.option(
                "--biases",
                type=click.Choice(BIAS_POLICIES),
                default="refuse",
                show_default=True,
                help="Attention biases (Qwen2): refuse; drop them (lossy everywhere); or hf-exact (exact in "
                "transformers only: vLLM's DeepSeek model drops them without an error).",
            ),
            click.option(
                "--rope-scaling",
                type=click.Choice(ROPE_SCALING_POLICIES),
                default="refuse",
                show_default=True,
                help="A scaled rope (llama3, linear): refuse it (vLLM's DeepSeek model rewrites it to "
                "DeepSeek-YaRN, wrong logits), or hf-exact (exact in transformers only; export.json and "
                "README.md say vLLM misreads it).",
            ),
            click.option(
                "--clip-context",
                is_flag=True,
                help="Sliding-window models: set max_position_embeddings to the window, the length up "
                "to which the window-less export is exact.",
            ),
        )
    ):
        fn = option(fn)
    return fn


@click.command("export")
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["deepseek-v3"]),
    default="deepseek-v3",
    show_default=True,
    help="Target format: stock transformers DeepseekV3ForCausalLM (served by vLLM and SGLang).",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="Export dtype; auto keeps OUT's. float16 is refused (see --help of the format).",
)
@export_options
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    default="any",
    show_default=True,
    help="vllm: refuse an export vLLM would refuse or misread (shapes other than 512 + 64, transformers-only "
    "options). any: write it and record in export.json what vLLM would make of it.",
)
@click.option("--overwrite", is_flag=True, help="Replace DEST if it is an earlier mlakit output or empty.")
@click.option("--no-verify", is_flag=True, help="Skip comparing the export's logits with OUT's.")
@verbosity_options
@user_errors
def export_command(
    out, dest, fmt, dtype, biases, rope_scaling, clip_context, target, overwrite, no_verify, quiet
):
    """Export the native mlakit checkpoint OUT (written by `mla-convert convert`) to DEST in another format."""
    from ..export import ExportOptions, export

    opts = ExportOptions(
        format=fmt,
        dtype=dtype,
        biases=biases,
        rope_scaling=rope_scaling,
        target=target,
        clip_context=clip_context,
        overwrite=overwrite,
        verify=not no_verify,
    )
    report = export(out, dest, opts)
    click.echo(
        json.dumps(
            {
                "output": str(dest),
                "format": fmt,
                "checks": report["checks"],
                "engines": report["engines"],
                "verify": report.get("verify"),
                "seconds": report["seconds"],
            },
            indent=2,
            allow_nan=False,
        )
    )
