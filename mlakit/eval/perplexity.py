"""Sliding-window perplexity of a causal language model.

The standard definition (the Hugging Face perplexity guide's, with every token scored):
the first window holds tokens ``[0, L)`` and scores tokens 1..L-1; each next window moves
its end ``S`` (stride) tokens further, holds the ``L`` tokens up to that end and scores only
the ``S`` tokens the previous window did not. So every token after the first is scored
exactly once, with up to ``L - 1`` tokens of context and at least ``L - S`` once past the
first window; the last window ends at the last token and is full length whenever the text
is. The first token has no context and is never scored, so ``1 <= S <= L - 1``.
Perplexity is ``exp(sum of NLL / number of scored tokens)``.

Windows are batched; a batch whose windows differ in length (only a text shorter than one
window makes a short one) is right-padded: a causal model's logits at real positions do
not depend on tokens after them, so padding changes nothing and needs no attention mask.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

__all__ = ["PerplexityResult", "Window", "sliding_window_perplexity", "sliding_windows", "window_nll"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` go through the model; targets ``[score_from, end)`` are scored."""

    begin: int
    end: int
    score_from: int

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def n_scored(self) -> int:
        return self.end - self.score_from


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    nll_sum: float
    n_tokens: int  # tokens in the evaluated text
    n_scored: int  # tokens scored (n_tokens - 1)
    n_windows: int
    seq_len: int
    stride: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def sliding_windows(n_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """The windows of the standard sliding-window perplexity over ``n_tokens`` tokens."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one token of context and one target), got {seq_len}")
    if not 1 <= stride < seq_len:
        raise ValueError(
            f"stride must be between 1 and seq_len - 1 = {seq_len - 1}, got {stride}: a larger stride would leave "
            "the first scored token of a window without context (or skip tokens); use stride <= seq_len - 1"
        )
    if n_tokens < 2:
        raise ValueError(
            f"perplexity needs at least 2 tokens (one context, one target), the text has {n_tokens}; "
            "use a longer text"
        )
    end = min(seq_len, n_tokens)
    windows = [Window(begin=0, end=end, score_from=1)]  # token 0 has no context: never a target
    while end < n_tokens:
        new_end = min(end + stride, n_tokens)
        windows.append(Window(begin=max(0, new_end - seq_len), end=new_end, score_from=end))
        end = new_end
    return windows


def _accepts_logits_to_keep(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _forward_logits(model, input_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits of the last ``keep`` positions (all when the model cannot skip any)."""
    kwargs = {"logits_to_keep": keep} if keep < input_ids.shape[1] and _accepts_logits_to_keep(model) else {}
    out = model(input_ids=input_ids, use_cache=False, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -keep:]


@torch.inference_mode()
def window_nll(model, ids: torch.Tensor, windows: list[Window], device: str | torch.device) -> torch.Tensor:
    """Summed NLL (float64, nats) of the scored targets of each window, run as one batch."""
    max_len = max(w.length for w in windows)
    batch = torch.zeros(len(windows), max_len, dtype=torch.long)  # right padding, see module doc
    for row, w in enumerate(windows):
        batch[row, : w.length] = ids[w.begin : w.end]
    # Only the positions that predict a target need logits: with equal lengths (no padding)
    # those are the last `keep` positions, which skips most of the LM head past the first window.
    if all(w.length == max_len for w in windows):
        keep = max(w.end - w.score_from + 1 for w in windows)
    else:
        keep = max_len
    keep = min(keep, max_len)
    logits = _forward_logits(model, batch.to(device), keep)  # (B, keep, V)
    if tuple(logits.shape[:2]) != (len(windows), keep):
        raise RuntimeError(
            f"model returned logits of shape {tuple(logits.shape)} for input {tuple(batch.shape)}"
        )
    offset = max_len - keep  # window position of logits[:, 0]
    sums = torch.zeros(len(windows), dtype=torch.float64)
    for row, w in enumerate(windows):
        # logits at position p predict the token at p + 1 (positions relative to the window)
        first = w.score_from - w.begin
        pred = logits[row, first - 1 - offset : w.length - 1 - offset].float()  # (n_scored, V)
        target = batch[row, first : w.length].to(pred.device)
        logp = torch.log_softmax(pred, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        sums[row] = -logp.double().sum().cpu()
    return sums


def sliding_window_perplexity(
    model,
    ids: torch.Tensor,
    seq_len: int,
    stride: int,
    batch_size: int = 1,
    device: str | torch.device = "cpu",
    progress: bool = True,
    desc: str = "perplexity",
) -> PerplexityResult:
    """Sliding-window perplexity of ``model`` on the 1-D token ids ``ids``.

    The model must already be on ``device`` in its evaluation dtype; it is put in eval
    mode. Deterministic for a deterministic model: windows run in a fixed order.
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids = ids.to(torch.long).cpu()
    windows = sliding_windows(int(ids.numel()), seq_len, stride)
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(max_pos, int) and max(w.length for w in windows) > max_pos:
        logger.warning("seq_len %d exceeds the model's max_position_embeddings %d", seq_len, max_pos)
    if hasattr(model, "eval"):
        model.eval()
    total = torch.zeros((), dtype=torch.float64)
    start = time.perf_counter()
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    with tqdm(total=len(windows), desc=desc, unit="win", disable=not progress, leave=False) as bar:
        for group in batches:
            total += window_nll(model, ids, group, device).sum()
            bar.update(len(group))
    seconds = time.perf_counter() - start
    n_scored = sum(w.n_scored for w in windows)
    nll = float(total) / n_scored
    result = PerplexityResult(
        ppl=math.exp(nll) if nll < 700.0 else math.inf,  # exp overflows past ~709
        nll=nll,
        nll_sum=float(total),
        n_tokens=int(ids.numel()),
        n_scored=n_scored,
        n_windows=len(windows),
        seq_len=seq_len,
        stride=stride,
        seconds=seconds,
    )
    logger.info(
        "%s: ppl %.4f over %d tokens in %d windows (%.1fs)", desc, result.ppl, n_scored, len(windows), seconds
    )
    return result
