"""The quality ablation with a conversion constant replaced: the ridge share of the refits' fit on all
calibration sequences (``refit_moments.HELD_OUT_SHARE``), the fisher allocation's step from uniform
ranks (``rank_plan.FISHER_STEP``) or the rotary key's share of each layer's budget
(``rank_plan.ROPE_SHARE``).

    cd bench && python experiments/ablation_constants.py --ridge-share 1 --budgets 0.3125 --rows 6 --out DIR
    cd bench && python experiments/ablation_constants.py --fisher-step 1 --budgets 0.3125 --rows 6 --out DIR
    cd bench && python experiments/ablation_constants.py --rope-share 0.3 --budgets 0.5,0.1875 --rows 6 --out DIR

``--ridge-share 1`` is the refits before 2026-12-04 (session 22): the grid's ridge applied unchanged
to moments of twice the sequences its held-out fits saw; 0.5 is the default (the fold's share of the
sequences). ``--fisher-step`` (0.5) and ``--rope-share`` (0.4) were chosen on the closed form's quality
sweeps, before the value refit. Every other argument goes to ``quality_ablation.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH.parent))  # mlakit, from a checkout
sys.path.insert(0, str(BENCH))  # quality_ablation and its helpers

import quality_ablation  # noqa: E402

from mlakit.convert import rank_plan, refit_moments  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ridge-share", type=float, help="the ridge of the fit on all sequences, as a share of the "
                    "held-out one (default: HELD_OUT_SHARE)")
    ap.add_argument("--fisher-step", type=float, help="how far the fisher ranks move from uniform toward the "
                    "KL-optimal ones, 0-1 (default: FISHER_STEP)")
    ap.add_argument("--rope-share", type=float, help="the rotary key's share of each layer's budget, "
                    "0-1 (default: ROPE_SHARE; --rope-dim fixes d_R instead)")
    args, rest = ap.parse_known_args()
    if args.ridge_share is not None:
        if not args.ridge_share > 0:
            ap.error(f"--ridge-share must be positive, got {args.ridge_share}")
        refit_moments.HELD_OUT_SHARE = args.ridge_share  # choose_ridge reads it at each call
    if args.fisher_step is not None:
        if not 0 <= args.fisher_step <= 1:
            ap.error(f"--fisher-step must be in [0, 1], got {args.fisher_step}")
        damped = rank_plan.damped_ranks  # ranks_from_curves looks it up at each call
        rank_plan.damped_ranks = lambda curves, uniform, budget, step: damped(curves, uniform, budget, args.fisher_step)
    if args.rope_share is not None:
        if not 0 < args.rope_share < 1:
            ap.error(f"--rope-share must be in (0, 1), got {args.rope_share}")
        rank_plan.ROPE_SHARE = args.rope_share  # budget_rope_dim reads it at each call
    sys.argv = [sys.argv[0], *rest]
    quality_ablation.main()


if __name__ == "__main__":
    main()
