"""The conversion's front door: ``ConvertOptions`` and ``convert`` (the Python API).

Both entry points run the one layer-wise driver (``run.run_conversion``); ``convert`` holds the
source in memory, ``convert_streaming`` reads a safetensors directory layer by layer and can
resume. The settings helpers live in ``settings`` and are importable from here too.
"""

from __future__ import annotations

from pathlib import Path

from ..options import ConvertOptions
from .run import resolve_device, run_conversion  # noqa: F401 - the CLI runs these
from .run_state import StreamOptions
from .settings import (  # noqa: F401 - the API's names
    AUTO_RRR_FROM,
    DTYPES,
    ConversionError,
    budget_values,
    cached_share,
    calibration_ids,
    check_ranks,
    effective_recipe,
    method_of,
    needs_calibration,
    needs_sensitivity,
    resolve_allocation,
    resolve_dtype,
    resolve_lowrank,
    sensitivity_sequences,
)
from .verify import logit_report, verify_token_ids  # noqa: F401

__all__ = ["ConversionError", "ConvertOptions", "StreamOptions", "convert", "convert_streaming"]


def convert(src: str, out: str | Path, opts: ConvertOptions | None = None, recipe=None, precheck=None,
            on_layer=None) -> dict:
    """Convert SRC into an MLA checkpoint at OUT with every source tensor held in memory; returns the
    conversion report (``run.run_conversion`` says what RECIPE, PRECHECK and ON_LAYER do)."""
    return run_conversion(src, out, opts or ConvertOptions(), "in-memory", recipe=recipe, precheck=precheck,
                          on_layer=on_layer)


def convert_streaming(src: str, out: str | Path, opts: ConvertOptions | None = None,
                      stream: StreamOptions | None = None, recipe=None, on_layer=None) -> dict:
    """Convert SRC (a directory of safetensors shards) into an MLA checkpoint at OUT, reading it layer
    by layer (resumable, memory bounded by one layer); the same bytes as ``convert``."""
    return run_conversion(src, out, opts or ConvertOptions(), "streaming", stream, recipe=recipe, on_layer=on_layer)
