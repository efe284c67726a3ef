"""What a finished conversion did per layer, read back from its ``conversion.json``: the latent rank and
rotary dims each layer caches, the FreqFold ``--fold 0`` measured for it (``fold_steps``: each candidate's
attention error at full latent rank, the chosen one shown), and where a refinement ran (``--refine``), the
layer's calibration loss before and after it (the attention output's squared error relative to the
target's energy, on the sequences the refinement used) and which result was kept; with ``--rope-dim
measured``, each candidate d_R's summed held-out error (``rope_choice``). ``mla-convert inspect OUT``
prints it."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["REPORT_NAME", "conversion_table", "is_conversion", "read_conversion"]

REPORT_NAME = "conversion.json"


def is_conversion(path: str | Path) -> bool:
    """True when PATH is a directory holding an mlakit conversion report."""
    return (Path(path).expanduser() / REPORT_NAME).is_file()


def read_conversion(path: str | Path) -> dict:
    """The per-layer summary of the conversion at PATH (JSON-ready)."""
    report = json.loads((Path(path).expanduser() / REPORT_NAME).read_text())
    layers = []
    for rec in report["layers"]:
        row = {"layer": rec["layer"], "kv_lora_rank": rec["kv_lora_rank"], "rope_dim": rec["qk_rope_head_dim"]}
        choice = rec.get("fold_choice")
        if choice:
            row |= {"fold": choice["fold"], "fold_errors": choice["errors"]}
        refine = rec.get("refine")
        if refine:
            row |= {"loss_before": refine["loss_before"], "loss_after": refine["loss_after"], "kept": refine["kept"]}
        layers.append(row)
    search = report.get("plan", {}).get("rope_search")
    per_layer = report["settings"].get("rope_dim") == "measured-per-layer"
    return ({"rope_search": search, "rope_per_layer": per_layer} if search else {}) | {
        "converted": str(path),
        "source": report["source"],
        "refine": report["settings"].get("refine", "none"),
        "kv_values_per_token": report["kv_values_per_token"],
        "source_kv_values_per_token": report["source_kv_values_per_token"],
        "layers": layers,
    }


def conversion_table(summary: dict) -> str:
    """One line per layer of ``read_conversion``'s SUMMARY."""
    refined = any("loss_before" in row for row in summary["layers"])
    folded = any("fold" in row for row in summary["layers"])
    share = summary["kv_values_per_token"] / summary["source_kv_values_per_token"]
    lines = [
        f"{summary['converted']} (from {summary['source']}): {summary['kv_values_per_token']} of "
        f"{summary['source_kv_values_per_token']} cached values per token ({share:.1%}), refine {summary['refine']}",
    ]
    if "rope_search" in summary:
        lines.append("d_R measured: " + ", ".join(f"{d}: {errors[0]:.4g} + {errors[1]:.4g}, shuffled {errors[2]:.4g}"
                                                  for d, errors in summary["rope_search"].items())
                     + " (summed over the layers: attention error held out on each validation fold, then on the "
                       "shuffled sequences; "
                     + ("each layer's d_R is its own least held-out error where that beats the default share's on "
                        "both folds and shuffled)" if summary.get("rope_per_layer") else
                        "the least held-out sum wins where it beats the default share's on both folds and shuffled)"))
    head = f"{'layer':>5}{'r':>6}{'d_R':>5}"
    if folded:
        head += f"{'fold':>6}{'rope error':>12}"
        lines.append("fold: the FreqFold measured best; rope error: its attention output's squared error at full "
                     "latent rank relative to the source's energy")
    if refined:
        head += f"{'loss before':>13}{'loss after':>12}{'after/before':>14}  kept"
        lines.append("loss: the attention output's squared error relative to the target's energy, on the "
                     "sequences the refinement used")
    lines.append(head)
    for row in summary["layers"]:
        line = f"{row['layer']:>5}{row['kv_lora_rank']:>6}{row['rope_dim']:>5}"
        if folded:
            fold = row.get("fold")
            line += f"{fold:>6}{row['fold_errors'][str(fold)]:>12.4g}" if fold else f"{'-':>6}{'-':>12}"
        if "loss_before" in row:
            before, after = row["loss_before"], row["loss_after"]
            ratio = after / before if before > 0 else 1.0
            line += f"{before:>13.4g}{after:>12.4g}{ratio:>14.3f}  {row['kept']}"
        lines.append(line)
    return "\n".join(lines)
