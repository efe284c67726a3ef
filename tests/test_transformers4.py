"""Converted checkpoints load under transformers 4.x with trust_remote_code, the way users on 4.x will.

The 4.x interpreter is ``.venv-tf4/bin/python`` (built by ``scripts/setup.sh --tests``) or
``MLAKIT_TF4_PYTHON``. mlakit is blocked in that process: only the files written beside the
weights and the legacy config fields (``rope_theta``/``rope_scaling``) are used.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from mlakit.mla_model import load_converted
from mlakit.pipeline.api import ConvertOptions, convert
from tests.tiny_models import BLOCK_MLAKIT

ROOT = Path(__file__).resolve().parent.parent
TF4_PYTHON = os.environ.get("MLAKIT_TF4_PYTHON") or str(ROOT / ".venv-tf4" / "bin" / "python")

_CHECK = BLOCK_MLAKIT + textwrap.dedent("""
    import json, sys
    import torch, transformers
    from transformers import AutoModelForCausalLM
    assert transformers.__version__.startswith("4."), transformers.__version__
    report = {}
    for directory in sys.argv[1:]:
        exp = torch.load(directory + "/expected.pt")
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()
        with torch.no_grad():
            err = (model(exp["ids"]).logits - exp["logits"]).abs().max().item()
            gen = model.generate(exp["ids"][:1, :8], max_new_tokens=16, do_sample=False)
        report[directory] = {"err": err, "same_tokens": bool(torch.equal(gen, exp["generated"]))}
    print(json.dumps({"version": transformers.__version__, "report": report}))
""")


def _tf4_python() -> str:
    if not Path(TF4_PYTHON).is_file():
        pytest.skip(f"no transformers 4.x interpreter at {TF4_PYTHON}: run `bash scripts/setup.sh --tests` "
                    f"or set MLAKIT_TF4_PYTHON")
    return TF4_PYTHON


@torch.no_grad()
def test_converted_checkpoints_load_under_transformers_4(tiny_sources, tmp_path):
    """Every family, compressed: same logits and greedy tokens as under transformers 5."""
    python = _tf4_python()
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    dirs = []
    opts = ConvertOptions(dtype="float32", kv_budget=0.5, calib="random", calib_samples=8, calib_seq_len=32,
                          verify=False, quiet=True)
    for family, src in tiny_sources.items():
        out = tmp_path / family
        convert(str(src), out, opts)
        model = load_converted(out, torch.float32)
        generated = model.generate(ids[:1, :8], max_new_tokens=16, do_sample=False)
        torch.save({"ids": ids, "logits": model(ids).logits, "generated": generated}, out / "expected.pt")
        dirs.append(str(out))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run([python, "-c", _CHECK, *dirs], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print("transformers", result["version"], {Path(d).name: r for d, r in result["report"].items()})
    for directory, r in result["report"].items():
        assert r["err"] <= 1e-5, f"{Path(directory).name}: max |dlogit| {r['err']:.3g} under transformers 4.x"
        assert r["same_tokens"], f"{Path(directory).name}: greedy tokens differ under transformers 4.x"
