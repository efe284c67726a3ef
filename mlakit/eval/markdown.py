"""Render eval and bench report dicts as Markdown that reads on its own."""

from __future__ import annotations

import json

__all__ = ["bench_markdown", "eval_markdown"]


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e6 else f"{x:.3e}"
    return str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "⏎ ").strip() or "(empty)"


_RELATION_WORDS = {
    "calibration text": "**is the calibration text, or part of it: this ratio is optimistic**; evaluate on text "
    "the conversion has not seen",
    "calibration source, disjoint part": "is the builtin text's evaluation part, disjoint from its calibration part "
    "but of the same kind (Python documentation), where the ratio is lowest; text of another kind gives a higher "
    "one (the README's \"Calibrate on your kind of text\")",
    "other text": "is not the calibration text",
}


def _calibration_lines(calibration: dict | None) -> list[str]:
    """What the evaluation text is to the (first) converted model's calibration, when that is known."""
    if not calibration or calibration.get("relation") not in _RELATION_WORDS:
        return []
    return [f"Calibrated on `{calibration['spec']}`: the evaluation text {_RELATION_WORDS[calibration['relation']]}.",
            ""]


def _conversion_lines(conversion: dict | None) -> list[str]:
    if not conversion:
        return ["No `conversion.json` was found in the converted directory."]
    scalars = {k: v for k, v in conversion.items() if k != "layers"}
    lines = ["Settings read from `conversion.json` (per-layer entries in report.json):", "", "```json"]
    lines += json.dumps(scalars, indent=2, default=str).splitlines()
    return [*lines, "```"]


def _ranks_table(converted: list[dict]) -> list[str]:
    """Per-layer r and d_R, two columns per converted model that has them."""
    ranked = [m for m in converted if m.get("layer_ranks")]
    header = ["layer"]
    for m in ranked:
        prefix = "" if len(ranked) == 1 else f"{m['label']} "
        header += [f"{prefix}kv_lora_rank r", f"{prefix}qk_rope_head_dim d_R"]
    n_layers = max(len(m["layer_ranks"]) for m in ranked)
    rows = []
    for i in range(n_layers):
        row = [i]
        for m in ranked:
            x = m["layer_ranks"][i] if i < len(m["layer_ranks"]) else {}
            row += [x.get("kv_lora_rank"), x.get("qk_rope_head_dim")]
        rows.append(row)
    return _table(header, rows)


def _model_rows(models: list[dict], original_ppl: float, original_kv: float) -> list[list]:
    rows = []
    for m in models:
        rows.append(
            [
                m["label"],
                m["ppl"],
                m["ppl"] / original_ppl,
                m["kv_values_per_token"],
                m["kv_bytes_per_token"],
                m["kv_bytes_per_token_config"],
                f"{100 * (1 - m['kv_bytes_per_token'] / original_kv):.1f}%",
            ]
        )
    return rows


def _tasks_lines(tasks: dict, labels: list[str]) -> list[str]:
    st = tasks["settings"]
    shots = "each task's default shots" if st["num_fewshot"] is None else f"{st['num_fewshot']}-shot"
    limit = "all documents" if st["limit"] is None else f"the first {st['limit']} documents"
    lines = [
        "## Downstream accuracy (lm-evaluation-harness)",
        "",
        f"lm-eval {st['harness_version']}, its HF wrapper around each loaded model, the same settings for "
        f"every model: {shots}, {limit} per task, batch size {st['batch_size']}. Value ± the harness's "
        "standard error.",
        "",
    ]
    rows = []
    for r in tasks["rows"]:
        cells = [
            f"{_fmt(v)} ± {_fmt(e)}" if e is not None else _fmt(v)
            for v, e in (r["values"][x] for x in labels)
        ]
        base, last = r["values"][labels[0]][0], r["values"][labels[-1]][0]
        delta = _fmt(last - base) if base is not None and last is not None else None
        rows.append([r["task"], r["metric"], r["n_samples"], *cells, delta])
    lines += _table(["task", "metric", "documents", *labels, f"{labels[-1]} - {labels[0]}"], rows)
    return [*lines, "", "![task accuracy](task_accuracy.png)", ""]


def eval_markdown(report: dict) -> str:
    orig, conv = report["original"], report["converted"]
    models = [orig, *(report.get("sweep") or [conv])]
    settings, data = report["settings"], report["data"]
    lines = [
        "# MLA conversion: evaluation report",
        "",
        f"Original `{orig['path']}` ({orig['architecture']}) against converted `{conv['path']}` "
        f"({conv['architecture']}), created {report['created_utc']}.",
        "",
        f"- **Perplexity**: original {_fmt(orig['ppl'])}, converted {_fmt(conv['ppl'])} "
        f"(ratio {_fmt(report['ppl_ratio'])}; 1.0 means no loss).",
        f"- **KV cache per token** (measured from cache tensors): original {_fmt(orig['kv_bytes_per_token'])} bytes, "
        f"converted {_fmt(conv['kv_bytes_per_token'])} bytes: **{report['kv_reduction_pct']:.1f}% smaller**.",
        "",
        "## Perplexity and KV cache",
        "",
        f"Data `{data['spec']}`: {data['n_tokens']} tokens (of {data['n_text_tokens']} in the text), identical ids for "
        f"every model (sha256 `{data['token_ids_sha256'][:16]}…`). Sliding windows of {settings['seq_len']} tokens, "
        f"stride {settings['stride']}: every token after the first scored once, with up to "
        f"{settings['seq_len'] - 1} tokens of context. dtype {settings['dtype']}, device {settings['device']}, "
        f"batch size {settings['batch_size']}.",
        "",
        *_calibration_lines(data.get("calibration")),
    ]
    lines += _table(
        [
            "model",
            "perplexity",
            "ppl ratio",
            "KV values/token",
            "KV bytes/token",
            "KV bytes/token (config)",
            "KV reduction",
        ],
        _model_rows(models, orig["ppl"], orig["kv_bytes_per_token"]),
    )
    lines += ["", "### KV cache per layer (measured values per token)", ""]
    n_layers = max(len(m["kv"]["measured_values_per_layer"]) for m in models)
    rows = []
    for i in range(n_layers):
        row = [i]
        for m in models:
            per = m["kv"]["measured_values_per_layer"]
            row.append(per[i] if i < len(per) else None)
        rows.append(row)
    lines += _table(["layer", *[m["label"] for m in models]], rows)
    lines += ["", "![KV per layer](kv_per_layer.png)", ""]
    if "layer_ranks.png" in report.get("plots", []):
        lines += ["## Per-layer latent rank and rotary dims", "", *_ranks_table(models[1:]), ""]
        lines += ["![layer ranks](layer_ranks.png)", ""]
    if "ppl_vs_kv.png" in report.get("plots", []):
        lines += ["## Perplexity against KV budget", "", "![perplexity vs KV](ppl_vs_kv.png)", ""]
    if report.get("tasks"):
        lines += _tasks_lines(report["tasks"], [m["label"] for m in models])
    if report.get("samples"):
        lines += [
            "## Greedy continuations",
            "",
            f"{settings['sample_tokens']} new tokens, argmax decoding.",
            "",
        ]
        with_samples = [m for m in models if m.get("samples")]
        rows = []
        for i, prompt in enumerate(x["prompt"] for x in orig["samples"]):
            rows.append([_cell(prompt), *(_cell(m["samples"][i]["continuation"]) for m in with_samples)])
        lines += _table(["prompt", *[m["label"] for m in with_samples]], rows)
        lines.append("")
    lines += ["## Conversion", ""]
    if "sweep" in report:
        for m in models[1:]:
            lines += [f"### {m['label']} (`{m['path']}`)", "", *_conversion_lines(m.get("conversion")), ""]
    else:
        lines += [*_conversion_lines(report.get("conversion")), ""]
    return "\n".join(lines)


def bench_markdown(report: dict) -> str:
    orig, conv = report["original"], report["converted"]
    s = report["settings"]
    lines = [
        "# MLA conversion: decode benchmark",
        "",
        f"Original `{orig['path']}` against converted `{conv['path']}` on {s['device']} in {s['dtype']}, "
        f"{s['new_tokens']} decode steps after a prefill of each context, created {report['created_utc']}.",
        f"Peak memory is {report['memory_kind']} (extra memory above the loaded model during prefill + decode).",
        "",
        f"KV cache per token (measured): original {_fmt(orig['kv_bytes_per_token'])} bytes, converted "
        f"{_fmt(conv['kv_bytes_per_token'])} bytes ({report['kv_reduction_pct']:.1f}% smaller).",
        "",
    ]
    rows = []
    for c in report["comparison"]:
        rows.append(
            [
                c["context_len"],
                c["batch_size"],
                c["original_tokens_per_s"],
                c["converted_tokens_per_s"],
                c["speedup"],
                _mib(c["original_peak_memory_bytes"]),
                _mib(c["converted_peak_memory_bytes"]),
                _mib(c["original_cache_bytes"]),
                _mib(c["converted_cache_bytes"]),
            ]
        )
    lines += _table(
        [
            "context",
            "batch",
            "orig tok/s",
            "conv tok/s",
            "speedup",
            "orig peak MiB",
            "conv peak MiB",
            "orig cache MiB",
            "conv cache MiB",
        ],
        rows,
    )
    lines += [
        "",
        "![decode benchmark](bench.png)",
        "",
        "## Conversion",
        "",
        *_conversion_lines(report.get("conversion")),
        "",
    ]
    return "\n".join(lines)


def _mib(x) -> float | None:
    return None if x is None else x / 2**20
