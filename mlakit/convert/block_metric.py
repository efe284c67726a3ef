"""A symmetric PSD matrix kept as its diagonal blocks (pure tensor math, float64).

The output metric of the low-rank step is block-diagonal: one dense block over the dropped key
components and one d x d block per KV head's values (``low_rank.output_metric``); TransMLA's
metric is diagonal (``low_rank.bkv_metric``). At Llama-2-7B shape the dense matrix would be
8128^2 (0.5 GB) and its eigendecomposition the costliest step of a layer; block by block it is
one 4032^2 block and 32 blocks of 128^2, and products with it never touch the zeros.

A block is a 1-D tensor (a diagonal block), a 2-D tensor (a dense block) or a 3-D tensor
(n, b, b) (n dense blocks of size b in a row).
"""

from __future__ import annotations

import torch

__all__ = ["BlockMetric", "as_block_metric"]


class BlockMetric:
    def __init__(self, blocks: list[torch.Tensor]):
        for b in blocks:
            if b.dim() not in (1, 2, 3) or (b.dim() > 1 and b.shape[-1] != b.shape[-2]):
                raise ValueError(f"a metric block must be (n,), (n, n) or (k, n, n), got {tuple(b.shape)}")
        self.blocks = [b.double() for b in blocks if self._size(b)]  # an empty block adds nothing

    @staticmethod
    def _size(b: torch.Tensor) -> int:
        return b.shape[0] if b.dim() < 3 else b.shape[0] * b.shape[1]

    @property
    def sizes(self) -> list[int]:
        return [self._size(b) for b in self.blocks]

    @property
    def shape(self) -> tuple[int, int]:
        n = sum(self.sizes)
        return (n, n)

    def double(self) -> BlockMetric:
        return self

    def dense(self) -> torch.Tensor:
        parts = []
        for b in self.blocks:
            parts += [torch.diag(b)] if b.dim() == 1 else [b] if b.dim() == 2 else list(b)
        return torch.block_diag(*parts)

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        """M @ x for x (n, k), block by block."""
        out = []
        for b, xb in zip(self.blocks, x.split(self.sizes, dim=0)):
            if b.dim() == 1:
                out.append(b[:, None] * xb)
            elif b.dim() == 2:
                out.append(b @ xb)
            else:
                out.append((b @ xb.reshape(b.shape[0], b.shape[1], -1)).reshape(xb.shape))
        return torch.cat(out, dim=0)

    def gram(self, x: torch.Tensor) -> torch.Tensor:
        """x^T M x (k, k), one block's rows at a time (symmetrised)."""
        out = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
        for b, xb in zip(self.blocks, x.split(self.sizes, dim=0)):
            out += xb.T @ (BlockMetric([b]) @ xb)
        return (out + out.T) / 2

    def powers(self, powers: tuple[float, ...], rel_eps: float = 1e-12) -> list[BlockMetric]:
        """M^p for each power, eigenvalues floored at rel_eps * (largest eigenvalue of M): the same
        floor, hence the same result, as ``psd_powers`` of the dense matrix."""
        eig = []
        for b in self.blocks:
            eig.append((b, None) if b.dim() == 1 else torch.linalg.eigh(b))
        top = max(float(vals.max()) for vals, _ in eig)
        floor = max(top, 1e-300) * rel_eps
        out = []
        for p in powers:
            blocks = []
            for vals, vecs in eig:
                v = vals.clamp_min(floor).pow(p)
                blocks.append(v if vecs is None else (vecs * v.unsqueeze(-2)) @ vecs.transpose(-1, -2))
            out.append(BlockMetric(blocks))
        return out


def as_block_metric(m: torch.Tensor | BlockMetric) -> BlockMetric:
    """A dense (n, n) matrix as a one-block metric; a BlockMetric unchanged."""
    return m if isinstance(m, BlockMetric) else BlockMetric([m.double()])
