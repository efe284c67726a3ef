"""Where the value refit's held-out error stands: each layer's moments of the default conversion (68.75%
less KV unless --kv-budget), then, per layer, the held-out error (fit on one fold, scored on the other,
both ways) relative to the closed form's of

- step 1 alone: the joint ridge map M (best ridge of the grid);
- steps 1-3: what the converter fits (M, each head's rank-d projection, o_proj; best ridge);
- step 1 with a reduced-rank correction: M0 + the top-k part of M - M0 in the latent's metric, best
  (ridge, k) over k in 8 .. 256 and full.

    python bench/experiments/refit_heldout.py [--kv-budget 0.3125] [--seed 0]

A diagnostic of the refit's own losses, not an option of the converter.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlakit.pipeline.refine_steps as refine_steps  # noqa: E402
from mlakit.convert.refine_values import value_weights  # noqa: E402
from mlakit.convert.refit_moments import (  # noqa: E402
    VALUE_RIDGES,
    effective_map,
    fit_values,
    head_roots,
    quadratic_error,
    ridge_solve,
    values_error,
)
from mlakit.pipeline.api import ConvertOptions  # noqa: E402
from mlakit.pipeline.run import run_conversion  # noqa: E402

RANKS = (8, 16, 32, 64, 128, 256)


def collect(kv_budget: float, seed: int) -> list[dict]:
    """Every layer's fold moments and closed-form weights, as the default conversion's refit sees them."""
    layers, refit = [], refine_steps.refit_values

    def keeping(block, moments, **kw):
        w_uv, w_o = value_weights(block.self_attn)
        layers.append({"folds": moments.result(), "w_uv": w_uv, "w_o": w_o,
                       "bias": block.self_attn.o_proj.bias is not None})
        return refit(block, moments, **kw)

    refine_steps.refit_values = keeping
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_conversion("default", Path(tmp) / "mla", ConvertOptions(kv_budget=kv_budget, seed=seed, quiet=True),
                           "in-memory")
    finally:
        refine_steps.refit_values = refit
    return layers


def cross(folds, maps) -> float:
    """Held-out error of MAPS[f] (fitted on fold f) on the other fold, summed over both ways."""
    return sum(quadratic_error(maps[f], *folds[1 - f]) for f in (0, 1))


def layer_errors(t: dict) -> list[float]:
    """Held-out errors of one layer: closed form, step 1, steps 1-3, reduced-rank step 1 (best of each grid)."""
    folds, w_uv, w_o, bias = t["folds"], t["w_uv"], t["w_o"], t["bias"]
    m0 = effective_map(w_uv, w_o)
    H, d, _ = w_uv.shape
    rms = float(w_uv.square().mean().sqrt())
    heads = [head_roots(f[0], H, bias) for f in folds]
    roots = []
    for aa, _, _ in folds:
        ev, evec = torch.linalg.eigh(aa)
        roots.append((evec * ev.clamp_min(0).sqrt()) @ evec.T)
    step1 = full = reduced = float("inf")
    for lam in VALUE_RIDGES:
        maps = [ridge_solve(folds[f][0], folds[f][1], lam, m0) for f in (0, 1)]
        step1 = min(step1, cross(folds, maps))
        fits = [fit_values(folds[f], lam, m0, H, d, bias, rms, heads[f]) for f in (0, 1)]
        full = min(full, sum(values_error(*fits[f], folds[1 - f]) for f in (0, 1)))
        bases = [torch.linalg.svd((maps[f] - m0) @ roots[f], full_matrices=False)[0] for f in (0, 1)]
        for k in RANKS:
            cut = [m0 + bases[f][:, :k] @ (bases[f][:, :k].T @ (maps[f] - m0)) for f in (0, 1)]
            reduced = min(reduced, cross(folds, cut))
    return [cross(folds, [m0, m0]), step1, full, min(reduced, step1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-budget", type=float, default=0.3125)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    totals = torch.zeros(4, dtype=torch.float64)  # closed form, step 1, steps 1-3, reduced-rank step 1
    for i, t in enumerate(collect(args.kv_budget, args.seed)):
        errors = layer_errors(t)
        totals += torch.tensor(errors, dtype=torch.float64)
        start, step1, full, reduced = errors
        print(f"layer {i:2d}: held-out error / closed form's: step 1 {step1 / start:.3f}, steps 1-3 "
              f"{full / start:.3f}, reduced-rank step 1 {reduced / start:.3f}", flush=True)
    s = totals / totals[0]
    print(f"all layers: step 1 {s[1]:.4f}, steps 1-3 {s[2]:.4f}, reduced-rank step 1 {s[3]:.4f}")


if __name__ == "__main__":
    main()
