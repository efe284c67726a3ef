"""Heal a converted MLA model by distillation from its original: the training loop.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` packed sequences on each
process. The teacher (the source model, frozen, eval mode, no_grad) gives final hidden
states; the student's forward computes the chunked KL (+ optional LM) loss inside its own
``forward`` so that DDP/FSDP wrappers see every student parameter used there. Built on
``accelerate``: CPU, one GPU, or several processes under an accelerate config (FSDP,
DeepSpeed); only the single-process CPU path is exercised by the tests.

Checkpoints (``accelerator.save_state``) hold model, optimizer, scheduler, RNG states and
the run's progress (step, data position, tokens, seconds, before-loss), so a resumed run
continues exactly where the checkpoint was taken.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mlakit.convert.output_dir import check_output, claim_output, local_paths

from .data import open_training_data
from .loss import distill_loss
from .output import (
    HealError,
    latest_checkpoint,
    prepare_work_dir,
    read_weight_layout,
    remove_work_dir,
    save_checkpoint,
    write_healed,
)
from .schedule import TRAIN_CHOICES, cosine_with_warmup, select_trainable

__all__ = ["HealError", "HealOptions", "heal"]

logger = logging.getLogger(__name__)

# Settings that change what a run computes: a resume must use the same values.
_RUN_KEYS = (
    "teacher",
    "data",
    "tokens",
    "seq_len",
    "lr",
    "batch_size",
    "grad_accum",
    "train",
    "temperature",
    "lm_weight",
    "warmup",
    "seed",
    "weight_decay",
    "max_grad_norm",
    "val_sequences",
)


@dataclass
class HealOptions:
    teacher: str
    data: str = "builtin"
    tokens: int = 200_000
    seq_len: int = 256
    lr: float = 1e-4
    batch_size: int = 4
    grad_accum: int = 1
    train: str = "attention"
    save_every: int = 0  # optimizer steps between checkpoints; 0 = none
    resume: bool = False
    temperature: float = 1.0
    lm_weight: float = 0.0
    warmup: int | None = None  # optimizer steps; None = 5% of the run
    seed: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    val_sequences: int = 16  # held-out sequences for the before/after loss
    chunk_tokens: int = 4096  # positions per chunk of the loss (batch x chunk length)
    work_dir: str | None = None  # checkpoints; default DEST.heal-work beside DEST
    keep_checkpoints: int = 1
    overwrite: bool = False
    quiet: bool = False


@dataclass
class _Progress:
    """Run state that is not in model/optimizer/scheduler; saved with every checkpoint."""

    step: int = 0
    position: int = 0  # training sequences consumed (all processes)
    tokens: int = 0
    seconds: float = 0.0
    before: dict = field(default_factory=dict)
    history: list = field(default_factory=list)  # (step, loss) every optimizer step

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class _Student(torch.nn.Module):
    """The student and its loss in one forward (what accelerate prepares and wraps)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, teacher_hidden, teacher_head, temperature, lm_weight, chunk_tokens):
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, S, D)
        out = distill_loss(
            hidden,
            teacher_hidden,
            input_ids,
            self.model.get_output_embeddings(),
            teacher_head,
            temperature,
            lm_weight,
            chunk_tokens,
        )
        return out.loss, torch.tensor([out.kl, out.student_nll])


def _check_options(opts: HealOptions) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise HealError(what)

    need(opts.tokens >= 1, f"--tokens must be >= 1, got {opts.tokens}")
    need(opts.seq_len >= 2, f"--seq-len must be >= 2, got {opts.seq_len}")
    need(opts.lr > 0, f"--lr must be > 0, got {opts.lr}")
    need(
        opts.batch_size >= 1 and opts.grad_accum >= 1,
        f"--batch-size and --grad-accum must be >= 1, got {opts.batch_size} and {opts.grad_accum}",
    )
    need(
        opts.train in TRAIN_CHOICES, f"--train must be one of {', '.join(TRAIN_CHOICES)}, got {opts.train!r}"
    )
    need(opts.temperature > 0, f"--temperature must be > 0 (1 = plain KL), got {opts.temperature}")
    need(opts.lm_weight >= 0, f"--lm-weight must be >= 0 (0 = distillation only), got {opts.lm_weight}")
    need(opts.save_every >= 0, f"--save-every must be >= 0 (0 = no checkpoints), got {opts.save_every}")
    need(opts.warmup is None or opts.warmup >= 0, f"--warmup must be >= 0 steps, got {opts.warmup}")
    need(opts.val_sequences >= 1, f"val_sequences must be >= 1, got {opts.val_sequences}")
    need(opts.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {opts.keep_checkpoints}")


def _read_student_config(out: Path) -> dict:
    from mlakit.mla_model import MLAConfig

    cfg_file = out / "config.json"
    if not out.is_dir() or not cfg_file.is_file():
        raise HealError(
            f"{out} is not a converted model directory (no config.json); "
            "pass the output directory of `mla-convert convert`"
        )
    config = json.loads(cfg_file.read_text(encoding="utf-8"))
    if config.get("model_type") != MLAConfig.model_type:
        raise HealError(
            f"{out} holds model_type {config.get('model_type')!r}, not mlakit's "
            f"{MLAConfig.model_type!r}; heal works on the native output of `mla-convert convert` "
            "(heal before exporting to deepseek-v3)"
        )
    return config


def _run_settings(opts: HealOptions, out: Path) -> dict:
    """What a resumed run must share with the checkpointed one: the settings and the content of both
    models (same shapes but other weights would otherwise continue silently)."""
    from mlakit.convert.fingerprint import content_fingerprint
    from mlakit.convert.source import SourceError, resolve_source

    try:
        _, teacher_path = resolve_source(opts.teacher)
    except SourceError as exc:
        raise HealError(f"--teacher {opts.teacher!r}: {exc}") from exc
    run = {k: getattr(opts, k) for k in _RUN_KEYS}
    return run | {
        "student_content": content_fingerprint(out),
        "teacher_content": content_fingerprint(teacher_path),
    }


def _teacher_parts(teacher):
    base = getattr(teacher, teacher.base_model_prefix)
    return base, teacher.get_output_embeddings()


@torch.no_grad()
def _heldout(student: _Student, teacher, val: torch.Tensor, batch: int, device, chunk_tokens: int) -> dict:
    """Mean KL(teacher || student) at T = 1 and both models' NLL on the held-out sequences."""
    base_t, head_t = _teacher_parts(teacher)
    student.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    n_pos = n_tgt = 0
    for i in range(0, len(val), batch):
        ids = val[i : i + batch].to(device)
        ht = base_t(input_ids=ids, use_cache=False).last_hidden_state
        loss, stats = student(ids, ht, head_t, 1.0, 0.0, chunk_tokens)
        teacher_nll = distill_loss(ht, ht, ids, head_t, head_t, 1.0, 0.0, chunk_tokens).student_nll
        B, S = ids.shape
        sums += torch.tensor(
            [float(stats[0]) * B * S, float(stats[1]) * B * (S - 1), teacher_nll * B * (S - 1)],
            dtype=torch.float64,
        )
        n_pos, n_tgt = n_pos + B * S, n_tgt + B * (S - 1)
    student.train()
    kl, s_nll, t_nll = float(sums[0] / n_pos), float(sums[1] / n_tgt), float(sums[2] / n_tgt)
    return {"kl": kl, "student_nll": s_nll, "teacher_nll": t_nll, "tokens": n_pos}


def _load_models(out: Path, opts: HealOptions, device):
    from mlakit.convert.source import SourceError, load_source_model
    from mlakit.eval.loading import load_tokenizer
    from mlakit.mla_model import load_converted

    student = load_converted(out, torch.float32, "cpu")
    teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        teacher, teacher_tok = load_source_model(opts.teacher, teacher_dtype, str(device))
    except SourceError as exc:
        raise HealError(f"--teacher {opts.teacher!r}: {exc}") from exc
    teacher.requires_grad_(False).eval()
    v_s = student.get_output_embeddings().weight.shape[0]
    v_t = teacher.get_output_embeddings().weight.shape[0]
    if v_s != v_t:
        raise HealError(
            f"teacher {opts.teacher!r} has a vocabulary of {v_t} tokens but the converted model {out} "
            f"has {v_s}: distillation compares the two next-token distributions token by token. "
            f"Fix: pass as --teacher the source model that {out} was converted from."
        )
    tokenizer = load_tokenizer([out]) or teacher_tok
    return student, teacher, tokenizer, v_s


def heal(out: str | Path, dest: str | Path, opts: HealOptions, on_step=None) -> dict:
    """Heal the converted model OUT by distillation from ``opts.teacher``; write DEST atomically.

    Returns the heal report (also stored under ``heal`` in DEST/conversion.json). ON_STEP, if
    given, is called as ``on_step(step)`` after every optimizer step (and its checkpoint).
    """
    from accelerate import Accelerator

    _check_options(opts)
    out, dest = Path(out).expanduser(), Path(dest).expanduser()
    _read_student_config(out)
    check_output(dest, opts.overwrite, sources=[out, *local_paths(opts.teacher)])
    work_dir = Path(opts.work_dir).expanduser() if opts.work_dir else dest.with_name(dest.name + ".heal-work")
    start_wall = time.time()

    accelerator = Accelerator()
    with (
        claim_output(dest, opts.overwrite, sources=[out, *local_paths(opts.teacher)])
        if accelerator.is_main_process
        else (contextlib.nullcontext()) as claim
    ):
        return _heal(accelerator, claim, out, work_dir, opts, on_step, start_wall)


def _heal(
    accelerator, claim, out: Path, work_dir: Path, opts: HealOptions, on_step, start_wall: float
) -> dict:
    from accelerate.utils import set_seed

    set_seed(opts.seed)
    device = accelerator.device
    student_model, teacher, tokenizer, vocab = _load_models(out, opts, device)
    layout = read_weight_layout(out)
    data = open_training_data(opts.data, tokenizer, vocab, opts.seq_len, opts.seed, opts.val_sequences)

    n_proc = accelerator.num_processes
    seqs_per_step = opts.batch_size * opts.grad_accum * n_proc
    tokens_per_step = seqs_per_step * opts.seq_len
    total_steps = opts.tokens // tokens_per_step
    if total_steps < 1:
        raise HealError(
            f"--tokens {opts.tokens} is less than one optimizer step of {tokens_per_step} tokens "
            f"(seq-len {opts.seq_len} x batch-size {opts.batch_size} x grad-accum {opts.grad_accum} "
            f"x {n_proc} processes). Fix: raise --tokens or lower those."
        )
    # every input is checked: only now touch the work dir
    resume_from = (
        prepare_work_dir(work_dir, opts.resume, _run_settings(opts, out))
        if accelerator.is_main_process
        else latest_checkpoint(work_dir)
    )
    warmup = opts.warmup if opts.warmup is not None else max(1, math.ceil(0.05 * total_steps))
    trained = select_trainable(student_model, opts.train)
    student = _Student(student_model)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    scheduler = cosine_with_warmup(optimizer, warmup, total_steps)
    n_params = sum(p.numel() for p in params)
    student, optimizer = accelerator.prepare(student, optimizer)
    params = [p for p in student.parameters() if p.requires_grad]  # as wrapped (FSDP flattens them)
    progress = _Progress()
    accelerator.register_for_checkpointing(scheduler, progress)
    base_t, head_t = _teacher_parts(teacher)

    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        logger.info("resumed from %s (step %d, %d tokens)", resume_from, progress.step, progress.tokens)
    else:
        progress.before = _heldout(
            student, teacher, data.validation, opts.batch_size, device, opts.chunk_tokens
        )
        logger.info(
            "before healing: held-out KL %.4f, student NLL %.4f, teacher NLL %.4f",
            progress.before["kl"],
            progress.before["student_nll"],
            progress.before["teacher_nll"],
        )
    logger.info(
        "training %d tensors (%d parameters), %d steps of %d tokens",
        len(trained),
        n_params,
        total_steps,
        tokens_per_step,
    )

    stream = data.iterate(progress.position)
    rank = accelerator.process_index
    student.train()
    bar = tqdm(
        total=total_steps,
        initial=progress.step,
        desc="heal",
        unit="step",
        disable=opts.quiet or not accelerator.is_local_main_process,
    )
    session_start, session_tokens = time.perf_counter(), 0
    while progress.step < total_steps:
        step_start = time.perf_counter()
        loss_sum = torch.zeros(2)
        for micro in range(opts.grad_accum):
            seqs = [next(stream) for _ in range(opts.batch_size * n_proc)]
            ids = torch.stack(seqs[rank * opts.batch_size : (rank + 1) * opts.batch_size]).to(device)
            with torch.no_grad():
                ht = base_t(input_ids=ids, use_cache=False).last_hidden_state
            sync = micro == opts.grad_accum - 1
            ctx = accelerator.no_sync(student) if not sync else contextlib.nullcontext()
            with ctx:
                loss, stats = student(ids, ht, head_t, opts.temperature, opts.lm_weight, opts.chunk_tokens)
                accelerator.backward(loss / opts.grad_accum)
            loss_sum += stats / opts.grad_accum
        grad_norm = accelerator.clip_grad_norm_(params, opts.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.position += seqs_per_step
        progress.tokens += tokens_per_step
        progress.seconds += time.perf_counter() - step_start
        progress.history.append([progress.step, round(float(loss_sum[0]), 6)])
        session_tokens += tokens_per_step
        rate = session_tokens / max(time.perf_counter() - session_start, 1e-9)
        bar.update(1)
        bar.set_postfix(
            kl=f"{float(loss_sum[0]):.4f}",
            nll=f"{float(loss_sum[1]):.3f}",
            lr=f"{scheduler.get_last_lr()[0]:.2e}",
            tok_s=f"{rate:.0f}",
            refresh=False,
        )
        logger.debug(
            "step %d kl %.5f nll %.4f grad-norm %.3f",
            progress.step,
            loss_sum[0],
            loss_sum[1],
            float(grad_norm),
        )
        if opts.save_every and progress.step % opts.save_every == 0 and progress.step < total_steps:
            save_checkpoint(accelerator, work_dir, progress.step, opts.keep_checkpoints)
        if on_step is not None:
            on_step(progress.step)
    bar.close()

    after = _heldout(student, teacher, data.validation, opts.batch_size, device, opts.chunk_tokens)
    logger.info("after healing: held-out KL %.4f, student NLL %.4f", after["kl"], after["student_nll"])
    state = accelerator.get_state_dict(student)
    report = {
        "settings": {k: getattr(opts, k) for k in _RUN_KEYS}
        | {"warmup": warmup, "chunk_tokens": opts.chunk_tokens},
        "trained_parameters": n_params,
        "trained_tensors": len(trained),
        "steps": progress.step,
        "tokens": progress.tokens,
        "tokens_per_step": tokens_per_step,
        "processes": n_proc,
        "device": str(device),
        "train_seconds": round(progress.seconds, 2),
        "wall_seconds": round(time.time() - start_wall, 2),
        "resumed": resume_from is not None,
        "heldout_before": progress.before,
        "heldout_after": after,
        "loss_history": progress.history,
    }
    if accelerator.is_main_process:
        state = {k.removeprefix("model."): v for k, v in state.items()}
        write_healed(out, claim, state, layout, report)
        remove_work_dir(work_dir)
    accelerator.wait_for_everyone()
    return report
