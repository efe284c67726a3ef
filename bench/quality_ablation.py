"""Quality ablation through the real conversion: closed form, + sequential calibration, + refinement,
+ the joint value / o_proj refit.

    nice python bench/quality_ablation.py --out bench/results/quality_ablation          # SmolLM2-135M
    python bench/quality_ablation.py --budgets 0.3125 --rows 2,4 --out /tmp/qa          # one budget, two rows

Every row is a whole ``mla-convert convert`` of --source (``run_conversion``, the pipeline users
run, with the row's options and ``StreamOptions``) into a temporary directory, loaded back with
``MLAForCausalLM.from_pretrained`` and scored by perplexity on several texts, each unlike the
calibration text (the builtin calibration part of ``pydoc_data.topics``):

- ``builtin``: the disjoint evaluation part of the same source (the nearest to the calibration);
- ``GPL-3``: /usr/share/common-licenses/GPL-3 (legal prose);
- ``vim manual``: the Vim user manual, /usr/share/vim/vim90/doc/usr_0*.txt (a manual).

A text whose file is absent on the machine is skipped with a note. Each row's ratio (converted /
source) has a 95% interval from a bootstrap over the evaluation windows, and every row is
compared with a base row on the same windows (paired; the closed form unless --base-row names
another): the interval of ppl(row) / ppl(base), kept as ``vs_default`` (the name from when the base
was always the closed form, then the default). The first row is TransMLA's method as mlakit
implements it (RoRoPE + FreqFold, BKV-PCA, uniform ranks), the reference the issues compare
against. Writes ablation.json and ablation.md to --out, and every row's per-window sums (sums.pt), so that a later
run can pair its rows with this run's base row (--pair-with): how a row under a changed module constant
(experiments/ablation_constants.py) is paired with the default.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from window_bootstrap import ScoredText

from mlakit.data import load_text, tokenize_text
from mlakit.io.source import open_source
from mlakit.mla_model import MLAForCausalLM
from mlakit.pipeline.api import ConvertOptions
from mlakit.pipeline.run import run_conversion
from mlakit.pipeline.run_state import StreamOptions

# name -> (option overrides, sequential calibration)
ROWS = {
    "TransMLA method (RoRoPE+FreqFold, BKV-PCA, uniform)": (
        {"rope_method": "transmla", "lowrank_method": "bkv_pca", "allocation": "uniform", "refine": "none"}, False),
    "closed form only (--refine none)": ({"refine": "none"}, False),
    "+ sequential calibration": ({"refine": "none"}, True),
    "+ refinement (--refine layer)": ({"refine": "layer"}, False),
    "+ sequential calibration + refinement": ({"refine": "layer"}, True),
    "+ value refit (--refine values; the default, --refine auto, where it fits)": ({"refine": "values"}, False),
    # the refit's cost is linear in its sequences: what half of the default calibration gives
    "+ value refit on 64 sequences (--refine values --refine-sequences 64)": (
        {"refine": "values", "refine_sequences": 64}, False),
    # what --refine auto runs where the joint solve is too large (7B shapes)
    "+ per-head value refit (--refine values-per-head)": ({"refine": "values-per-head"}, False),
    # the same rank in every layer: one pass over the calibration set (no statistics pass, no sensitivity sweep)
    "+ value refit, uniform ranks (--refine values --allocation uniform)": (
        {"refine": "values", "allocation": "uniform"}, False),
    # the value refit on the source's own hidden states: one forward less, blind to the layers below (the
    # default until 2026-12-05)
    "+ value refit on the source stream (--refine values --refine-inputs source)": (
        {"refine": "values", "refine_inputs": "source"}, False),
    # the converted-stream refit undoing all of the error the layers below left (the default until 2026-12-06)
    "+ value refit undoing all the inherited error (--refine values --refine-compensate 1)": (
        {"refine": "values", "refine_compensate": 1.0}, False),
    # the default at a chosen FreqFold, paired with the auto fold on the same windows (rope_select.transmla_fold
    # gives the auto fold before 2026-12-06: 1 where more than half the frequencies are kept, 2 at d_R 24, d 64)
    "+ value refit, fold 1 (--refine values --fold 1)": ({"refine": "values", "fold": 1}, False),
    "+ value refit, fold 2 (--refine values --fold 2)": ({"refine": "values", "fold": 2}, False),
    # the fold rule's choice at d_R 24, d 64 (rope_select.auto_fold) from 2026-12-06 until --fold 0 measured it
    "+ value refit, fold 4 (--refine values --fold 4)": ({"refine": "values", "fold": 4}, False),
    # the default with the shared d_R measured in the statistics pass instead of the default share (rope_choice)
    "+ value refit, measured rotary dims (--refine values --rope-dim measured)": (
        {"refine": "values", "rope_dim": "measured"}, False),
    # each layer's d_R measured by the same rule on that layer's own errors (rope_choice)
    "+ value refit, rotary dims measured per layer (--refine values --rope-dim measured-per-layer)": (
        {"refine": "values", "rope_dim": "measured-per-layer"}, False),
}
BASE_ROW = "closed form only (--refine none)"
TEXTS = {
    "builtin": lambda: load_text("builtin", "eval"),
    "GPL-3": lambda: Path("/usr/share/common-licenses/GPL-3").read_text(),
    "vim manual": lambda: "\n".join(Path(p).read_text(errors="replace")
                                    for p in sorted(glob.glob("/usr/share/vim/vim90/doc/usr_0*.txt"))) or None,
}


def load_texts(tokenizer, n_tokens: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, read in TEXTS.items():
        try:
            text = read()
        except OSError as exc:
            print(f"skipping {name}: {exc}", flush=True)
            continue
        if not text:
            print(f"skipping {name}: no text on this machine", flush=True)
            continue
        out[name] = tokenize_text(tokenizer, text)[:n_tokens]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="default")
    ap.add_argument("--budgets", default="0.5,0.3125,0.1875")
    ap.add_argument("--rows", default="all", help="comma-separated row numbers (1-based) or 'all'")
    ap.add_argument("--calib-samples", type=int, default=None, help="default: the options model's")
    ap.add_argument("--calib-seq-len", type=int, default=None, help="default: the options model's")
    ap.add_argument("--calib-data", default=None, help="calibration text SPEC (default: the options model's)")
    ap.add_argument("--seed", type=int, default=None, help="the conversion's seed, which draws the calibration "
                    "windows (default: the options model's)")
    ap.add_argument("--rope-dim", type=int, default=None, help="shared d_R of every row (default: ROPE_SHARE of the budget)")
    ap.add_argument("--lowrank-method", default=None, help="latent factorisation of every row but the TransMLA one "
                    "(default: the options model's, auto)")
    ap.add_argument("--base-row", type=int, default=None, help="the row (1-based) every other row is paired with "
                    "(default: the closed form's)")
    ap.add_argument("--eval-tokens", type=int, default=4096, help="tokens of each text scored")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--pair-with", type=Path, default=None, help="pair every row with the base row of the run "
                    "in this directory (its sums.pt; same source, texts and windows) instead of this run's")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    names = list(ROWS) if args.rows == "all" else [list(ROWS)[int(i) - 1] for i in args.rows.split(",")]
    base_row = BASE_ROW if args.base_row is None else list(ROWS)[args.base_row - 1]
    if base_row not in names and args.pair_with is None:
        ap.error(f"--base-row {args.base_row} is not among --rows {args.rows}")
    paired = load_sums(args.pair_with, ap) if args.pair_with else None
    missing = [b for b in args.budgets.split(",") if paired and f"{float(b)}|{base_row}" not in paired["rows"]]
    if missing:
        ap.error(f"--pair-with {args.pair_with}: no row '{base_row}' at budget(s) {', '.join(missing)} there")
    order = sorted(names, key=lambda n: n != base_row)  # the base row first: the others pair with it
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    source = open_source(args.source)
    texts = {k: ScoredText(ids, args.seq_len, args.stride, args.bootstrap)
             for k, ids in load_texts(source.tokenizer(), args.eval_tokens).items()}

    def window_sums(model) -> dict[str, torch.Tensor]:
        return {k: text.sums(model) for k, text in texts.items()}

    def interval(k, diff):
        ci = texts[k].interval(diff)
        return None if ci is None else [round(v, 4) for v in ci]

    src_sums = window_sums(source.load_model(torch.float32))
    src_ppl = {k: texts[k].ratio(s) for k, s in src_sums.items()}
    print(f"source perplexity: {src_ppl}", flush=True)
    if paired is not None and (paired["source"].keys() != src_sums.keys() or any(
            not torch.equal(paired["source"][k], s) for k, s in src_sums.items())):
        ap.error(f"--pair-with {args.pair_with}: its source scored other windows or texts; pair runs with the same "
                 "--source, --eval-tokens, --seq-len and --stride")

    results, sums_by = [], {}

    def write(complete: bool) -> dict:
        """The tables so far (after every row, so a run stopped early keeps what it measured)."""
        meta = {"source": args.source, "source_ppl": src_ppl,
                "eval_tokens": {k: int(t.ids.numel()) for k, t in texts.items()},
                "seq_len": args.seq_len, "stride": args.stride, "bootstrap": args.bootstrap,
                "calib_samples": args.calib_samples or ConvertOptions().calib_samples,
                "calib_seq_len": args.calib_seq_len or ConvertOptions().calib_seq_len, "rope_dim": args.rope_dim,
                "lowrank_method": args.lowrank_method, "calib_data": args.calib_data or ConvertOptions().calib,
                "seed": ConvertOptions().seed if args.seed is None else args.seed,
                "base_row": base_row, "seconds": round(time.time() - t0), "complete": complete,
                **({"pair_with": str(args.pair_with)} if args.pair_with else {})}
        (args.out / "ablation.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        torch.save({"source": src_sums, "rows": {f"{b}|{n}": v for (b, n), v in sums_by.items()}},
                   args.out / "sums.pt")
        (args.out / "ablation.md").write_text(render(meta, results, names))
        return meta

    for budget in [float(b) for b in args.budgets.split(",")]:
        for name in order:
            overrides, sequential = ROWS[name]
            extra = {k: v for k, v in (("calib_samples", args.calib_samples), ("calib_seq_len", args.calib_seq_len),
                                       ("rope_dim", args.rope_dim), ("calib", args.calib_data),
                                       ("seed", args.seed)) if v is not None and k not in overrides}
            if args.lowrank_method and "lowrank_method" not in overrides:
                extra["lowrank_method"] = args.lowrank_method
            opts = ConvertOptions(kv_budget=budget, quiet=True, **overrides, **extra)
            tick = time.time()
            with tempfile.TemporaryDirectory() as tmp:
                report = run_conversion(args.source, Path(tmp) / "mla", opts, "in-memory",
                                        StreamOptions(sequential=sequential))
                seconds = time.time() - tick
                sums = window_sums(MLAForCausalLM.from_pretrained(Path(tmp) / "mla", torch_dtype=torch.float32))
            row = {"budget": budget, "row": name, "convert_seconds": round(seconds, 1),
                   "ranks": [lay["kv_lora_rank"] for lay in report["layers"]],
                   "rope_dim": report["plan"].get("rope_dim", report["layers"][0]["qk_rope_head_dim"]),
                   **{k: report["plan"][k] for k in ("rope_search", "rope_layer_search") if k in report["plan"]},
                   "folds": [lay.get("fold_choice", {}).get("fold") for lay in report["layers"]], "texts": {}}
            for k, s in sums.items():
                ppl = texts[k].ratio(s)
                cell = {"ppl": ppl, "ratio": ppl / src_ppl[k], "ratio_ci95": interval(k, s - src_sums[k])}
                base = (paired["rows"][f"{budget}|{base_row}"] if paired
                        else sums_by.get((budget, base_row)) if name != base_row else None)
                if base is not None:
                    cell["vs_default"] = texts[k].ratio(s - base[k])
                    cell["vs_default_ci95"] = interval(k, s - base[k])
                row["texts"][k] = cell
            sums_by[(budget, name)] = sums
            results.append(row)
            print(f"{budget:<7} {name:52s} d_R {row['rope_dim']} {seconds:6.0f} s  " + "  ".join(
                f"{k} {c['ratio']:.3f}" + (f" ({c['vs_default']:.3f}x)" if "vs_default" in c else "")
                for k, c in row["texts"].items()), flush=True)
            write(complete=False)

    meta = write(complete=True)
    print(render(meta, results, names))


def load_sums(run: Path, ap: argparse.ArgumentParser) -> dict:
    """The per-window sums another run of this bench saved in RUN (its sums.pt)."""
    if not (run / "sums.pt").is_file():
        ap.error(f"--pair-with {run}: no sums.pt there; give the --out directory of a run of this bench")
    return torch.load(run / "sums.pt")


def render(meta: dict, results: list[dict], names: list[str]) -> str:
    texts = list(meta["source_ppl"])
    budgets = sorted({r["budget"] for r in results}, reverse=True)
    per_text = ", ".join(f"{t}: {meta['eval_tokens'][t]} tokens, source ppl {meta['source_ppl'][t]:.3f}" for t in texts)
    lines = [f"Perplexity ratio (converted / source) of {meta['source']} converted by `run_conversion` (in memory), "
             f"calibration {meta.get('calib_data', 'builtin')} {meta['calib_samples']} x {meta['calib_seq_len']}"
             f" (seed {meta.get('seed', 0)}); "
             + (f"d_R {meta['rope_dim']} in every row; " if meta.get("rope_dim") else "")
             + (f"--lowrank-method {meta['lowrank_method']} in every row but TransMLA's; " if meta.get("lowrank_method") else "") +
             f"{per_text}; "
             f"window {meta['seq_len']}, stride {meta['stride']}. In parentheses: ppl relative to the "
             f"row '{meta.get('base_row', BASE_ROW)}'"
             + (f" of the run in {meta['pair_with']}" if meta.get("pair_with") else "")
             + f" on the same windows with its 95% interval "
             f"({meta['bootstrap']} bootstrap "
             f"resamples of the windows). Bold: the best row of a budget and text. Whole run {meta['seconds']} s"
             + ("." if meta.get("complete", True) else ", stopped or still running: only the rows measured so far."),
             ""]
    for budget in budgets:
        rows = [r for r in results if r["budget"] == budget]
        lines += [f"**kv_budget {budget:g} ({1 - budget:.2%} less KV)**", "",
                  "| row | " + " | ".join(texts) + " | convert s |", "|---|" + "---|" * (len(texts) + 1)]
        for name in names:
            r = next((x for x in rows if x["row"] == name), None)
            if r is None:  # not measured yet
                continue
            cells = []
            for t in texts:
                c = r["texts"][t]
                cell = f"{c['ratio']:.3f}"
                if math.isclose(c["ratio"], min(x["texts"][t]["ratio"] for x in rows)):
                    cell = f"**{cell}**"
                if c.get("vs_default_ci95"):
                    lo, hi = c["vs_default_ci95"]
                    cell += f" ({c['vs_default']:.3f}x, {lo:.3f}-{hi:.3f})"
                cells.append(cell)
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['convert_seconds']:.0f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
