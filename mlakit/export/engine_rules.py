"""Which stock exports the serving engines read correctly; refusals and opt-ins for the rest.

vLLM 0.32 serves a ``deepseek_v3`` checkpoint through its own DeepSeek model, which rewrites any
rope scaling to DeepSeek-YaRN and drops attention biases, both without an error (its model code does
so, whatever the config says), and whose MLA layer refuses r + d_R outside ``VLLM_MLA_WIDTHS``
(``convert/engine_target.py`` says which backend takes which). Whatever an engine would misread is
refused unless a transformers-only opt-in is given, and every export records in export.json (and a
README.md beside the weights) what vLLM would make of it.
"""

from __future__ import annotations

from ..arch.families import AttentionShape
from ..choices import BIAS_POLICIES, ROPE_SCALING_POLICIES
from ..convert.engine_target import TARGETS, VLLM_MLA_RANK, VLLM_MLA_ROPE_DIM, VLLM_MLA_WIDTHS

__all__ = [
    "BIAS_POLICIES",
    "NATIVE_ALTERNATIVE",
    "ROPE_SCALING_POLICIES",
    "STOCK_ROPE_TYPES",
    "ExportError",
    "bias_refusal",
    "check_biases",
    "check_rope_scaling",
    "check_source_for_export",
    "check_window",
    "engine_readme",
    "target_refusal",
    "vllm_problems",
]

# The fix every refusal for the engines names: the native checkpoint, served through mlakit's own model.
NATIVE_ALTERNATIVE = (
    "or serve the native checkpoint instead with mlakit's vLLM plugin (`mla-convert convert` without --format "
    "deepseek-v3, then `vllm serve OUT`), which computes this model's own rope and biases"
)
# Rope types whose scaling is a function of each frequency alone, so it commutes with picking a
# sub-table; yarn/dynamic/longrope also depend on the head dim or the sequence length.
STOCK_ROPE_TYPES = ("default", "linear", "llama3")


class ExportError(ValueError):
    """The native checkpoint cannot be expressed exactly in the target format; the message says how to fix it."""


def check_rope_scaling(rope_type: str, policy: str) -> None:
    """Refuse a rope type deepseek-v3 cannot express, and a scaled one unless POLICY is hf-exact."""
    if policy not in ROPE_SCALING_POLICIES:
        raise ExportError(f"--rope-scaling {policy!r} is not one of {', '.join(ROPE_SCALING_POLICIES)}")
    if rope_type not in STOCK_ROPE_TYPES:
        raise ExportError(
            f"rope_type {rope_type!r} cannot be exported: deepseek-v3 recomputes it for qk_rope_head_dim, "
            f"which changes the frequencies; supported: {', '.join(STOCK_ROPE_TYPES)}; {NATIVE_ALTERNATIVE}"
        )
    if rope_type != "default" and policy == "refuse":
        raise ExportError(
            f"the model's rope is scaled (rope_type {rope_type!r}), and vLLM's DeepSeek model rewrites every rope "
            f"scaling of a deepseek_v3 checkpoint to its own DeepSeek-YaRN, which gives wrong logits without an "
            f"error. Pass --rope-scaling hf-exact for an export that is exact in transformers only (its "
            f"export.json and README.md say vLLM misreads it), {NATIVE_ALTERNATIVE}"
        )


def check_biases(native: dict, policy: str) -> list[str]:
    """Names of the native bias kinds present; ExportError when they are present and the policy refuses."""
    if policy not in BIAS_POLICIES:
        raise ExportError(f"--biases {policy!r} is not one of {', '.join(BIAS_POLICIES)}")
    present = [k for k in ("q_proj_bias", "kv_a_proj_bias", "o_proj_bias") if native.get(k)]
    if present and policy == "refuse":
        raise ExportError(bias_refusal(present))
    return present


def bias_refusal(present: list[str]) -> str:
    """The refusal of attention biases PRESENT under ``--biases refuse``."""
    return (
        f"the model has attention biases ({', '.join(present)}; Qwen2's q/k/v biases), which deepseek-v3 "
        f"cannot hold as they are: stock transformers has no q_proj bias, and vLLM's DeepSeek model has no "
        f"attention biases (it drops them without an error). Pass --biases hf-exact (exact in transformers only: "
        f"attention_bias plus q through q_lora_rank; vLLM misreads it), --biases drop (lossy everywhere; the "
        f"export report measures the change), {NATIVE_ALTERNATIVE}"
    )


def check_window(window: int | None, max_positions: int, clip_context: bool) -> int:
    """The max_position_embeddings of the export given the native sliding window."""
    if window is None or window >= max_positions:
        return max_positions
    if not clip_context:
        raise ExportError(
            f"the checkpoint uses a sliding window of {window} tokens (max_position_embeddings "
            f"{max_positions}); deepseek-v3 has no sliding window, so the export matches only sequences of at "
            f"most {window} tokens. Pass --clip-context to export with max_position_embeddings={window} "
            f"(engines then refuse longer contexts)"
        )
    return window


def vllm_problems(rank: int, rope_dim: int, rope: dict, keep_biases: bool) -> list[str]:
    """What vLLM's DeepSeek model would get wrong or refuse in an export of these shapes (empty: none)."""
    problems = []
    width = rank + rope_dim
    if (rank, rope_dim) != (VLLM_MLA_RANK, VLLM_MLA_ROPE_DIM):
        if width in VLLM_MLA_WIDTHS:
            problems.append(
                f"r + d_R = {rank} + {rope_dim}: vLLM's CPU, FlashMLA and CUTLASS MLA kernels take only "
                f"{VLLM_MLA_RANK} + {VLLM_MLA_ROPE_DIM}; only its Triton MLA backend (GPU) accepts {width} "
                f"(not run here)"
            )
        else:
            problems.append(
                f"r + d_R = {rank} + {rope_dim} = {width}: vLLM refuses it at the first forward (`Head dimension "
                f"{width} is not supported by MLA`); its MLA layer takes {' or '.join(map(str, VLLM_MLA_WIDTHS))}, "
                f"every backend {VLLM_MLA_RANK} + {VLLM_MLA_ROPE_DIM} (`convert --target vllm` plans that for "
                f"models caching more than {VLLM_MLA_RANK + VLLM_MLA_ROPE_DIM} values per layer; smaller ones "
                f"gain nothing from MLA in vLLM)"
            )
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        problems.append(
            f"rope_type {rope['rope_type']!r} (--rope-scaling hf-exact): vLLM's DeepSeek model rewrites it to "
            f"DeepSeek-YaRN, which gives wrong logits without an error"
        )
    if keep_biases:
        problems.append(
            "attention biases (--biases hf-exact): vLLM's DeepSeek model drops them, which gives wrong logits "
            "without an error"
        )
    return problems


def engine_readme(problems: list[str]) -> str:
    """README.md written beside an export vLLM would refuse or misread."""
    lines = "\n".join(f"- {p}" for p in problems)
    return (
        "# mlakit deepseek-v3 export: exact in transformers, NOT for vLLM\n\n"
        "Stock transformers (`AutoModelForCausalLM.from_pretrained`, no remote code) computes what the native "
        "mlakit checkpoint computes. vLLM would refuse or misread this export:\n\n"
        f"{lines}\n\n"
        "To serve it with vLLM, serve the native checkpoint with mlakit's vLLM plugin (`vllm serve OUT`), or "
        "re-convert with `--target vllm` and without the transformers-only options. Details: export.json.\n"
    )


def check_source_for_export(source_config, shape: AttentionShape, opts) -> None:
    """Refuse, before a conversion starts, a source whose deepseek-v3 export OPTS (ExportOptions) would refuse.

    SHAPE: the source's ``attention_shape``."""
    if opts.target not in TARGETS:
        raise ExportError(f"--target {opts.target!r} is not one of {', '.join(TARGETS)}")
    present = (["q_proj_bias", "kv_a_proj_bias"] if shape.qkv_bias else []) + (
        ["o_proj_bias"] if shape.o_bias else []
    )
    check_biases(dict.fromkeys(present, True), opts.biases)
    rope = (
        getattr(source_config, "rope_parameters", None) or getattr(source_config, "rope_scaling", None) or {}
    )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    check_rope_scaling(rope_type, opts.rope_scaling)
    check_window(shape.window, source_config.max_position_embeddings, opts.clip_context)
    if opts.target == "vllm":
        keep = bool(present) and opts.biases == "hf-exact"
        problems = vllm_problems(VLLM_MLA_RANK, VLLM_MLA_ROPE_DIM, {"rope_type": rope_type}, keep)
        if problems:
            raise ExportError(target_refusal(problems))


def target_refusal(problems: list[str]) -> str:
    """The refusal of an export under ``--target vllm`` that vLLM would refuse or misread."""
    return (
        "--target vllm, but vLLM would refuse or misread this deepseek-v3 export: "
        + "; ".join(problems)
        + f". Drop the transformers-only options (--biases hf-exact, --rope-scaling hf-exact), {NATIVE_ALTERNATIVE}"
    )
