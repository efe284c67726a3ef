"""Serving mlakit's native MLA checkpoints in engines (vLLM, through an out-of-tree plugin).

Importing this package imports nothing of vLLM: ``vllm_plugin.register`` is the entry point
vLLM calls, ``vllm_model`` the model class it imports lazily, ``served_shape`` the engine-free
checks and padding math.
"""

from __future__ import annotations

__all__: list[str] = []
