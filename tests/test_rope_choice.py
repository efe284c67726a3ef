"""--rope-dim measured: the shared d_R chosen in the statistics pass from each candidate's held-out error, checked on
the shuffled sequences; --rope-dim measured-per-layer: each layer's d_R by the same rule on that layer's errors."""

from __future__ import annotations

import json

import pytest
import torch

from mlakit.convert.rank_plan import equal_share_ranks, uniform_ranks
from mlakit.convert.rope_choice import MIN_LATENT, choose_rope_dim, rope_candidates, shuffled_sequences
from mlakit.export import ExportError, export
from mlakit.io.work_dir import work_dir_for
from mlakit.mla_model import MLAForCausalLM
from mlakit.options import OptionsError
from mlakit.pipeline.api import ConversionError, ConvertOptions, StreamOptions, convert, convert_streaming
from mlakit.pipeline.conversion_table import conversion_table, read_conversion
from tests.convert_helpers import (
    Interrupt,
    assert_same_bytes,
    assert_same_checkpoint,
    fast_args,
    run,
    stop_at,
)

pytestmark = pytest.mark.filterwarnings("ignore")

# llama_gqa: 2 KV heads of head_dim 16 (32 rotary dims at most); at 0.75 of the cache a layer keeps 48 values,
# so the default share gives d_R 16 and the candidates are 8, 16, 24 and 32. 8 sequences of 32 tokens per
# validation fold: enough tokens for the value refit to run at every candidate
MEASURED = dict(kv_budget=0.75, allocation="fisher", rope_dim="measured", calib="random", calib_samples=16,
                calib_seq_len=32, dtype="float32", quiet=True)
PER_LAYER = MEASURED | {"rope_dim": "measured-per-layer"}


def test_candidates_run_from_half_to_twice_the_default_and_leave_a_latent():
    assert rope_candidates(3, 64, 120, 32) == [16, 24, 32, 40, 48, 56, 64]
    assert rope_candidates(2, 64, 80, 24) == [16, 24, 32, 40, 48]
    assert rope_candidates(2, 64, 32, 8) == [8, 16]  # a latent of 16 left: no further
    assert rope_candidates(2, 16, 48, 16) == [8, 16, 24, 32]  # at most every rotary dim of the G heads
    for budget in range(24, 400, 7):
        for reference in (8, 16, 40):
            got = rope_candidates(4, 64, budget, reference)
            assert reference in got and got == sorted(set(got))
            assert all(d % 8 == 0 and d <= 256 for d in got)
            assert all(budget - d >= MIN_LATENT and reference / 2 <= d <= 2 * reference for d in got if d != reference)


def test_the_least_error_wins_only_where_both_folds_and_the_shuffled_sequences_agree():
    held = {16: [0.30, 0.32, 0.5], 24: [0.20, 0.25, 0.45], 32: [0.19, 0.24, 0.4]}
    assert choose_rope_dim(held, 16) == 32
    # 32's total is least, but the second fold does not see it beat the default: no change
    assert choose_rope_dim({16: [0.30, 0.32, 0.5], 32: [0.20, 0.33, 0.4]}, 16) == 16
    # both folds agree, but on the shuffled sequences the default is better: no change
    assert choose_rope_dim({16: [0.30, 0.32, 0.5], 32: [0.20, 0.25, 0.51]}, 16) == 16
    # equal: no gain shown on either fold
    assert choose_rope_dim({16: [0.30, 0.32, 0.5], 24: [0.30, 0.32, 0.4]}, 24) == 24
    # equal totals: the smaller d_R; the shuffled error does not rank, it only vetoes
    assert choose_rope_dim({8: [0.1, 0.1, 0.3], 16: [0.1, 0.1, 0.2], 24: [0.2, 0.2, 0.4]}, 24) == 8


def test_shuffled_sequences_keep_each_sequence_s_tokens_and_first_token():
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
    before = ids.clone()
    got = shuffled_sequences(ids, seed=0)
    assert torch.equal(ids, before)  # the input is left as it was
    assert torch.equal(got[:, 0], ids[:, 0]) and not torch.equal(got, ids)
    assert all(torch.equal(a.sort().values, b.sort().values) for a, b in zip(got, ids))
    assert torch.equal(got, shuffled_sequences(ids, seed=0)) and not torch.equal(got, shuffled_sequences(ids, seed=1))


def test_the_measured_conversion_is_the_one_at_the_chosen_dim(tiny_sources, tmp_path):
    """In memory and streaming alike: every candidate measured and reported, the rule's choice taken, and the
    weights those of a conversion given that d_R, bit for bit."""
    source = str(tiny_sources["llama_gqa"])
    mem = convert(source, tmp_path / "mem", ConvertOptions(**MEASURED))
    got = convert_streaming(source, tmp_path / "stream", ConvertOptions(**MEASURED))
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")
    assert got["plan"] == mem["plan"]
    search = {int(d): e for d, e in got["plan"]["rope_search"].items()}
    assert sorted(search) == [8, 16, 24, 32] and all(len(e) == 3 and min(e) >= 0 for e in search.values())
    chosen = got["plan"]["rope_dim"]
    assert chosen == choose_rope_dim(search, 16)
    assert {r["qk_rope_head_dim"] for r in got["layers"]} == {chosen}
    fixed = convert(source, tmp_path / "fixed", ConvertOptions(**(MEASURED | {"rope_dim": chosen})))
    assert_same_checkpoint(tmp_path / "fixed", tmp_path / "mem")
    assert [r.get("fold_choice") for r in fixed["layers"]] == [r.get("fold_choice") for r in got["layers"]]
    assert "rope_dim: measured" in (tmp_path / "mem" / "recipe.yaml").read_text()  # the recipe reruns the search
    line = next(x for x in conversion_table(read_conversion(tmp_path / "mem")).splitlines() if "d_R measured" in x)
    assert all(f"{d}: {e[0]:.4g} + {e[1]:.4g}, shuffled {e[2]:.4g}" in line for d, e in search.items()), line


def test_each_layer_s_measured_dim_is_the_rule_s_choice_on_that_layer_s_errors(tiny_sources, tmp_path):
    """The same measurements as the shared choice, the rule applied to each layer's own; in memory and streaming
    alike, within the budget, and the conversion table says how each d_R was chosen."""
    source = str(tiny_sources["llama_gqa"])
    mem = convert(source, tmp_path / "mem", ConvertOptions(**PER_LAYER))
    got = convert_streaming(source, tmp_path / "stream", ConvertOptions(**PER_LAYER))
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")
    assert got["plan"] == mem["plan"]
    layers = [{int(d): e for d, e in found.items()} for found in got["plan"]["rope_layer_search"]]
    assert len(layers) == 2 and all(sorted(found) == [8, 16, 24, 32] for found in layers)
    chosen = [choose_rope_dim(found, 16) for found in layers]
    assert got["plan"]["rope_dim"] == chosen == [r["qk_rope_head_dim"] for r in got["layers"]]
    shared = convert_streaming(source, tmp_path / "shared", ConvertOptions(**MEASURED))
    assert shared["plan"]["rope_search"] == got["plan"]["rope_search"]  # the layers' errors summed
    for d, summed in got["plan"]["rope_search"].items():
        assert [sum(found[int(d)][k] for found in layers) for k in range(3)] == pytest.approx(summed, abs=1e-5)
    cached = [r["kv_lora_rank"] + r["qk_rope_head_dim"] for r in got["layers"]]
    assert sum(cached) <= got["plan"]["budget_values_per_token"]
    assert "rope_dim: measured-per-layer" in (tmp_path / "mem" / "recipe.yaml").read_text()
    table = conversion_table(read_conversion(tmp_path / "mem"))
    assert "each layer's d_R is its own least held-out error" in table, table


def test_layers_at_different_measured_dims_convert_load_and_keep_the_budget(tiny_sources, tmp_path, monkeypatch):
    """Whatever d_R the rule gives each layer (here forced apart), every layer keeps the same share of the budget
    before the fisher plan moves ranks, the checkpoint holds each layer's shape, and it loads and runs."""
    import mlakit.pipeline.fold_steps as fold_steps

    forced = iter([8, 32])
    monkeypatch.setattr(fold_steps, "choose_rope_dim", lambda found, reference: next(forced))
    out = tmp_path / "out"
    report = convert_streaming(str(tiny_sources["llama_gqa"]), out, ConvertOptions(**PER_LAYER))
    assert report["plan"]["rope_dim"] == [8, 32] == [r["qk_rope_head_dim"] for r in report["layers"]]
    budget = report["plan"]["budget_values_per_token"]
    assert sum(r["kv_lora_rank"] + r["qk_rope_head_dim"] for r in report["layers"]) <= budget
    # each layer's folds measured at its own d_R: head_dim 16 folds 1 or 2 at d_R 8, none to choose at every dim
    assert [sorted(map(int, r["fold_choice"]["errors"])) if "fold_choice" in r else None
            for r in report["layers"]] == [[1, 2], None]
    config = json.loads((out / "config.json").read_text())
    assert config["qk_rope_head_dim"] == [8, 32]
    assert config["kv_lora_rank"] == [r["kv_lora_rank"] for r in report["layers"]]
    model = MLAForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    logits = model(torch.randint(0, model.config.vocab_size, (1, 12))).logits
    assert torch.isfinite(logits).all()
    with pytest.raises(ExportError, match=r"differs across layers .* not measured-per-layer"):
        export(out, tmp_path / "stock")
    assert not (tmp_path / "stock").exists()


def test_the_stock_export_refuses_a_measured_dim_before_any_work(tiny_sources, tmp_path):
    code, out = run(tiny_sources["llama_gqa"], tmp_path / "out", "--calib", "random", "--kv-budget", 0.75,
                    "--rope-dim", "measured-per-layer", "--format", "deepseek-v3")
    assert code != 0 and "measured-per-layer" in out and "give --rope-dim as a number" in out, out
    assert not (tmp_path / "out").exists()


def test_equal_share_ranks_give_every_layer_the_same_cache_and_match_uniform_at_one_dim():
    assert equal_share_ranks(2, 16, 96, [8, 32]) == [40, 16]  # 48 values per layer
    assert equal_share_ranks(2, 16, 200, [8, 32]) == [56, 32]  # capped at full rank, 2 G d - d_R
    for d in (8, 16, 24):
        assert equal_share_ranks(3, 64, 30 * 120, [d] * 30) == uniform_ranks(30, 3, 64, d, 30 * 120 - 30 * d)


@pytest.mark.parametrize("phase", ["statistics", "convert"])
@pytest.mark.parametrize("mode", ["measured", "measured-per-layer"])
def test_an_interrupted_measured_conversion_resumes_at_the_same_dim(tiny_sources, tmp_path, phase, mode):
    """Stopped in the statistics pass, the resumed run carries the shuffled sequences on from the layer it stopped
    at; stopped in the convert pass, it keeps the d_R chosen before."""
    source, opts = str(tiny_sources["llama_gqa"]), ConvertOptions(**(MEASURED | {"rope_dim": mode}))
    reference = convert_streaming(source, tmp_path / "reference", opts)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        convert_streaming(source, out, opts, on_layer=stop_at(phase, 1))
    state = json.loads((work_dir_for(out) / "state.json").read_text())
    assert state["stats_done"] == (1 if phase == "statistics" else 2)  # the tiny model has two layers
    if phase == "convert":
        assert len(state["rope_dims"]) == 2 and set(state["rope_dims"]) <= {8, 16, 24, 32}
    report = convert_streaming(source, out, opts, StreamOptions(resume=True))
    assert report["plan"] == reference["plan"]
    if phase == "convert":
        assert report["pipeline"]["resumed_from_layer"] == 1
        assert [r["qk_rope_head_dim"] for r in report["layers"]] == state["rope_dims"]
    assert_same_checkpoint(out, tmp_path / "reference")


@pytest.mark.parametrize("fields, message", [
    ({"rope_dim": "measured"}, "give --kv-budget as well"),
    ({"rope_dim": "measured", "kv_budget": 0.5, "stock_rope": True}, "give --rope-dim as a number"),
    ({"rope_dim": "measured-per-layer"}, "measured-per-layer chooses .* give --kv-budget as well"),
])
def test_a_measured_dim_outside_a_budget_is_refused(fields, message):
    with pytest.raises(OptionsError, match=message):
        ConvertOptions(**fields)


def test_a_one_pass_allocation_cannot_measure_and_says_so(tiny_sources, tmp_path):
    code, out = run(tiny_sources["llama_gqa"], tmp_path / "out", *fast_args()[4:], "--kv-budget", 0.75,
                    "--rope-dim", "measured", "--allocation", "uniform")
    assert code != 0 and "use --allocation fisher or planned" in out, out
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConversionError, match="two-pass plan"):
        convert(str(tiny_sources["llama_gqa"]), tmp_path / "out", ConvertOptions(**(MEASURED | {"allocation": "uniform"})))
