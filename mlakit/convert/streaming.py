"""Layer-wise conversion: memory bounded by one decoder layer, resumable, atomic.

Per layer: read that layer's tensors from the safetensors shards (one tensor at a time), build
the source decoder layer, push the calibration hidden states through it in batches while the
calibration accumulator (``calibration.layer_accumulator``) gathers E[x~ x~^T] and the attention
lag profile of its input, convert the attention (``layer_metrics`` + ``compress_layer``, the
in-memory pipeline's math), append the converted and the copied tensors to the output shards,
and drop everything. The layer's output hidden states (on disk, float32) feed the next layer,
exactly as in the full model. Only the embedding lookup, one layer and the float64 math of one
layer are ever resident.

Planned and fisher allocation (``--allocation planned|fisher``) need every layer's error curve
before any rank is chosen: a first pass computes each layer's statistics and curve and spills the
statistics to the work directory (one (D+1)^2 float64 matrix per layer on disk, never all in RAM);
ranks are planned; a second pass converts each layer from its spilled statistics. Fisher
allocation also needs each layer's loss sensitivity, which the in-memory pipeline takes from one
backward pass through the whole model: here the first pass also keeps every layer's input for
the first ``SENSITIVITY_SAMPLES`` calibration sequences (on disk), and a backward sweep from the
last layer to the first recomputes one layer at a time from its kept input and carries the
gradient down, with the same sampled labels and the same gradient probes.

Verification is layer-wise too: 32 fixed tokens (the in-memory pipeline's) run through every
source layer and every converted layer (weights cast to the output dtype, as a reload would
see them) alongside the conversion; the final norm and LM head give both logits.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from .assemble import (
    check_shapes,
    check_source_tensors,
    is_ignored_buffer,
    mla_config,
    mla_layer_tensors,
    model_shapes,
    read_attention,
)
from .calibration import (
    ATTENTION_SAMPLES,
    BATCH_SIZE,
    LOGIT_ROWS,
    LayerStats,
    layer_accumulator,
    logit_gradient,
)
from .compress import compress_layer
from .engine_target import check_target_shape, fit_target
from .families import LAYER_PREFIX, attention_shape
from .fingerprint import content_fingerprint
from .layer_metrics import layer_metrics
from .layer_runner import MLALayers, SourceLayers
from .mla_layer import AttentionWeights
from .output_dir import OutputExistsError, check_output, claim_output, local_paths
from .pipeline import (
    ConversionError,
    ConvertOptions,
    _write_tokenizer_files,
    budget_values,
    calibration_ids,
    check_calibration,
    check_ranks,
    effective_recipe,
    logit_report,
    method_of,
    needs_calibration,
    resolve_allocation,
    resolve_dtype,
    resolve_lowrank,
    sensitivity_sequences,
    verify_token_ids,
)
from .rank_plan import budget_layout, error_curve, ranks_from_curves, uniform_ranks
from .shard_stream import Cursor, ShardLayout, ShardStreamWriter, read_header
from .source import SourceError, open_source, resolve_source
from .stream_memory import choose_batch_size, estimate_sweep_bytes
from .work_dir import HiddenStore, WorkDir, open_work_dir, work_dir_for
from .writer import AUTO_MAP, write_json, write_modeling_code

__all__ = [
    "PIPELINES",
    "StreamOptions",
    "choose_pipeline",
    "convert_streaming",
    "resolve_device",
    "run_conversion",
]

log = logging.getLogger(__name__)

STATE_VERSION = 3  # 2: spilled statistics hold the error curve itself, not its log; 3: source content hashed


@dataclass
class StreamOptions:
    resume: bool = False  # continue the work directory an interrupted run left beside OUT
    max_memory: int | None = None  # host RAM budget in bytes: sets the calibration batch, or refuses
    batch_size: int = BATCH_SIZE  # calibration sequences per forward (at most; --max-memory may lower it)
    max_shard_bytes: int = 2 * 1024**3


class _Tensors:
    """A name -> tensor dict that reads like a Source (for ``read_attention``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._t = tensors

    def tensor(self, name: str) -> torch.Tensor:
        return self._t[name]


def _on(device: str, w: AttentionWeights, stats: LayerStats | None):
    if device == "cpu":
        return w, stats
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(w).items()}
    w = AttentionWeights(**fields)
    if stats is not None:
        stats = LayerStats(
            stats.sigma.to(device), stats.lag_p2.to(device), stats.inv_freq.to(device), stats.tokens
        )
    return w, stats


class _StreamingConversion:
    """Everything fixed before the first layer runs: settings, ranks, tensor layout."""

    def __init__(self, source, opts: ConvertOptions, stream: StreamOptions):
        self.source, self.stream = source, stream
        cfg = source.config
        self.shape = shape = attention_shape(cfg)
        check_target_shape(opts, shape)
        self.opts = opts = resolve_lowrank(opts, shape)  # the report and the saved recipe name the method used
        self.n = n = cfg.num_hidden_layers
        check_source_tensors(source)
        self.dtype = resolve_dtype(opts.dtype, cfg)
        self.device = opts.device
        self.method = method_of(opts, shape)
        G, d = shape["num_kv_heads"], shape["head_dim"]
        self.two_pass = False  # planned or fisher: every layer's statistics before any rank
        self.plan_report: dict = {}
        if opts.kv_budget is not None:
            budget = budget_values(opts, shape, n)
            fixed_rope = None if opts.rope_dim == "full" else int(opts.rope_dim)
            try:
                self.rope_dim, self.rank_budget = budget_layout(n, G, d, budget, fixed_rope, opts.stock_rope)
            except ValueError as exc:
                raise ConversionError(str(exc)) from exc
            self.uniform = uniform_ranks(n, G, d, self.rope_dim, self.rank_budget)
            self.two_pass = opts.allocation in ("planned", "fisher")
            self.ranks = None if self.two_pass else self.uniform
            self.plan_report = {"allocation": opts.allocation, "rope_dim": self.rope_dim,
                                "budget_values_per_token": budget}
        else:
            rank, self.rope_dim = check_ranks(opts, shape)
            self.ranks = [rank] * n
        self.calibrated = needs_calibration(opts, shape)
        self.calib_ids = calibration_ids(source, opts, cfg.vocab_size) if self.calibrated else None
        # sequences whose layer inputs the fisher backward sweep keeps (0: no sweep)
        self.n_sensitivity = sensitivity_sequences(opts, self.calib_ids.shape[0]) if self.calibrated else 0
        self.batch_size = stream.batch_size
        if self.calibrated:
            sweep = None
            if self.n_sensitivity:
                sweep = estimate_sweep_bytes(cfg, shape, opts.calib_seq_len, self.n_sensitivity, LOGIT_ROWS, opts.device)
            self.batch_size = choose_batch_size(
                cfg, shape, opts.calib_seq_len, stream.batch_size, stream.max_memory, opts.device, sweep
            )
        names = source.tensor_names()
        self.layer_names = [
            [m for m in names if m.startswith(LAYER_PREFIX.format(i=i)) and not is_ignored_buffer(m)] for i in range(n)
        ]
        in_layers = {m for ns in self.layer_names for m in ns}
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.global_names = [
            m
            for m in names
            if m not in in_layers
            and not is_ignored_buffer(m)
            and not (self.tied and m == "lm_head.weight")
        ]
        self.head_name = (
            "model.embed_tokens.weight" if self.tied or "lm_head.weight" not in names else "lm_head.weight"
        )

    def norm_and_head(self) -> dict[str, torch.Tensor]:
        """The source's final norm weight and LM head (key ``head``), as ``SourceLayers.head`` reads them."""
        return {"model.norm.weight": self.source.tensor("model.norm.weight"), "head": self.source.tensor(self.head_name)}

    def fingerprint(self) -> dict:
        """What must match for a work directory to be resumed."""
        settings = {k: v for k, v in asdict(self.opts).items() if k not in ("device", "overwrite", "quiet")}
        return {
            "version": STATE_VERSION,
            "source": str(self.source.directory.resolve()),
            "source_content": content_fingerprint(self.source.directory),  # names and sizes are not enough
            "settings": settings,
            "max_shard_bytes": self.stream.max_shard_bytes,
        }

    def placeholder_config(self, ranks: list[int]):
        half = self.shape["head_dim"] // 2
        layers = [
            SimpleNamespace(
                kv_lora_rank=r,
                rope_dim=self.rope_dim,
                freq_index=[j % half for j in range(self.rope_dim // 2)],
            )
            for r in ranks
        ]
        return mla_config(self.source.config, self.shape, layers, self.dtype)

    def layout(self, ranks: list[int]) -> tuple[ShardLayout, list[list[str]]]:
        """Output tensors in write order (layer by layer, then embeddings/norm/head), and each layer's names."""
        shapes = model_shapes(self.placeholder_config(ranks))
        per_layer = []
        for i in range(self.n):
            prefix = LAYER_PREFIX.format(i=i)
            attn = sorted(k for k in shapes if k.startswith(prefix + "self_attn."))
            rest = sorted(
                k for k in shapes if k.startswith(prefix) and not k.startswith(prefix + "self_attn.")
            )
            copied = [m for m in self.layer_names[i] if ".self_attn." not in m]
            if sorted(copied) != rest:
                raise ConversionError(
                    f"layer {i}: source tensors {sorted(set(copied) ^ set(rest))[:5]} do not match "
                    f"the MLA model's; is {self.source.spec} a complete checkpoint?"
                )
            per_layer.append(attn + rest)
        glob = sorted(k for k in shapes if not k.startswith("model.layers."))
        if sorted(self.global_names) != glob:
            raise ConversionError(
                f"source tensors {sorted(set(self.global_names) ^ set(glob))[:5]} do not match "
                f"the MLA model's; is {self.source.spec} a complete checkpoint?"
            )
        order = [k for names in per_layer for k in names] + glob
        return ShardLayout(
            [(k, shapes[k], self.dtype) for k in order], self.stream.max_shard_bytes
        ), per_layer


class _Runner:
    """Runs the passes over the layers, committing state after each."""

    def __init__(self, conv: _StreamingConversion, work: WorkDir, state: dict):
        self.c, self.work, self.state = conv, work, state
        src, opts = conv.source, conv.opts
        self.src_layers = SourceLayers(src.config, conv.shape["window"], conv.device)
        self.n_calib = 0 if conv.calib_ids is None else conv.calib_ids.shape[0]
        if self.n_calib:
            self.store = HiddenStore(work.path, self.n_calib, conv.calib_ids.shape[1], src.config.hidden_size)
        self.verify = opts.verify
        if state.get("started"):
            streams = work.load_tensors("verify.pt") if self.verify else {}
            self.verify_src, self.verify_mla = streams.get("source"), streams.get("mla")
        else:
            self._start()

    def _start(self) -> None:
        """Embed the calibration and verification tokens: layer 0's inputs."""
        c = self.c
        emb = c.source.tensor("model.embed_tokens.weight")
        if self.n_calib:
            with self.store.writer(0) as sink:
                for s in range(0, self.n_calib, c.batch_size):
                    sink.write(torch.nn.functional.embedding(c.calib_ids[s : s + c.batch_size], emb).float())
        self.verify_src = self.verify_mla = None
        if self.verify:
            ids = verify_token_ids(c.source.config.vocab_size)
            self.verify_src = emb.float()[ids].to(c.device)
            self.verify_mla = emb.to(c.dtype).float()[ids].to(c.device)
        self.state["started"] = True
        self._commit(None)

    def _commit(self, writer: ShardStreamWriter | None) -> None:
        if writer is not None:
            writer.sync()
            self.state["cursor"] = asdict(writer.cursor)
        if self.verify:
            self.work.save_tensors(
                "verify.pt", {"source": self.verify_src.cpu(), "mla": self.verify_mla.cpu()}
            )
        self.work.commit(self.state)

    def _read_layer(self, i: int) -> dict[str, torch.Tensor]:
        return {name: self.c.source.tensor(name) for name in self.c.layer_names[i]}

    @torch.no_grad()
    def _source_layer(self, i: int, tensors: dict) -> LayerStats | None:
        """Run source layer I over the calibration hidden states (slot i % 2 -> the other slot) and the
        verification stream; returns the statistics of its attention input."""
        c, runner = self.c, self.src_layers
        layer = runner.layer(i, tensors)
        stats = None
        if self.n_calib:
            acc = layer_accumulator(layer.self_attn, runner.inv_freq, c.shape)
            handles = acc.attach()
            slot, last = i % 2, i == c.n - 1
            try:
                with contextlib.nullcontext() if last else self.store.writer(1 - slot) as sink:
                    for s in range(0, self.n_calib, c.batch_size):
                        hidden = self.store.read(slot, s, min(s + c.batch_size, self.n_calib)).to(c.device)
                        acc.with_attention = s < ATTENTION_SAMPLES
                        out = runner.run(layer, hidden)
                        if sink is not None:
                            sink.write(out)
            finally:
                for handle in handles:
                    handle.remove()
            stats = acc.result()
        if self.verify:
            self.verify_src = runner.run(layer, self.verify_src)
        return stats

    def _convert_layer(
        self, i: int, tensors: dict, stats, rank: int, writer, names: list[str], mla_layers
    ) -> dict:
        c = self.c
        w, stats = _on(c.device, read_attention(_Tensors(tensors), i, c.shape), stats)
        with torch.device(c.device) if c.device != "cpu" else contextlib.nullcontext():
            metrics = layer_metrics(w, stats) if stats is not None else None
            mla = compress_layer(w, metrics, c.method, c.rope_dim, rank)
        del w, stats, metrics  # the float64 statistics are done with before the layer is written
        out = mla_layer_tensors(i, mla, c.dtype, q_bias=c.shape["qkv_bias"], kv_a_bias=c.shape["qkv_bias"])
        out.update({m: tensors[m].to(c.dtype) for m in names if m not in out})
        for name in names:
            writer.write(name, out[name])
        if self.verify:
            mla_layers.config.rope_freq_index[i] = list(mla.freq_index)
            self.verify_mla = mla_layers.run(mla_layers.layer(i, out), self.verify_mla)
        return {
            "layer": i,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_rope_head_dim": mla.rope_dim,
            "rope_freq_index": list(mla.freq_index),
        }

    def _progress(self, desc: str, done: int):
        return tqdm(
            total=self.c.n,
            initial=done,
            desc=desc,
            unit="layer",
            disable=self.c.opts.quiet,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def statistics_pass(self) -> None:
        """Planned and fisher allocation, pass 1: every layer's statistics (spilled) and error curve,
        and for fisher the inputs of the sensitivity sequences."""
        c, st = self.c, self.state
        with self._progress("layer statistics", st.setdefault("stats_done", 0)) as bar:
            for i in range(st["stats_done"], c.n):
                tensors = self._read_layer(i)
                if c.n_sensitivity:
                    kept = self.store.read(i % 2, 0, c.n_sensitivity)
                    self.work.save_tensors(f"sens-{i:05d}.pt", {"hidden": kept})
                stats = self._source_layer(i, tensors)
                w, dev_stats = _on(c.device, read_attention(_Tensors(tensors), i, c.shape), stats)
                with torch.device(c.device) if c.device != "cpu" else contextlib.nullcontext():
                    error = error_curve(w, layer_metrics(w, dev_stats), c.method, c.rope_dim).cpu()
                self.work.save_tensors(
                    f"stats-{i:05d}.pt",
                    {
                        "sigma": stats.sigma,
                        "lag_p2": stats.lag_p2,
                        "inv_freq": stats.inv_freq,
                        "tokens": torch.tensor(stats.tokens),
                        "error": error,
                    },
                )
                del tensors, stats, w, dev_stats, error
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
                probe = layer_accumulator(layer.self_attn, runner.inv_freq, c.shape)
                handle = layer.self_attn.register_forward_hook(probe.probe_gradient)
                try:
                    kept = self.work.load_tensors(f"sens-{i:05d}.pt")["hidden"].to(c.device)
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
        """Planned and fisher allocation: the ranks, from the spilled error curves."""
        c, st = self.c, self.state
        errors = [self.work.load_tensors(f"stats-{i:05d}.pt")["error"] for i in range(c.n)]
        try:
            st["ranks"] = ranks_from_curves(errors, st.get("sensitivity", [None] * c.n), c.opts.allocation,
                                            c.uniform, c.rank_budget)
        except ValueError as exc:
            raise ConversionError(str(exc)) from exc
        self._commit(None)

    def convert_pass(self) -> None:
        c, st = self.c, self.state
        ranks = st["ranks"]
        layout, per_layer = c.layout(ranks)
        mla_layers = MLALayers(c.placeholder_config(ranks), c.device) if self.verify else None
        if mla_layers is not None:
            for rec in st["layers"]:
                mla_layers.config.rope_freq_index[rec["layer"]] = rec["rope_freq_index"]
        writer = ShardStreamWriter(layout, self.work.path, Cursor(**st["cursor"]) if "cursor" in st else None)
        try:
            with self._progress("converting layers", len(st["layers"])) as bar:
                for i in range(len(st["layers"]), c.n):
                    tick = time.time()
                    tensors = self._read_layer(i)
                    if c.two_pass:
                        spilled = self.work.load_tensors(f"stats-{i:05d}.pt")
                        stats = LayerStats(
                            spilled["sigma"], spilled["lag_p2"], spilled["inv_freq"], int(spilled["tokens"])
                        )
                    else:
                        stats = self._source_layer(i, tensors)
                    st["layers"].append(
                        self._convert_layer(i, tensors, stats, ranks[i], writer, per_layer[i], mla_layers)
                    )
                    del tensors, stats
                    st.setdefault("layer_seconds", []).append(round(time.time() - tick, 2))
                    self._commit(writer)
                    log.info("layer %d/%d converted in %.1f s", i + 1, c.n, time.time() - tick)
                    bar.update()
            for name in layout.entries[writer.cursor.tensor :]:
                writer.write(name[0], c.source.tensor(name[0]).to(c.dtype))
            writer.finish()
        finally:
            writer.close()

    def verify_report(self) -> dict:
        c = self.c
        want_in = c.norm_and_head()
        got_in = {k: v.to(c.dtype) for k, v in want_in.items()}
        mla_layers = MLALayers(c.placeholder_config(self.state["ranks"]), c.device)
        want = self.src_layers.logits(self.verify_src, want_in, "head")
        got = mla_layers.logits(self.verify_mla, got_in, "head")
        return logit_report(got, want) | {"method": "layer-wise"}


def convert_streaming(
    src: str,
    out: str | Path,
    opts: ConvertOptions | None = None,
    stream: StreamOptions | None = None,
    recipe=None,
) -> dict:
    """Convert SRC (a directory of safetensors shards) into an MLA checkpoint at OUT, layer by layer.

    Same output as ``pipeline.convert``; see the module docstring for memory and resume."""
    try:
        opts = resolve_allocation(fit_target(opts or ConvertOptions()), streaming=True)
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc
    stream = stream or StreamOptions()
    check_calibration(opts)
    torch.manual_seed(opts.seed)
    start = time.time()
    check_output(out, opts.overwrite, local_paths(src))  # before the source is resolved (a hub id downloads)
    kind, src_path = resolve_source(src)
    if kind != "dir" or not any(Path(src_path).glob("*.safetensors")):
        raise ConversionError(
            f"{src} is not a directory of *.safetensors files, so it cannot be read layer by "
            f"layer; use --pipeline in-memory (GGUF and pickle checkpoints load whole)"
        )
    with claim_output(out, opts.overwrite, sources=[src_path]) as claim:
        return _convert_streaming(claim, src, opts, stream, recipe, start)


def _convert_streaming(claim, src: str, opts: ConvertOptions, stream: StreamOptions, recipe, start: float) -> dict:
    out_path = claim.out
    source = open_source(src)
    conv = _StreamingConversion(source, opts, stream)
    opts = conv.opts
    work = WorkDir(work_dir_for(out_path))
    state = open_work_dir(work, conv.fingerprint(), stream.resume)
    resumed_from = len(state["layers"])
    if conv.ranks is not None:
        state.setdefault("ranks", conv.ranks)
    try:
        runner = _Runner(conv, work, state)
        phases = {"open": round(time.time() - start, 2)}  # this process's seconds per phase (a resumed run skips some)

        def timed(name, fn):
            tick = time.time()
            out = fn()
            phases[name] = round(time.time() - tick, 2)
            return out

        if conv.two_pass and "ranks" not in state:
            timed("statistics", runner.statistics_pass)
            if conv.n_sensitivity and "sensitivity" not in state:
                timed("sensitivity_sweep", runner.sensitivity_sweep)
            runner.plan()
        timed("convert", runner.convert_pass)
        verify = timed("verify", runner.verify_report) if opts.verify else None
    except BaseException as exc:
        # a damaged source (non-finite or unreadable tensor) must be replaced, and a resume from another
        # source is refused: the finished layers are worth nothing
        damaged = isinstance(exc, SourceError)
        if damaged or (not state.get("layers") and not state.get("stats_done") and not stream.resume):
            shutil.rmtree(work.path, ignore_errors=True)
        else:
            log.warning(
                "conversion interrupted; %s keeps the finished layers: rerun with --resume to continue",
                work.path,
            )
        raise
    layers = [
        SimpleNamespace(
            kv_lora_rank=r["kv_lora_rank"], rope_dim=r["qk_rope_head_dim"], freq_index=r["rope_freq_index"]
        )
        for r in state["layers"]
    ]
    config = mla_config(source.config, conv.shape, layers, conv.dtype)
    config.auto_map = dict(AUTO_MAP)
    written = {}  # strict transfer, checked on the written shard headers (no weight is read back)
    for f in work.path.glob("*.safetensors"):
        written.update({k: torch.empty(v["shape"], device="meta") for k, v in read_header(f).items()})
    check_shapes(config, written)
    shape = conv.shape
    plan = conv.plan_report | ({"ranks": state["ranks"]} if opts.kv_budget is not None else {})
    report = {
        "source": str(src),
        "source_architecture": shape["family"],
        "settings": asdict(opts) | {"dtype": str(conv.dtype).replace("torch.", "")},
        "source_kv_values_per_token_per_layer": 2 * shape["num_kv_heads"] * shape["head_dim"],
        "plan": plan,
        "layers": [
            {
                "layer": r["layer"],
                "kv_lora_rank": r["kv_lora_rank"],
                "qk_rope_head_dim": r["qk_rope_head_dim"],
                "rope_freq_index": r["rope_freq_index"],
            }
            for r in state["layers"]
        ],
        "pipeline": {
            "name": "streaming",
            "calibration_batch": conv.batch_size,
            "resumed_from_layer": resumed_from,
            "layer_seconds": state.get("layer_seconds", []),
            "phase_seconds": phases,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        },
    }
    report["kv_values_per_token"] = sum(r["kv_lora_rank"] + r["qk_rope_head_dim"] for r in state["layers"])
    report["source_kv_values_per_token"] = report["source_kv_values_per_token_per_layer"] * len(layers)
    tmp = work.path
    config.to_json_file(str(tmp / "config.json"), use_diff=False)
    write_modeling_code(tmp)
    (tmp / "recipe.yaml").write_text(effective_recipe(opts, recipe).to_yaml())
    _write_tokenizer_files(source, config, tmp)
    if verify is not None:
        report["verify"] = verify
    report["seconds"] = round(time.time() - start, 2)
    write_json(tmp / "conversion.json", report)
    work.remove_resume_files()
    try:
        claim.publish(tmp)
    except OutputExistsError as exc:  # the finished checkpoint is kept: it cost a whole conversion
        raise OutputExistsError(f"{exc}. The finished checkpoint is in {tmp}; move it where you want it") from exc
    log.info("wrote %s in %.1f s", out_path, time.time() - start)
    return report


PIPELINES = ("auto", "streaming", "in-memory")


def choose_pipeline(src: str, pipeline: str = "auto") -> str:
    """'streaming' or 'in-memory' for SRC: auto streams local/hub directories of safetensors shards
    (read lazily) and loads GGUF files and pickles whole (they have no lazy reader)."""
    from .source import resolve_source

    if pipeline not in PIPELINES:
        raise ConversionError(f"--pipeline {pipeline!r} is not one of {', '.join(PIPELINES)}")
    if pipeline != "auto":
        return pipeline
    kind, path = resolve_source(src)
    return "streaming" if kind == "dir" and any(Path(path).glob("*.safetensors")) else "in-memory"


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; anything else is checked and kept."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise ConversionError(f"--device {device!r} is not one of cpu, cuda, cuda:N, auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConversionError(
            f"--device {device} was asked for but no CUDA device is visible; use --device cpu or auto"
        )
    return device


def run_conversion(
    src: str,
    out: str | Path,
    opts: ConvertOptions,
    pipeline: str = "auto",
    stream: StreamOptions | None = None,
    recipe=None,
) -> dict:
    """The conversion the CLI runs: the streaming or the in-memory pipeline (see ``choose_pipeline``)."""
    from .pipeline import convert

    stream = stream or StreamOptions()
    chosen = choose_pipeline(src, pipeline)
    if chosen == "in-memory":
        if stream.resume or stream.max_memory is not None:
            flag = "--resume" if stream.resume else "--max-memory"
            why = (
                "was asked for"
                if pipeline == "in-memory"
                else f"was chosen because {src} is not a directory of safetensors"
            )
            raise ConversionError(
                f"{flag} needs the streaming pipeline, but the in-memory one {why}; "
                f"drop {flag}, or pass a model directory with *.safetensors and --pipeline streaming"
            )
        log.info("in-memory pipeline for %s", src)
        return convert(src, out, opts, recipe=recipe)
    return convert_streaming(src, out, opts, stream, recipe=recipe)
