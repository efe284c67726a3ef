"""Conversion recipes: YAML files validated by pydantic (unknown keys are errors).

The same objects work from Python and YAML::

    recipe = Recipe.load("smollm2-135m")          # a built-in name or a path to a .yaml file
    opts = recipe.to_options(overwrite=True)      # ConvertOptions for mlakit.convert.pipeline.convert
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..choices import MIN_CALIB_SEQ_LEN

__all__ = ["BUILTIN_RECIPES", "MIN_CALIB_SEQ_LEN", "Calibration", "MethodSpec", "Recipe", "RecipeError", "RefineSpec"]


class RecipeError(ValueError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MethodSpec(_Strict):
    rope: Literal["scored", "transmla", "high", "uniform", "norm"] = "scored"
    lowrank: Literal["auto", "rrr", "bkv_pca", "svd"] = "auto"
    fold: int = Field(0, ge=0)  # 0 = auto
    mixing: Literal["pca", "none"] = "pca"
    stock_rope: bool = False  # rope the stock deepseek-v3 export can express


class RefineSpec(_Strict):
    """Layer-wise refinement after the closed form (convert/refine.py)."""

    mode: Literal["none", "layer"] = "none"
    epochs: float = Field(0.0, ge=0, le=1000)  # Adam passes; 0: the closed-form o_proj refit only
    lr: float = Field(1e-3, gt=0, lt=1)  # Adam step relative to each weight's RMS
    batch: int = Field(4, ge=1)  # sequences per Adam step
    sequences: int | None = Field(None, ge=1)  # calibration sequences refined on (None: all)


class Calibration(_Strict):
    data: str = "builtin"
    samples: int = Field(128, ge=1)
    seq_len: int = Field(256, ge=MIN_CALIB_SEQ_LEN)


class Recipe(_Strict):
    name: str | None = None
    description: str | None = None
    kv_budget: float | None = Field(None, gt=0, le=1)
    allocation: Literal["auto", "uniform", "planned", "fisher"] = "auto"
    kv_lora_rank: int | Literal["full"] | None = None
    rope_dim: int | Literal["full"] | None = None
    method: MethodSpec = MethodSpec()
    refine: RefineSpec = RefineSpec()
    calibration: Calibration = Calibration()
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # serving engine whose MLA kernels the plan must fit (vllm: 512 + 64 in every layer; engine_target.py)
    target: Literal["any", "vllm"] = "any"

    @field_validator("kv_lora_rank", "rope_dim")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError("must be 'full' or a non-negative integer")
        return v

    @classmethod
    def load(cls, name_or_path: str | Path) -> Recipe:
        path = Path(name_or_path)
        if str(name_or_path) in BUILTIN_RECIPES:
            text = resources.files(__package__).joinpath(f"{name_or_path}.yaml").read_text()
            source = f"built-in recipe {name_or_path}"
        elif path.is_file():
            text, source = path.read_text(), str(path)
        else:
            raise RecipeError(f"recipe {name_or_path!r} is neither a built-in ({', '.join(BUILTIN_RECIPES)}) "
                              f"nor an existing YAML file")
        return cls.from_yaml(text, source)

    @classmethod
    def from_yaml(cls, text: str, source: str = "recipe") -> Recipe:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise RecipeError(f"{source} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise RecipeError(f"{source} must be a mapping of recipe fields")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            fields = ", ".join(cls.model_fields)
            raise RecipeError(f"{source} is invalid:\n  " + "\n  ".join(lines) + f"\nrecipe fields: {fields}") from exc

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def to_options(self, **overrides):
        """ConvertOptions for this recipe; OVERRIDES (e.g. CLI flags) win over recipe fields."""
        from ..convert.pipeline import ConvertOptions

        fields = dict(
            kv_budget=self.kv_budget,
            allocation=self.allocation,
            kv_lora_rank="full" if self.kv_lora_rank is None else self.kv_lora_rank,
            rope_dim="full" if self.rope_dim is None else self.rope_dim,
            rope_method=self.method.rope,
            lowrank_method=self.method.lowrank,
            fold=self.method.fold,
            mixing=self.method.mixing,
            stock_rope=self.method.stock_rope,
            calib=self.calibration.data,
            calib_samples=self.calibration.samples,
            calib_seq_len=self.calibration.seq_len,
            dtype=self.dtype,
            target=self.target,
            refine=self.refine.mode,
            refine_epochs=self.refine.epochs,
            refine_lr=self.refine.lr,
            refine_batch=self.refine.batch,
            refine_sequences=self.refine.sequences,
        )
        fields.update(overrides)
        return ConvertOptions(**fields)


BUILTIN_RECIPES = ("smollm2-135m", "llama-2-7b", "llama-3-8b", "qwen2.5-7b", "mistral-7b-v0.3")
