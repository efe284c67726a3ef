"""Report figures, drawn on matplotlib ``Figure`` objects (no pyplot, no global state)."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = [
    "bench_figure",
    "kv_per_layer_figure",
    "layer_ranks_figure",
    "ppl_vs_kv_figure",
    "task_accuracy_figure",
]


def layer_ranks_figure(series: dict[str, list[dict]]) -> Figure:
    """Per-layer latent rank r and rope dims d_R; ``series`` maps a label to per-layer dicts
    with ``kv_lora_rank`` and ``qk_rope_head_dim``."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, layers in series.items():
        idx = list(range(len(layers)))
        ax.plot(idx, [lay["kv_lora_rank"] for lay in layers], marker="o", label=f"{label}: kv_lora_rank r")
        ax.plot(
            idx,
            [lay["qk_rope_head_dim"] for lay in layers],
            marker="s",
            linestyle="--",
            label=f"{label}: rope dims d_R",
        )
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("dimensions cached per token")
    ax.set_title("Per-layer latent rank and rotary dims")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def kv_per_layer_figure(series: dict[str, list[float]]) -> Figure:
    """Measured KV bytes per token for each layer, one line per model."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, values in series.items():
        ax.plot(range(len(values)), values, marker="o", label=label)
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("KV cache bytes per token")
    ax.set_title("Measured KV cache per layer")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def ppl_vs_kv_figure(points: list[dict]) -> Figure:
    """Perplexity against KV bytes per token; ``points`` have ``label``, ``kv_bytes_per_token``, ``ppl``."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    conv = sorted((p for p in points if not p.get("is_original")), key=lambda p: p["kv_bytes_per_token"])
    ax.plot([p["kv_bytes_per_token"] for p in conv], [p["ppl"] for p in conv], marker="o", label="converted")
    for p in conv:
        ax.annotate(
            p["label"],
            (p["kv_bytes_per_token"], p["ppl"]),
            fontsize="x-small",
            xytext=(3, 3),
            textcoords="offset points",
        )
    for p in points:
        if p.get("is_original"):
            ax.scatter(
                [p["kv_bytes_per_token"]], [p["ppl"]], marker="*", s=150, color="black", label="original"
            )
    ax.set_xlabel("KV cache bytes per token")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity against KV budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def bench_figure(results: dict[str, list[dict]]) -> Figure:
    """Decode tokens/s (left) and peak memory (right) against context length, one line per
    model and batch size; ``results`` maps a model label to BenchPoint dicts."""
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    ax_speed, ax_mem = fig.subplots(1, 2)
    for label, points in results.items():
        for batch in sorted({p["batch_size"] for p in points}):
            pts = sorted((p for p in points if p["batch_size"] == batch), key=lambda p: p["context_len"])
            ctx = [p["context_len"] for p in pts]
            ax_speed.plot(
                ctx, [p["decode_tokens_per_s"] for p in pts], marker="o", label=f"{label}, B={batch}"
            )
            mem = [p["peak_memory_bytes"] for p in pts]
            if all(m is not None for m in mem):
                ax_mem.plot(ctx, [m / 2**20 for m in mem], marker="o", label=f"{label}, B={batch}")
    ax_speed.set(xlabel="context length", ylabel="decode tokens/s", title="Decode throughput")
    ax_mem.set(xlabel="context length", ylabel="peak extra memory (MiB)", title="Peak memory")
    for ax in (ax_speed, ax_mem):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return fig


def task_accuracy_figure(rows: list[dict], models: list[str]) -> Figure:
    """Grouped bars: one group per task, one bar per model, with the harness's standard error.
    ``rows`` have ``task``, ``metric`` and per model label ``{label: (value, stderr or None)}``."""
    fig = Figure(figsize=(max(6, 1.6 * len(rows) + 2), 4.5), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(len(models), 1)
    for j, label in enumerate(models):
        xs = [i + (j - (len(models) - 1) / 2) * width for i in range(len(rows))]
        vals = [r["values"][label][0] for r in rows]
        errs = [r["values"][label][1] or 0.0 for r in rows]
        ax.bar(xs, vals, width, yerr=errs, capsize=3, label=label)
    ax.set_xticks(range(len(rows)), [f"{r['task']}\n({r['metric']})" for r in rows], fontsize="small")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("Downstream accuracy (lm-evaluation-harness), ± standard error")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return fig
