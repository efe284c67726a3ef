"""The measured choices of the layer driver (``driver.LayerDriver`` inherits them): the FreqFold
(``fold_choice``) and, with ``--rope-dim measured``, each candidate d_R's held-out error (``rope_choice``),
both measured on the first ``FOLD_TOKENS`` calibration tokens of the stream the layer's statistics came from.

For each candidate fold the layer is converted with the latent at full rank, so that the fold's rotary
split is all that differs between candidates (the rank the layer will get is not yet known in the
statistics pass of a two-pass plan), and its attention output is compared with the source attention's on
the same inputs. Each candidate d_R is then converted at its fold with the latent at the uniform rank the
budget leaves, and measured as the layer will be converted: after the joint value refit where the
conversion runs one, by the refit's error on each held-out validation fold; else the closed form's error
on each of those halves. Beside it, the converted layer's error on the same sequences with their tokens
shuffled (``rope_choice.shuffled_sequences``), carried through the source layers in a stream of their own
(``SHUFFLED`` slots) alongside the statistics pass.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..arch import names
from ..convert.compress import (
    LayerPrep,
    Method,
    compress_layer,
    prep_from_tensors,
    prep_tensors,
    prepare_layer,
)
from ..convert.fold_choice import FOLD_TOKENS, choose_fold, fold_candidates
from ..convert.layer_metrics import LayerMetrics
from ..convert.mla_layer import AttentionWeights
from ..convert.rank_plan import error_curve
from ..convert.refine import attention_and_output, attention_output
from ..convert.refine_values import ValueMoments, add_batch, refit_values, value_weights
from ..convert.refit_moments import values_error
from ..convert.rope_choice import choose_rope_dim, shuffled_sequences
from ..io.work_dir import HiddenStore
from .layer_runner import MLALayers

__all__ = ["FoldSteps", "spilled_key", "spilled_prep"]

log = logging.getLogger(__name__)

# the hidden-state slots of the shuffled sequences' stream (``FoldSteps._shuffled_stream``), used in turn
SHUFFLED = "shuffled"


def spilled_key(rope_dim: int, name: str) -> str:
    """The name of a spilled rotary plan's or error curve's tensor NAME at d_R ROPE_DIM."""
    return f"d{rope_dim}.{name}"


def spilled_prep(tensors: dict[str, torch.Tensor], rope_dim: int, device: str) -> LayerPrep:
    """The rotary plan and Gram matrix at d_R ROPE_DIM among a layer's spilled TENSORS, on DEVICE."""
    key = spilled_key(rope_dim, "")
    return prep_from_tensors({k.removeprefix(key): v for k, v in tensors.items() if k.startswith(key)}, device)


class FoldSteps:
    """The per-layer measured choices of ``LayerDriver`` (it reads the driver's setup ``c``, ``work``, ``store``,
    ``n_calib``, ``src_layers`` and ``state``, and its ``_input_slot``)."""

    def _measures_fold(self, metrics: LayerMetrics | None, rope_dim: int) -> bool:
        m, c = self.c.method, self.c
        return (metrics is not None and m.rope == "scored" and m.fold == 0 and not m.stock_rope
                and len(fold_candidates(c.shape.head_dim, rope_dim)) > 1)

    def _measured_rows(self) -> int:
        """The calibration sequences the measured choices read: the first ``FOLD_TOKENS`` tokens' worth."""
        return min(self.n_calib, -(-FOLD_TOKENS // self.c.calib_ids.shape[1]))

    def _measured_stream(self, i: int, source, base: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``FOLD_TOKENS`` tokens' inputs of layer I on the stream at BASE, and the attention output of
        SOURCE (source layer I, built) on them."""
        c, bs = self.c, self.c.batch_size
        inputs = self.store.read(self._input_slot(i, base), 0, self._measured_rows()).to(c.device)
        return inputs, torch.cat([attention_output(source, self.src_layers.run, inputs[s : s + bs])
                                  for s in range(0, inputs.shape[0], bs)])

    @torch.no_grad()
    def _shuffled_stream(self, i: int, source) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer I's inputs on the shuffled measured sequences and the attention output of SOURCE (source layer I,
        built) on them; the source layer's output goes on to layer I + 1's slot. Layer 0 embeds them first."""
        c, bs, rows = self.c, self.c.batch_size, self._measured_rows()
        store = HiddenStore(self.work.path, rows, c.calib_ids.shape[1], c.source.config.hidden_size,
                            durable=self.work.durable)
        slot = lambda k: f"{SHUFFLED}-{k % 2}"  # noqa: E731
        if i == 0:
            ids = shuffled_sequences(c.calib_ids[:rows], c.opts.seed)
            with store.writer(slot(0)) as sink:
                sink.write(torch.nn.functional.embedding(ids, c.source.tensor(names.EMBED)).float())
        inputs = store.read(slot(i), 0, rows).to(c.device)
        targets = []
        with store.writer(slot(i + 1)) as sink:
            for s in range(0, rows, bs):
                attention, out = attention_and_output(source, self.src_layers.run, inputs[s : s + bs])
                targets.append(attention)
                sink.write(out)
        return inputs, torch.cat(targets)

    def _converted(self, i: int, tensors: dict, w: AttentionWeights, metrics: LayerMetrics, method: Method,
                   rope_dim: int, rank: int, prep: LayerPrep | None = None):
        """Layer I converted with METHOD at ROPE_DIM and RANK (float32; PREP: ``prepare_layer``'s result for
        these, when at hand), and the runner that runs it."""
        c = self.c
        layers = MLALayers(c.placeholder_config([rank] * c.n, rope_dim), c.device)
        mla = compress_layer(w, metrics, method, rope_dim, rank, prep)
        layers.config.rope_freq_index[i] = list(mla.freq_index)
        return layers.converted(i, mla, tensors, c.shape.qkv_bias), layers.run

    @torch.no_grad()
    def _layer_method(self, i: int, tensors: dict, w: AttentionWeights, metrics: LayerMetrics | None,
                      base: int, rope_dim: int | None = None, stream=None) -> tuple[Method, dict | None]:
        """The method layer I is converted with at ROPE_DIM (default: the layer's in the setup), and the record of
        its fold choice (None when none was measured: data-free, a fold or rope method asked for, or a single
        candidate). TENSORS: the source layer's; the calibration stream at BASE still holds layer I's input
        (STREAM: ``_measured_stream``'s result, when already at hand)."""
        c = self.c
        rope_dim = c.rope_dims[i] if rope_dim is None else rope_dim
        if not self._measures_fold(metrics, rope_dim):
            return c.method, None
        stream = stream or self._measured_stream(i, self.src_layers.layer(i, tensors), base)
        full = 2 * c.shape.num_kv_heads * c.shape.head_dim - rope_dim

        def error(fold: int) -> float:
            converted = self._converted(i, tensors, w, metrics, replace(c.method, fold=fold), rope_dim, full)
            return self._relative_error(*converted, stream)

        fold, errors = choose_fold(fold_candidates(c.shape.head_dim, rope_dim), error)
        record = {"fold": fold, "errors": {str(f): round(e, 6) for f, e in errors.items()},
                  "sequences": stream[0].shape[0]}
        return replace(c.method, fold=fold), record

    @torch.no_grad()
    def _held_out(self, block, run, stream) -> list[float]:
        """BLOCK's relative attention error on each validation fold of STREAM's sequences (k: sequence k % 2),
        after the joint value refit where the conversion runs one (its held-out error, fitted on the other
        fold), else the closed form's."""
        inputs, targets = stream
        moments, bs = ValueMoments(), self.c.batch_size
        for s in range(0, inputs.shape[0], bs):
            add_batch(moments, block, run, inputs[s : s + bs], targets[s : s + bs], s)
        if self.c.refine is not None and self.c.refine.method == "values":
            report = refit_values(block, moments)
            held = report.get("cv_folds_refit" if report["kept"] == "values refit" else "cv_folds_start")
            if held is not None:
                return held
            # no validation ran (the start is exact, or a fold is too short): the refit left BLOCK as it was
        folds = moments.result()
        total = folds[0][2] + folds[1][2]
        return [values_error(*value_weights(block.self_attn), f) / total for f in folds]

    def _layer_choices(self, i: int, tensors: dict, w: AttentionWeights, metrics: LayerMetrics,
                       base: int) -> dict[str, torch.Tensor]:
        """The statistics pass's measured choices for layer I at each candidate d_R: the fold record and (when
        d_R is measured) the held-out errors and the error on the shuffled sequences into the run state's
        ``measured``; returns the rotary plans and error curves to spill (``spilled_key``)."""
        c, spill, found = self.c, {}, {}
        measured = len(c.rope_candidates) > 1
        stream = shuffled = None
        if measured:  # one build of the source layer for both streams
            source = self.src_layers.layer(i, tensors)
            stream, shuffled = self._measured_stream(i, source, base), self._shuffled_stream(i, source)
            del source
        for d in c.rope_candidates:
            method, record = self._layer_method(i, tensors, w, metrics, base, d, stream)
            prep = prepare_layer(w, metrics, method, d)
            found[str(d)] = {"fold": record}
            if measured:
                block, run = self._converted(i, tensors, w, metrics, method, d, c.layout_at(d)[2][i], prep)
                found[str(d)]["held_out"] = self._held_out(block, run, stream)  # leaves BLOCK refitted
                found[str(d)]["shuffled"] = self._relative_error(block, run, shuffled)
            error = error_curve(w, metrics, method, d, prep).cpu()
            spill |= {spilled_key(d, k): v for k, v in (prep_tensors(prep) | {"error": error}).items()}
        self.state.setdefault("measured", {})[str(i)] = found
        return spill

    @torch.no_grad()
    def _relative_error(self, block, run, stream) -> float:
        """BLOCK's attention error on STREAM (inputs, the source attention's output), relative to its energy."""
        inputs, targets = stream
        bs = self.c.batch_size
        err = sum(float((attention_output(block, run, inputs[s : s + bs]) - targets[s : s + bs])
                        .double().square().sum()) for s in range(0, inputs.shape[0], bs))
        ref = float(targets.double().square().sum())
        return err / ref if ref > 0 else err

    def _settle_choices(self) -> list[torch.Tensor]:
        """Once every layer is measured: the measured d_R (``_choose_rope_dims``) into the run state and the setup,
        then each layer's fold record at the d_R it is converted with; returns each layer's spilled error curve
        at that d_R (what the rank plan reads)."""
        c, st = self.c, self.state
        if len(c.rope_candidates) > 1:
            self._choose_rope_dims()
        st["folds"] = {str(i): st["measured"][str(i)][str(d)]["fold"] for i, d in enumerate(c.rope_dims)}
        return [self.work.load_tensors(f"stats-{i:05d}.pt")[spilled_key(d, "error")] for i, d in enumerate(c.rope_dims)]

    def _choose_rope_dims(self) -> None:
        """``rope_choice.choose_rope_dim`` on the errors summed over the layers (one shared d_R), or with
        ``--rope-dim measured-per-layer`` on each layer's own errors (a d_R per layer, by the same rule)."""
        c, st = self.c, self.state

        def errors(d: int, i: int) -> list[float]:  # layer I's at candidate D: held out per fold, then shuffled
            found = st["measured"][str(i)][str(d)]
            return found["held_out"] + [found["shuffled"]]

        rounded = lambda found: {str(d): [round(e, 6) for e in v] for d, v in found.items()}  # noqa: E731
        search = {d: [sum(errors(d, i)[k] for i in range(c.n)) for k in range(3)] for d in c.rope_candidates}
        st["rope_report"] = {"rope_search": rounded(search)}
        if c.rope_per_layer:
            layers = [{d: errors(d, i) for d in c.rope_candidates} for i in range(c.n)]
            st["rope_dims"] = [choose_rope_dim(found, c.reference_rope) for found in layers]
            st["rope_report"]["rope_layer_search"] = [rounded(found) for found in layers]
        else:
            st["rope_dims"] = [choose_rope_dim(search, c.reference_rope)] * c.n
        c.use_rope_dims(st["rope_dims"], st["rope_report"])
        sums = ", ".join(f"{d}: {sum(v[:2]):.4f}, {v[2]:.4f}" for d, v in search.items())
        log.info("--rope-dim %s: d_R %s (summed held-out error per candidate, then on the shuffled sequences: %s)",
                 c.opts.rope_dim, c.plan_report["rope_dim"], sums)
