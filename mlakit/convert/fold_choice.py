"""FreqFold chosen by measurement on the calibration data.

The scored rotary selection folds groups of adjacent frequencies so that a kept component can carry a
group's energy at one representative frequency (``rope_select``). How far to fold is a trade the rotary
error model does not judge well: on a 2-KV-head model it ranks the folds in reverse of what perplexity
measures (docs/results.md, "The fold rule"). So with calibration statistics at hand, ``--fold 0`` converts
the layer once per candidate fold and keeps the fold whose attention output comes nearest the source
attention's on calibration sequences (the caller measures: ``choose_fold``'s ERROR). The candidates run
from no folding to ``auto_fold``'s fold below half the frequencies kept: the least fold that leaves no more
groups than kept components. A larger fold leaves groups with nothing kept in them and only adds phase
error to what is kept.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FOLD_TOKENS", "choose_fold", "fold_candidates"]

# calibration tokens each candidate fold's attention error is measured on: the first sequences of the stream
# whose statistics the layer is converted from (all of them when the calibration is shorter)
FOLD_TOKENS = 8192


def fold_candidates(head_dim: int, rope_dim: int) -> list[int]:
    """The folds ``--fold 0`` measures at ROPE_DIM: each divisor of head_dim/2 up to the least that leaves
    no more frequency groups than the d_R/2 kept components; just [1] when every frequency can keep one."""
    half, n_keep = head_dim // 2, rope_dim // 2
    divisors = [f for f in range(1, half + 1) if half % f == 0]
    if n_keep == 0 or n_keep >= half:
        return [1]
    cap = next(f for f in divisors if half // f <= n_keep)
    return [f for f in divisors if f <= cap]


def choose_fold(candidates: list[int], error: Callable[[int], float]) -> tuple[int, dict[int, float]]:
    """The candidate fold whose ERROR(fold) is least (the smaller fold on a tie), and every candidate's error."""
    errors = {f: float(error(f)) for f in candidates}
    return min(candidates, key=lambda f: (errors[f], f)), errors
