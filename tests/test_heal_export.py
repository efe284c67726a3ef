"""The chain convert -> heal -> export: the DeepSeek-V3 export of a healed model, loaded by
stock transformers, computes the healed model's logits (not the unhealed conversion's)."""

from __future__ import annotations

import torch

from mlakit import load_converted
from mlakit.export import ExportOptions, export
from mlakit.heal import HealOptions, heal
from tests.heal_helpers import make_heal_pair
from tests.tiny_models import assert_close

FP32_BOUND = 1e-3  # as tests/test_export.py: native vs stock DeepSeek-V3 in float32


def test_healed_model_exports_with_its_healed_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    # stock-form rope and one rank for every layer: what the DeepSeek-V3 export needs
    teacher, native = make_heal_pair(
        tmp_path,
        rope_method="transmla",
        rope_dim=16,
        kv_lora_rank=20,
        calib="random",
        calib_samples=8,
        calib_seq_len=32,
    )
    opts = HealOptions(
        teacher=str(teacher),
        data="random",
        tokens=20 * 64,
        seq_len=16,
        batch_size=4,
        lr=2e-3,
        val_sequences=8,
        quiet=True,
    )
    report = heal(native, tmp_path / "healed", opts)
    before, after = report["heldout_before"]["kl"], report["heldout_after"]["kl"]
    assert after < 0.8 * before, f"held-out KL {before:.4f} -> {after:.4f}"
    export(tmp_path / "healed", tmp_path / "ds3", ExportOptions(dtype="float32"))

    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        healed = load_converted(tmp_path / "healed", torch.float32)(ids).logits
        unhealed = load_converted(native, torch.float32)(ids).logits
        stock = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ds3"), dtype=torch.float32).eval()
        assert type(stock).__module__.startswith("transformers.models.deepseek_v3"), type(stock).__module__
        exported = stock(ids).logits
    err = assert_close("export vs healed", exported, healed, atol=FP32_BOUND)
    gap = float((healed - unhealed).abs().max())
    assert gap > 50 * max(err, 1e-6), f"healing moved the logits by only {gap:.2e} (export error {err:.2e})"
    print(f"export vs healed {err:.2e}; healed vs unhealed {gap:.2e}")
