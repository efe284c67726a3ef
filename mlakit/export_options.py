"""The export options, declared once: `mla-convert export`'s flags, `convert --format deepseek-v3`'s
export flags, and the Python API (``mlakit.export.export(out, dest, ExportOptions(...))``).

A bad value or a contradiction is an ``OptionsError`` naming the field and its flag, raised when the
options are made: before the native checkpoint (or, for ``convert --format``, the source) is read.
What depends on the checkpoint itself (its biases, rope scaling, sliding window, dtype) is checked
by ``export/engine_rules.py`` and ``export/deepseek_v3.py``. Torch-free, so ``--help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

from .choices import BIAS_POLICIES, DTYPE_NAMES, ROPE_SCALING_POLICIES, TARGETS
from .option_schema import strict_init

__all__ = ["EXPORT_FORMATS", "ExportOptions"]

EXPORT_FORMATS = ("deepseek-v3",)  # what a native checkpoint can be exported to


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ExportOptions:
    format: Annotated[
        Literal[EXPORT_FORMATS],
        Field(
            description="Target format: stock transformers DeepseekV3ForCausalLM (served by vLLM and SGLang)."
        ),
    ] = "deepseek-v3"
    dtype: Annotated[
        Literal[("auto", *DTYPE_NAMES)],
        Field(
            description="Export dtype; auto keeps OUT's. float16 is refused: it cannot hold the tiny latent "
            "scale that makes the stock kv_a_layernorm an identity."
        ),
    ] = "auto"
    biases: Annotated[
        Literal[BIAS_POLICIES],
        Field(
            description="Attention biases (Qwen2): refuse; drop them (lossy everywhere); or hf-exact (exact in "
            "transformers only: vLLM's DeepSeek model drops them without an error)."
        ),
    ] = "refuse"
    rope_scaling: Annotated[
        Literal[ROPE_SCALING_POLICIES],
        Field(
            description="A scaled rope (llama3, linear): refuse it (vLLM's DeepSeek model rewrites it to "
            "DeepSeek-YaRN, wrong logits), or hf-exact (exact in transformers only; export.json and README.md "
            "say vLLM misreads it)."
        ),
    ] = "refuse"
    target: Annotated[
        Literal[TARGETS],
        Field(
            description="vllm: refuse an export vLLM would refuse or misread (shapes other than 512 + 64, "
            "transformers-only options). any: write it and record in export.json what vLLM would make of it."
        ),
    ] = "any"
    clip_context: Annotated[
        bool,
        Field(
            description="Sliding-window models: set max_position_embeddings to the window, the length up to "
            "which the window-less export is exact."
        ),
    ] = False
    overwrite: Annotated[
        bool, Field(description="Replace DEST if it is an earlier mlakit output or empty.")
    ] = False
    verify: Annotated[
        bool, Field(description="Compare the export's logits with OUT's (--no-verify skips it).")
    ] = True

    @field_validator("dtype")
    @classmethod
    def _not_float16(cls, value: str) -> str:
        if value in ("float16", "fp16"):
            raise ValueError(
                "must not be float16: the identity kv_a_layernorm scales the latent by a tiny alpha, below "
                "float16's range; use --dtype bfloat16 or --dtype float32"
            )
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self):
        # hf-exact writes what only transformers reads; --target vllm asks for what vLLM reads
        for name, flag in (("biases", "--biases"), ("rope_scaling", "--rope-scaling")):
            if self.target == "vllm" and getattr(self, name) == "hf-exact":
                raise ValueError(
                    f"{flag} hf-exact and --target vllm contradict each other: hf-exact is exact in transformers "
                    f"only (vLLM's DeepSeek model misreads it without an error); drop {flag} hf-exact"
                    + (" (or use --biases drop, lossy)" if name == "biases" else "")
                    + ", or drop --target vllm"
                )
        return self


# Python callers (and dataclasses.replace) get an OptionsError that names the flag, not pydantic's text.
strict_init(ExportOptions, "export")
