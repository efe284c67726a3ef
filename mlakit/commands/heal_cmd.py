"""``mla-convert heal OUT --teacher SRC DEST``: distillation from the original model."""

from __future__ import annotations

import json
import logging
import os

import click

from .common import quiet_transformers, user_errors, verbosity_options

__all__ = ["heal_command"]


@click.command("heal")
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@click.option(
    "--teacher",
    required=True,
    metavar="SRC",
    help="The original model OUT was converted from: HF directory, hub id, .gguf file, or 'default'.",
)
@click.option(
    "--data",
    default="builtin",
    show_default=True,
    metavar="SPEC",
    help="Training text: 'builtin' (its calibration part, never the evaluation part), a local text "
    "file, hf:NAME[:CONFIG[:SPLIT]] (streamed; split defaults to train), or 'random' "
    "(random token ids, for smoke tests).",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    default=200_000,
    show_default=True,
    help="Training tokens (rounded down to whole optimizer steps).",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=2),
    default=256,
    show_default=True,
    help="Tokens per packed training sequence.",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=1e-4,
    show_default=True,
    help="Peak AdamW learning rate.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Sequences per micro-batch on each process.",
)
@click.option(
    "--grad-accum",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Micro-batches per optimizer step.",
)
@click.option(
    "--train",
    type=click.Choice(["attention", "all"]),
    default="attention",
    show_default=True,
    help="Parameters to train: the MLA attention projections (q_proj, kv_a_proj_with_mqa, kv_b_proj, "
    "o_proj, with biases) or every parameter.",
)
@click.option(
    "--save-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Checkpoint every N optimizer steps into the work dir (0: never).",
)
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in the work dir.")
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Checkpoint folder  [default: DEST.heal-work beside DEST; removed when DEST is written].",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Distillation temperature T (KL on softmax(z/T), scaled by T^2).",
)
@click.option(
    "--lm-weight",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Weight of the next-token cross-entropy added to the KL.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=None,
    help="Linear warmup steps before the cosine decay  [default: 5% of the steps].",
)
@click.option(
    "--max-grad-norm",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Gradient clipping norm.",
)
@click.option("--weight-decay", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds data order and every RNG.")
@click.option("--overwrite", is_flag=True, help="Replace DEST if it is an earlier mlakit output or empty.")
@verbosity_options
@user_errors
def heal_command(out, dest, quiet, **flags):
    """Heal the converted model OUT by distillation from its original (--teacher); write DEST.

    Trains with accelerate: run plainly for CPU or one GPU, or under `accelerate launch
    --multi_gpu --num_processes N` / `torchrun --nproc-per-node N` for N processes (DDP; on CPU
    over gloo), or with an accelerate config for FSDP/DeepSpeed on GPUs. DEST is written atomically in the
    same format as OUT, with the heal settings and held-out losses in conversion.json."""
    from mlakit.data import DataSpecError
    from mlakit.heal import HealOptions, heal

    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file checkpoint messages
    opts = HealOptions(quiet=quiet, **flags)
    with quiet_transformers(quiet):
        try:
            report = heal(out, dest, opts)
        except DataSpecError as exc:
            raise click.BadParameter(str(exc), param_hint="--data") from exc
    if int(os.environ.get("RANK", "0")) != 0:  # under a launcher: one summary, from the main process
        return
    before, after = report["heldout_before"], report["heldout_after"]
    summary = {
        "output": str(dest),
        "tokens": report["tokens"],
        "steps": report["steps"],
        "heldout_kl": [round(before["kl"], 5), round(after["kl"], 5)],
        "heldout_nll_student": [round(before["student_nll"], 5), round(after["student_nll"], 5)],
        "heldout_nll_teacher": round(before["teacher_nll"], 5),
        "train_seconds": report["train_seconds"],
        "processes": report["processes"],
        "tokens_per_second": report["tokens_per_second"],
    }
    click.echo(json.dumps(summary, indent=2, allow_nan=False))
