"""Train a small Qwen2-style model here, from local text only: a second model family for the quality benches.

    python bench/train_qwen2.py --out /tmp/qwen2-small                       # about 30 minutes on 2 cores
    cd bench && python quality_ablation.py --source /tmp/qwen2-small --budgets 0.3125 --rows 1,2,6 --out DIR

When this was written no second real model family was found offline (``fetch_qwen25.py`` fetches one since
session 46), and random weights have no attention structure to lose. This trains one instead, with the traits
of the Qwen2 family that SmolLM2 lacks:
two KV heads of 64 (here shared by two query heads each), biases on q, k and v, rope theta 1e6, rms eps 1e-6,
tied embeddings, and a vocabulary and training text of its own. It is small (6 layers, hidden 256: sized for
the compute of a short run on a CPU) and trained briefly (``--steps`` x 8 x 512 tokens), so it is far weaker
than a real Qwen2: a check of how the method's choices carry to other shapes and other weights, not a stand-in
for issue #19's real Qwen2-style model.

Training text: the top-level modules of the Python standard library (code, comments and docstrings) and the
calibration part of ``pydoc_data.topics`` (``mlakit.data``). None of the quality benches' evaluation texts is
in it: the builtin evaluation topics, the GPL-3 licence and the Vim manual. The tokenizer is a byte-level BPE
trained on the same text. Everything is drawn from ``--seed``: the same command with the same Python (whose
standard library is the text) and the same torch writes the same model, up to the order of floating-point sums
across thread counts.

Writes a Hugging Face directory (config.json, model.safetensors, tokenizer files) and train.json (the settings
and the loss every 20 steps) to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from mlakit.data import load_text

EOS = "<|endoftext|>"
VOCAB = 8192
SEQ_LEN, BATCH = 512, 8


def corpus() -> list[str]:
    """The training documents, in a fixed order: the calibration topics, then every top-level stdlib module."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
    return [load_text("builtin", "calib")] + modules


def train_tokenizer(docs: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS,
                                   model_max_length=1 << 30)  # no limit: texts are tokenized whole


def qwen2_config(eos_id: int) -> Qwen2Config:
    return Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                       bos_token_id=eos_id, eos_token_id=eos_id)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps of 8 x 512 tokens")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; pass a new path (the model is written there whole, at the end)")
    torch.manual_seed(args.seed)
    docs = corpus()
    tokenizer = train_tokenizer(docs)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = torch.cat([torch.tensor(tokenizer(d)["input_ids"] + [eos]) for d in docs])
    print(f"{len(docs)} documents, {ids.numel()} tokens; training {args.steps * BATCH * SEQ_LEN} tokens", flush=True)

    model = Qwen2ForCausalLM(qwen2_config(eos))
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    log, start, running = [], time.time(), None
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=max(1, args.steps // 10))
        offsets = torch.randint(0, ids.numel() - SEQ_LEN, (BATCH,), generator=gen)
        batch = torch.stack([ids[o : o + SEQ_LEN] for o in offsets.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % 20 == 0 or step + 1 == args.steps:
            log.append({"step": step + 1, "loss": round(running, 4), "seconds": round(time.time() - start, 1)})
            print(log[-1], flush=True)

    # written beside OUT and renamed at the end, so an interrupted run leaves no half-written model at OUT
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=args.out.parent, prefix=f".{args.out.name}.partial-"))
    model.eval()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    settings = {"steps": args.steps, "lr": args.lr, "seed": args.seed, "batch": BATCH, "seq_len": SEQ_LEN,
                "vocab": VOCAB, "corpus_tokens": int(ids.numel()), "torch_threads": torch.get_num_threads()}
    (tmp / "train.json").write_text(json.dumps({"settings": settings, "loss": log}, indent=1) + "\n")
    tmp.rename(args.out)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
