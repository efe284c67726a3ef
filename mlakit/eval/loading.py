"""Open the two models an evaluation compares, their tokenizer, device and dtype.

The original goes through :func:`mlakit.io.source.load_source_model` (HF directory,
hub id, GGUF file or ``default``). A converted directory whose config is mlakit's own MLA
model type goes through :func:`mlakit.mla_model.load_converted`; any other config (a
stock ``deepseek_v3`` export, or a plain model) through ``AutoModelForCausalLM``, so the
evaluator works for every Hugging Face causal LM.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

__all__ = [
    "DTYPES",
    "ModelLoadError",
    "find_converted_dirs",
    "load_converted_model",
    "load_original_model",
    "load_tokenizer",
    "read_conversion",
    "resolve_device",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model, tokenizer, device or dtype that cannot be used; the message says the fix."""


def resolve_device(device: str) -> torch.device:
    """``auto`` is ``cuda`` when a GPU is visible, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but no CUDA GPU is visible; use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def read_conversion(path: str | Path) -> dict | None:
    """The ``conversion.json`` of a converted directory, or None where there is none."""
    file = Path(path) / "conversion.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file} is not valid JSON ({exc}); re-run the conversion") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(
            f"{file} holds {type(data).__name__}, expected a JSON object; re-run the conversion"
        )
    return data


def find_converted_dirs(path: str | Path) -> list[Path]:
    """``path`` itself when it holds a model (config.json), else its sub-directories that do
    (a sweep written as one folder per budget), sorted by name."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelLoadError(
            f"converted model {str(path)!r} is not a directory; pass the output directory of convert"
        )
    if (root / "config.json").is_file():
        return [root]
    subdirs = sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.json").is_file())
    if not subdirs:
        raise ModelLoadError(
            f"{root} holds no config.json and no sub-directories with one; pass the output directory of convert"
        )
    return subdirs


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path / 'config.json'} cannot be read ({exc}); re-run the conversion") from exc


def load_converted_model(path: str | Path, dtype: torch.dtype, device: torch.device):
    """Load a converted directory as an eval-mode causal LM on ``device``."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; pass the output directory of `mla-convert convert`")
    from mlakit.mla_model import MLAConfig, load_converted

    if _model_type(path) == MLAConfig.model_type:
        return load_converted(path, dtype=dtype, device=str(device))
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"{path} cannot be loaded as a causal LM ({exc}); re-run the conversion"
        ) from exc
    return model.to(device).eval()


def load_original_model(spec: str, dtype: torch.dtype, device: torch.device):
    """(model, tokenizer or None) for the original SPEC (directory, hub id, GGUF or ``default``)."""
    from mlakit.io.source import load_source_model

    return load_source_model(spec, dtype=dtype, device=str(device))


def load_tokenizer(candidates: list[str | Path]):
    """The first tokenizer that loads from ``candidates`` (directories), or None."""
    from transformers import AutoTokenizer

    for cand in candidates:
        path = Path(cand).expanduser()
        if not path.is_dir():
            continue
        if not any(
            (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            continue
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            logger.warning("tokenizer in %s cannot be loaded: %s", path, exc)
    return None
