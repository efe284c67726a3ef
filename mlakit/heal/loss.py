"""Distillation loss: KL(teacher || student) on the next-token distributions, plus an optional
language-modelling loss, computed in chunks of positions so that full-vocabulary logits
(49152 wide for SmolLM2, 128256 for Llama 3) never exist for a whole batch at once.

With temperature T both logit sets are divided by T and the KL is multiplied by T² (Hinton
et al., 2015, "Distilling the Knowledge in a Neural Network"), so its gradient scale does not
depend on T. When there is more than one chunk each chunk's head and loss run under
activation checkpointing: the backward pass recomputes one chunk's logits instead of
keeping every chunk's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["DistillLoss", "distill_loss"]


@dataclass
class DistillLoss:
    loss: torch.Tensor  # scalar, what backward runs on
    kl: float  # mean KL per position (times T²), nats
    student_nll: float  # mean next-token NLL of the student (T = 1), nats
    n_positions: int


def _chunk_sums(hs, ht, targets, student_head, teacher_head, temperature: float, with_nll: bool):
    """(sum of KL over positions, sum of student NLL over targets) for one chunk.

    hs, ht: (B, C, D) hidden states; targets: (B, C) next-token ids, -100 where none."""
    zs = student_head(hs).float()  # (B, C, V)
    with torch.no_grad():
        zt = teacher_head(ht).float()  # (B, C, V)
    log_ps = F.log_softmax(zs / temperature, dim=-1)
    log_pt = F.log_softmax(zt / temperature, dim=-1)
    kl = F.kl_div(log_ps.flatten(0, 1), log_pt.flatten(0, 1), log_target=True, reduction="sum")
    if with_nll:
        nll = F.cross_entropy(zs.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    else:
        nll = zs.new_zeros(())
    return kl, nll


def distill_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    student_head,
    teacher_head,
    temperature: float = 1.0,
    lm_weight: float = 0.0,
    chunk_tokens: int = 4096,
) -> DistillLoss:
    """Loss = T² · mean KL(p_teacher^T || p_student^T) + lm_weight · mean student NLL.

    student_hidden, teacher_hidden: (B, S, D_s), (B, S, D_t) final hidden states (after the
    final norm); input_ids: (B, S). Every position contributes to the KL; positions 0..S-2
    to the NLL (their next token is in the batch). CHUNK_TOKENS bounds B x chunk positions.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B, S = input_ids.shape
    targets = torch.full_like(input_ids, -100)
    targets[:, :-1] = input_ids[:, 1:]  # (B, S)
    step = max(1, chunk_tokens // B)
    chunks = [(a, min(a + step, S)) for a in range(0, S, step)]
    recompute = len(chunks) > 1 and torch.is_grad_enabled() and student_hidden.requires_grad
    with_nll = True  # reported even when it is not optimised; costs one logsumexp per chunk
    kl_sum = student_hidden.new_zeros((), dtype=torch.float32)
    nll_sum = student_hidden.new_zeros((), dtype=torch.float32)
    for a, b in chunks:
        args = (
            student_hidden[:, a:b],
            teacher_hidden[:, a:b],
            targets[:, a:b],
            student_head,
            teacher_head,
            temperature,
            with_nll,
        )
        kl, nll = checkpoint(_chunk_sums, *args, use_reentrant=False) if recompute else _chunk_sums(*args)
        kl_sum = kl_sum + kl
        nll_sum = nll_sum + nll
    n_pos, n_targets = B * S, B * (S - 1)
    kl_mean = kl_sum * (temperature**2) / n_pos
    nll_mean = nll_sum / max(n_targets, 1)
    loss = kl_mean + lm_weight * nll_mean if lm_weight else kl_mean
    return DistillLoss(
        loss=loss, kl=float(kl_mean.detach()), student_nll=float(nll_mean.detach()), n_positions=n_pos
    )
