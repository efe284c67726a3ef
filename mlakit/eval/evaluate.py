"""Evaluate a converted model against its original: perplexity on the same token ids,
KV cache per token (config and measured), greedy samples; assemble the report dict.

Models are loaded one at a time (original first, then each converted directory) so peak
memory is one model. Every model sees the very same 1-D tensor of token ids, in the same
dtype on the same device; its SHA-256 is recorded in the report.
"""

from __future__ import annotations

import gc
import hashlib
import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from mlakit.data import calibration_relation, load_text, tokenize_text

from .kv_accounting import account_kv, kv_reduction
from .loading import (
    ModelLoadError,
    find_converted_dirs,
    load_converted_model,
    load_original_model,
    load_tokenizer,
    read_conversion,
    resolve_device,
    resolve_dtype,
)
from .perplexity import sliding_window_perplexity
from .samples import DEFAULT_PROMPTS, greedy_continuations
from .tasks import TaskSettings, prepare_tasks, score_tasks, task_rows, task_settings_dict

__all__ = ["EvalSettings", "eval_figures", "layer_ranks", "run_eval", "sweep_labels", "token_ids_digest"]

logger = logging.getLogger(__name__)


@dataclass
class EvalSettings:
    original: str
    converted: list[str]  # directories; a directory of converted directories is a sweep
    data: str = "builtin"
    seq_len: int = 1024
    stride: int | None = None  # None: seq_len // 2
    max_tokens: int | None = None  # None: the whole text
    batch_size: int = 4
    device: str = "auto"
    dtype: str = "auto"
    tokenizer: str | None = None
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    sample_tokens: int = 32  # 0: no samples
    kv_probe_len: int = 16
    progress: bool = True
    tasks: TaskSettings | None = None  # downstream tasks through lm-evaluation-harness; None: none

    @property
    def effective_stride(self) -> int:
        return self.stride if self.stride is not None else max(1, self.seq_len // 2)


def token_ids_digest(ids: torch.Tensor) -> str:
    """SHA-256 of the token ids as little-endian int64, to show two runs used the same tokens."""
    return hashlib.sha256(ids.to(torch.int64).cpu().numpy().astype("<i8").tobytes()).hexdigest()


def layer_ranks(conversion: dict | None, config) -> list[dict] | None:
    """Per-layer ``kv_lora_rank`` and ``qk_rope_head_dim``: from ``conversion["layers"]``
    when present, else from the model config (int or per-layer list), else None."""
    layers = (conversion or {}).get("layers")
    if (
        isinstance(layers, list)
        and layers
        and all(isinstance(x, dict) and "kv_lora_rank" in x and "qk_rope_head_dim" in x for x in layers)
    ):
        return [
            {"kv_lora_rank": int(x["kv_lora_rank"]), "qk_rope_head_dim": int(x["qk_rope_head_dim"])}
            for x in layers
        ]
    rank = getattr(config, "kv_lora_rank", None)
    if rank is None:
        return None
    n = int(config.num_hidden_layers)
    rope = getattr(config, "qk_rope_head_dim", 0) or 0
    ranks = list(rank) if isinstance(rank, (list, tuple)) else [rank] * n
    ropes = list(rope) if isinstance(rope, (list, tuple)) else [rope] * n
    return [{"kv_lora_rank": int(r), "qk_rope_head_dim": int(d)} for r, d in zip(ranks, ropes)]


def _vocab_rows(model) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.num_embeddings) if emb is not None else int(model.config.vocab_size)


def _check_vocab(model, ids: torch.Tensor, label: str) -> None:
    rows = _vocab_rows(model)
    top = int(ids.max())
    if top >= rows:
        raise ModelLoadError(
            f"the tokenizer produced token id {top}, but the {label} model's embedding has {rows} rows; "
            "the tokenizer does not belong to this model. Fix: pass the model's own tokenizer with --tokenizer DIR."
        )


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _evaluate_model(
    model, label: str, path: str, ids, tokenizer, s: EvalSettings, device, tasks=None
) -> dict:
    _check_vocab(model, ids, label)
    ppl = sliding_window_perplexity(
        model,
        ids,
        s.seq_len,
        s.effective_stride,
        s.batch_size,
        device,
        progress=s.progress,
        desc=f"ppl {label}",
    )
    kv = account_kv(model, batch_size=2, seq_len=s.kv_probe_len, device=device)
    samples = []
    if s.sample_tokens > 0 and s.prompts:
        samples = greedy_continuations(model, tokenizer, s.prompts, s.sample_tokens, device)
    scored = score_tasks(model, tokenizer, tasks, label) if tasks is not None else None
    return {
        "label": label,
        "path": str(path),
        "model_type": getattr(model.config, "model_type", None),
        "architecture": type(model).__name__,
        "n_params": int(sum(p.numel() for p in model.parameters())),
        "ppl": ppl.ppl,
        "nll": ppl.nll,
        "perplexity": ppl.to_dict(),
        "kv_values_per_token": kv.values_per_token,
        "kv_bytes_per_token": kv.bytes_per_token,
        "kv_values_per_token_config": kv.config_values_per_token,
        "kv_bytes_per_token_config": kv.config_bytes_per_token,
        "kv": kv.to_dict(),
        "samples": samples,
        **({"tasks": scored["tasks"], "harness_requests": scored["requests"]} if scored else {}),
    }


def sweep_labels(paths: list[Path]) -> list[str]:
    """Directory names, widened with parent folders until they are unique."""
    depth = 1
    while True:
        labels = ["/".join(p.resolve().parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels) or depth > 8:
            return labels
        depth += 1


def _resolve_tokenizer(s: EvalSettings, original_tokenizer, converted_dirs: list[Path]):
    if s.tokenizer:
        tok = load_tokenizer([s.tokenizer])
        if tok is None:
            raise ModelLoadError(
                f"--tokenizer {s.tokenizer!r} holds no loadable tokenizer (tokenizer.json / tokenizer_config.json); "
                "pass the directory of the original model's tokenizer"
            )
        return tok
    if original_tokenizer is not None:
        return original_tokenizer
    tok = load_tokenizer(converted_dirs)
    if tok is None:
        raise ModelLoadError(
            f"neither the original {s.original!r} nor the converted directories carry a tokenizer; "
            "pass one with --tokenizer DIR"
        )
    return tok


def run_eval(s: EvalSettings) -> dict:
    """Run the whole evaluation and return the report dict (see :mod:`mlakit.eval.report`)."""
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    stride = s.effective_stride
    if s.seq_len < 2 or not 1 <= stride < s.seq_len:
        raise ValueError(
            f"need seq_len >= 2 and 1 <= stride <= seq_len - 1, got seq_len={s.seq_len}, stride={stride}"
        )
    if s.batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {s.batch_size}")
    if not s.converted:
        raise ValueError("no converted model given; pass --converted OUT")
    converted_dirs = [d for c in s.converted for d in find_converted_dirs(c)]
    # fail on a bad conversion.json or data spec before loading any model
    conversions = [read_conversion(d) for d in converted_dirs]
    text = load_text(s.data, "eval")
    tasks = prepare_tasks(s.tasks) if s.tasks is not None else None  # unknown or unreachable: fail now

    logger.info("loading original %s (%s on %s)", s.original, dtype, device)
    model, original_tokenizer = load_original_model(s.original, dtype, device)
    tokenizer = _resolve_tokenizer(s, original_tokenizer, converted_dirs)
    ids = tokenize_text(tokenizer, text)
    n_text_tokens = int(ids.numel())
    if s.max_tokens is not None:
        ids = ids[: s.max_tokens]
    if ids.numel() < 2:
        raise ValueError(
            f"data {s.data!r} gives {ids.numel()} tokens; perplexity needs at least 2. Use a longer text."
        )
    original = _evaluate_model(model, "original", s.original, ids, tokenizer, s, device, tasks)
    del model
    _free(device)

    converted = []
    sweep = len(converted_dirs) > 1
    labels = sweep_labels(converted_dirs) if sweep else ["converted"]
    for path, label, conversion in zip(converted_dirs, labels, conversions):
        logger.info("loading converted %s", path)
        model = load_converted_model(path, dtype, device)
        entry = _evaluate_model(model, label, str(path), ids, tokenizer, s, device, tasks)
        entry["conversion"] = conversion
        calib = ((conversion or {}).get("settings") or {}).get("calib")
        entry["calibration"] = {"spec": calib, "relation": calibration_relation(s.data, calib)}
        if entry["calibration"]["relation"] == "calibration text":
            logger.warning("%s was calibrated on %s, which holds the evaluation text %s: its ratio is optimistic; "
                           "evaluate on text the conversion has not seen", path, calib, s.data)
        entry["layer_ranks"] = layer_ranks(entry["conversion"], model.config)
        entry["ppl_ratio"] = entry["ppl"] / original["ppl"]
        entry["kv_reduction"] = kv_reduction(original["kv_bytes_per_token"], entry["kv_bytes_per_token"])
        converted.append(entry)
        del model
        _free(device)

    first = converted[0]
    samples = [
        {"prompt": o["prompt"], "original": o["continuation"], "converted": c["continuation"]}
        for o, c in zip(original["samples"], first["samples"])
    ]
    report = {
        "kind": "eval",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "data": {
            "spec": s.data,
            "n_tokens": int(ids.numel()),
            "n_text_tokens": n_text_tokens,
            "token_ids_sha256": token_ids_digest(ids),
            "calibration": first["calibration"],
        },
        "settings": {
            **asdict(s),
            "stride": stride,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
        },
        "original": original,
        "converted": first,
        "ppl_ratio": first["ppl_ratio"],
        "kv_reduction": first["kv_reduction"],
        "kv_reduction_pct": 100.0 * first["kv_reduction"],
        "conversion": first["conversion"],
        "samples": samples,
    }
    if sweep:
        report["sweep"] = converted
    if tasks is not None:
        report["tasks"] = {"settings": task_settings_dict(tasks), "rows": task_rows([original, *converted])}
    report["plots"] = sorted(eval_figures(report, draw=False))
    return report


def eval_figures(report: dict, draw: bool = True) -> dict:
    """Figures for an eval report, by file name (``draw=False``: names only, values None).
    matplotlib is imported only to draw: importing it would slow every CLI start, --help included."""
    converted = report.get("sweep") or [report["converted"]]
    names = ["kv_per_layer.png"]
    if any(c.get("layer_ranks") for c in converted):
        names.append("layer_ranks.png")
    if len(converted) > 1:
        names.append("ppl_vs_kv.png")
    if report.get("tasks", {}).get("rows"):
        names.append("task_accuracy.png")
    if not draw:
        return dict.fromkeys(names)
    from .plots import kv_per_layer_figure, layer_ranks_figure, ppl_vs_kv_figure, task_accuracy_figure

    figs = {}
    models = [report["original"], *converted]
    figs["kv_per_layer.png"] = kv_per_layer_figure(
        {m["label"]: m["kv"]["measured_bytes_per_layer"] for m in models}
    )
    if "layer_ranks.png" in names:
        figs["layer_ranks.png"] = layer_ranks_figure(
            {c["label"]: c["layer_ranks"] for c in converted if c.get("layer_ranks")}
        )
    if "ppl_vs_kv.png" in names:
        points = [
            {
                "label": m["label"],
                "kv_bytes_per_token": m["kv_bytes_per_token"],
                "ppl": m["ppl"],
                "is_original": m is report["original"],
            }
            for m in models
        ]
        figs["ppl_vs_kv.png"] = ppl_vs_kv_figure(points)
    if "task_accuracy.png" in names:
        figs["task_accuracy.png"] = task_accuracy_figure(
            report["tasks"]["rows"], [m["label"] for m in models]
        )
    return figs
