"""The conversion's front door: ``ConvertOptions`` and ``convert`` (the Python API).

Both entry points run the one layer-wise driver (``run.run_conversion``); ``convert`` holds the
source in memory, ``convert_streaming`` reads a safetensors directory layer by layer and can
resume. The settings helpers live in ``settings`` and are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .refine import RefineSettings
from .run import resolve_device, run_conversion  # noqa: F401 - the CLI runs these
from .run_state import StreamOptions
from .settings import (  # noqa: F401 - the API's names
    AUTO_RRR_FROM,
    DTYPES,
    ConversionError,
    budget_values,
    cached_share,
    calibration_ids,
    check_calibration,
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


@dataclass
class ConvertOptions:
    kv_lora_rank: int | str = "full"
    rope_dim: int | str = "full"
    kv_budget: float | None = None  # fraction of the source's cached values per token; overrides the two above
    allocation: str = "auto"  # how a kv_budget is spread over layers: rank_plan.ALLOCATIONS
    rope_method: str = "scored"
    lowrank_method: str = "auto"
    fold: int = 0  # 0 = auto (see rope_select.auto_fold)
    mixing: str = "pca"
    stock_rope: bool = False  # rope the stock deepseek-v3 export can express (every k-th frequency)
    target: str = "any"  # serving engine whose MLA kernels the plan must fit: engine_target.TARGETS
    # layer-wise refinement after the closed form (convert/refine.py): choices.REFINE_MODES
    refine: str = "none"
    refine_epochs: float = RefineSettings.epochs  # Adam passes (0: the closed-form o_proj refit only)
    refine_lr: float = RefineSettings.lr  # Adam step relative to each weight's RMS
    refine_batch: int = RefineSettings.batch  # sequences per Adam step
    refine_sequences: int | None = RefineSettings.sequences  # calibration sequences refined on (None: all)
    calib: str = "builtin"
    calib_samples: int = 128
    calib_seq_len: int = 256
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    overwrite: bool = False
    verify: bool = True
    quiet: bool = False


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
