"""Low-rank factorisations of the joint NoPE-key/value map y = W_y x~ (x~ = [x; 1]).

Each returns ``(down, up)`` with c_kv = down @ x~ (r rows) and y ~= up @ c_kv.
"""

from __future__ import annotations

import torch

__all__ = ["full_rank", "weight_svd"]


def full_rank(w_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent is y itself: exact."""
    return w_y.clone(), torch.eye(w_y.shape[0], dtype=w_y.dtype)


def weight_svd(w_y: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-free: best rank-r approximation of W_y in Frobenius norm (Eckart-Young)."""
    if not 1 <= rank <= w_y.shape[0]:
        raise ValueError(f"rank must be in [1, {w_y.shape[0]}], got {rank}")
    u, s, vh = torch.linalg.svd(w_y.double(), full_matrices=False)
    return (s[:rank, None] * vh[:rank]).to(w_y.dtype), u[:, :rank].to(w_y.dtype)
