"""Which half of a converted attention loses the quality: its scores or its values?

    python bench/experiments/oracle_split.py --converted runs/smollm2-values --out bench/results/oracle_split

Scores a converted model (``MLAForCausalLM``) three ways on the texts of ``quality_ablation.py``
(4096 tokens each, windows of 512, stride 256), every attention patched for this process only:

- ``converted``: the converted attention itself, recomputed explicitly (a check: it must give the
  converted model's own ratio);
- ``source scores``: the source layer's attention probabilities (its q_proj and k_proj with the full
  rotary embedding, on the converted model's own hidden states) times the converted values
  (kv_b_proj's value rows on the latent) and the converted o_proj;
- ``source values``: the converted probabilities times the source layer's values (v_proj) and
  o_proj, on the same hidden states.

Each replaces one half by the source's while the other stays converted; the ratio that drops most
names the half where the compression's loss lies. The errors of the layers below still reach each
layer (every patch runs in every layer at once). Writes oracle_split.{md,json} to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: quality_ablation, window_bootstrap
from quality_ablation import load_texts  # noqa: E402
from window_bootstrap import ScoredText  # noqa: E402

from mlakit.io.source import open_source  # noqa: E402
from mlakit.mla_model import MLAForCausalLM  # noqa: E402

MODES = ("converted", "source scores", "source values")


def _probabilities(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of q k^T * SCALE, (B, H, S, S)."""
    S = q.shape[2]
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~causal, torch.finfo(scores.dtype).min), dim=-1)


def patched_forward(src_attn, mode: str):
    """A forward for one MLAAttention (bound as a method) that mixes in SRC_ATTN's half named by MODE."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        B, S, _ = hidden_states.shape
        H, d = self.num_heads, self.qk_nope_head_dim
        q_nope, q_rope, c_kv, k_rope = self._project(hidden_states, position_embeddings)
        kv = self.kv_b_proj(c_kv).view(B, S, H, d + self.v_head_dim).transpose(1, 2)
        if mode == "source scores":
            hd = src_attn.head_dim
            q = src_attn.q_proj(hidden_states).view(B, S, -1, hd).transpose(1, 2)
            k = src_attn.k_proj(hidden_states).view(B, S, -1, hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
            p = _probabilities(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1), src_attn.scaling)
        else:
            k = torch.cat([kv[..., :d], k_rope[:, None].expand(B, H, S, k_rope.shape[-1])], -1)
            p = _probabilities(torch.cat([q_nope, q_rope], -1), k, self.scaling)
        if mode == "source values":
            hd = src_attn.head_dim
            v = src_attn.v_proj(hidden_states).view(B, S, -1, hd).transpose(1, 2)
            out = p @ v.repeat_interleave(H // v.shape[1], 1)
            return src_attn.o_proj(out.transpose(1, 2).reshape(B, S, -1)), None
        return self.o_proj((p @ kv[..., d:]).transpose(1, 2).reshape(B, S, -1)), None

    return forward


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="default")
    ap.add_argument("--converted", required=True, type=Path, help="a converted checkpoint of --source")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    t0 = time.time()
    source = open_source(args.source)
    texts = {k: ScoredText(ids, 512, 256, 10) for k, ids in load_texts(source.tokenizer(), args.eval_tokens).items()}
    src = source.load_model(torch.float32)
    with torch.no_grad():
        src_sums = {k: t.sums(src) for k, t in texts.items()}
    model = MLAForCausalLM.from_pretrained(args.converted, torch_dtype=torch.float32)
    with torch.no_grad():
        own = {k: t.ratio(t.sums(model) - src_sums[k]) for k, t in texts.items()}
    rows = {"converted model": own}
    for mode in MODES:
        for layer, src_layer in zip(model.model.layers, src.model.layers):
            attn = layer.self_attn
            attn.forward = types.MethodType(patched_forward(src_layer.self_attn, mode), attn)
        with torch.no_grad():
            rows[mode] = {k: t.ratio(t.sums(model) - src_sums[k]) for k, t in texts.items()}
        print(mode, {k: round(v, 3) for k, v in rows[mode].items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"source": args.source, "converted": str(args.converted), "eval_tokens": args.eval_tokens,
            "window": 512, "stride": 256, "seconds": round(time.time() - t0)}
    (args.out / "oracle_split.json").write_text(json.dumps({"meta": meta, "ratios": rows}, indent=2))
    names = list(texts)
    lines = [f"Perplexity ratio (patched converted / source) of {args.converted.name}, windows 512, stride 256, "
             f"{args.eval_tokens} tokens per text (`bench/experiments/oracle_split.py`).", "",
             "| attention | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {row} | " + " | ".join(f"{r[k]:.3f}" for k in names) + " |" for row, r in rows.items()]
    (args.out / "oracle_split.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
