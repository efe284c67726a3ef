"""An export's verification: the stock checkpoint's logits against the native one's, both in float32, with one
decoder layer of each in memory at a time, as the conversion verifies itself (``pipeline.verify``).

Each side runs its own modules: the native layers are ``MLADecoderLayer`` (``MLALayers``), the stock ones
transformers' own ``DeepseekV3DecoderLayer`` with its rotary table and causal mask, built from the exported
config.json (``SourceLayers``, which builds any transformers family). Both streams start from their own
embedding (the stock one carries the residual scale) and end in their own final norm and LM head, so every
tensor the export wrote is read back and used; the verification's memory is two layers and the embeddings
and heads, at any model size."""

from __future__ import annotations

import torch
from torch import nn

from ..arch import names
from ..pipeline.layer_runner import MLALayers, SourceLayers
from ..pipeline.verify import VERIFY_TOKENS, logit_report, verify_token_ids

__all__ = ["verify_export"]


@torch.no_grad()
def verify_export(native, stock, max_positions: int) -> dict:
    """Logits of the export (``stock``: a reader of its shards) against the native checkpoint (``native``) on
    the verification tokens, at most MAX_POSITIONS of them."""
    from transformers import DeepseekV3Config

    cfg = native.config
    ids = verify_token_ids(cfg.vocab_size, min(VERIFY_TOKENS, max_positions))
    stock_layers = SourceLayers(DeepseekV3Config.from_pretrained(str(stock.directory)), window=None)
    mla_layers = MLALayers(cfg)
    embed = native.tensor(names.EMBED)
    want = nn.functional.embedding(ids, embed.float())
    got = nn.functional.embedding(ids, stock.tensor(names.EMBED).float())
    for i in range(cfg.num_hidden_layers):
        prefix = names.layer_prefix(i)
        want = mla_layers.run(mla_layers.layer(i, native.tensors(prefix)), want)
        got = stock_layers.run(stock_layers.layer(i, stock.tensors(prefix)), got)
    head = native.tensor(names.LM_HEAD) if native.has(names.LM_HEAD) else embed  # a native model may tie it
    want = mla_layers.logits(want, native.tensors(names.FINAL_NORM_PREFIX) | {names.LM_HEAD: head}, names.LM_HEAD)
    got = stock_layers.logits(
        got, stock.tensors(names.FINAL_NORM_PREFIX) | {names.LM_HEAD: stock.tensor(names.LM_HEAD)}, names.LM_HEAD
    )
    report = logit_report(got, want)
    report["max_abs_logit_diff_fp32"] = report.pop("max_abs_logit_diff")  # both ran in float32
    return report | {"method": "layer-wise"}
