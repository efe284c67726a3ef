"""Architecture knowledge as data: the source families mlakit converts and the attention shape
a config implies (``families``), and every tensor name it reads or writes (``names``).

Imports neither torch nor transformers, so any layer (CLI checks included) can read it cheaply."""

from __future__ import annotations

from . import names
from .families import FAMILIES, AttentionShape, Family, UnsupportedModelError, attention_shape, family_for

__all__ = [
    "FAMILIES",
    "AttentionShape",
    "Family",
    "UnsupportedModelError",
    "attention_shape",
    "family_for",
    "names",
]
