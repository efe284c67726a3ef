"""One evaluation text cut into sliding windows, scored per window, with bootstrap intervals.

The quality benches compare many converted models on the same windows: each model's summed NLL
per window (``sums``) gives its perplexity, and the difference of two models' sums gives a paired
ratio whose 95% interval comes from resampling the windows (the same resamples for every model).
"""

from __future__ import annotations

import math

import torch

from mlakit.eval.perplexity import sliding_windows, window_nll


class ScoredText:
    def __init__(self, ids: torch.Tensor, seq_len: int, stride: int, bootstrap: int, seed: int = 0):
        self.ids = ids
        self.windows = sliding_windows(int(ids.numel()), seq_len, stride)
        self.scored = torch.tensor([w.n_scored for w in self.windows], dtype=torch.float64)
        gen = torch.Generator().manual_seed(seed)
        self.resamples = torch.randint(0, len(self.windows), (bootstrap, len(self.windows)), generator=gen)

    def sums(self, model) -> torch.Tensor:
        """Summed NLL of each window's scored tokens under MODEL (put in eval mode)."""
        model.eval()
        return torch.cat([window_nll(model, self.ids, self.windows[i : i + 4], "cpu")
                          for i in range(0, len(self.windows), 4)])

    def ratio(self, diff: torch.Tensor) -> float:
        """exp(sum DIFF / scored tokens): a perplexity from SUMS, or a ratio of two from their difference."""
        return math.exp(float(diff.sum() / self.scored.sum()))

    def interval(self, diff: torch.Tensor) -> list[float] | None:
        """95% bootstrap interval (over windows) of ``ratio(DIFF)``; None without resamples."""
        if self.resamples.shape[0] == 0:
            return None
        stats = (diff[self.resamples].sum(1) / self.scored[self.resamples].sum(1)).exp()
        return [float(stats.quantile(0.025)), float(stats.quantile(0.975))]
