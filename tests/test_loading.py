"""A converted checkpoint loads three ways, and its config carries the fields transformers 4.x reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

import mlakit  # noqa: F401  (registers the Auto classes)
from mlakit import MLAForCausalLM
from mlakit.pipeline.api import ConvertOptions, convert
from tests.tiny_models import BLOCK_MLAKIT, assert_close


@pytest.fixture(scope="module")
def scaled_out(tiny_sources, tmp_path_factory):
    dest = tmp_path_factory.mktemp("load") / "llama3"
    opts = ConvertOptions(dtype="float32", rope_dim=16, quiet=True, calib="random", calib_samples=8, calib_seq_len=32)
    convert(str(tiny_sources["llama3_scaled"]), dest, opts)
    return dest


@torch.no_grad()
def test_auto_class_and_direct_class_agree(scaled_out):
    ids = torch.randint(3, 96, (1, 12))
    auto = AutoModelForCausalLM.from_pretrained(str(scaled_out)).eval()
    direct = MLAForCausalLM.from_pretrained(str(scaled_out)).eval()
    assert isinstance(auto, MLAForCausalLM)
    assert_close("auto vs direct", auto(ids).logits, direct(ids).logits, atol=0)


def test_config_has_legacy_rope_fields_and_auto_map(scaled_out):
    cfg = json.loads((scaled_out / "config.json").read_text())
    assert cfg["model_type"] == "mlakit_mla"
    assert cfg["rope_theta"] == 500000.0  # what transformers 4.x reads
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0  # what transformers 5.x reads
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_mla.MLAForCausalLM"
    code = (scaled_out / "modeling_mla.py").read_text()
    assert "from ..kernels" not in code and "import mlakit" not in code and "from mlakit" not in code


def test_legacy_config_fields_alone_rebuild_the_same_rope(scaled_out):
    """A loader that only understands rope_theta/rope_scaling (4.x) must get the same frequencies."""
    from mlakit.mla_model.configuration_mla import MLAConfig

    raw = json.loads((scaled_out / "config.json").read_text())
    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"}
    assert MLAConfig(**legacy).rope_parameters == MLAConfig(**raw).rope_parameters


def test_remote_code_loads_without_mlakit(scaled_out, tmp_path):
    ids = torch.randint(3, 96, (1, 12))
    with torch.no_grad():
        want = MLAForCausalLM.from_pretrained(str(scaled_out)).eval()(ids).logits
    torch.save({"ids": ids, "logits": want}, tmp_path / "expected.pt")
    script = BLOCK_MLAKIT + textwrap.dedent(f"""
        import json, sys
        import torch
        from transformers import AutoModelForCausalLM
        exp = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(scaled_out)!r}, trust_remote_code=True).eval()
        assert not any(m == "mlakit" or m.startswith("mlakit.") for m in sys.modules), "mlakit was imported"
        with torch.no_grad():
            got = model(exp["ids"]).logits
        err = (got - exp["logits"]).abs().max().item()
        assert err <= 1e-5, err
        out = model.generate(exp["ids"], max_new_tokens=5, do_sample=False)
        print("OK", type(model).__module__, err, out.shape[1])
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK transformers_modules" in proc.stdout, proc.stdout
