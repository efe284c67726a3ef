"""Pick the absorbed-decode implementation: Triton on CUDA, the torch reference elsewhere.

``MLAKIT_DECODE=triton|torch`` (or the ``backend`` argument) forces one. Forcing Triton on
a CPU tensor runs the kernel in Triton's interpreter, which must be enabled with
``TRITON_INTERPRET=1`` before triton is first imported.
"""

from __future__ import annotations

import os

import torch

from .decode_reference import mla_decode_reference

__all__ = ["mla_decode", "resolve_backend"]

_BACKENDS = ("auto", "triton", "torch")


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    choice = (backend or os.environ.get("MLAKIT_DECODE", "auto")).lower()
    if choice not in _BACKENDS:
        raise ValueError(f"decode backend {choice!r} is not one of {_BACKENDS}; set MLAKIT_DECODE accordingly")
    if choice == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    return choice


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def mla_decode(q_lat, q_rope, c_kv, k_rope, lengths, scale, block_table=None, starts=None, backend=None):
    """Absorbed decode; see ``decode_reference`` for the shapes and semantics."""
    if resolve_backend(q_lat.device, backend) == "triton":
        from .decode_triton import mla_decode_triton
        return mla_decode_triton(q_lat, q_rope, c_kv, k_rope, lengths, scale, block_table=block_table, starts=starts)
    return mla_decode_reference(q_lat, q_rope, c_kv, k_rope, lengths, scale, block_table=block_table, starts=starts)
