"""The refits' fit on all calibration sequences at other shares of the held-out ridge: the
quality ablation with ``refit_moments.HELD_OUT_SHARE`` replaced.

    cd bench && python experiments/ridge_share.py --share 1 --budgets 0.3125 --rows 6 --out DIR
    cd bench && python experiments/ridge_share.py --share 0.25 --budgets 0.3125 --rows 6 --out DIR

``--share 1`` is the refits before 2026-12-04 (session 22): the grid's ridge applied unchanged to
moments of twice the sequences its held-out fits saw. 0.5 is the default (the fold's share of the
sequences); smaller shares weigh the closed form less than the held-out fits found best. Every other
argument goes to ``quality_ablation.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH.parent))  # mlakit, from a checkout
sys.path.insert(0, str(BENCH))  # quality_ablation and its helpers

import quality_ablation  # noqa: E402

from mlakit.convert import refit_moments  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--share", type=float, required=True, help="the ridge of the fit on all sequences, "
                    "as a share of the held-out one")
    args, rest = ap.parse_known_args()
    if not args.share > 0:
        ap.error(f"--share must be positive, got {args.share}")
    refit_moments.HELD_OUT_SHARE = args.share  # choose_ridge reads it at each call
    sys.argv = [sys.argv[0], *rest]
    quality_ablation.main()


if __name__ == "__main__":
    main()
