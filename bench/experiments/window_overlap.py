"""How much distinct text a calibration draw holds: the distinct 8-grams of token ids over all of its
windows, for several window counts. Random windows overlap once they cover a fair part of the text (the
builtin calibration text is under 90K tokens with SmolLM2's tokenizer), so more windows add fewer new
8-grams than tokens; an 8-gram is long enough that a repeat is almost always a shared passage.

    python bench/experiments/window_overlap.py                 # 64, 128, 256 windows of 512, seeds 0 and 1
    python bench/experiments/window_overlap.py --samples 173 --seeds 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mlakit.data import calibration_batches  # noqa: E402
from mlakit.io.source import open_source  # noqa: E402

GRAM = 8


def distinct_grams(windows) -> int:
    """Distinct GRAM-token runs inside the rows of WINDOWS (a run never spans two windows)."""
    seen = set()
    for row in windows.tolist():
        seen.update(tuple(row[i : i + GRAM]) for i in range(len(row) - GRAM + 1))
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", default="64,128,256", help="comma-separated window counts")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seeds", default="0,1", help="comma-separated draw seeds")
    args = ap.parse_args()
    tokenizer = open_source("default").tokenizer()
    print(f"| windows x {args.seq_len} | seed | distinct {GRAM}-grams | {GRAM}-grams in all windows |")
    print("|---|---|---|---|")
    for n in (int(s) for s in args.samples.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            windows = calibration_batches(tokenizer, "builtin", n, args.seq_len, seed, flag="--calib")
            print(f"| {n} | {seed} | {distinct_grams(windows)} | {n * (args.seq_len - GRAM + 1)} |")


if __name__ == "__main__":
    main()
