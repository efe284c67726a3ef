"""Verification: the converted model's logits against the source's, on fixed token ids.

One set of ids and one report for every check: the layer-wise driver (each source layer and
each converted layer run on the ids alongside the conversion) and the deepseek-v3 export
(stock model against the native one).
"""

from __future__ import annotations

import torch

from .settings import ConversionError

__all__ = ["VERIFY_TOKENS", "logit_report", "verify_token_ids"]

VERIFY_TOKENS = 32


def verify_token_ids(vocab_size: int, tokens: int = VERIFY_TOKENS) -> torch.Tensor:
    """The fixed (1, TOKENS) token ids every verification runs on."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, tokens), generator=gen)


def logit_report(got: torch.Tensor, want: torch.Tensor) -> dict:
    """How far logits GOT are from WANT; a non-finite converted logit is a ConversionError."""
    bad = int((~torch.isfinite(got)).sum())
    if bad:
        raise ConversionError(
            f"verification failed: {bad} of {got.numel()} converted logits are NaN or infinite (the source's "
            f"{'are' if torch.isfinite(want).all() else 'are not'} all finite); the converted model is broken, "
            f"nothing was published. Check the source weights and the dtype (float16 overflows: try bfloat16)"
        )
    diff = (got - want).abs()
    return {"tokens": got.shape[1], "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
            "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean())}


def layerwise_report(conv, src_layers, mla_layers, verify_src: torch.Tensor, verify_mla: torch.Tensor) -> dict:
    """The final norm and LM head on the verification streams the driver carried through every layer:
    the source's in float32, the converted model's with its weights cast to the output dtype, as a
    reload would see them."""
    want_in = conv.norm_and_head()
    got_in = {k: v.to(conv.dtype) for k, v in want_in.items()}
    want = src_layers.logits(verify_src, want_in, "head")
    got = mla_layers.logits(verify_mla, got_in, "head")
    return logit_report(got, want) | {"method": "layer-wise"}
