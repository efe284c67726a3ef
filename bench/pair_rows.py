"""Paired perplexity ratio of two rows of one quality_ablation.py run, from the per-window sums it saved.

quality_ablation.py pairs every row with one base row; this compares any two rows of a run (for instance two
options that both differ from the default) on the same windows, with the bench's bootstrap interval:

    python bench/pair_rows.py results/quality_ablation_qwen2_small/rope_per_layer 16 15

prints, per budget and text, row 16's perplexity relative to row 15's (rows numbered as quality_ablation.py's
--rows) with its 95% interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from quality_ablation import ROWS
from window_bootstrap import ScoredText


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the --out directory of a quality_ablation.py run")
    ap.add_argument("row", type=int, help="the row compared (quality_ablation.py's row number)")
    ap.add_argument("base", type=int, help="the row it is compared with")
    args = ap.parse_args()
    if not (args.run / "sums.pt").is_file():
        ap.error(f"{args.run}: no sums.pt there; give the --out directory of a quality_ablation.py run")
    meta = json.loads((args.run / "ablation.json").read_text())["meta"]
    rows = torch.load(args.run / "sums.pt")["rows"]
    row, base = list(ROWS)[args.row - 1], list(ROWS)[args.base - 1]
    print(f"{row}\nrelative to {base}\n(ppl ratio on the same windows, 95% interval from {meta['bootstrap']} "
          f"resamples of the windows)")
    for budget in sorted({float(k.split("|")[0]) for k in rows}, reverse=True):
        if f"{budget}|{row}" not in rows or f"{budget}|{base}" not in rows:
            continue
        cells = []
        for text, n_tokens in meta["eval_tokens"].items():
            # the windows and their resamples depend only on the text's length (as in the bench's own run)
            scored = ScoredText(torch.zeros(n_tokens, dtype=torch.long), meta["seq_len"], meta["stride"],
                                meta["bootstrap"])
            diff = rows[f"{budget}|{row}"][text] - rows[f"{budget}|{base}"][text]
            low, high = scored.interval(diff)
            cells.append(f"{text} {scored.ratio(diff):.3f}x ({low:.3f}-{high:.3f})")
        print(f"{budget:<7} " + "; ".join(cells))


if __name__ == "__main__":
    main()
