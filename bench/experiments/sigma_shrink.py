"""The quality ablation with every layer's input second moment shrunk toward its diagonal before the closed
form: Sigma' = (1 - a) Sigma + a diag(Sigma), which keeps each input dimension's scale and weakens the
correlations the calibration text's kind imprints on the RoPE split, the ranks and the latent (the value
refit still fits the real activations). A measurement of whether a less text-specific latent generalises;
not an option of the converter: no rule picks a from the calibration alone (a Ledoit-Wolf estimate with
sequences as the sampling unit gives a ~ 0.001 in every layer, so sampling error is not what differs
between texts).

    SHRINK=0.3 python bench/experiments/sigma_shrink.py --budgets 0.3125 --rows 6 --out DIR

Every argument goes to bench/quality_ablation.py.
"""

from __future__ import annotations

import os

import torch
from ablation_run import run_ablation  # noqa: E402 (first: it puts this checkout on sys.path)

import mlakit.pipeline.driver as driver  # noqa: E402

ALPHA = float(os.environ.get("SHRINK", "0.3"))
_layer_metrics = driver.layer_metrics


def shrunk_metrics(w, stats):
    sigma = stats.sigma
    stats.sigma = (1 - ALPHA) * sigma + ALPHA * torch.diag(sigma.diagonal())
    try:
        return _layer_metrics(w, stats)
    finally:
        stats.sigma = sigma


driver.layer_metrics = shrunk_metrics
run_ablation()
