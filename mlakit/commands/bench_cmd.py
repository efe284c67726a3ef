"""``mla-convert bench``: decode tokens/s and peak memory of a converted model against its original."""

from __future__ import annotations

import click

from .common import (
    IntList,
    compare_device_option,
    compare_dtype_option,
    original_option,
    quiet_transformers,
    user_errors,
)

__all__ = ["bench_command"]


@click.command("bench")
@original_option
@click.option(
    "--converted",
    required=True,
    metavar="OUT",
    type=click.Path(exists=True, file_okay=False),
    help="Output directory of `mla-convert convert`.",
)
@click.option(
    "--context-lengths",
    type=IntList(),
    default="128,512,1024",
    show_default=True,
    help="Prompt lengths to prefill before decoding (comma-separated).",
)
@click.option(
    "--batch-sizes",
    type=IntList(),
    default="1,4",
    show_default=True,
    help="Sequences decoded together (comma-separated).",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Decode steps timed after each prefill.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Short untimed runs before measuring.",
)
@compare_device_option
@compare_dtype_option
@click.option(
    "--report",
    "report_dir",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Write report.json, report.md and bench.png into DIR (replaced atomically).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@user_errors
def bench_command(
    original, converted, context_lengths, batch_sizes, new_tokens, warmup, device, dtype, report_dir, quiet
):
    """Decode throughput (tokens/s) and peak memory of the original and the converted model
    at each context length and batch size; on CPU, peak memory is sampled process RSS."""
    from mlakit.eval.benchmark import BenchSettings, bench_figures, run_bench
    from mlakit.eval.markdown import bench_markdown
    from mlakit.eval.report import check_report_dir, write_report_dir

    settings = BenchSettings(
        original=original,
        converted=converted,
        context_lengths=context_lengths,
        batch_sizes=batch_sizes,
        new_tokens=new_tokens,
        device=device,
        dtype=dtype,
        warmup=warmup,
        progress=not quiet,
    )
    with quiet_transformers(quiet):
        if report_dir:
            check_report_dir(report_dir)
        report = run_bench(settings)
        if report_dir:
            path = write_report_dir(report_dir, report, bench_markdown(report), bench_figures(report))
    click.echo(f"{'context':>8} {'batch':>6} {'orig tok/s':>11} {'conv tok/s':>11} {'speedup':>8}")
    for row in report["comparison"]:
        click.echo(
            f"{row['context_len']:>8} {row['batch_size']:>6} {row['original_tokens_per_s']:>11.1f} "
            f"{row['converted_tokens_per_s']:>11.1f} {row['speedup']:>8.2f}"
        )
    click.echo(
        f"KV bytes/token: original {report['original']['kv_bytes_per_token']:.0f}  converted "
        f"{report['converted']['kv_bytes_per_token']:.0f}  reduction {report['kv_reduction_pct']:.1f}%"
    )
    if report_dir:
        click.echo(f"report: {path}")
