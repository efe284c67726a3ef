"""Heal a converted MLA model by distillation from its original: the training loop.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` packed sequences on each
process. The teacher (the source model, frozen, eval mode, no_grad) gives final hidden
states; the student's forward computes the chunked KL (+ optional LM) loss inside its own
``forward`` so that DDP/FSDP wrappers see every student parameter used there. Built on
``accelerate``: CPU, one GPU, or several processes (``accelerate launch`` / ``torchrun``;
tested: DDP over gloo with two CPU processes, tests/test_heal_distributed.py).

Several processes: every process walks the same seeded global sequence stream and trains on
its own slice of each global micro-batch (process r takes sequences r*B..(r+1)*B-1 of the
N*B drawn), so the processes see disjoint data and N processes at batch B compute what one
process at batch N*B computes (the mean loss of equal shares, averaged by DDP's gradient
all-reduce), up to float summation order. The data position, step and schedule count global
sequences, so a DDP checkpoint resumes under another process count when the sequences per
step (batch x accum x processes) stay the same; FSDP checkpoints are sharded and resume only
under the same count. DEST is written once, by the main process, atomically.

Checkpoints (``accelerator.save_state``) hold model, optimizer, scheduler, RNG states and
the run's progress (step, data position, tokens, seconds, before-loss), so a resumed run
continues exactly where the checkpoint was taken.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mlakit.heal_options import HealOptions
from mlakit.io.output_dir import check_output, claim_output, local_paths

from .data import open_training_data
from .models import StudentWithLoss, heldout_loss, load_models, read_student_config, teacher_parts
from .output import (
    HealError,
    check_work_dir,
    read_weight_layout,
    remove_work_dir,
    save_checkpoint,
    write_healed,
    write_run_settings,
)
from .schedule import cosine_with_warmup, select_trainable

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
# What a resume checks: the same, except that the micro-batch split of a step may change
# (another process count) as long as the sequences per optimizer step stay the same.
_RESUME_KEYS = tuple(k for k in _RUN_KEYS if k not in ("batch_size", "grad_accum"))


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


def _run_settings(opts: HealOptions, out: Path, accelerator) -> dict:
    """What a resumed run must share with the checkpointed one: the settings, the sequences per
    optimizer step, the process count where checkpoints are sharded (FSDP), and the content of
    both models (same shapes but other weights would otherwise continue silently)."""
    from accelerate.utils import DistributedType

    from mlakit.io.fingerprint import content_fingerprint
    from mlakit.io.source import SourceError, resolve_source

    try:
        _, teacher_path = resolve_source(opts.teacher)
    except SourceError as exc:
        raise HealError(f"--teacher {opts.teacher!r}: {exc}") from exc
    n = accelerator.num_processes
    run = {k: getattr(opts, k) for k in _RESUME_KEYS}
    return run | {
        "sequences_per_step": opts.batch_size * opts.grad_accum * n,
        "fsdp_processes": n if accelerator.distributed_type == DistributedType.FSDP else None,
        "student_content": content_fingerprint(out),
        "teacher_content": content_fingerprint(teacher_path),
    }


def make_accelerator():
    """An Accelerator for this launch. Under ``torchrun`` / ``accelerate launch --multi_gpu`` on a
    machine without CUDA, accelerate would give every process a world of its own (each one
    training alone and all racing to write DEST); asking for CPU makes them one gloo group."""
    import os

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    world = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = Accelerator(cpu=world > 1 and not torch.cuda.is_available())
    if accelerator.num_processes != world:
        raise HealError(
            f"the launcher started {world} processes (WORLD_SIZE) but accelerate joined "
            f"{accelerator.num_processes}; each would train alone. Fix: launch with `accelerate launch "
            "--multi_gpu --num_processes N` or `torchrun --nproc-per-node N`, and set "
            "ACCELERATE_USE_CPU=1 on a machine without GPUs."
        )
    fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_asked and accelerator.distributed_type != DistributedType.FSDP:
        raise HealError(
            f"FSDP was asked for (accelerate launch --use_fsdp) but accelerate runs this launch as "
            f"{accelerator.distributed_type.value}: its FSDP needs GPUs, and on CPU it would silently "
            "replicate the model on every process instead of sharding it. Fix: drop --use_fsdp to "
            "train with DDP on CPU, or run FSDP on GPUs."
        )
    return accelerator


def heal(out: str | Path, dest: str | Path, opts: HealOptions, on_step=None, on_batch=None) -> dict:
    """Heal the converted model OUT by distillation from ``opts.teacher``; write DEST atomically.

    Returns the heal report (also stored under ``heal`` in DEST/conversion.json). Hooks, called
    on every process: ON_STEP as ``on_step(step)`` after every optimizer step (and its
    checkpoint); ON_BATCH as ``on_batch(step, ids)`` with each (batch, seq_len) micro-batch this
    process trains on in optimizer step STEP (1-based).
    """
    out, dest = Path(out).expanduser(), Path(dest).expanduser()
    read_student_config(out)
    check_output(dest, opts.overwrite, sources=[out, *local_paths(opts.teacher)])
    work_dir = Path(opts.work_dir).expanduser() if opts.work_dir else dest.with_name(dest.name + ".heal-work")
    start_wall = time.time()

    accelerator = make_accelerator()
    with (
        claim_output(dest, opts.overwrite, sources=[out, *local_paths(opts.teacher)])
        if accelerator.is_main_process
        else (contextlib.nullcontext()) as claim
    ):
        return _heal(accelerator, claim, out, work_dir, opts, (on_step, on_batch), start_wall)


def _throughput(accelerator, tokens: int, seconds: float) -> list[dict]:
    """Training tokens and seconds of this session on every process (gathered to all)."""
    local = torch.tensor([[float(tokens), float(seconds)]], dtype=torch.float64, device=accelerator.device)
    rows = accelerator.gather(local).cpu().tolist() if accelerator.num_processes > 1 else local.tolist()
    return [
        {
            "process": i,
            "tokens": int(t),
            "seconds": round(sec, 3),
            "tokens_per_second": round(t / max(sec, 1e-9), 1),
        }
        for i, (t, sec) in enumerate(rows)
    ]


def _heal(accelerator, claim, out: Path, work_dir: Path, opts: HealOptions, hooks, start_wall: float) -> dict:
    from accelerate.utils import set_seed

    on_step, on_batch = hooks
    set_seed(opts.seed)
    device = accelerator.device
    main = accelerator.is_main_process
    student_model, teacher, tokenizer, vocab = load_models(out, opts.teacher, device)
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
    # every input is checked (on every process, so a refusal stops all): only now touch the work dir
    run = _run_settings(opts, out, accelerator)
    resume_from = check_work_dir(work_dir, opts.resume, run)
    accelerator.wait_for_everyone()
    if main:
        write_run_settings(work_dir, run)
    warmup = opts.warmup if opts.warmup is not None else max(1, math.ceil(0.05 * total_steps))
    trained = select_trainable(student_model, opts.train)
    student = StudentWithLoss(student_model)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    scheduler = cosine_with_warmup(optimizer, warmup, total_steps)
    n_params = sum(p.numel() for p in params)
    student, optimizer = accelerator.prepare(student, optimizer)
    params = [p for p in student.parameters() if p.requires_grad]  # as wrapped (FSDP flattens them)
    progress = _Progress()
    accelerator.register_for_checkpointing(scheduler, progress)
    base_t, head_t = teacher_parts(teacher)
    heldout = lambda: heldout_loss(  # noqa: E731 - the same arguments before and after
        accelerator, student, teacher, data.validation, opts.batch_size, opts.chunk_tokens
    )

    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        logger.info("resumed from %s (step %d, %d tokens)", resume_from, progress.step, progress.tokens)
    else:
        progress.before = heldout()
        logger.info(
            "before healing: held-out KL %.4f, student NLL %.4f, teacher NLL %.4f",
            progress.before["kl"],
            progress.before["student_nll"],
            progress.before["teacher_nll"],
        )
    logger.info(
        "training %d tensors (%d parameters), %d steps of %d tokens on %d process(es)",
        len(trained),
        n_params,
        total_steps,
        tokens_per_step,
        n_proc,
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
    session_start, session_tokens, session_seconds = time.perf_counter(), 0, 0.0
    while progress.step < total_steps:
        step_start = time.perf_counter()
        loss_sum = torch.zeros(2)
        for micro in range(opts.grad_accum):
            seqs = [next(stream) for _ in range(opts.batch_size * n_proc)]  # one global micro-batch
            ids = torch.stack(seqs[rank * opts.batch_size : (rank + 1) * opts.batch_size]).to(device)
            if on_batch is not None:
                on_batch(progress.step + 1, ids)
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
        if n_proc > 1:  # the loss of the global batch: the mean of equal shares
            loss_sum = accelerator.reduce(loss_sum.to(device), "mean").cpu()
        elapsed = time.perf_counter() - step_start
        progress.step += 1
        progress.position += seqs_per_step
        progress.tokens += tokens_per_step
        progress.seconds += elapsed
        progress.history.append([progress.step, round(float(loss_sum[0]), 6)])
        session_tokens += tokens_per_step // n_proc
        session_seconds += elapsed
        rate = session_tokens * n_proc / max(time.perf_counter() - session_start, 1e-9)
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

    after = heldout()
    logger.info("after healing: held-out KL %.4f, student NLL %.4f", after["kl"], after["student_nll"])
    per_process = _throughput(accelerator, session_tokens, session_seconds)
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
        "distributed": str(accelerator.distributed_type).rsplit(".", 1)[-1],
        "device": str(device),
        "train_seconds": round(progress.seconds, 2),
        "wall_seconds": round(time.time() - start_wall, 2),
        "tokens_per_second": round(sum(r["tokens"] for r in per_process) / max(session_seconds, 1e-9), 1),
        "per_process": per_process,  # this session's (a resumed run counts from its resume)
        "resumed": resume_from is not None,
        "heldout_before": progress.before,
        "heldout_after": after,
        "loss_history": progress.history,
    }
    if main:
        state = {k.removeprefix("model."): v for k, v in state.items()}
        write_healed(out, claim, state, layout, report)
        remove_work_dir(work_dir)
    accelerator.wait_for_everyone()
    return report
