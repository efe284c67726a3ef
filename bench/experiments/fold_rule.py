"""The closed form at one budget with chosen (shared d_R, FreqFold) pairs: what the auto fold rule costs.

    cd bench && python experiments/fold_rule.py --source /tmp/qwen2-small --pairs 24:2,24:4,32:1,32:2

Each pair converts --source at --kv-budget with ``--refine none --rope-dim R --fold F`` (the pipeline users run,
in memory) and scores it as bench/quality_ablation.py does (up to --eval-tokens of each of its texts, window 512,
stride 256), printing the perplexity ratio to the source, with the fold ``--fold 0`` (the default) picks
(``rope_select.auto_fold``). Until 2026-12-06 that was the largest divisor of d/2 leaving at least d_R/2
frequency groups, so some groups could keep no rotating component; this script showed what that cost
(docs/results.md, "The d_R 24 anomaly").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quality_ablation import load_texts  # noqa: E402
from window_bootstrap import ScoredText  # noqa: E402

from mlakit.arch.families import attention_shape  # noqa: E402
from mlakit.convert.rope_select import auto_fold  # noqa: E402
from mlakit.io.source import open_source  # noqa: E402
from mlakit.mla_model import MLAForCausalLM  # noqa: E402
from mlakit.pipeline.api import ConvertOptions  # noqa: E402
from mlakit.pipeline.run import run_conversion  # noqa: E402
from mlakit.pipeline.run_state import StreamOptions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="default")
    ap.add_argument("--kv-budget", type=float, default=0.3125)
    ap.add_argument("--pairs", required=True, help="comma-separated ROPE_DIM:FOLD")
    ap.add_argument("--eval-tokens", type=int, default=16384)
    args = ap.parse_args()
    source = open_source(args.source)
    head_dim = attention_shape(source.config).head_dim
    texts = {k: ScoredText(ids, 512, 256, 1) for k, ids in load_texts(source.tokenizer(), args.eval_tokens).items()}
    base = {k: t.ratio(t.sums(source.load_model(torch.float32))) for k, t in texts.items()}
    print("d_R | fold | auto fold | " + " | ".join(texts))
    for pair in args.pairs.split(","):
        rope, fold = (int(v) for v in pair.split(":"))
        opts = ConvertOptions(kv_budget=args.kv_budget, rope_dim=rope, fold=fold, refine="none", quiet=True)
        with tempfile.TemporaryDirectory() as tmp:
            run_conversion(args.source, Path(tmp) / "mla", opts, "in-memory", StreamOptions())
            model = MLAForCausalLM.from_pretrained(Path(tmp) / "mla", torch_dtype=torch.float32)
            ratios = [t.ratio(t.sums(model)) / base[k] for k, t in texts.items()]
        print(f"{rope} | {fold} | {auto_fold(head_dim // 2, rope // 2)} | " + " | ".join(f"{r:.3f}" for r in ratios),
              flush=True)


if __name__ == "__main__":
    main()
