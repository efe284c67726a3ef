"""mlakit: convert GQA/MHA checkpoints into Multi-head Latent Attention (MLA) models.

``import mlakit`` registers the MLA Auto classes with transformers, but without importing
transformers (or torch) itself: that costs seconds, which ``mla-convert --help`` and a usage error
should not pay. If transformers is already imported the classes are registered now, otherwise the
moment it is imported. ``MLAConfig``, ``MLAForCausalLM`` and ``load_converted`` load on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys

__version__ = "0.1.0"
__all__ = ["MLAConfig", "MLAForCausalLM", "__version__", "load_converted"]

_LAZY = {"MLAConfig": ".mla_model", "MLAForCausalLM": ".mla_model", "load_converted": ".mla_model"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register() -> None:
    """Import ``mla_model``, which registers the Auto classes as it loads. When it is being imported
    right now (its own import of transformers got here), it registers at its end."""
    if f"{__name__}.mla_model" not in sys.modules:
        importlib.import_module(".mla_model", __name__)


class _RegisterAfter(importlib.abc.Loader):
    """Runs transformers' own loader, then registers the Auto classes."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            _register()
        except Exception:  # never break the import of transformers itself
            logging.getLogger(__name__).warning("could not register the MLA Auto classes", exc_info=True)


class _TransformersHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


if "transformers" in sys.modules:
    _register()
elif not any(isinstance(f, _TransformersHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _TransformersHook())
