"""Would a d_R chosen per layer help text unlike the calibration's? Read from experiments/rope_dim_shift.py's
per-layer output (the files it wrote under bench/results), without converting anything again.

    cd bench && python experiments/rope_dim_layer_choice.py results/quality_ablation_values/rope_dim_shift_0.3125.md

Each layer there keeps the same budget at every candidate (d_R + the uniform latent rank), so a d_R per layer
leaves the cache unchanged. Compared, on each kind of text the file holds: the shared d_R the pipeline uses
(the default share's, ``rank_plan.budget_rope_dim``, and the best shared one on the calibration), and each
layer's own d_R of least held-out error on the calibration's kind (``calib``: what a per-layer rule could see;
the other kinds are read only to judge it). Printed: the summed attention error of each choice per kind, and
the per-layer choice relative to each shared one. The errors are relative attention errors after the
value refit, summed over the layers: a proxy that ranked d_R as perplexity did in docs/results.md, "The rotary
share, measured after the value refit", not a perplexity.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH.parent))

from mlakit.convert.rank_plan import budget_rope_dim  # noqa: E402

NUMBER = re.compile(r"^\d+(\.\d+)?$")


def read_shift_file(path: Path) -> tuple[int, list[int], list[dict[str, list[float]]]]:
    """The per-layer budget, the candidates and, per layer, each kind's error at every candidate."""
    text = path.read_text()
    budget = int(re.search(r"per-layer budget (\d+)", text).group(1))
    candidates = [int(c) for c in re.search(r"candidates \[([^\]]*)\]", text).group(1).split(",")]
    layers = []
    for line in text.splitlines():
        if not line.startswith("layer "):
            continue
        kinds = {}
        for part in line.split(":", 1)[1].split(";"):
            words = part.split()
            kinds[" ".join(w for w in words if not NUMBER.match(w))] = [float(w) for w in words if NUMBER.match(w)]
        layers.append(kinds)
    return budget, candidates, layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--kv-heads", type=int, default=3, help="the source's KV heads (SmolLM2: 3; the trained model: 2)")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    for path in args.files:
        budget, candidates, layers = read_shift_file(path)
        default = budget_rope_dim(args.kv_heads, args.head_dim, budget)
        shared = {k: [sum(layer[k][j] for layer in layers) for j in range(len(candidates))] for k in layers[0]}
        best = min(range(len(candidates)), key=lambda j: shared["calib"][j])
        picks = [min(range(len(candidates)), key=lambda j: layer["calib"][j]) for layer in layers]
        print(f"{path.name}: per-layer budget {budget}, candidates {candidates}, default shared d_R {default}, "
              f"best shared on calib {candidates[best]}")
        print(f"  per-layer d_R (least calib error): {[candidates[j] for j in picks]}, "
              f"mean {sum(candidates[j] for j in picks) / len(picks):.1f}")
        for kind, sums in shared.items():
            per_layer = sum(layer[kind][j] for layer, j in zip(layers, picks))
            at_default = sums[candidates.index(default)] if default in candidates else float("nan")
            print(f"  {kind}: shared {default} {at_default:.4g}, shared {candidates[best]} {sums[best]:.4g}, "
                  f"per layer {per_layer:.4g} ({per_layer / at_default - 1:+.1%} vs the default's shared d_R, "
                  f"{per_layer / sums[best] - 1:+.1%} vs the best shared on calib)")


if __name__ == "__main__":
    main()
