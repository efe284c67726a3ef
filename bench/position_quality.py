"""Where in the context a conversion loses quality: the perplexity ratio by token position.

    python bench/position_quality.py --converted runs/smollm2-mla runs/smollm2-values --out DIR
    python bench/position_quality.py --converted runs/smollm2-mla --score-scales 1,1.3 --out DIR

Each text is cut into non-overlapping windows of --window tokens, every window is scored from its
first token, and the per-token NLL difference (converted - source) is averaged over the windows in
position buckets (0-63, 64-127, ...): exp of that mean is the bucket's perplexity ratio. The
calibration sees sequences of ``calib_seq_len`` tokens (256 by default), so the buckets beyond it
show how a conversion fitted on short sequences holds up on long ones. With --score-scales, each
converted model is also scored with every attention score multiplied by each scale (its
``softmax_scale`` times the scale, in every layer): a diagnostic of how much of the loss is
attention that has become flatter than the source's, not a conversion option. --score-growth
T0:BETA (repeatable) does the same with a scale that grows with the query's position t (from 0):
1 + BETA * ln((t + 1) / T0) beyond T0, 1 before.

The texts are those of quality_ablation.py (the builtin evaluation text, GPL-3, the Vim manual).
Writes position_quality.{md,json} to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from quality_ablation import load_texts

from mlakit.io.source import open_source
from mlakit.mla_model import MLAForCausalLM
from mlakit.mla_model.modeling_mla import MLAAttention


@torch.no_grad()
def token_nll(model, ids: torch.Tensor, window: int) -> torch.Tensor:
    """(windows, window - 1) NLL of every token after the first of each non-overlapping window."""
    model.eval()
    n = ids.numel() // window
    rows = ids[: n * window].view(n, window)
    out = []
    for row in rows:
        logp = model(row[None]).logits[0, :-1].float().log_softmax(-1)
        out.append(-logp.gather(-1, row[1:, None])[:, 0])
    return torch.stack(out)


def buckets(window: int) -> list[tuple[int, int]]:
    """Position buckets of the scored tokens: doubling widths from 64 (0-63, 64-127, 128-255, ...)."""
    edges, e = [0, 64], 64
    while e * 2 < window:
        e *= 2
        edges.append(e)
    edges.append(window - 1)
    return list(zip(edges, edges[1:]))


def set_scores(model, base: list[float], scale: float, growth: tuple[float, float] | None) -> None:
    """Every attention of MODEL scores with BASE[layer] * SCALE, times the position growth (t0, beta) if given."""
    for layer, b in zip(model.model.layers, base):
        attn = layer.self_attn
        attn.scaling = b * scale
        attn.__dict__.pop("_project", None)  # back to the class's projection
        if growth is not None:
            t0, beta = growth

            def project(hidden, rotary, attn=attn, t0=t0, beta=beta):
                q_nope, q_rope, c_kv, k_rope = MLAAttention._project(attn, hidden, rotary)
                t = torch.arange(1, hidden.shape[1] + 1, dtype=q_nope.dtype, device=q_nope.device)
                g = 1 + beta * (t / t0).log().clamp_min(0)  # (S,), queries at (B, H, S, .)
                return q_nope * g[:, None], q_rope * g[:, None], c_kv, k_rope

            attn._project = project


def parse_growth(spec: str) -> tuple[float, float]:
    try:
        t0, beta = (float(v) for v in spec.split(":"))
    except ValueError:
        raise SystemExit(f"--score-growth {spec!r}: expected T0:BETA, e.g. 128:0.15") from None
    if t0 <= 0:
        raise SystemExit(f"--score-growth {spec!r}: T0 must be a positive position")
    return t0, beta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="default")
    ap.add_argument("--converted", nargs="+", required=True, type=Path, help="converted checkpoint directories")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of each text (whole windows of it are scored)")
    ap.add_argument("--texts", default=None, help="comma-separated names of the texts to score (default: all)")
    ap.add_argument("--score-scales", default="1", help="comma-separated multipliers of every attention score")
    ap.add_argument("--score-growth", action="append", default=[], metavar="T0:BETA",
                    help="also score with a scale growing with the position (diagnostic; repeatable)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    growths = [parse_growth(g) for g in args.score_growth]
    if args.tokens < args.window:
        raise SystemExit(f"--tokens {args.tokens} holds no window of {args.window} tokens; raise --tokens or lower --window")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    source = open_source(args.source)
    limit = getattr(source.config, "max_position_embeddings", None)
    if limit is not None and args.window > limit:
        raise SystemExit(f"--window {args.window} is longer than the source's context ({limit}); pick at most {limit}")
    texts = load_texts(source.tokenizer(), args.tokens)
    if args.texts:
        unknown = set(args.texts.split(",")) - set(texts)
        if unknown:
            raise SystemExit(f"--texts: {sorted(unknown)} not among the texts on this machine: {sorted(texts)}")
        texts = {k: v for k, v in texts.items() if k in args.texts.split(",")}
    src_model = source.load_model(torch.float32)
    src = {k: token_nll(src_model, ids, args.window) for k, ids in texts.items()}
    del src_model
    spans = buckets(args.window)
    rows = []
    for path in args.converted:
        model = MLAForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        base = [layer.self_attn.scaling for layer in model.model.layers]
        variants = [(float(s), None) for s in args.score_scales.split(",")]
        variants += [(1.0, g) for g in growths]
        for scale, growth in variants:
            set_scores(model, base, scale, growth)
            row = {"model": str(path), "score_scale": scale, "score_growth": growth, "texts": {}}
            for k, ids in texts.items():
                diff = token_nll(model, ids, args.window) - src[k]
                row["texts"][k] = {"all": math.exp(float(diff.mean())),
                                   "buckets": [math.exp(float(diff[:, a:b].mean())) for a, b in spans]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"source": args.source, "window": args.window, "windows": {k: int(t.numel()) // args.window for k, t in texts.items()},
            "buckets": spans, "seconds": round(time.time() - t0)}
    (args.out / "position_quality.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "position_quality.md").write_text(render(meta, rows))
    print(render(meta, rows))


def render(meta: dict, rows: list[dict]) -> str:
    spans = meta["buckets"]
    head = "| model | score scale | text | all | " + " | ".join(f"{a}-{b - 1}" for a, b in spans) + " |"
    lines = [f"Perplexity ratio (converted / source) of {meta['source']} by token position: non-overlapping windows of "
             f"{meta['window']} tokens, each scored from its first token ({meta['windows']} windows per text). "
             f"Score scale: every attention score multiplied by it (a diagnostic, not a conversion option). "
             f"Whole run {meta['seconds']} s.", "", head, "|---|---|---|---|" + "---|" * len(spans)]
    for r in rows:
        for k, c in r["texts"].items():
            scale = f"{r['score_scale']:g}" if not r.get("score_growth") else "1 + {1:g} ln(t/{0:g})".format(*r["score_growth"])
            lines.append(f"| {Path(r['model']).name} | {scale} | {k} | {c['all']:.3f} | "
                         + " | ".join(f"{v:.2f}" for v in c["buckets"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
