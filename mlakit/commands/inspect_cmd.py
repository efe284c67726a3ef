"""`mla-convert inspect SRC`: per-layer K/V/rotary spectra and the rank plan a KV budget gives."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .common import user_errors, verbosity_options
from .option_flags import option_flags

if TYPE_CHECKING:
    from ..arch.families import AttentionShape
    from ..options import ConvertOptions

# The conversion modules (torch, transformers) are imported in the functions that use them, so that
# `mla-convert --help` and usage errors answer without loading them.

__all__ = ["format_table", "inspect_command", "inspect_source", "spectra_figure"]

REPORT_JSON, FIGURE_PNG = "inspect.json", "spectra.png"
THRESHOLDS = (0.9, 0.99)


def _check_budget_fits(kv_budget: float, shape: AttentionShape, n_layers: int) -> None:
    """Fail before calibrating when the budget cannot hold the shared rope dims plus rank 4 per layer."""
    from ..convert.rank_plan import budget_rope_dim
    from ..pipeline.api import ConversionError

    per_layer = 2 * shape.num_kv_heads * shape.head_dim
    budget = int(kv_budget * n_layers * per_layer)
    d_r = budget_rope_dim(shape.num_kv_heads, shape.head_dim, budget / n_layers)
    need = n_layers * (d_r + 4)
    if budget < need:
        raise ConversionError(
            f"--kv-budget {kv_budget:g} leaves {budget} cached values per token over {n_layers} layers, below the "
            f"minimum {need} (rope dims {d_r} + latent rank 4 per layer); use --kv-budget >= "
            f"{math.ceil(need / (n_layers * per_layer) * 1e4) / 1e4:g}"
        )


def _plan(ws, ms, shape: AttentionShape, opts: ConvertOptions) -> dict:
    """The per-layer (kv_lora_rank, rope dims) that `convert --kv-budget` would build."""
    from ..convert.inspect_model import latent_energy_kept
    from ..pipeline.settings import method_of
    from ..pipeline.whole_model import build_layers

    built, plan = build_layers(ws, ms, shape, opts, quiet=opts.quiet)
    method = method_of(opts, shape)
    rows = [
        {
            "layer": i,
            "kv_lora_rank": lay.kv_lora_rank,
            "rope_dim": lay.rope_dim,
            "values_per_token": lay.kv_lora_rank + lay.rope_dim,
            "latent_energy_kept": round(latent_energy_kept(w, m, method, lay.rope_dim, lay.kv_lora_rank), 6),
        }
        for i, (w, m, lay) in enumerate(zip(ws, ms, built))
    ]
    return {
        "kv_budget": opts.kv_budget,
        "allocation": plan["allocation"],
        "budget_values_per_token": plan["budget_values_per_token"],
        "values_per_token": sum(r["values_per_token"] for r in rows),
        "source_values_per_token": len(rows) * 2 * shape.num_kv_heads * shape.head_dim,
        "rope_dim": plan["rope_dim"],
        "layers": rows,
    }


def inspect_source(src: str, opts: ConvertOptions, thresholds: tuple[float, ...] = THRESHOLDS) -> dict:
    """Calibrate SRC once and return the inspection report (JSON-ready)."""
    import torch
    from tqdm.auto import tqdm

    from ..arch.families import attention_shape
    from ..convert.assemble import read_attention
    from ..convert.inspect_model import layer_spectra, spectra_summary
    from ..convert.layer_metrics import layer_metrics
    from ..io.source import open_source
    from ..pipeline.whole_model import calibrate

    start = time.time()
    torch.manual_seed(opts.seed)
    source = open_source(src)
    shape = attention_shape(source.config)
    n_layers = source.config.num_hidden_layers
    if opts.kv_budget is not None:
        _check_budget_fits(opts.kv_budget, shape, n_layers)
    ws = [read_attention(source, i, shape) for i in range(n_layers)]
    stats = calibrate(source, shape, opts)
    ms = [layer_metrics(w, st) for w, st in zip(ws, stats)]
    layers = [
        {"layer": i, **spectra_summary(layer_spectra(w, m), thresholds)}
        for i, (w, m) in enumerate(
            tqdm(list(zip(ws, ms)), desc="layer spectra", disable=opts.quiet, leave=False)
        )
    ]
    return {
        "source": str(src),
        "architecture": shape.family,
        "num_layers": n_layers,
        **{k: getattr(shape, k) for k in ("num_heads", "num_kv_heads", "head_dim", "hidden_size")},
        "kv_dims_per_layer": 2 * shape.num_kv_heads * shape.head_dim,
        "calibration": {
            "data": opts.calib,
            "samples": opts.calib_samples,
            "seq_len": opts.calib_seq_len,
            "seed": opts.seed,
            "tokens": stats[0].tokens,
        },
        "thresholds": list(thresholds),
        "inv_freq": [float(f"{x:.6g}") for x in stats[0].inv_freq.tolist()],
        "layers": layers,
        "plan": _plan(ws, ms, shape, opts) if opts.kv_budget is not None else None,
        "seconds": round(time.time() - start, 2),
    }


def format_table(report: dict) -> str:
    """One line per layer: dims holding each energy threshold for K, V, K+V, the RoRoPE lead share, the plan."""
    G, d = report["num_kv_heads"], report["head_dim"]
    keys = [f"{t:g}" for t in report["thresholds"]]
    pct = [f"{float(k) * 100:g}%" for k in keys]
    plan = report["plan"]
    lines = [
        f"{report['source']} ({report['architecture']}): {report['num_layers']} layers, {report['num_heads']} heads, "
        f"{G} KV heads x head_dim {d}; K and V have {G * d} dims each, K+V {2 * G * d}",
        "columns: dims holding that share of the calibration energy; rope lead = share of key energy in the "
        "leading RoRoPE component of each frequency (1/G = no concentration)",
    ]
    head = (
        "layer"
        + "".join(f"{p + ' ' + name:>10}" for name in ("K", "V", "K+V") for p in pct)
        + f"{'rope lead':>11}"
    )
    if plan:
        head += f" |{'r':>5}{'d_R':>5}{'y kept':>8}"
    lines.append(head)
    for i, lay in enumerate(report["layers"]):
        row = f"{lay['layer']:>5}" + "".join(
            f"{lay[part]['dims'][k]:>10}" for part in ("k", "v", "kv") for k in keys
        )
        row += f"{lay['rotary']['lead_energy_share']:>11.3f}"
        if plan:
            p = plan["layers"][i]
            row += f" |{p['kv_lora_rank']:>5}{p['rope_dim']:>5}{p['latent_energy_kept']:>8.3f}"
        lines.append(row)
    if plan:
        lines.append(
            f"plan for --kv-budget {plan['kv_budget']:g} (allocation {plan['allocation']}): {plan['values_per_token']} of {plan['source_values_per_token']} "
            f"cached values per token ({plan['values_per_token'] / plan['source_values_per_token']:.1%}, budget "
            f"{plan['budget_values_per_token']}), shared rope dims d_R {plan['rope_dim']}; y kept = share of the "
            f"latent target's energy (dropped rotary keys + values) in its top r directions"
        )
    return "\n".join(lines)


def spectra_figure(report: dict):
    """Unexplained K+V energy by dims per layer (colour = depth), dims per layer with the plan, and the
    RoRoPE lead share per layer x frequency. Built from the report alone, so inspect.json can be redrawn."""
    import numpy as np
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    layers, plan = report["layers"], report["plan"]
    n, G = len(layers), report["num_kv_heads"]
    keys = [f"{t:g}" for t in report["thresholds"]]
    fig = Figure(figsize=(17, 4.8), layout="constrained")
    ax_spec, ax_dims, ax_rot = fig.subplots(1, 3)

    cmap, norm = "viridis", Normalize(0, max(n - 1, 1))
    sm = ScalarMappable(norm=norm, cmap=cmap)
    for lay in layers:
        eig = np.asarray(lay["kv"]["eigenvalues"])
        rest = 1 - np.cumsum(eig) / max(eig.sum(), 1e-300)
        ax_spec.semilogy(
            np.arange(1, eig.size + 1), np.clip(rest, 1e-6, 1), color=sm.to_rgba(lay["layer"]), lw=1
        )
    for k in keys:
        ax_spec.axhline(1 - float(k), color="grey", ls=":", lw=1)
    ax_spec.set_ylim(1e-4, 1.05)
    ax_spec.set_xlabel("K+V dims kept (top eigen-directions)")
    ax_spec.set_ylabel("unexplained K+V energy")
    ax_spec.set_title("K+V energy spectrum per layer")
    fig.colorbar(sm, ax=ax_spec, label="layer")

    idx = [lay["layer"] for lay in layers]
    if plan:
        r = [p["kv_lora_rank"] for p in plan["layers"]]
        d_r = [p["rope_dim"] for p in plan["layers"]]
        ax_dims.bar(idx, r, color="tab:blue", alpha=0.35, label="planned kv_lora_rank r")
        ax_dims.bar(idx, d_r, bottom=r, color="tab:orange", alpha=0.35, label="planned rope dims d_R")
    for part, colour in (("k", "tab:red"), ("v", "tab:green"), ("kv", "black")):
        label = {"k": "K", "v": "V", "kv": "K+V"}[part]
        for k, style in zip(keys, ("--", "-")):
            ax_dims.plot(
                idx,
                [lay[part]["dims"][k] for lay in layers],
                style,
                color=colour,
                marker=".",
                label=f"{label} {float(k) * 100:g}%",
            )
    ax_dims.set_xlabel("layer")
    ax_dims.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_dims.set_ylabel("dims")
    ax_dims.set_title(
        "Dims for 90% / 99% of the energy" + (f"; plan at budget {plan['kv_budget']:g}" if plan else "")
    )
    ax_dims.grid(alpha=0.3)
    ax_dims.legend(fontsize="x-small", ncol=2)

    lead = np.asarray([lay["rotary"]["lead_fraction"] for lay in layers])  # (layers, d/2)
    im = ax_rot.imshow(
        lead, aspect="auto", origin="lower", cmap="magma", vmin=1 / G, vmax=1, interpolation="nearest"
    )
    ax_rot.set_xlabel("rotary frequency index j (0 = highest)")
    ax_rot.set_ylabel("layer")
    ax_rot.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_rot.set_title("RoRoPE: key energy share of the leading mixed component")
    fig.colorbar(im, ax=ax_rot, label="share")
    return fig


def _check_out(out: str) -> Path:
    """OUT may be new, empty, or an earlier inspect output (replaced); anything else is refused."""
    path = Path(out).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise click.BadParameter(
            f"{path} exists and is not a directory; pass a new directory", param_hint="--out"
        )
    if path.is_dir() and any(path.iterdir()) and not (path / REPORT_JSON).is_file():
        raise click.BadParameter(
            f"{path} is not empty and holds no {REPORT_JSON}, so it is not an earlier inspect "
            f"output; refusing to replace it. Pass a new or empty directory",
            param_hint="--out",
        )
    return path


@click.command("inspect")
@click.argument("src")
@option_flags(
    "kv_budget", "allocation", "calib", "calib_samples", "calib_seq_len", "device",
    help={"kv_budget": "Also show the per-layer plan `convert --kv-budget` would build for this fraction of the "
                       "source's cached values per token (e.g. 0.3125)."},
)  # fmt: skip
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help=f"Directory for {REPORT_JSON} and {FIGURE_PNG}, written atomically (an earlier inspect "
    "output there is replaced); without it only the table is printed.",
)
@verbosity_options
@user_errors
def inspect_command(src, kv_budget, allocation, calib, calib_samples, calib_seq_len, out, device, quiet):
    """Per-layer K/V/rotary spectra of SRC (model directory, .gguf file, hub id, or 'default').

    SRC may also be a checkpoint `convert` wrote: then the table says what each layer caches and, for
    a refined conversion, its calibration loss before and after refinement (nothing is calibrated)."""
    from ..options import ConvertOptions
    from ..pipeline.conversion_table import conversion_table, is_conversion, read_conversion

    out_path = _check_out(out) if out else None
    if is_conversion(src):
        if kv_budget is not None:
            raise click.BadParameter(f"{src} is a converted checkpoint: --kv-budget plans the conversion of a "
                                     f"source model; pass the source instead", param_hint="--kv-budget")
        summary = read_conversion(src)
        click.echo(conversion_table(summary))
        if out_path is not None:
            from ..io.output_dir import atomic_output
            from ..io.writer import write_json

            with atomic_output(out_path, overwrite=True, markers=(REPORT_JSON,)) as tmp:
                write_json(tmp / REPORT_JSON, summary)
            click.echo(f"wrote {out_path / REPORT_JSON}")
        return
    opts = ConvertOptions(  # checked before torch is imported
        kv_budget=kv_budget,
        allocation=allocation,
        calib=calib,
        calib_samples=calib_samples,
        calib_seq_len=calib_seq_len,
        device=device,
        quiet=quiet,
    )
    from ..io.output_dir import atomic_output
    from ..io.writer import write_json
    from ..pipeline.run import resolve_device

    opts = dataclasses.replace(opts, device=resolve_device(opts.device))  # auto: cuda when visible
    report = inspect_source(src, opts)
    click.echo(format_table(report))
    if out_path is not None:
        fig = spectra_figure(report)
        with atomic_output(out_path, overwrite=True, markers=(REPORT_JSON,)) as tmp:
            write_json(tmp / REPORT_JSON, report)
            fig.savefig(tmp / FIGURE_PNG, dpi=110)
        click.echo(f"wrote {out_path / REPORT_JSON} and {out_path / FIGURE_PNG}")
