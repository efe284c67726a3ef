"""The two models of a heal run: loading and checking them, the student wrapped with its loss
(what accelerate prepares), and the held-out before/after loss (sharded across processes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .loss import distill_loss
from .output import HealError

__all__ = ["StudentWithLoss", "heldout_loss", "load_models", "read_student_config", "teacher_parts"]


class StudentWithLoss(torch.nn.Module):
    """The student and its loss in one forward, so that DDP/FSDP wrappers see every student
    parameter used there (the loss's head is the student's own output embedding)."""

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


def read_student_config(out: Path) -> dict:
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


def teacher_parts(teacher):
    """(the teacher's base model giving final hidden states, its output head)."""
    base = getattr(teacher, teacher.base_model_prefix)
    return base, teacher.get_output_embeddings()


def load_models(out: Path, teacher_spec: str, device):
    """(student on CPU in float32, frozen teacher on DEVICE, tokenizer or None, vocabulary size)."""
    from mlakit.eval.loading import load_tokenizer
    from mlakit.io.source import SourceError, load_source_model
    from mlakit.mla_model import load_converted

    student = load_converted(out, torch.float32, "cpu")
    teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        teacher, teacher_tok = load_source_model(teacher_spec, teacher_dtype, str(device))
    except SourceError as exc:
        raise HealError(f"--teacher {teacher_spec!r}: {exc}") from exc
    teacher.requires_grad_(False).eval()
    v_s = student.get_output_embeddings().weight.shape[0]
    v_t = teacher.get_output_embeddings().weight.shape[0]
    if v_s != v_t:
        raise HealError(
            f"teacher {teacher_spec!r} has a vocabulary of {v_t} tokens but the converted model {out} "
            f"has {v_s}: distillation compares the two next-token distributions token by token. "
            f"Fix: pass as --teacher the source model that {out} was converted from."
        )
    tokenizer = load_tokenizer([out]) or teacher_tok
    return student, teacher, tokenizer, v_s


@torch.no_grad()
def heldout_loss(accelerator, student, teacher, val: torch.Tensor, batch: int, chunk_tokens: int) -> dict:
    """Mean KL(teacher || student) at T = 1 and both models' NLL on the held-out sequences VAL.

    Under DDP each process scores a contiguous share of VAL with the unwrapped student (its
    weights are the same on every process) and the sums are all-reduced: the same numbers as
    one process scoring all of VAL, up to float summation order. Under FSDP the parameters
    are sharded, so every process runs the wrapped student over all of VAL (the same number
    of forward calls on each, which FSDP's gathers need)."""
    from accelerate.utils import DistributedType

    sharded = accelerator.distributed_type == DistributedType.FSDP
    model = student if sharded else accelerator.unwrap_model(student)
    share = val if sharded else torch.tensor_split(val, accelerator.num_processes)[accelerator.process_index]
    base_t, head_t = teacher_parts(teacher)
    model.eval()
    sums = torch.zeros(5, dtype=torch.float64)  # KL sum, student NLL sum, teacher NLL sum, positions, targets
    for i in range(0, len(share), batch):
        ids = share[i : i + batch].to(accelerator.device)
        ht = base_t(input_ids=ids, use_cache=False).last_hidden_state
        _, stats = model(ids, ht, head_t, 1.0, 0.0, chunk_tokens)
        teacher_nll = distill_loss(ht, ht, ids, head_t, head_t, 1.0, 0.0, chunk_tokens).student_nll
        B, S = ids.shape
        sums += torch.tensor(
            [
                float(stats[0]) * B * S,
                float(stats[1]) * B * (S - 1),
                teacher_nll * B * (S - 1),
                B * S,
                B * (S - 1),
            ],
            dtype=torch.float64,
        )
    model.train()
    if not sharded and accelerator.num_processes > 1:
        sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
    kl, s_nll, t_nll, n_pos, n_tgt = sums.tolist()
    return {
        "kl": kl / n_pos,
        "student_nll": s_nll / n_tgt,
        "teacher_nll": t_nll / n_tgt,
        "tokens": int(n_pos),
    }
