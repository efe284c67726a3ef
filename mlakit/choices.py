"""Option values shared by the CLI and the modules that act on them, kept free of torch and
transformers so that ``mla-convert --help`` and a usage error answer without importing them."""

from __future__ import annotations

__all__ = [
    "ALLOCATIONS",
    "BIAS_POLICIES",
    "DTYPE_NAMES",
    "HEAL_TRAIN_CHOICES",
    "LOWRANK_METHODS",
    "MEASURED_ROPE_DIMS",
    "MIN_CALIB_SEQ_LEN",
    "MIXINGS",
    "ROPE_METHODS",
    "REFINE_FIXED_INPUTS",
    "REFINE_INPUTS",
    "REFINE_MODES",
    "ROPE_SCALING_POLICIES",
    "STOCK_ROPE_METHODS",
    "TARGETS",
]

DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # keys of pipeline.DTYPES
ALLOCATIONS = ("auto", "uniform", "planned", "fisher")  # rank_plan's ways of spreading a --kv-budget
# --rope-dim values chosen in the statistics pass (convert.rope_choice): one shared d_R, or one per layer
MEASURED_ROPE_DIMS = ("measured", "measured-per-layer")
ROPE_METHODS = ("scored", "transmla", "high", "uniform", "norm")  # rope_select's ways of picking rotary dims
LOWRANK_METHODS = ("rrr", "bkv_pca", "svd")  # low_rank's latent factorisations (--lowrank-method adds auto)
MIXINGS = ("pca", "none")  # rotary mixing within a FreqFold group (rope_select)
STOCK_ROPE_METHODS = ("scored", "transmla")  # rope methods that can keep the stock deepseek-v3 table
BIAS_POLICIES = ("refuse", "drop", "hf-exact")  # the deepseek-v3 export's handling of attention biases
ROPE_SCALING_POLICIES = ("refuse", "hf-exact")  # the export's handling of a scaled rope (llama3, linear)
TARGETS = ("any", "vllm")  # engines a conversion can be planned for (convert.engine_target)
# after the closed form: nothing, convert.refine, convert.refine_values or convert.refine_heads on every
# layer; auto is values where the conversion compresses and its joint solve fits the memory and the
# arithmetic share (pipeline.stream_memory.REFIT_WORK_SHARE), else values-per-head where that fits, else none
REFINE_MODES = ("auto", "none", "layer", "values", "values-per-head")
# which hidden states a refinement reads: the converted model's (the layers below already converted, so the
# layer learns to compensate their error) or the source's own; auto: converted for layer and values,
# source for values-per-head (its targets are each source head's output, which has no residual to compensate)
REFINE_INPUTS = ("auto", "converted", "source")
# the refinements bound to one stream (the one each must read); the others read either, converted under auto
REFINE_FIXED_INPUTS = {"layer": "converted", "values-per-head": "source"}
HEAL_TRAIN_CHOICES = ("attention", "all")  # what `heal --train` trains (heal.schedule.select_trainable)

# The rotary selection weighs each component by its attention at every query-key distance
# (``calibration``'s lag profile, weighted by 1 - cos(theta * lag)); a 1-token sequence has only
# distance 0, where every weight is 0, so it could not tell rotary components apart. Two tokens
# give one non-zero distance: the least the statistics need (longer ones measure more of them).
MIN_CALIB_SEQ_LEN = 2
