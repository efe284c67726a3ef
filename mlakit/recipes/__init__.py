"""Conversion recipes: ``ConvertOptions`` serialised, with a name and a description.

A recipe's keys are the recipe fields of ``mlakit.options.ConvertOptions`` (``RECIPE_FIELDS``),
validated by that model: a misspelt key or a bad value (a method name, a budget) is a
``RecipeError`` naming the key, its flag and the allowed values, before any model is read.
The same objects work from Python and YAML::

    recipe = Recipe.load("smollm2-135m")          # a built-in name or a path to a .yaml file
    opts = recipe.to_options(overwrite=True)      # ConvertOptions for mlakit.pipeline.api.convert

Recipes written before the options were declared once nest some keys (``method: {rope, lowrank,
fold, mixing, stock_rope}``, ``calibration: {data, samples, seq_len}``, ``null`` ranks next to a
budget); ``LEGACY_KEYS`` maps them onto the fields, so old ``recipe.yaml`` files keep loading.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..choices import MIN_CALIB_SEQ_LEN
from ..option_schema import format_errors
from ..options import RECIPE_FIELDS, ConvertOptions

__all__ = [
    "BUILTIN_RECIPES", "LEGACY_KEYS", "MIN_CALIB_SEQ_LEN", "Calibration", "MethodSpec", "Recipe", "RecipeError",
]  # fmt: skip

BUILTIN_RECIPES = ("smollm2-135m", "llama-2-7b", "llama-3-8b", "qwen2.5-7b", "mistral-7b-v0.3")

# legacy nested block -> {its key: the ConvertOptions field}
LEGACY_KEYS = {
    "method": {"rope": "rope_method", "lowrank": "lowrank_method", "fold": "fold", "mixing": "mixing",
               "stock_rope": "stock_rope"},
    "calibration": {"data": "calib", "samples": "calib_samples", "seq_len": "calib_seq_len"},
}  # fmt: skip


class RecipeError(ValueError):
    pass


class MethodSpec(dict):
    """A legacy ``method:`` block (rope, lowrank, fold, mixing, stock_rope); Recipe maps it onto fields."""


class Calibration(dict):
    """A legacy ``calibration:`` block (data, samples, seq_len); Recipe maps it onto fields."""


def _flatten(data: dict) -> tuple[dict, dict]:
    """DATA with legacy blocks and ``null`` ranks mapped onto fields, and field -> the legacy key used."""
    data, aliases = dict(data), {}
    for block, keys in LEGACY_KEYS.items():
        if block not in data:
            continue
        nested = data.pop(block)
        if not isinstance(nested, dict):
            raise RecipeError(
                f"{block} must be a mapping of {', '.join(keys)} (or use the flat keys "
                f"{', '.join(keys.values())})"
            )
        for key, value in nested.items():
            if key not in keys:
                raise RecipeError(f"{block}.{key} is not a recipe key; {block} takes {', '.join(keys)}")
            data[keys[key]], aliases[keys[key]] = value, f"{block}.{key}"
    for name in ("kv_lora_rank", "rope_dim"):
        if name in data and data[name] is None:  # legacy: unset (the budget plans it)
            del data[name]
    return data, aliases


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    description: str | None = None
    options: ConvertOptions = Field(default_factory=ConvertOptions)

    @model_validator(mode="before")
    @classmethod
    def _options_from_keys(cls, data):
        """Recipe fields may be given flat (``Recipe(kv_budget=0.5)``, a YAML file): they become ``options``."""
        if not isinstance(data, dict):
            return data
        data, _ = _flatten(data)
        flat = {k: data.pop(k) for k in list(data) if k in RECIPE_FIELDS}
        if flat:
            base = data.get("options", ConvertOptions())
            base = asdict(base) if isinstance(base, ConvertOptions) else dict(base)
            data["options"] = base | flat
        return data

    def __getattr__(self, name: str):
        """A recipe field reads its option: ``recipe.kv_budget`` is ``recipe.options.kv_budget``."""
        if name in RECIPE_FIELDS:
            return getattr(self.options, name)
        return super().__getattr__(name)

    @classmethod
    def from_options(
        cls, opts: ConvertOptions, name: str | None = None, description: str | None = None
    ) -> Recipe:
        """The recipe that reproduces OPTS (its run-time fields, like device, are not part of a recipe)."""
        return cls(
            name=name,
            description=description,
            options=ConvertOptions(**{k: v for k, v in asdict(opts).items() if k in RECIPE_FIELDS}),
        )

    @classmethod
    def load(cls, name_or_path: str | Path) -> Recipe:
        path = Path(name_or_path)
        if str(name_or_path) in BUILTIN_RECIPES:
            text = resources.files(__package__).joinpath(f"{name_or_path}.yaml").read_text()
            source = f"built-in recipe {name_or_path}"
        elif path.is_file():
            text, source = path.read_text(), str(path)
        else:
            raise RecipeError(
                f"recipe {name_or_path!r} is neither a built-in ({', '.join(BUILTIN_RECIPES)}) "
                f"nor an existing YAML file"
            )
        return cls.from_yaml(text, source)

    @classmethod
    def from_yaml(cls, text: str, source: str = "recipe") -> Recipe:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise RecipeError(f"{source} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise RecipeError(f"{source} must be a mapping of recipe keys")
        try:
            flat, aliases = _flatten(data)
        except RecipeError as exc:
            raise RecipeError(f"{source} is invalid: {exc}") from exc
        keys = ("name", "description", *RECIPE_FIELDS)
        unknown = [k for k in flat if k not in keys]
        if unknown:
            raise RecipeError(
                f"{source} is invalid: unknown key{'s' * (len(unknown) > 1)} "
                f"{', '.join(map(repr, unknown))}; recipe keys: {', '.join(keys)}"
            )
        try:
            return cls.model_validate(flat)
        except ValidationError as exc:
            lines = format_errors(exc, ConvertOptions, prefix=("options",), aliases=aliases)
            raise RecipeError(
                f"{source} is invalid:\n  " + "\n  ".join(lines) + f"\nrecipe keys: {', '.join(keys)}"
            ) from None

    def to_yaml(self) -> str:
        """The recipe as YAML: name, description and every recipe field (``from_yaml`` reads it back)."""
        fields = {k: v for k, v in asdict(self.options).items() if k in RECIPE_FIELDS}
        return yaml.safe_dump({"name": self.name, "description": self.description} | fields, sort_keys=False)

    def to_options(self, **overrides) -> ConvertOptions:
        """ConvertOptions for this recipe; OVERRIDES (e.g. CLI flags, run-time fields) win over its fields."""
        return replace(self.options, **overrides) if overrides else self.options
