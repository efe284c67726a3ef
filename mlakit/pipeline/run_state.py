"""Everything one conversion fixes before its first layer runs: settings, ranks, tensor layout.

``ConversionSetup`` resolves the options against the source (ranks or the budget layout, the
method, dtype, calibration ids and batch), lists each layer's tensors and the output layout,
and says what a work directory must match to be resumed. It reads no layer weight.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace

import torch

from ..arch import names
from ..arch.families import attention_shape
from ..choices import MEASURED_ROPE_DIMS, REFINE_FIXED_INPUTS
from ..convert.assemble import check_source_tensors, mla_config, model_shapes
from ..convert.calibration import BATCH_SIZE, LOGIT_ROWS, LayerStats, attention_sequences
from ..convert.engine_target import check_target_shape
from ..convert.mla_layer import AttentionWeights
from ..convert.rank_plan import budget_layout, equal_share_ranks, uniform_ranks
from ..convert.rope_choice import rope_candidates
from ..io.fingerprint import content_fingerprint
from ..io.shard_stream import ShardLayout
from .settings import (
    VALUE_REFITS,
    ConversionError,
    budget_values,
    calibration_ids,
    check_ranks,
    fixed_rope_dim,
    method_of,
    needs_calibration,
    refine_settings,
    resolve_dtype,
    resolve_lowrank,
    sensitivity_sequences,
)
from .stream_memory import (
    REFIT_WORK_SHARE,
    check_values_refit,
    choose_batch_size,
    estimate_sweep_bytes,
    values_refit_work,
)

log = logging.getLogger(__name__)

__all__ = ["STATE_VERSION", "ConversionSetup", "LayerRecord", "StreamOptions", "TensorDict", "on_device"]

STATE_VERSION = 10  # 2: spilled curves, not their log; 3: source content hashed; 4: every source kind;
# 5: layer metrics spilled, not the statistics; 6: hidden states in the work directory's STORE_DTYPE;
# 7: dropped rotary components read by phase-averaged queries (the spilled plans and grams change);
# 8: spilled plans and curves keyed by their d_R (--rope-dim measured spills one per candidate);
# 9: --rope-dim measured also measures each candidate on the shuffled sequences; 10: a measured d_R per layer


@dataclass
class StreamOptions:
    """How the layer-wise driver runs (not what it computes; none of it is in a recipe)."""

    resume: bool = False  # continue the work directory an interrupted run left beside OUT
    max_memory: int | None = None  # host RAM budget in bytes: sets the calibration batch, or refuses
    batch_size: int = BATCH_SIZE  # calibration sequences per forward (at most; --max-memory may lower it)
    max_shard_bytes: int = 2 * 1024**3
    # sequential calibration: layer i's statistics are taken on the hidden states the converted
    # layers 0..i-1 produce (a second hidden-state stream beside the source's), so each layer is
    # fitted to the inputs it will see in the converted model
    sequential: bool = False


@dataclass
class LayerRecord:
    """One converted layer's shape in the report and the config (what ``mla_config`` reads)."""

    kv_lora_rank: int
    rope_dim: int
    freq_index: list[int] = field(default_factory=list)


class TensorDict:
    """A name -> tensor dict that reads like a Source (for ``read_attention``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._t = tensors

    def tensor(self, name: str) -> torch.Tensor:
        return self._t[name]


def on_device(device: str, w: AttentionWeights, stats: LayerStats | None):
    """W and STATS moved to DEVICE for the float64 per-layer math (unchanged on the CPU)."""
    if device == "cpu":
        return w, stats
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(w).items()}
    w = AttentionWeights(**fields)
    if stats is not None:
        stats = LayerStats(stats.sigma.to(device), stats.lag_p2.to(device), stats.inv_freq.to(device), stats.tokens,
                           stats.sensitivity)
    return w, stats


def _concrete_inputs(opts):
    """OPTS with ``--refine-inputs auto`` made what its refinement reads (unchanged for --refine none)."""
    if opts.refine == "none" or opts.refine_inputs != "auto":
        return opts
    return replace(opts, refine_inputs=REFINE_FIXED_INPUTS.get(opts.refine, "converted"))


class ConversionSetup:
    """The resolved settings of converting SOURCE with OPTS (see the module docstring)."""

    def _resolve_refine(self, opts, shape, stream: StreamOptions):
        """OPTS with ``--refine auto`` made concrete, and a value refit asked for by name checked before any
        work. The joint refit (values) solves over every head's latent at once, so its memory grows with
        (heads x rank)^2 and its work with the cube; values-per-head fits head by head, then o_proj. auto is
        values where the conversion compresses (a lossless one has nothing to refit), its solve fits the
        memory and its arithmetic stays within ``REFIT_WORK_SHARE`` of the layer's forward; else
        values-per-head on the same terms; else none. Each step down is logged, and the saved recipe and
        report name the refit that ran."""
        if opts.refine not in ("auto", *VALUE_REFITS):
            return _concrete_inputs(opts)
        if opts.refine == "auto" and not self.calibrated:
            return replace(opts, refine="none", refine_inputs="auto")
        # a plan's ranks average the uniform ones: at least this; a measured d_R may be the least candidate
        rank = max(self.ranks or self.layout_at(min(self.rope_candidates))[2])
        reasons = []
        for method in VALUE_REFITS if opts.refine == "auto" else (opts.refine,):
            bound = REFINE_FIXED_INPUTS.get(method)
            if opts.refine == "auto" and opts.refine_inputs not in ("auto", bound or opts.refine_inputs):
                reasons.append(f"--refine {method} reads the {bound} stream, and --refine-inputs "
                               f"{opts.refine_inputs} was asked for.")
                continue
            try:
                check_values_refit(shape, rank, stream.max_memory, method)
            except ValueError as exc:
                if opts.refine != "auto":
                    raise ConversionError(str(exc)) from exc
                reasons.append(str(exc))
                continue
            chosen = _concrete_inputs(replace(opts, refine=method))
            refit_tokens = refine_settings(chosen).used(opts.calib_samples) * opts.calib_seq_len
            work = values_refit_work(self.source.config, shape, rank, max(self.rope_dims),
                                     opts.calib_seq_len, opts.calib_samples * opts.calib_seq_len, refit_tokens, method)
            if opts.refine == "auto" and work > REFIT_WORK_SHARE:
                reasons.append(f"--refine {method} over {shape.num_heads} heads at kv_lora_rank {rank} would take about "
                               f"{work:.1f}x a layer's forward arithmetic over the calibration (the default allows "
                               f"{REFIT_WORK_SHARE:g}x); asked for by name, it runs anyway.")
                continue
            if reasons:
                log.info("--refine auto: %s. %s", method, " ".join(reasons))
            return chosen
        log.info("--refine auto: no value refit, the closed form only. %s", " ".join(reasons))
        return replace(opts, refine="none", refine_inputs="auto")

    def __init__(self, source, opts, stream: StreamOptions):
        self.source, self.stream = source, stream
        cfg = source.config
        self.shape = shape = attention_shape(cfg)
        check_target_shape(opts, shape)
        check_ranks(opts if opts.kv_budget is None else _full_ranks(opts), shape)  # fail early
        self.n = n = cfg.num_hidden_layers
        check_source_tensors(source)
        self.dtype = resolve_dtype(opts.dtype, cfg)
        self.device = opts.device
        self.two_pass = False  # planned or fisher: every layer's statistics before any rank
        self.plan_report: dict = {}
        if opts.kv_budget is not None:
            self.budget = budget = budget_values(opts, shape, n)
            rope_dim, self.rank_budget, self.uniform = self.layout_at(fixed_rope_dim(opts), opts.stock_rope)
            self.two_pass = opts.allocation in ("planned", "fisher")
            self.ranks = None if self.two_pass else self.uniform
            self.plan_report = {"allocation": opts.allocation, "rope_dim": rope_dim,
                                "budget_values_per_token": budget}
            # the d_R the statistics pass measures (one: it is given), and the default's
            self.rope_candidates, self.reference_rope = [rope_dim], rope_dim
            if opts.rope_dim in MEASURED_ROPE_DIMS:
                if not self.two_pass:
                    raise ConversionError(f"--rope-dim {opts.rope_dim} is chosen once every layer has been measured, "
                                          f"in a two-pass plan; --allocation {opts.allocation} converts each layer "
                                          f"as it goes: use --allocation fisher or planned, or give --rope-dim")
                self.rope_candidates = rope_candidates(shape.num_kv_heads, shape.head_dim, budget // n, rope_dim)
        else:
            rank, rope_dim = check_ranks(opts, shape)
            self.ranks = [rank] * n
            self.rope_candidates = [rope_dim]
        self.rope_dims = [rope_dim] * n  # each layer's d_R (a measured one is chosen after the statistics pass)
        self.rope_per_layer = opts.rope_dim == "measured-per-layer"
        self.calibrated = needs_calibration(opts, shape)
        self.opts = opts = self._resolve_refine(opts, shape, stream)
        # after the refit is known (auto's latent depends on it); the report and the saved recipe name the method used
        self.opts = opts = resolve_lowrank(opts, shape)
        self.method = method_of(opts, shape)
        self.refine = refine_settings(opts)  # None: no layer-wise refinement
        self.calib_ids = calibration_ids(source, opts, cfg.vocab_size) if self.calibrated else None
        # sequences whose layer inputs the fisher backward sweep keeps (0: no sweep)
        self.n_sensitivity = sensitivity_sequences(opts, self.calib_ids.shape[0]) if self.calibrated else 0
        self.n_attention = attention_sequences(opts.calib_seq_len)  # sequences that measure the attention lag profile
        self.batch_size = stream.batch_size
        if self.calibrated:
            sweep = None
            if self.n_sensitivity:
                sweep = estimate_sweep_bytes(cfg, shape, opts.calib_seq_len, self.n_sensitivity, LOGIT_ROWS,
                                             opts.device)
            try:
                self.batch_size = choose_batch_size(cfg, shape, opts.calib_seq_len, stream.batch_size,
                                                    stream.max_memory, opts.device, sweep)
            except ValueError as exc:
                raise ConversionError(str(exc)) from exc
        present = source.tensor_names()
        self.layer_names = [
            [m for m in present if m.startswith(names.layer_prefix(i)) and not names.is_ignored_buffer(m)]
            for i in range(n)
        ]
        in_layers = {m for ns in self.layer_names for m in ns}
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.global_names = [
            m for m in present
            if m not in in_layers and not names.is_ignored_buffer(m) and not names.is_dropped_head(m, self.tied)
        ]
        self.head_name = names.head_weight(present, self.tied)

    def layout_at(self, rope_dim: int | None, stock: bool = False) -> tuple[int, int, list[int]]:
        """The budget at shared ROPE_DIM (None: the default share; STOCK: a stock-rope d_R): (d_R, the
        latent budget over all layers, the uniform ranks)."""
        G, d = self.shape.num_kv_heads, self.shape.head_dim
        try:
            rope_dim, rank_budget = budget_layout(self.n, G, d, self.budget, rope_dim, stock)
        except ValueError as exc:
            raise ConversionError(str(exc)) from exc
        return rope_dim, rank_budget, uniform_ranks(self.n, G, d, rope_dim, rank_budget)

    def use_rope_dims(self, rope_dims: list[int], report: dict) -> None:
        """Convert layer i with ROPE_DIMS[i], the candidates the statistics pass chose (a measured --rope-dim:
        one shared, or one per layer) by the errors in REPORT, which goes into the plan report (``rope_search``:
        d_R -> summed held-out error per validation fold, then on the shuffled sequences; with d_R per layer also
        ``rope_layer_search``, each layer's). With d_R per layer every layer keeps the same share of the budget
        before the allocation moves ranks (``rank_plan.equal_share_ranks``), the share each candidate was
        measured at."""
        if len(rope_dims) != self.n or not set(rope_dims) <= set(self.rope_candidates):
            raise ConversionError(f"d_R {rope_dims} were not measured ({self.n} layers, candidates "
                                  f"{self.rope_candidates}); the work directory does not match this conversion: "
                                  f"start it afresh")
        G, d = self.shape.num_kv_heads, self.shape.head_dim
        self.rope_dims = list(rope_dims)
        self.rank_budget = self.budget - sum(rope_dims)
        self.uniform = equal_share_ranks(G, d, self.budget, self.rope_dims)
        shared = rope_dims[0] if not self.rope_per_layer else list(rope_dims)
        self.plan_report |= {"rope_dim": shared} | report

    def norm_and_head(self) -> dict[str, torch.Tensor]:
        """The source's final norm weight and LM head (key ``head``), as ``SourceLayers.head`` reads them."""
        return {names.FINAL_NORM: self.source.tensor(names.FINAL_NORM), "head": self.source.tensor(self.head_name)}

    def fingerprint(self) -> dict:
        """What must match for a work directory to be resumed."""
        settings = {k: v for k, v in asdict(self.opts).items() if k not in ("device", "overwrite", "quiet")}
        path = self.source.gguf_file or self.source.directory
        return {
            "version": STATE_VERSION,
            "source": str(path.resolve()),
            "source_content": content_fingerprint(path),  # names and sizes are not enough
            "settings": settings,
            "max_shard_bytes": self.stream.max_shard_bytes,
            "sequential": self.stream.sequential,
        }

    def placeholder_config(self, ranks: list[int], rope_dim: int | None = None):
        """The MLA config of RANKS at d_R ROPE_DIM in every layer (default: each layer's, ``rope_dims``) with the
        rope frequencies still unknown (they fix no tensor shape)."""
        half = self.shape.head_dim // 2
        dims = self.rope_dims if rope_dim is None else [rope_dim] * self.n
        layers = [LayerRecord(r, d, [j % half for j in range(d // 2)]) for r, d in zip(ranks, dims)]
        return mla_config(self.source.config, self.shape, layers, self.dtype)

    def layout(self, ranks: list[int]) -> tuple[ShardLayout, list[list[str]]]:
        """Output tensors in write order (layer by layer, then embeddings/norm/head), and each layer's names."""
        shapes = model_shapes(self.placeholder_config(ranks))
        per_layer = []
        for i in range(self.n):
            prefix, attn_prefix = names.layer_prefix(i), names.attn_prefix(i)
            attn = sorted(k for k in shapes if k.startswith(attn_prefix))
            rest = sorted(k for k in shapes if k.startswith(prefix) and not k.startswith(attn_prefix))
            copied = [m for m in self.layer_names[i] if not m.startswith(attn_prefix)]
            if sorted(copied) != rest:
                raise ConversionError(
                    f"layer {i}: source tensors {sorted(set(copied) ^ set(rest))[:5]} do not match "
                    f"the MLA model's; is {self.source.spec} a complete checkpoint?"
                )
            per_layer.append(attn + rest)
        glob = sorted(k for k in shapes if not k.startswith(names.LAYERS_PREFIX))
        if sorted(self.global_names) != glob:
            raise ConversionError(
                f"source tensors {sorted(set(self.global_names) ^ set(glob))[:5]} do not match "
                f"the MLA model's; is {self.source.spec} a complete checkpoint?"
            )
        order = [k for names in per_layer for k in names] + glob
        return ShardLayout([(k, shapes[k], self.dtype) for k in order], self.stream.max_shard_bytes), per_layer


def _full_ranks(opts):
    from dataclasses import replace

    return replace(opts, kv_lora_rank="full")
