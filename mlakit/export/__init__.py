"""Exports of native mlakit checkpoints to formats other loaders read (stock DeepSeek-V3)."""

from __future__ import annotations

from .engine_rules import ExportError
from .run import FORMATS, ExportOptions, convert_to_format, export

__all__ = ["FORMATS", "ExportError", "ExportOptions", "convert_to_format", "export"]
