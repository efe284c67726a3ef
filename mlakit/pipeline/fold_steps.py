"""The measured FreqFold of the layer driver (``driver.LayerDriver`` inherits it): ``fold_choice``'s rule
run on the layer's calibration stream.

For each candidate fold the layer is converted with the latent at full rank, so that the fold's rotary
split is all that differs between candidates (the rank the layer will get is not yet known in the
statistics pass of a two-pass plan), and its attention output on the first ``FOLD_TOKENS`` calibration
tokens of the stream its statistics came from is compared with the source attention's on the same inputs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..convert.compress import Method, compress_layer
from ..convert.fold_choice import FOLD_TOKENS, choose_fold, fold_candidates
from ..convert.layer_metrics import LayerMetrics
from ..convert.mla_layer import AttentionWeights
from ..convert.refine import attention_output
from .layer_runner import MLALayers

__all__ = ["FoldSteps"]


class FoldSteps:
    """The per-layer fold choice of ``LayerDriver`` (it reads the driver's setup ``c``, ``store``, ``n_calib``
    and ``src_layers``, and its ``_input_slot``)."""

    def _measures_fold(self, metrics: LayerMetrics | None) -> bool:
        m, c = self.c.method, self.c
        return (metrics is not None and m.rope == "scored" and m.fold == 0 and not m.stock_rope
                and len(fold_candidates(c.shape.head_dim, c.rope_dim)) > 1)

    @torch.no_grad()
    def _layer_method(self, i: int, tensors: dict, w: AttentionWeights, metrics: LayerMetrics | None,
                      base: int) -> tuple[Method, dict | None]:
        """The method layer I is converted with, and the record of its fold choice (None when none was
        measured: data-free, a fold or rope method asked for, or a single candidate). TENSORS: the source
        layer's; the calibration stream at BASE still holds layer I's input."""
        c = self.c
        if not self._measures_fold(metrics):
            return c.method, None
        rows = min(self.n_calib, -(-FOLD_TOKENS // c.calib_ids.shape[1]))
        bs = c.batch_size
        inputs = self.store.read(self._input_slot(i, base), 0, rows).to(c.device)
        source = self.src_layers.layer(i, tensors)
        targets = torch.cat([attention_output(source, self.src_layers.run, inputs[s : s + bs])
                             for s in range(0, rows, bs)])
        del source
        ref = float(targets.double().square().sum())
        full = 2 * c.shape.num_kv_heads * c.shape.head_dim - c.rope_dim
        layers = MLALayers(c.placeholder_config([full] * c.n), c.device)

        def error(fold: int) -> float:
            mla = compress_layer(w, metrics, replace(c.method, fold=fold), c.rope_dim, full)
            layers.config.rope_freq_index[i] = list(mla.freq_index)
            block = layers.converted(i, mla, tensors, c.shape.qkv_bias)
            err = sum(float((attention_output(block, layers.run, inputs[s : s + bs]) - targets[s : s + bs])
                            .double().square().sum()) for s in range(0, rows, bs))
            return err / ref if ref > 0 else err

        fold, errors = choose_fold(fold_candidates(c.shape.head_dim, c.rope_dim), error)
        record = {"fold": fold, "errors": {str(f): round(e, 6) for f, e in errors.items()}, "sequences": rows}
        return replace(c.method, fold=fold), record
