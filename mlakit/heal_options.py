"""The heal options, declared once: `mla-convert heal`'s flags and the Python API
(``mlakit.heal.heal(out, dest, HealOptions(teacher=...))``).

A bad value is an ``OptionsError`` naming the field and its flag, raised when the options are made:
before the student, the teacher or the training data is opened. What depends on the models or the
data (a token count below one optimizer step, a tokenizer-less teacher) is checked by
``mlakit.heal``. Torch-free, so ``--help`` stays fast.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

from .choices import HEAL_TRAIN_CHOICES
from .option_schema import strict_init

__all__ = ["HealOptions"]

_NO_FLAG = {"flag": None}  # set from Python only (quiet: the shared -q/--quiet)


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class HealOptions:
    teacher: Annotated[
        str,
        Field(
            min_length=1,
            description="The original model OUT was converted from: HF directory, hub id, .gguf file, or "
            "'default'.",
            json_schema_extra={"metavar": "SRC"},
        ),
    ]
    data: Annotated[
        str,
        Field(
            min_length=1,
            description="Training text: 'builtin' (its calibration part, never the evaluation part), a local "
            "text file, hf:NAME[:CONFIG[:SPLIT]] (streamed; split defaults to train), or 'random' (random token "
            "ids, for smoke tests).",
            json_schema_extra={"metavar": "SPEC"},
        ),
    ] = "builtin"
    tokens: Annotated[
        int, Field(ge=1, description="Training tokens (rounded down to whole optimizer steps).")
    ] = 200_000
    seq_len: Annotated[int, Field(ge=2, description="Tokens per packed training sequence.")] = 256
    lr: Annotated[float, Field(gt=0, description="Peak AdamW learning rate.")] = 1e-4
    batch_size: Annotated[int, Field(ge=1, description="Sequences per micro-batch on each process.")] = 4
    grad_accum: Annotated[int, Field(ge=1, description="Micro-batches per optimizer step.")] = 1
    train: Annotated[
        Literal[HEAL_TRAIN_CHOICES],
        Field(
            description="Parameters to train: the MLA attention projections (q_proj, kv_a_proj_with_mqa, "
            "kv_b_proj, o_proj, with biases) or every parameter."
        ),
    ] = "attention"
    save_every: Annotated[
        int, Field(ge=0, description="Checkpoint every N optimizer steps into the work dir (0: never).")
    ] = 0
    resume: Annotated[bool, Field(description="Continue from the latest checkpoint in the work dir.")] = False
    temperature: Annotated[
        float, Field(gt=0, description="Distillation temperature T (KL on softmax(z/T), scaled by T^2).")
    ] = 1.0
    lm_weight: Annotated[
        float, Field(ge=0, description="Weight of the next-token cross-entropy added to the KL.")
    ] = 0.0
    warmup: Annotated[
        int | None,
        Field(ge=0, description="Linear warmup steps before the cosine decay  [default: 5% of the steps]."),
    ] = None
    seed: Annotated[int, Field(description="Seeds data order and every RNG.")] = 0
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay.")] = 0.0
    max_grad_norm: Annotated[float, Field(gt=0, description="Gradient clipping norm.")] = 1.0
    val_sequences: Annotated[
        int,
        Field(ge=1, description="Held-out sequences for the before/after loss.", json_schema_extra=_NO_FLAG),
    ] = 16
    chunk_tokens: Annotated[
        int,
        Field(
            ge=1,
            description="Positions per chunk of the loss (batch x chunk length).",
            json_schema_extra=_NO_FLAG,
        ),
    ] = 4096
    work_dir: Annotated[
        str | None,
        Field(
            description="Checkpoint folder  [default: DEST.heal-work beside DEST; removed when DEST is written].",
            json_schema_extra={"metavar": "DIRECTORY"},
        ),
    ] = None
    keep_checkpoints: Annotated[
        int, Field(ge=1, description="Checkpoints kept in the work dir.", json_schema_extra=_NO_FLAG)
    ] = 1
    overwrite: Annotated[
        bool, Field(description="Replace DEST if it is an earlier mlakit output or empty.")
    ] = False
    quiet: Annotated[bool, Field(description="No progress bars.", json_schema_extra=_NO_FLAG)] = False

    @field_validator("teacher", "data", "work_dir", mode="before")
    @classmethod
    def _path_as_text(cls, value):
        return os.fspath(value) if isinstance(value, os.PathLike) else value


# Python callers (and dataclasses.replace) get an OptionsError that names the flag, not pydantic's text.
strict_init(HealOptions, "heal")
