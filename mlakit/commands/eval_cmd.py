"""``mla-convert eval``: perplexity, KV cache and (``--tasks``) downstream accuracy of a converted
model against its original."""

from __future__ import annotations

import click

from .common import (
    compare_device_option,
    compare_dtype_option,
    original_option,
    quiet_transformers,
    user_errors,
)

__all__ = ["eval_command"]


@click.command("eval")
@original_option
@click.option(
    "--converted",
    required=True,
    multiple=True,
    metavar="OUT",
    type=click.Path(exists=True, file_okay=False),
    help="Output directory of `mla-convert convert`. Repeat it, or pass a folder of converted "
    "directories, to evaluate a sweep (adds a perplexity-vs-KV plot).",
)
@click.option(
    "--data",
    default="builtin",
    show_default=True,
    metavar="SPEC",
    help="Evaluation text: 'builtin' (offline, disjoint from the calibration text), a local text "
    "file, or hf:NAME[:CONFIG[:SPLIT]] (e.g. hf:wikitext:wikitext-2-raw-v1:test).",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=2),
    default=1024,
    show_default=True,
    help="Window length L: each token is scored with up to L-1 tokens of context.",
)
@click.option(
    "--stride",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens each window moves on and scores, 1..L-1  [default: L/2].",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=2),
    default=None,
    help="Evaluate only the first N tokens of the text  [default: all].",
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=4, show_default=True, help="Windows per forward pass."
)
@compare_device_option
@compare_dtype_option
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    metavar="DIR",
    help="Tokenizer directory, for models saved without one  [default: the original's].",
)
@click.option(
    "--report",
    "report_dir",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Write report.json, report.md and plots into DIR (replaced atomically).",
)
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    metavar="TEXT",
    help="Prompt for the greedy side-by-side continuations (repeatable)  [default: 4 fixed prompts].",
)
@click.option(
    "--sample-tokens",
    type=click.IntRange(min=0),
    default=32,
    show_default=True,
    help="New tokens per greedy continuation; 0 skips the samples.",
)
@click.option(
    "--tasks",
    default=None,
    metavar="NAMES",
    help="Also score downstream tasks through lm-evaluation-harness (the 'eval' extra), comma "
    "separated, e.g. arc_easy,hellaswag,piqa,winogrande. The harness's tasks read the hub; offline, "
    "use local task files (--include-path).",
)
@click.option(
    "--include-path",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    metavar="DIR",
    help="Folder of the harness's YAML task files (e.g. over a local JSONL) for --tasks.",
)
@click.option(
    "--num-fewshot",
    type=click.IntRange(min=0),
    default=None,
    help="Few-shot examples per --tasks prompt  [default: each task's own, 0 for the common ones].",
)
@click.option(
    "--task-limit",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Score only the first N documents of each task (quick checks; not comparable to papers).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@user_errors
def eval_command(
    original,
    converted,
    data,
    seq_len,
    stride,
    max_tokens,
    batch_size,
    device,
    dtype,
    tokenizer,
    report_dir,
    prompts,
    sample_tokens,
    tasks,
    include_path,
    num_fewshot,
    task_limit,
    quiet,
):
    """Compare a converted MLA model with its original: sliding-window perplexity on the
    same token ids, KV cache bytes per token (config and measured), greedy samples."""
    from mlakit.data import DataSpecError
    from mlakit.eval.evaluate import EvalSettings, eval_figures, run_eval
    from mlakit.eval.markdown import eval_markdown
    from mlakit.eval.report import check_report_dir, write_report_dir
    from mlakit.eval.samples import DEFAULT_PROMPTS
    from mlakit.eval.tasks import TaskEvalError, TaskSettings

    if stride is not None and stride >= seq_len:
        raise click.BadParameter(
            f"stride {stride} must be smaller than --seq-len {seq_len}: the first token a window "
            f"scores needs context in it; use a stride between 1 and {seq_len - 1}",
            param_hint="--stride",
        )
    if include_path and not tasks:
        raise click.BadParameter("--include-path needs --tasks NAMES", param_hint="--include-path")
    task_settings = None
    if tasks is not None:
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        if not names:
            raise click.BadParameter("no task names; pass e.g. --tasks arc_easy,piqa", param_hint="--tasks")
        task_settings = TaskSettings(names, include_path, num_fewshot, task_limit, batch_size)
    settings = EvalSettings(
        original=original,
        converted=list(converted),
        data=data,
        seq_len=seq_len,
        stride=stride,
        max_tokens=max_tokens,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        tokenizer=tokenizer,
        prompts=list(prompts) or list(DEFAULT_PROMPTS),
        sample_tokens=sample_tokens,
        progress=not quiet,
        tasks=task_settings,
    )
    with quiet_transformers(quiet):
        if report_dir:
            check_report_dir(report_dir)
        try:
            report = run_eval(settings)
        except DataSpecError as exc:
            raise click.BadParameter(str(exc), param_hint="--data") from exc
        except TaskEvalError as exc:
            raise click.BadParameter(str(exc), param_hint="--tasks") from exc
        if report_dir:
            path = write_report_dir(report_dir, report, eval_markdown(report), eval_figures(report))
    o, c = report["original"], report["converted"]
    click.echo(
        f"tokens:     {report['data']['n_tokens']} ({data}, window {seq_len}, stride {settings.effective_stride})"
    )
    click.echo(
        f"perplexity: original {o['ppl']:.4f}  converted {c['ppl']:.4f}  ratio {report['ppl_ratio']:.4f}"
    )
    click.echo(
        f"KV bytes/token: original {o['kv_bytes_per_token']:.0f}  converted {c['kv_bytes_per_token']:.0f}  "
        f"reduction {report['kv_reduction_pct']:.1f}%"
    )
    for entry in report.get("sweep", [])[1:]:
        click.echo(
            f"  {entry['label']}: ppl {entry['ppl']:.4f}  KV bytes/token {entry['kv_bytes_per_token']:.0f}"
        )
    for row in report.get("tasks", {}).get("rows", []):
        vals = "  ".join(f"{label} {v:.4f}" for label, (v, _e) in row["values"].items() if v is not None)
        click.echo(f"{row['task']} ({row['metric']}, {row['n_samples']} docs): {vals}")
    if report_dir:
        click.echo(f"report:     {path}")
