"""The refinement steps of the layer driver (``driver.LayerDriver`` inherits them).

After the closed form has built converted layer i, ``--refine values`` refits its value maps and
o_proj jointly from moments over the converted stream, toward the source's targets plus the gap between
the streams weighed against the source attention's output on the converted input (``refine.compensate``;
over the source stream with ``--refine-inputs source``: ``_refit_values``), ``--refine
values-per-head`` head by head on the source stream and then o_proj, in two passes over it
(``_refit_per_head``), and ``--refine layer`` refits and optionally trains it on the converted stream
toward the source's targets plus the gap (the value refit's target at ``refine.compensate`` 1:
``_refine``). Each reads the source layer's inputs,
and the source attention's output on them, either from what the source run before kept on disk
(``kept_slot`` slots: the statistics pass of a two-pass plan, or the convert pass's own run in a
one-pass plan) or from the source stream.
The per-head refit's targets are the source attention's o_proj input (each head's own output), the
others' its output (``heads`` of ``refine.attention_output``).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from tqdm.auto import tqdm

from ..arch import names
from ..convert.refine import attention_and_output, attention_output, exact_loss, refine_layer
from ..convert.refine_heads import refit_per_head
from ..convert.refine_values import (
    ValueMoments,
    add_batch,
    compensating_target,
    flat_latents,
    layer_from_latents,
    refit_values,
)
from ..io.work_dir import HiddenStore
from .layer_runner import MLALayers

__all__ = ["CONVERTED", "LATENTS", "SOURCE", "RefineSteps", "kept_slot"]

# first hidden-state slot of each stream (a stream uses its slot and the next in turn, unless the source
# stream's inputs are kept: ``LayerDriver._input_slot``)
SOURCE, CONVERTED = 0, 2
# the slot of the latents a converted-stream value refit keeps for carrying that stream on (``_latent_store``)
LATENTS = "latents"


def kept_slot(i: int, what: str) -> str:
    """The store slot of layer I's kept source inputs (WHAT "input") or its attention's output on them ("target")."""
    return f"{what}-{i:05d}"


class RefineSteps:
    """The per-layer refinement of ``LayerDriver`` (it reads the driver's setup ``c``, ``work``, ``store``, ``state``,
    ``src_layers``, ``n_calib``, ``stream_rows`` and ``sequential``, and its ``_input_slot`` and
    ``_disk_allows``; it sets ``latents``, which ``_propagate`` reads)."""

    def _write_attention(self, i: int, block, out: dict) -> None:
        prefix = names.attn_prefix(i)
        for name, t in block.self_attn.state_dict().items():
            out[prefix + name] = t.detach().to(self.c.dtype).contiguous()

    def _exact(self) -> float:
        """The start loss a refit keeps as exact: its inputs and targets come rounded from the store."""
        return exact_loss(self.target_store.dtype)

    def _targets_kept(self) -> bool:
        """Whether the source run before the refinement kept the layer's targets: the statistics pass of a
        two-pass plan (with the inputs, ``kept_inputs``), or the convert pass's own run in a one-pass plan."""
        return bool(self.state.get("kept_inputs") or self.one_pass_keeps)

    def _source_input(self, i: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sequences START .. STOP - 1 of source layer I's input and its attention's output (o_proj's input for
        the per-head refit), the latter kept by the source run before (``_targets_kept``); or the input from
        the source stream and None (the caller runs the source layer)."""
        c = self.c
        x = self.store.read(self._input_slot(i, SOURCE), start, stop).to(c.device)
        if self._targets_kept():
            return x, self.target_store.read(kept_slot(i, "target"), start, stop).to(c.device)
        return x, None

    def _refit_values(self, i: int, tensors: dict, mla, out: dict, mla_layers: MLALayers) -> dict:
        """``--refine values`` on converted layer I: moments of its latents and of its target over the first
        sequences, then ``refit_values``; when the refit was kept, its attention tensors replace those in OUT
        (output dtype). Returns the report entry. On the source stream the target is the source attention's
        output a on the source input x; on the converted stream (input x') it lies between x + a - x', so that
        the layer's residual output x' + attn(x') comes as close as it can to the source's x + a (the update
        also undoes what the layers below got wrong: ``_refine``'s target, there fitted by o_proj alone), and
        the source attention's own output on x' (on half the sequences: ``compensating_target``), weighed by
        ``refine.compensate``.
        The targets were kept by the source run before (``_targets_kept``), or the source stream is still at
        layer I's input and the source run that gives the targets carries it on to layer I + 1 (a one-pass plan
        advanced it already)."""
        n = self.c.refine.used(self.n_calib)
        converted = self.c.refine.inputs == "converted"
        share = self.c.refine.compensate if converted else 1.0
        # the source layer: for the targets when not kept, and for its function on the converted input
        src_layer = self.src_layers.layer(i, tensors) if share < 1 or not self._targets_kept() else None
        run, round_ = self.src_layers.run, self.target_store.round
        source_function = lambda h, layer=src_layer: round_(attention_output(layer, run, h))  # noqa: E731
        block = mla_layers.converted(i, mla, tensors, self.c.shape.qkv_bias)
        moments = ValueMoments()
        latents = self._latent_store(i, block) if converted else None
        with torch.no_grad(), latents.writer(LATENTS) if latents is not None else contextlib.nullcontext() as kept:
            for s, x, target in self._source_batches(i, n, src_layer, self._advances(i)):
                if converted:
                    x_conv = self.store.read(self._input_slot(i, CONVERTED), s, s + x.shape[0]).to(x.device)
                    x, target = x_conv, compensating_target(target, x, x_conv, share, source_function, s)
                a = add_batch(moments, block, mla_layers.run, x, target, s)
                if kept is not None:
                    kept.write(a)
        self.latents = (block, latents) if converted else None  # for ``_propagate``, once the layer is final
        del src_layer, source_function
        report = refit_values(block, moments, start_ridge=self._refine_below().get("ridge"), exact=self._exact())
        if report["kept"] == "values refit":
            self._write_attention(i, block, out)
        return {"method": "values", "inputs": self.c.refine.inputs, "sequences": n} | (
            {"compensate": share} if converted else {}) | report

    def _latent_store(self, i: int, block) -> HiddenStore | None:
        """Where the converted-stream value refit of layer I keeps its attention-weighted latents, so that
        carrying the converted stream on to layer I + 1 (``_from_latents``) needs no second scoring of the
        attention; None when it cannot: the last layer, a stream of more sequences than the refit reads, or
        too little free disk (``_disk_allows``)."""
        attn = block.self_attn
        # float32: the stream carried on is then what running the layer gives, up to the order of the sums; never
        # resumed from (an interrupted layer is converted again), so never synced to disk
        store = HiddenStore(self.work.path, self.stream_rows, self.store.shape[1], attn.num_heads * attn.kv_lora_rank,
                            durable=False, dtype=torch.float32)
        fits = self.c.refine.used(self.n_calib) == self.stream_rows and self._disk_allows(store.nbytes(self.stream_rows))
        return store if fits and i < self.c.n - 1 else None

    def _from_latents(self, refit: tuple, mla_layers: MLALayers):
        """``run(layer, hidden)`` that carries the converted stream through refitted layer LAYER, batch by batch in
        ``_run_stream``'s order, from the latents of REFIT = (block, store) (``_refit_values``): the refit changes
        only what follows the scores, so the latents it gathered still hold. Those the store kept are read back;
        with no store they are computed again, from the same block in the same float32 arithmetic, so a run
        writes the same bytes whether the disk had room or not. The scores are those of the refit's float32
        weights, the value maps and o_proj those of LAYER (what the checkpoint holds)."""
        block, store = refit
        rows, bs = self.stream_rows, self.c.batch_size
        kept = None if store is None else (store.read(LATENTS, s, min(s + bs, rows)) for s in range(0, rows, bs))

        def run(layer, hidden):
            latents = flat_latents(block, mla_layers.run, hidden) if kept is None else next(kept).to(hidden.device)
            return layer_from_latents(layer, hidden, latents)
        return run

    def _advances(self, i: int) -> bool:
        """Whether the source run that gives layer I's refit targets must also carry the source stream on to
        layer I + 1: a two-pass plan whose statistics pass kept no inputs (the one-pass plans advanced it already)."""
        c = self.c
        return c.two_pass and not self.sequential and not self.state.get("kept_inputs") and i < c.n - 1

    def _source_batches(self, i: int, n: int, src_layer, advance: bool, heads: bool = False):
        """(first sequence, source input, target) over the first N calibration sequences of layer I, a batch at a
        time: the targets kept by the source run before (``_targets_kept``), or from SRC_LAYER run on the source
        stream (with ADVANCE, that run's output is written as layer I + 1's input). The target is the source
        attention's output, or with HEADS its o_proj input."""
        bs = self.c.batch_size
        with self.store.writer(self._input_slot(i + 1, SOURCE)) if advance else contextlib.nullcontext() as sink:
            for s in range(0, n, bs):
                x, target = self._source_input(i, s, min(s + bs, n))
                if target is None:  # not kept (a two-pass plan advancing the stream keeps none): computed,
                    if sink is not None:  # then rounded as a kept one already is
                        target, following = attention_and_output(src_layer, self.src_layers.run, x, heads=heads)
                        sink.write(following)
                    else:
                        target = attention_output(src_layer, self.src_layers.run, x, heads=heads)
                    target = self.target_store.round(target)
                yield s, x, target

    def _refine_below(self) -> dict:
        """The refinement record of the layer converted before this one (empty for the first)."""
        return self.state["layers"][-1].get("refine", {}) if self.state["layers"] else {}

    def _refit_per_head(self, i: int, tensors: dict, mla, out: dict, mla_layers: MLALayers) -> dict:
        """``--refine values-per-head`` on converted layer I (``refine_heads.refit_per_head``), in two passes over
        the first sequences of the source stream: each reads layer I's source inputs and the source attention's
        o_proj input on them, kept by the source run before (``_targets_kept``) or from a run of the source
        layer (the first run also carries the source stream on to layer I + 1 where a two-pass plan needs it,
        as ``_refit_values``)."""
        n = self.c.refine.used(self.n_calib)
        src_layer = None if self._targets_kept() else self.src_layers.layer(i, tensors)
        block = mla_layers.converted(i, mla, tensors, self.c.shape.qkv_bias)
        passes = [self._advances(i)]  # only the first pass carries the source stream on
        batches = lambda: self._source_batches(i, n, src_layer, passes.pop() if passes else False, heads=True)  # noqa: E731
        below = self._refine_below()
        report = refit_per_head(block, mla_layers.run, batches, start_ridge=below.get("ridge"),
                                start_o_ridge=below.get("o_proj_ridge"), exact=self._exact())
        if report["kept"] == "values refit per head":
            self._write_attention(i, block, out)
        return {"method": "values-per-head", "sequences": n} | report

    def _refine(self, i: int, tensors: dict, mla, out: dict, mla_layers: MLALayers) -> dict:
        """Refine converted layer I (float32, from MLA) on the first sequences of the converted stream
        toward the source layer's attention output on the source stream; when the refinement kept new
        weights, they replace the attention tensors in OUT (output dtype). Returns the report entry."""
        c, settings = self.c, self.c.refine
        n, bs = settings.used(self.n_calib), c.batch_size
        src_layer = None if self._targets_kept() else self.src_layers.layer(i, tensors)  # kept: unused
        with torch.no_grad():
            targets = []
            for s in range(0, n, bs):
                x, attention = self._source_input(i, s, min(s + bs, n))
                if attention is None:
                    attention = self.target_store.round(attention_output(src_layer, self.src_layers.run, x))
                targets.append(x + attention)
            targets = torch.cat(targets)
        del src_layer
        inputs = self.store.read(self._input_slot(i, CONVERTED), 0, n).to(c.device)
        block = mla_layers.converted(i, mla, tensors, self.c.shape.qkv_bias)
        report = refine_layer(block, mla_layers.forward, inputs, targets, settings, seed=c.opts.seed + i,
                              progress=lambda steps: tqdm(steps, desc=f"refining layer {i}", leave=False,
                                                          disable=c.opts.quiet, file=sys.stderr),
                              exact=self._exact())
        if report["kept"] in ("o_proj refit", "adam"):
            self._write_attention(i, block, out)
        return {k: report[k] for k in ("loss_before", "loss_after", "kept", "steps", "seconds", "ridge",
                                       "ridge_all", "ridges_tried", "cv_loss_start", "cv_loss_refit", "refit") if k in report}

