"""The conversion report (``conversion.json``) and the side files beside the converted weights."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ..io.writer import AUTO_MAP, write_modeling_code
from .settings import effective_recipe

__all__ = ["conversion_report", "write_side_files", "write_tokenizer_files"]


def conversion_report(src: str, setup, opts, plan: dict, layers: list[dict], pipeline: dict) -> dict:
    """The report of converting SRC: settings, plan, each layer's shape, the driver's PIPELINE facts."""
    shape = setup.shape
    per_layer = 2 * shape.num_kv_heads * shape.head_dim
    return {
        "source": str(src),
        "source_architecture": shape.family,
        "settings": asdict(opts) | {"dtype": str(setup.dtype).replace("torch.", "")},
        "source_kv_values_per_token_per_layer": per_layer,
        "plan": plan,
        "layers": [{k: r[k] for k in ("layer", "kv_lora_rank", "qk_rope_head_dim", "rope_freq_index", "fold_choice",
                                      "refine") if k in r} for r in layers],
        "pipeline": pipeline,
        "kv_values_per_token": sum(r["kv_lora_rank"] + r["qk_rope_head_dim"] for r in layers),
        "source_kv_values_per_token": per_layer * len(layers),
    }


def write_side_files(directory: Path, source, config, opts, recipe=None) -> None:
    """config.json (with the remote-code map), the modeling code, recipe.yaml and the tokenizer files."""
    config.auto_map = dict(AUTO_MAP)
    config.to_json_file(str(directory / "config.json"), use_diff=False)
    write_modeling_code(directory)
    (directory / "recipe.yaml").write_text(effective_recipe(opts, recipe).to_yaml())
    write_tokenizer_files(source, config, directory)


def write_tokenizer_files(source, config, directory: Path) -> None:
    """The source's tokenizer and generation config (or one made from CONFIG) into DIRECTORY."""
    from transformers import GenerationConfig

    tokenizer = source.tokenizer()
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    gen_path = source.directory / "generation_config.json" if source.directory else None
    if gen_path is not None and gen_path.is_file():
        GenerationConfig.from_pretrained(str(source.directory)).save_pretrained(str(directory))
    else:
        GenerationConfig.from_model_config(config).save_pretrained(str(directory))

