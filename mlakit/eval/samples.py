"""Greedy continuations of fixed prompts, to put next to each other in a report."""

from __future__ import annotations

import logging

import torch

__all__ = ["DEFAULT_PROMPTS", "greedy_continuations"]

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
)


@torch.inference_mode()
def greedy_continuations(
    model,
    tokenizer,
    prompts: tuple[str, ...] | list[str] = DEFAULT_PROMPTS,
    max_new_tokens: int = 32,
    device: str | torch.device = "cpu",
) -> list[dict]:
    """Greedy (argmax) continuation of each prompt, one prompt at a time (no padding).

    Returns ``[{"prompt": ..., "continuation": ...}, ...]``; the continuation is the
    decoded new tokens only. Runs through ``model.generate`` so the model's own cache is used.
    """
    if hasattr(model, "eval"):
        model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        pad_id = 0
    results = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]], dtype=torch.long, device=device)
        if ids.shape[1] == 0:
            raise ValueError(f"prompt {prompt!r} encodes to no tokens; pass a non-empty prompt")
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad_id,
        )
        new = out[0, ids.shape[1] :].tolist()
        results.append({"prompt": prompt, "continuation": tokenizer.decode(new, skip_special_tokens=True)})
    logger.info("generated %d greedy continuations", len(results))
    return results
