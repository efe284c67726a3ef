"""The layer-wise conversion driver: the one orchestration of every conversion.

Per layer: read that layer's tensors from the source (one tensor at a time; a GGUF or pickle
source holds them in memory, a safetensors directory reads them from disk), build the source
decoder layer, push the calibration hidden states through it in batches while the calibration
accumulator (``calibration.layer_accumulator``) gathers E[x~ x~^T] and the attention lag profile
of its input, convert the attention (``convert_layer``: ``layer_metrics`` + ``compress_layer``),
append the converted and the copied tensors to the output shards, and drop everything. The
layer's output hidden states (on disk in the work directory, rounded to its ``STORE_DTYPE``) feed
the next layer, exactly as in the full model. Only the embedding lookup, one layer and the float64
math of one layer are ever resident.

Planned and fisher allocation need every layer's error curve before any rank is chosen: a
statistics pass computes each layer's metrics (``layer_metrics``) and curve and spills them to
the work directory with its rotary plan and the Gram matrix the error curve and the
factorisation share (``compress.prepare_layer``); ranks are planned; the convert pass converts
each layer from what was spilled, so that per-layer float64 work is done once.
With ``--fold 0`` each layer's FreqFold (``--rope-dim measured``: and each candidate d_R's error) is measured
where its metrics are computed (``fold_steps``); a two-pass plan keeps the choices in its run state.
Fisher allocation also needs each layer's loss sensitivity: the statistics pass keeps every
layer's input for the first calibration sequences (``calibration.sensitivity_sequences``), and a backward sweep
from the last layer to the first recomputes one layer at a time from its kept input and carries
the gradient down, with labels sampled from the source's own prediction (as
``calibration.collect_stats`` draws them in one whole-model backward pass).

With ``StreamOptions.sequential`` the driver keeps two hidden-state streams, the source's and
the converted model's: layer i's statistics are taken on the converted stream, the output of the
converted layers 0..i-1 (layer 0's input is the same embedding on both).

A refinement that reads the converted stream (``--refine layer``, and ``--refine values`` unless
``--refine-inputs source``) keeps both streams too: after the closed form, each converted layer is
refitted from its inputs on the converted stream toward the source layer's attention output on the
source stream plus the gap between the two streams' inputs, so it compensates the error the layers
below it left (the value refit weighs that target against the source attention's own output on the
converted input: ``--refine-compensate``); the refined layer is the one written and the one the
converted stream runs through.
``--refine layer`` refits o_proj (and may train the attention: ``refine.refine_layer``), ``--refine
values`` each head's value map and o_proj jointly from moments of the attention-weighted latents
(``refine_values``); as that refit leaves the scores alone, the converted stream is carried on from the
latents it gathered (kept on disk for the purpose) instead of scoring the attention a second time. With
``--refine-inputs source`` the value refit reads the source stream only, against the source attention's
output on the source layer's own input; ``--refine values-per-head``
does that head by head against each source head's own output, then o_proj (``refine_heads``). In a
two-pass plan that refines, the statistics pass keeps each layer's source inputs and attention
outputs (o_proj's inputs for the per-head refit) on disk when they fit (``KEEP_INPUTS_SHARE``), so
the convert pass does not run the source stream again; in a one-pass plan that refines, the source
run each layer's statistics come from keeps that layer's targets for the refinement right after it.

Verification is layer-wise too: 32 fixed tokens (``verify.verify_token_ids``) run through every
source layer and every converted layer (weights cast to the output dtype, as a reload would
see them) alongside the conversion; the final norm and LM head give both logits.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from dataclasses import asdict
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from ..arch import names
from ..convert.assemble import mla_layer_tensors, read_attention
from ..convert.calibration import LayerStats, layer_accumulator, logit_gradient
from ..convert.compress import LayerPrep, compress_layer
from ..convert.layer_metrics import LayerMetrics, layer_metrics, metrics_from_tensors, metrics_tensors
from ..convert.rank_plan import ranks_from_curves
from ..convert.refine import keep_attention_output
from ..io.shard_stream import Cursor, ShardStreamWriter
from ..io.work_dir import HiddenStore, WorkDir
from .fold_steps import FoldSteps, spilled_prep
from .layer_runner import MLALayers, SourceLayers
from .refine_steps import CONVERTED, LATENTS, SOURCE, RefineSteps, kept_slot
from .run_state import ConversionSetup, TensorDict, on_device
from .settings import ConversionError
from .verify import layerwise_report, verify_token_ids

__all__ = ["CONVERTED", "SOURCE", "LayerDriver"]

log = logging.getLogger(__name__)


class Spilled(NamedTuple):
    """What the statistics pass of a two-pass plan computed for one layer and the convert pass reuses."""

    metrics: LayerMetrics | None
    prep: LayerPrep | None


# A two-pass plan that refines keeps each layer's source inputs and its attention's output on them from
# the statistics pass when together they take at most this share of the work directory's free disk:
# the convert pass then reads them instead of running the source stream a second time. Either way the
# output is the same, bit for bit.
KEEP_INPUTS_SHARE = 0.25


class LayerDriver(RefineSteps, FoldSteps):
    """Runs the passes over the layers of SETUP, committing STATE to WORK after each layer.

    ON_LAYER(phase, index), if given, is called before layer INDEX of PHASE (``"statistics"`` or
    ``"convert"``) runs, once every earlier layer's work is committed: a progress hook, and the
    place where a test interrupts a run as a crash would."""

    def __init__(self, setup: ConversionSetup, work: WorkDir, state: dict, on_layer=None):
        self.c, self.work, self.state = setup, work, state
        self.on_layer = on_layer or (lambda phase, index: None)
        self.sequential = setup.stream.sequential
        src = setup.source
        self.src_layers = SourceLayers(src.config, setup.shape.window, setup.device)
        self.n_calib = 0 if setup.calib_ids is None else setup.calib_ids.shape[0]
        self.refining = setup.refine is not None and self.n_calib > 0
        # a converted hidden-state stream beside the source's: sequential statistics or the inputs of a
        # refinement that reads it (--refine-inputs converted)
        self.two_streams = self.sequential or (self.refining and setup.refine.inputs == "converted")
        # sequences the converted stream (and, in the convert pass of a two-pass plan, the source
        # stream) must carry: all for sequential statistics, else only those refinement reads
        self.stream_rows = self.n_calib if self.sequential or not self.refining else setup.refine.used(self.n_calib)
        if self.n_calib:
            self.store = HiddenStore(work.path, self.n_calib, setup.calib_ids.shape[1], src.config.hidden_size,
                                     durable=work.durable)
            # the kept targets: the source attention's output, or for the per-head refit its o_proj input (H d wide)
            self.head_targets = self.refining and setup.refine.method == "values-per-head"
            width = setup.shape.num_heads * setup.shape.head_dim if self.head_targets else src.config.hidden_size
            self.target_store = HiddenStore(work.path, self.n_calib, setup.calib_ids.shape[1], width,
                                            durable=work.durable)
        # a one-pass plan that refines keeps each layer's targets from the source run its statistics come
        # from, for the refinement right after it, instead of running the source attention again (when one
        # layer's fit in KEEP_INPUTS_SHARE of the free disk; the bytes written are the same either way)
        self.one_pass_keeps = bool(self.refining and not setup.two_pass and not self.sequential
                                   and self._disk_allows(self.target_store.nbytes(self.stream_rows)))
        self.verify = setup.opts.verify
        self.latents = None  # (block, store) of the layer's converted-stream value refit, for ``_propagate``
        if "rope_dims" in state:  # measured by the run this one resumes
            setup.use_rope_dims(state["rope_dims"], state["rope_report"])
        if state.get("started"):
            streams = work.load_tensors("verify.pt") if self.verify else {}
            self.verify_src, self.verify_mla = streams.get("source"), streams.get("mla")
        else:
            self._start()

    # -- state ------------------------------------------------------------------------------------

    def _disk_allows(self, nbytes: int) -> bool:
        """Whether NBYTES of kept hidden states fit in ``KEEP_INPUTS_SHARE`` of the work directory's free disk."""
        return nbytes <= KEEP_INPUTS_SHARE * shutil.disk_usage(self.work.path).free

    def _start(self) -> None:
        """Embed the calibration and verification tokens: layer 0's inputs. Decide whether the statistics
        pass keeps the source inputs and targets (``kept_inputs``): a two-pass plan that refines, not
        sequential, with both fitting in ``KEEP_INPUTS_SHARE`` of the free disk."""
        c = self.c
        need = c.n * (self.store.nbytes(self.n_calib) + self.target_store.nbytes(self.stream_rows)) if self.n_calib else 0
        self.state["kept_inputs"] = bool(c.two_pass and self.refining and not self.sequential
                                         and self._disk_allows(need))
        self._embed((SOURCE,))
        self.verify_src = self.verify_mla = None
        if self.verify:
            emb = c.source.tensor(names.EMBED)
            ids = verify_token_ids(c.source.config.vocab_size)
            self.verify_src = emb.float()[ids].to(c.device)
            self.verify_mla = emb.to(c.dtype).float()[ids].to(c.device)
        self.state["started"] = True
        self._commit(None)

    def _embed(self, streams) -> None:
        """The calibration tokens' float32 embeddings into the first slot of each of STREAMS."""
        if not self.n_calib:
            return
        c = self.c
        emb = c.source.tensor(names.EMBED)
        for base in streams:
            with self.store.writer(self._input_slot(0, base)) as sink:
                for s in range(0, self.n_calib, c.batch_size):
                    sink.write(torch.nn.functional.embedding(c.calib_ids[s : s + c.batch_size], emb).float())

    def _commit(self, writer: ShardStreamWriter | None) -> None:
        if writer is not None:
            writer.sync()
            self.state["cursor"] = asdict(writer.cursor)
        if self.verify:
            self.work.save_tensors("verify.pt", {"source": self.verify_src.cpu(), "mla": self.verify_mla.cpu()})
        self.work.commit(self.state)

    def _input_slot(self, i: int, base: int) -> int | str:
        """The store slot of layer I's input on the stream at BASE: the stream's two slots in turn, or
        when the source inputs are kept, the source stream's own per-layer files (``kept_slot``), which
        the statistics pass writes as it goes and the convert pass reads back."""
        if base == SOURCE and self.state.get("kept_inputs"):
            return kept_slot(i, "input")
        return base + i % 2

    def _read_layer(self, i: int) -> dict[str, torch.Tensor]:
        return {name: self.c.source.tensor(name) for name in self.c.layer_names[i]}

    def _progress(self, desc: str, done: int):
        return tqdm(total=self.c.n, initial=done, desc=desc, unit="layer", disable=self.c.opts.quiet,
                    file=sys.stderr, dynamic_ncols=True)

    # -- one layer over the calibration set ---------------------------------------------------------

    @torch.no_grad()
    def _run_stream(self, i: int, base: int, run, layer, acc=None, write: bool = True,
                    rows: int | None = None, keep: int = 0) -> LayerStats | None:
        """LAYER (through RUN) over the first ROWS sequences (default: all) of layer I's input on the stream
        at BASE (``_input_slot``), its output to layer I + 1's input slot when WRITE; with ACC, the
        statistics of the layer's attention input; with KEEP, its attention's output for the first KEEP
        sequences to layer I's kept target slot (``kept_slot``)."""
        c = self.c
        slot = self._input_slot(i, base)
        rows = self.n_calib if rows is None else rows
        handles = acc.attach() if acc is not None else []
        seen = {}
        if keep:
            handles.append(keep_attention_output(layer, seen, heads=self.head_targets))
        try:
            with (self.store.writer(self._input_slot(i + 1, base)) if write else contextlib.nullcontext()) as sink, \
                    (self.target_store.writer(kept_slot(i, "target")) if keep else contextlib.nullcontext()) as targets:
                for s in range(0, rows, c.batch_size):
                    hidden = self.store.read(slot, s, min(s + c.batch_size, rows)).to(c.device)
                    if acc is not None:
                        acc.with_attention = s < c.n_attention
                    out = run(layer, hidden)
                    if sink is not None:
                        sink.write(out)
                    if s < keep:
                        targets.write(seen["attention"][: keep - s])
        finally:
            for handle in handles:
                handle.remove()
        return acc.result() if acc is not None else None

    def _accumulator(self, layer):
        return layer_accumulator(layer.self_attn, self.src_layers.inv_freq, self.c.shape)

    @torch.no_grad()
    def _source_layer(self, i: int, tensors: dict, base: int = SOURCE, verify: bool = True,
                      keep: int = 0) -> LayerStats | None:
        """Source layer I over the calibration stream BASE (and the verification stream when VERIFY);
        returns the statistics of its attention input. KEEP: see ``_run_stream``."""
        layer = self.src_layers.layer(i, tensors)
        stats = None
        if self.n_calib:
            stats = self._run_stream(i, base, self.src_layers.run, layer, self._accumulator(layer),
                                     write=i < self.c.n - 1, keep=keep)
        if self.verify and verify:
            self.verify_src = self.src_layers.run(layer, self.verify_src)
        return stats

    @torch.no_grad()
    def _sequential_layer(self, i: int, tensors: dict) -> LayerStats | None:
        """Sequential calibration: source layer I's statistics on the converted stream; the source
        stream advances through it too (the targets a layer-wise refinement fits)."""
        layer = self.src_layers.layer(i, tensors)
        stats = None
        if self.n_calib:
            stats = self._run_stream(i, CONVERTED, self.src_layers.run, layer, self._accumulator(layer), write=False)
            if i < self.c.n - 1:
                self._run_stream(i, SOURCE, self.src_layers.run, layer)
        if self.verify:
            self.verify_src = self.src_layers.run(layer, self.verify_src)
        return stats

    # -- the passes -------------------------------------------------------------------------------

    def statistics_pass(self) -> None:
        """Planned and fisher allocation, pass 1: every layer's statistics and error curve (spilled),
        and for fisher the inputs of the sensitivity sequences."""
        c, st = self.c, self.state
        with self._progress("layer statistics", st.setdefault("stats_done", 0)) as bar:
            for i in range(st["stats_done"], c.n):
                self.on_layer("statistics", i)
                tensors = self._read_layer(i)
                if c.n_sensitivity:
                    kept = self.store.read(self._input_slot(i, SOURCE), 0, c.n_sensitivity)
                    # in the store's dtype, which holds the read values exactly
                    self.work.save_tensors(f"sens-{i:05d}.pt", {"hidden": kept.to(self.store.dtype)})
                # sequential: the verification stream advances with the convert pass instead
                stats = self._source_layer(i, tensors, verify=not self.sequential,
                                           keep=self.stream_rows if st["kept_inputs"] else 0)
                w, stats = on_device(c.device, read_attention(TensorDict(tensors), i, c.shape), stats)
                with self._on_device():
                    metrics = layer_metrics(w, stats)
                    spill = self._layer_choices(i, tensors, w, metrics, SOURCE)
                # the convert pass reads the metrics, rotary plan and Gram matrix back instead of
                # computing them again
                self.work.save_tensors(f"stats-{i:05d}.pt", metrics_tensors(metrics) | spill)
                del tensors, stats, w, metrics, spill
                st["stats_done"] = i + 1
                self._commit(None)
                bar.update()

    def sensitivity_sweep(self) -> None:
        """Fisher allocation: each layer's loss sensitivity, from the last layer down. Each layer is
        rebuilt from its tensors and run with gradients on its kept input (one sequence at a time);
        the last layer's output goes through the final norm and the LM head with labels sampled
        from the source's own prediction, as ``calibration.collect_stats`` draws them."""
        c, runner = self.c, self.src_layers
        head = runner.head(c.norm_and_head(), "head")
        generator = torch.Generator().manual_seed(c.opts.seed)
        sensitivity, grads = [None] * c.n, None
        with self._progress("loss sensitivities", 0) as bar:
            for i in reversed(range(c.n)):
                layer = runner.layer(i, self._read_layer(i)).requires_grad_(False)
                probe = self._accumulator(layer)
                handle = layer.self_attn.register_forward_hook(probe.probe_gradient)
                try:
                    kept = self.work.load_tensors(f"sens-{i:05d}.pt")["hidden"].to(c.device, torch.float32)
                    below = []
                    for s in range(kept.shape[0]):
                        x = kept[s : s + 1].requires_grad_()
                        with torch.enable_grad():
                            out = runner.forward(layer, x)
                            out.backward(logit_gradient(head, out, generator) if grads is None else grads[s])
                        below.append(x.grad)
                finally:
                    handle.remove()
                grads, sensitivity[i] = below, probe.sensitivity()
                del layer, kept
                bar.update()
        self.state["sensitivity"] = sensitivity
        self._commit(None)

    def plan(self) -> None:
        """Planned and fisher allocation: the measured choices, then the ranks from the spilled error curves."""
        c, st = self.c, self.state
        errors = self._settle_choices()
        try:
            st["ranks"] = ranks_from_curves(errors, st.get("sensitivity", [None] * c.n), c.opts.allocation,
                                            c.uniform, c.rank_budget)
        except ValueError as exc:
            raise ConversionError(str(exc)) from exc
        self._commit(None)

    def _spilled(self, i: int) -> Spilled:
        t = self.work.load_tensors(f"stats-{i:05d}.pt")
        return Spilled(metrics_from_tensors(t, self.c.device), spilled_prep(t, self.c.rope_dims[i], self.c.device))

    def _on_device(self):
        """The default device of the per-layer math (a no-op on the CPU)."""
        return torch.device(self.c.device) if self.c.device != "cpu" else contextlib.nullcontext()

    def convert_pass(self) -> None:
        """Every layer not yet converted: its statistics (taken now, or spilled by the statistics
        pass), ``convert_layer``, its tensors to the shards; then the global tensors."""
        c, st = self.c, self.state
        ranks = st["ranks"]
        layout, self.per_layer = c.layout(ranks)
        mla_layers = MLALayers(c.placeholder_config(ranks), c.device)
        for rec in st["layers"]:
            mla_layers.config.rope_freq_index[rec["layer"]] = rec["rope_freq_index"]
        if (self.two_streams or self.refining) and not st["layers"]:  # the streams start from the embeddings
            # (a statistics pass left the source slots at the last layer's hidden states; kept inputs need none)
            self._embed(((CONVERTED,) if self.two_streams else ()) + (() if st.get("kept_inputs") else (SOURCE,)))
        writer = ShardStreamWriter(layout, self.work.path, Cursor(**st["cursor"]) if "cursor" in st else None,
                                   durable=self.work.durable)
        try:
            with self._progress("converting layers", len(st["layers"])) as bar:
                for i in range(len(st["layers"]), c.n):
                    self.on_layer("convert", i)
                    tick = time.time()
                    tensors = self._read_layer(i)
                    if self.sequential:
                        stats = self._sequential_layer(i, tensors)
                    elif c.two_pass:
                        stats = self._spilled(i)
                        if self.refining and c.refine.method == "layer" and not st.get("kept_inputs"):
                            self._advance_source(i, tensors)  # the source stream carries the targets
                            # (the value refits advance it themselves)
                    else:
                        stats = self._source_layer(i, tensors, keep=self.stream_rows if self.one_pass_keeps else 0)
                    out, record = self.convert_layer(i, tensors, stats, ranks[i], mla_layers)
                    del tensors, stats
                    for name in self.per_layer[i]:
                        writer.write(name, out[name])
                    self._propagate(i, mla_layers, mla_layers.layer(i, out))
                    st["layers"].append(record)
                    st.setdefault("layer_seconds", []).append(round(time.time() - tick, 2))
                    self._commit(writer)
                    if st.get("kept_inputs"):
                        self.store.remove(kept_slot(i, "input"))
                    if self._targets_kept():
                        self.target_store.remove(kept_slot(i, "target"))
                    log.info("layer %d/%d converted in %.1f s", i + 1, c.n, time.time() - tick)
                    bar.update()
            for name in layout.entries[writer.cursor.tensor :]:
                writer.write(name[0], c.source.tensor(name[0]).to(c.dtype))
            writer.finish()
        finally:
            writer.close()

    def convert_layer(self, i: int, tensors: dict, stats: LayerStats | Spilled | None, rank: int,
                      mla_layers: MLALayers) -> tuple[dict, dict]:
        """The per-layer convert step: source layer I's TENSORS and its attention-input STATS (or what
        the statistics pass computed from them; None: data-free) to the converted layer's tensors
        (output dtype, full checkpoint names, the copied norms and MLP included) at kv_lora_rank
        RANK, and its report record. The layer's rope frequencies go into MLA_LAYERS' config, so
        ``mla_layers.layer(i, out)`` builds it. The calibration stream this layer read is at
        ``self._input_slot(i, SOURCE)`` (or CONVERTED when sequential)."""
        c = self.c
        spilled = stats if isinstance(stats, Spilled) else Spilled(None, None)  # on c.device already
        w, stats = on_device(c.device, read_attention(TensorDict(tensors), i, c.shape),
                             stats if isinstance(stats, LayerStats) else None)
        with self._on_device():
            if stats is not None:
                metrics = layer_metrics(w, stats)
                method, fold = self._layer_method(i, tensors, w, metrics, CONVERTED if self.sequential else SOURCE)
            else:
                metrics, method, fold = spilled.metrics, c.method, self.state.get("folds", {}).get(str(i))
            mla = compress_layer(w, metrics, method, c.rope_dims[i], rank, spilled.prep)
        del w, stats, spilled, metrics  # the float64 statistics are done with before the layer is written
        out = mla_layer_tensors(i, mla, c.dtype, q_bias=c.shape.qkv_bias, kv_a_bias=c.shape.qkv_bias)
        out.update({m: tensors[m].to(c.dtype) for m in self.per_layer[i] if m not in out})
        mla_layers.config.rope_freq_index[i] = list(mla.freq_index)
        record = {"layer": i, "kv_lora_rank": mla.kv_lora_rank, "qk_rope_head_dim": mla.rope_dim,
                  "rope_freq_index": list(mla.freq_index)} | ({"fold_choice": fold} if fold else {})
        if self.refining and c.refine.method == "values":
            record["refine"] = self._refit_values(i, tensors, mla, out, mla_layers)
        elif self.refining and c.refine.method == "values-per-head":
            record["refine"] = self._refit_per_head(i, tensors, mla, out, mla_layers)
        elif self.refining:
            record["refine"] = self._refine(i, tensors, mla, out, mla_layers)
        return out, record

    @torch.no_grad()
    def _advance_source(self, i: int, tensors: dict) -> None:
        """The source stream through source layer I (its statistics are already spilled)."""
        if i < self.c.n - 1:
            self._run_stream(i, SOURCE, self.src_layers.run, self.src_layers.layer(i, tensors), rows=self.stream_rows)

    @torch.no_grad()
    def _propagate(self, i: int, mla_layers: MLALayers, layer) -> None:
        """Converted layer I on the verification stream and on the converted stream when there is one: from
        the latents of its converted-stream value refit (``_from_latents``), or run whole."""
        refit, self.latents = self.latents, None
        if self.two_streams and self.n_calib and i < self.c.n - 1:
            run = mla_layers.run if refit is None else self._from_latents(refit, mla_layers)
            self._run_stream(i, CONVERTED, run, layer, rows=self.stream_rows)
        if refit is not None and refit[1] is not None:
            refit[1].remove(LATENTS)
        if self.verify:
            self.verify_mla = mla_layers.run(layer, self.verify_mla)

    def verify_report(self) -> dict:
        mla_layers = MLALayers(self.c.placeholder_config(self.state["ranks"]), self.c.device)
        return layerwise_report(self.c, self.src_layers, mla_layers, self.verify_src, self.verify_mla)
