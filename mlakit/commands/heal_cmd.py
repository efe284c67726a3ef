"""``mla-convert heal OUT --teacher SRC DEST``: distillation from the original model; flags generated
from ``HealOptions``."""

from __future__ import annotations

import json
import logging
import os

import click

from ..heal_options import HealOptions
from .common import quiet_transformers, user_errors, verbosity_options
from .option_flags import option_flags

__all__ = ["heal_command"]


@click.command("heal")
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@option_flags(model=HealOptions)
@verbosity_options
@user_errors
def heal_command(out, dest, quiet, **flags):
    """Heal the converted model OUT by distillation from its original (--teacher); write DEST.

    Trains with accelerate: run plainly for CPU or one GPU, or under `accelerate launch
    --multi_gpu --num_processes N` / `torchrun --nproc-per-node N` for N processes (DDP; on CPU
    over gloo), or with an accelerate config for FSDP/DeepSpeed on GPUs. DEST is written atomically in the
    same format as OUT, with the heal settings and held-out losses in conversion.json."""
    opts = HealOptions(quiet=quiet, **flags)  # every value checked before a model or the data is opened
    # imported here, not at the top: --help and usage errors answer without torch
    from mlakit.data import DataSpecError
    from mlakit.heal import heal

    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file checkpoint messages
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
