"""The quality ablation with every layer's value metric (the error model's weight on value errors, against
the keys') multiplied by VALUE_WEIGHT before the rotary split, the ranks and the latent are chosen. A
measurement of the error model's balance of keys and values under the value refit; not an option of the
converter.

    VALUE_WEIGHT=0.5 python bench/experiments/value_weight.py --budgets 0.3125 --rows 6 --out DIR

Every argument goes to bench/quality_ablation.py.
"""

from __future__ import annotations

import os

from ablation_run import run_ablation  # noqa: E402 (first: it puts this checkout on sys.path)

import mlakit.pipeline.driver as driver  # noqa: E402

WEIGHT = float(os.environ.get("VALUE_WEIGHT", "0.5"))
_layer_metrics = driver.layer_metrics


def weighted_metrics(w, stats):
    m = _layer_metrics(w, stats)
    m.value_metric = m.value_metric * WEIGHT
    return m


driver.layer_metrics = weighted_metrics
run_ablation()
