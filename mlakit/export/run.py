"""Export orchestration: read a native mlakit checkpoint, map it (``deepseek_v3.py``), write the
stock checkpoint atomically with tokenizer files and an export report, and verify it.

All disk reads and writes of an export live here."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..arch import names
from ..convert.engine_target import fit_target
from ..export_options import EXPORT_FORMATS, ExportOptions
from ..io.output_dir import check_output, claim_output, local_paths
from ..io.shard_stream import dtype_of_code, read_header
from ..io.source import TOKENIZER_FILES, resolve_source
from ..io.writer import write_json
from .deepseek_v3 import check_dtype, layer_tensors, legacy_rope_fields, plan_export, stock_config
from .engine_rules import (
    ExportError,
    check_source_for_export,
    check_window,
    engine_readme,
    target_refusal,
    vllm_problems,
)
from .verify import verify_export

__all__ = ["FORMATS", "ExportOptions", "convert_to_format", "export", "read_native"]

log = logging.getLogger(__name__)

FORMATS = ("native", *EXPORT_FORMATS)  # what `convert --format` writes
_PROVENANCE = ("conversion.json", "recipe.yaml")


class _Shards:
    """The safetensors files of a checkpoint DIRECTORY as a lazy name -> float64 tensor reader."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        self._where = {}
        for path in sorted(self.directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                self._where.update(dict.fromkeys(f.keys(), path))
        if not self._where:
            raise ExportError(f"{self.directory} has no .safetensors weights")

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise ExportError(f"{self.directory}: tensor {name} is missing; re-run `mla-convert convert`")
        with safe_open(str(self._where[name]), framework="pt") as f:
            return f.get_tensor(name).double()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with PREFIX (a layer's, the final norm's)."""
        return {name: self.tensor(name) for name in self._where if name.startswith(prefix)}


class _Native(_Shards):
    """A native checkpoint directory: its MLAConfig and its tensors."""

    def __init__(self, directory: Path):
        from ..mla_model.configuration_mla import MLAConfig

        directory = Path(directory)
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            raise ExportError(f"{directory} has no config.json; pass the directory `mla-convert convert` wrote")
        model_type = json.loads(cfg_path.read_text()).get("model_type")
        if model_type != MLAConfig.model_type:
            raise ExportError(
                f"{directory} holds model_type {model_type!r}, not a native mlakit checkpoint "
                f"({MLAConfig.model_type!r}); convert it first with `mla-convert convert`"
            )
        self.config = MLAConfig.from_pretrained(str(directory))
        super().__init__(directory)
        # the dtype the conversion stored, from the embedding file's header (not its data)
        self.dtype = dtype_of_code(read_header(self._where[names.EMBED])[names.EMBED]["dtype"])


def read_native(directory) -> _Native:
    return _Native(Path(directory))


_LAYER_NAMES = tuple(names.attn(m) for m in names.MLA_ATTN_PROJ) + tuple(names.mlp(m) for m in names.MLP_PROJ)
_LAYER_BIASES = tuple(names.attn(m, "bias") for m in (names.Q_PROJ, names.KV_A_PROJ, names.O_PROJ))


def stock_layer(native: _Native, plan, dtype, i: int) -> tuple[dict, dict]:
    """Decoder layer I's stock tensors, and its facts with the biases the plan drops {name: max |b|}
    (public so that a test can watch when each layer is made)."""
    cfg, p = native.config, names.layer_prefix(i)
    dropped = {}
    t = {k: native.tensor(p + k) for k in _LAYER_NAMES}
    for k in _LAYER_BIASES:
        if native.has(p + k):
            t[k] = native.tensor(p + k)
            if not plan.keep_biases:
                dropped[p + k] = float(t[k].abs().max())
    norm_in = native.tensor(p + names.norm(names.INPUT_NORM))
    layer, fact = layer_tensors(plan, t, cfg.rope_freq_index[i], norm_in, p)
    layer[p + names.norm(names.INPUT_NORM)] = norm_in
    layer[p + names.norm(names.POST_ATTN_NORM)] = native.tensor(p + names.norm(names.POST_ATTN_NORM))
    return {k: v.to(dtype).contiguous() for k, v in layer.items()}, {"layer": i, "dropped": dropped} | fact


def _stock_globals(native: _Native, plan, dtype) -> dict:
    embed = native.tensor(names.EMBED)
    head = native.tensor(names.LM_HEAD) if native.has(names.LM_HEAD) else embed
    return {
        names.EMBED: (embed * plan.residual).to(dtype),
        names.LM_HEAD: head.to(dtype).contiguous(),  # untied: the final norm undoes the residual scale
        names.FINAL_NORM: native.tensor(names.FINAL_NORM).to(dtype),
    }


def _write_stock(native: _Native, plan, dtype, directory: Path) -> tuple[list[dict], dict]:
    """Write the stock state dict into DIRECTORY as sharded safetensors, one decoder layer in memory at a
    time; returns (per-layer facts, dropped biases {name: max |b|}).

    The shard layout is fixed before the first byte (``ShardLayout``): every layer's names and shapes
    are layer 0's under its own prefix, since the stock format has one rank and one rope dim in every
    layer (the shard writer refuses a tensor that differs). The tensors go out in sorted-name order, as
    ``save_state_dict`` writes a whole state dict, so the files are the same bytes."""
    from ..io.shard_stream import ShardLayout, ShardStreamWriter

    n_layers = native.config.num_hidden_layers
    facts = {}
    pending = _stock_globals(native, plan, dtype)  # tensors made and not yet written
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in pending.items()}
    layer, facts[0] = stock_layer(native, plan, dtype, 0)
    pending.update(layer)
    prefix0 = names.layer_prefix(0)
    for i in range(n_layers):
        p = names.layer_prefix(i)
        shapes.update({p + k[len(prefix0):]: (tuple(v.shape), v.dtype) for k, v in layer.items()})
    del layer  # layer 0's tensors stay in PENDING only until written
    order = sorted(shapes)
    writer = ShardStreamWriter(ShardLayout([(n, *shapes[n]) for n in order]), directory)
    try:
        for name in order:
            if name not in pending:  # the first name of a layer not made yet: sorted, a layer's names are adjacent
                i = int(name[len(names.LAYERS_PREFIX):].split(".", 1)[0])
                layer, facts[i] = stock_layer(native, plan, dtype, i)
                pending.update(layer)
            writer.write(name, pending.pop(name))
        writer.finish()
    finally:
        writer.close()
    in_order = [facts[i] for i in range(n_layers)]
    dropped = {name: size for fact in in_order for name, size in fact.pop("dropped").items()}
    return in_order, dropped


def _copy_side_files(native_dir: Path, dest: Path) -> list[str]:
    copied = []
    for name in (*TOKENIZER_FILES, *_PROVENANCE):
        src = native_dir / name
        if src.is_file():
            shutil.copy2(src, dest / ("native_" + name if name in _PROVENANCE else name))
            copied.append(name)
    return copied


def export(native_dir, dest, opts: ExportOptions | None = None) -> dict:
    """Export the native checkpoint NATIVE_DIR as OPTS.format at DEST; returns the export report.

    OPTS were validated when they were made (``mlakit.export_options``), before anything is read here."""
    opts = opts or ExportOptions()
    with claim_output(dest, opts.overwrite, sources=[native_dir]) as claim:
        return _export_into(claim, Path(native_dir), opts)


def _export_into(claim, native_dir: Path, opts: ExportOptions) -> dict:
    start = time.time()
    native = read_native(native_dir)
    cfg = native.config
    dtype = check_dtype(opts.dtype, native.dtype)
    max_positions = check_window(cfg.attention_window, cfg.max_position_embeddings, opts.clip_context)
    plan, rope = plan_export(cfg, opts.biases, opts.rope_scaling, max_positions)
    problems = vllm_problems(plan.rank, plan.rope_dim, rope, plan.keep_biases)
    if opts.target == "vllm" and problems:
        raise ExportError(target_refusal(problems))
    fields = stock_config(cfg, plan, rope, max_positions, dtype)
    from transformers import DeepseekV3Config, GenerationConfig

    config = DeepseekV3Config(**fields)
    report = {
        "format": "deepseek-v3",
        "native": str(native_dir),
        "settings": asdict(opts) | {"dtype": str(dtype).replace("torch.", "")},
        "checks": {
            "uniform_kv_lora_rank": plan.rank,
            "uniform_qk_rope_head_dim": plan.rope_dim,
            "rope": {
                "source_table_stride": plan.stride,
                "stock_rope_parameters": rope,
                "kept_source_frequencies": [plan.stride * s for s in range(plan.rope_dim // 2)],
                "rope_interleave": True,
            },
            "softmax_scale": {"native": cfg.softmax_scale, "q_prescale": plan.q_scale},
            "rms_norm_eps": {"source": cfg.rms_norm_eps, "pinned": plan.eps, "residual_scale": plan.residual},
            "biases": {"present": plan.present_biases, "policy": opts.biases, "dropped_max_abs": {}},
            "sliding_window": {"native": cfg.attention_window, "max_position_embeddings": max_positions},
            "dtype": str(dtype).replace("torch.", ""),
        },
        "engines": {
            "transformers": "exact: stock DeepseekV3ForCausalLM, no remote code (transformers 4.x and 5.x)",
            "vllm": {"serves_exactly": not problems, "problems": problems},
        },
    }
    with claim.staging() as tmp:
        report["layers"], report["checks"]["biases"]["dropped_max_abs"] = _write_stock(native, plan, dtype, tmp)
        config.save_pretrained(str(tmp))
        _add_legacy_rope(tmp / "config.json", rope)
        if problems:
            (tmp / "README.md").write_text(engine_readme(problems))
        report["copied"] = _copy_side_files(native_dir, tmp)
        if not (tmp / "generation_config.json").is_file():
            GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        if opts.verify:
            report["verify"] = verify_export(native, _Shards(tmp), max_positions)
        report["seconds"] = round(time.time() - start, 2)
        write_json(tmp / "export.json", report)
    if problems:
        log.warning(
            "%s loads exactly in transformers, but vLLM would refuse or misread it: %s",
            claim.out,
            "; ".join(problems),
        )
    log.info("exported %s to %s in %.1f s", native_dir, claim.out, time.time() - start)
    return report


def _add_legacy_rope(path: Path, rope: dict) -> None:
    """Write the legacy rope fields transformers 4.x reads into the config.json 5.x wrote without them."""
    cfg = json.loads(path.read_text())
    cfg.update(legacy_rope_fields(rope))
    write_json(path, cfg)


def convert_to_format(
    fmt: str, src: str, out, convert_opts, recipe=None, export_opts: ExportOptions | None = None,
    pipeline: str = "auto", stream=None,
):
    """`convert --format`: native writes OUT directly; deepseek-v3 converts into a temporary native
    checkpoint beside OUT (through PIPELINE with STREAM's options, as ``run_conversion``: a directory of
    safetensors streams by default), exports it to OUT one layer at a time and removes the temporary one."""
    from ..pipeline.api import ConversionError, run_conversion

    if fmt not in FORMATS:
        raise ConversionError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "native":
        return run_conversion(src, out, convert_opts, pipeline, stream, recipe=recipe)
    check_output(out, convert_opts.overwrite, local_paths(src))
    if convert_opts.dtype in ("float16", "fp16"):
        check_dtype(convert_opts.dtype, torch.float16)
    try:  # one rank in every layer, stock-form rope (a caller's explicit per-layer allocation is refused)
        convert_opts = fit_target(convert_opts, stock_export=True)
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc
    export_opts = export_opts or ExportOptions(overwrite=convert_opts.overwrite, verify=convert_opts.verify)
    export_opts = replace(export_opts, target=convert_opts.target)

    def precheck(source_config, shape):  # refuse what the export would refuse before calibrating
        check_source_for_export(source_config, shape, export_opts)

    _, src_path = resolve_source(src)
    with claim_output(out, convert_opts.overwrite, sources=[src_path]) as claim:
        scratch = claim.scratch()  # marked: a later run into OUT removes it if this one is killed
        try:
            report = run_conversion(src, scratch / "native", convert_opts, pipeline, stream, recipe=recipe,
                                    precheck=precheck)
            if export_opts.dtype == "auto" and report["settings"]["dtype"] == "float16":
                log.warning("the source is float16, which deepseek-v3 cannot hold; exporting bfloat16")
                export_opts = replace(export_opts, dtype="bfloat16")
            report["export"] = _export_into(claim, scratch / "native", export_opts)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return report
