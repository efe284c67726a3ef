"""The quality ablation with the value refit's ridge multiplied by a factor: the ridge the held-out folds
choose is scaled by RIDGE_SCALE before the fit on all sequences (``refit_moments.HELD_OUT_SHARE`` times the
factor). A measurement of whether the refit, which fits the calibration text's kind, would generalise
better to other text if shrunk harder toward the closed form; not an option of the converter.

    RIDGE_SCALE=4 python bench/experiments/ridge_scale.py --budgets 0.3125 --rows 6 --out DIR

Every argument goes to bench/quality_ablation.py.
"""

from __future__ import annotations

import os

from ablation_run import run_ablation  # noqa: E402 (first: it puts this checkout on sys.path)

import mlakit.convert.refit_moments as refit_moments  # noqa: E402

refit_moments.HELD_OUT_SHARE *= float(os.environ.get("RIDGE_SCALE", "4"))
run_ablation()
