"""Is the value refit's held-out error unimodal in the ridge? (the check behind ``choose_ridge``'s walk)

    python bench/experiments/ridge_search.py --out bench/results/ridge_search.md

Converts SmolLM2-135M with the main job's recipe and ``--refine values`` in memory, with
``refine_values.choose_ridge`` wrapped for this process only: every layer's held-out error is
computed at every ridge of the grid (the whole grid, as before the walk), and the table lists them
relative to the layer's minimum, with the grid minimum, the ridge the walk from the grid's middle
stops at, and how many local minima the layer's errors have.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from mlakit.convert import refine_values, refit_moments
from mlakit.pipeline.run import run_conversion
from mlakit.pipeline.run_state import StreamOptions
from mlakit.recipes import Recipe


def walk(errors: list[float]) -> int:
    """Where the walk of ``choose_ridge`` stops on ERRORS (one per ridge, ascending)."""
    k = len(errors) // 2
    while (best := min((j for j in (k - 1, k, k + 1) if 0 <= j < len(errors)), key=errors.__getitem__)) != k:
        k = best
    return k


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="default")
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True, help="markdown table to write")
    args = ap.parse_args()
    rows, original = [], refine_values.choose_ridge

    def every_ridge(w0, folds, fit, ridges=refit_moments.RIDGES, error=None):
        err = error or (lambda w, m: refit_moments.quadratic_error(w, *m))
        errors = [sum(err(fit(1 - f, r), folds[f]) for f in (0, 1)) for r in ridges]
        rows.append(errors)
        return original(w0, folds, fit, ridges, error)

    refine_values.choose_ridge = every_ridge
    opts = replace(Recipe.load(args.recipe).to_options(), refine="values", quiet=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_conversion(args.source, Path(tmp) / "mla", opts, "in-memory", StreamOptions())
    grid = refit_moments.VALUE_RIDGES
    lines = [f"Held-out error of the value refit at every ridge, relative to each layer's minimum: {args.source}, "
             f"recipe {args.recipe} with --refine values (`python bench/experiments/ridge_search.py`).", "",
             "| layer | " + " | ".join(f"{r:g}" for r in grid) + " | grid min | walk stops | local minima |",
             "|---|" + "---|" * (len(grid) + 3)]
    for i, errors in enumerate(rows):
        low = min(errors)
        minima = sum((j == 0 or e < errors[j - 1]) and (j == len(errors) - 1 or e < errors[j + 1])
                     for j, e in enumerate(errors))
        lines.append(f"| {i} | " + " | ".join(f"{e / low:.3f}" for e in errors)
                     + f" | {grid[errors.index(low)]:g} | {grid[walk(errors)]:g} | {minima} |")
    agree = sum(errors.index(min(errors)) == walk(errors) for errors in rows)
    lines += ["", f"The walk stops at the grid minimum in {agree} of {len(rows)} layers.", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
