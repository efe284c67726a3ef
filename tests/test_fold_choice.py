"""--fold 0 with calibration: each candidate FreqFold measured on the calibration stream, the least error kept."""

from __future__ import annotations

import pytest

from mlakit.convert.fold_choice import choose_fold, fold_candidates
from mlakit.convert.rope_select import auto_fold
from mlakit.pipeline.api import ConvertOptions, convert, convert_streaming
from mlakit.pipeline.conversion_table import conversion_table, read_conversion
from tests.convert_helpers import assert_same_bytes, checkpoint_tensors

pytestmark = pytest.mark.filterwarnings("ignore")

# llama_gqa: 2 KV heads of head_dim 16, so 8 frequencies; rope dim 6 keeps 3 components: folds 1, 2 and 4
CALIB = dict(calib="random", calib_samples=6, calib_seq_len=16, dtype="float32", quiet=True, refine="none")


@pytest.mark.parametrize("half", [8, 32, 64])
def test_candidates_run_from_no_fold_to_the_least_fold_with_no_group_left_empty(half):
    divisors = [f for f in range(1, half + 1) if half % f == 0]
    for n_keep in range(0, half + 2):
        got = fold_candidates(2 * half, 2 * n_keep)
        if n_keep == 0 or n_keep >= half:
            assert got == [1]
            continue
        cap = got[-1]
        assert got == [f for f in divisors if f <= cap]
        assert half // cap <= n_keep and all(half // f > n_keep for f in got[:-1])
        assert auto_fold(half, n_keep) in got  # the rule the data-free conversion uses is always a candidate
    assert fold_candidates(64, 24) == [1, 2, 4] and fold_candidates(64, 40) == [1, 2]


def test_the_least_error_is_chosen_and_a_tie_goes_to_the_smaller_fold():
    assert choose_fold([1, 2, 4], {1: 0.3, 2: 0.1, 4: 0.2}.get) == (2, {1: 0.3, 2: 0.1, 4: 0.2})
    assert choose_fold([1, 2, 4], {1: 0.5, 2: 0.2, 4: 0.2}.get)[0] == 2


def test_each_layer_is_converted_at_the_fold_its_measurement_chose(tiny_sources, tmp_path):
    """One-pass (uniform ranks): every layer's attention is the one an explicit --fold of its chosen fold
    writes, and the choice is the least of the errors the report records."""
    source = str(tiny_sources["llama_gqa"])
    shape = dict(kv_lora_rank=20, rope_dim=6, **CALIB)
    report = convert(source, tmp_path / "auto", ConvertOptions(**shape))
    got = checkpoint_tensors(tmp_path / "auto")
    chosen = set()
    for rec in report["layers"]:
        choice = rec["fold_choice"]
        errors = {int(f): e for f, e in choice["errors"].items()}
        assert sorted(errors) == [1, 2, 4] and all(e >= 0 for e in errors.values())
        assert choice["fold"] == min(errors, key=lambda f: (errors[f], f))
        chosen.add(choice["fold"])
    for fold in chosen:
        convert(source, tmp_path / f"fold{fold}", ConvertOptions(fold=fold, **shape))
        fixed = checkpoint_tensors(tmp_path / f"fold{fold}")
        for rec in report["layers"]:
            if rec["fold_choice"]["fold"] == fold:
                prefix = f"model.layers.{rec['layer']}.self_attn."
                assert all((got[k] == fixed[k]).all() for k in got if k.startswith(prefix)), (fold, rec["layer"])
    # inspect shows each layer's fold and its measured error
    table = conversion_table(read_conversion(tmp_path / "auto")).splitlines()
    assert "fold" in table[-3] and "rope error" in table[-3]
    for rec, line in zip(report["layers"], table[-2:]):
        choice = rec["fold_choice"]
        assert line.split()[3:5] == [str(choice["fold"]), f"{choice['errors'][str(choice['fold'])]:.4g}"]


def test_a_fold_asked_for_or_another_rope_method_measures_nothing(tiny_sources, tmp_path):
    source = str(tiny_sources["llama_gqa"])
    asked = convert(source, tmp_path / "asked", ConvertOptions(kv_lora_rank=20, rope_dim=6, fold=2, **CALIB))
    other = convert(source, tmp_path / "other", ConvertOptions(kv_lora_rank=20, rope_dim=6, rope_method="transmla",
                                                               **CALIB))
    assert not any("fold_choice" in r for r in asked["layers"] + other["layers"])


def test_the_two_pass_choice_is_the_same_in_memory_and_streaming(tiny_sources, tmp_path):
    """Fisher ranks: the fold is measured in the statistics pass, kept in the run state, and reported."""
    opts = ConvertOptions(kv_budget=0.3, allocation="fisher", rope_dim=6, **CALIB)
    mem = convert(str(tiny_sources["qwen2"]), tmp_path / "mem", opts)
    got = convert_streaming(str(tiny_sources["qwen2"]), tmp_path / "stream", opts)
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")
    assert [r["fold_choice"] for r in got["layers"]] == [r["fold_choice"] for r in mem["layers"]]
    assert all(set(r["fold_choice"]["errors"]) == {"1", "2", "4"} for r in got["layers"])
