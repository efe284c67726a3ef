"""Helpers for the eval tests: tiny random Llama models, a character tokenizer, fake LMs.

Nothing here downloads anything: models are built from configs, the tokenizer from a
fixed character vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

__all__ = [
    "FixedLogitsLM",
    "RecordingLM",
    "char_tokenizer",
    "save_tiny_llama",
    "tiny_llama",
    "tiny_llama_config",
]

VOCAB = 128


def char_tokenizer():
    """A fast tokenizer with one token per printable ASCII character (ids 3..), <unk>=0, <s>=1, </s>=2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in [chr(i) for i in range(32, 127)] + ["\n", "\t"]:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def save_tiny_llama(
    path: Path,
    seed: int = 0,
    perturb: float = 0.0,
    tokenizer: bool = True,
    conversion: dict | None = None,
    **overrides,
) -> Path:
    """Save a tiny random Llama (optionally with weights perturbed by ``perturb`` * noise) to ``path``."""
    model = tiny_llama(seed, **overrides)
    if perturb:
        gen = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    if tokenizer:
        char_tokenizer().save_pretrained(path)
    if conversion is not None:
        (Path(path) / "conversion.json").write_text(json.dumps(conversion))
    return Path(path)


class FixedLogitsLM(torch.nn.Module):
    """A causal 'LM' whose logits at a position depend only on the token there: row
    ``table[token]``. Its loss can be computed by hand."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.config = SimpleNamespace(vocab_size=table.shape[0], max_position_embeddings=10_000)

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(logits=self.table[input_ids])


class RecordingLM(torch.nn.Module):
    """Uniform logits; records every input_ids batch it sees."""

    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.seen: list[torch.Tensor] = []
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=10_000)
        self.vocab = vocab

    def forward(self, input_ids, **kwargs):
        self.seen.append(input_ids.clone())
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))
