"""--refine values-per-head (convert/refine_heads.py): each head's value map, then o_proj, refitted from
moments in two passes. It never raises the calibration loss, leaves an exact start bit-exact, lowers the
loss of a compressed layer as its moments say a direct forward does; in the driver it gives the same bytes
from kept inputs or a second source run (in memory and streaming: test_refine_values), and auto picks it
where the joint refit's work or memory is too large."""

from __future__ import annotations

import pytest
import torch
import yaml

from mlakit.convert.refine import attention_output
from mlakit.convert.refine_heads import refit_per_head
from mlakit.pipeline import driver, refine_steps, run_state
from mlakit.pipeline.api import ConvertOptions, convert, convert_streaming
from tests.convert_helpers import assert_same_bytes, fast_args, layer_records, run
from tests.test_refine import layer_case, state_copy

CALIB = dict(calib="random", calib_samples=48, calib_seq_len=32, dtype="float32", quiet=True)


def _case(tiny_sources, family, rope_dim, rank):
    return layer_case(tiny_sources[family], family, rope_dim, rank, loss="heads", sequences=48)[:4]


def _batches(x, o, batch: int = 5):
    return lambda: ((s, x[s : s + batch], o[s : s + batch]) for s in range(0, x.shape[0], batch))


def _direct_loss(block, run, x, y) -> float:
    with torch.no_grad():
        got = attention_output(block, run, x).detach().double()
    return float((got - y.double()).square().sum() / y.double().square().sum())


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
def test_refit_lowers_the_loss_of_a_compressed_layer_as_a_forward_measures_it(tiny_sources, family):
    block, run, x, o = _case(tiny_sources, family, 8, 12)
    y = torch.nn.functional.linear(o, block.self_attn.o_proj.weight, block.self_attn.o_proj.bias).detach()
    start = _direct_loss(block, run, x, y)
    report = refit_per_head(block, run, _batches(x, o))
    assert report["kept"] == "values refit per head", report
    assert report["loss_before"] == pytest.approx(start, rel=1e-5)
    assert report["loss_after"] == pytest.approx(_direct_loss(block, run, x, y), rel=1e-4)
    assert report["loss_after"] < 0.9 * report["loss_before"]


def test_full_rank_with_all_rope_kept_is_left_bit_exact(tiny_sources):
    block, run, x, o = _case(tiny_sources, "llama_gqa", None, None)
    before = state_copy(block)
    report = refit_per_head(block, run, _batches(x, o))
    assert report["kept"] == "start (already exact)" and report["loss_after"] == report["loss_before"] <= 1e-10
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


def test_refit_never_returns_a_higher_calibration_loss(tiny_sources, monkeypatch):
    """With every ridge's fit made worse than the start (a fit that returns noise), the closed form is kept."""
    from mlakit.convert import refine_heads

    block, run, x, o = _case(tiny_sources, "qwen2", 8, 12)
    before = state_copy(block)
    monkeypatch.setattr(refine_heads, "_fit_heads", lambda m, ridge, prior: prior + 10 * torch.randn_like(prior))
    monkeypatch.setattr(refine_heads, "choose_ridge", lambda w0, folds, fit, *a, **k: (1.0, {"ridge": 1.0}))
    report = refit_per_head(block, run, _batches(x, o))
    assert report["kept"] == "start" and report["loss_after"] == report["loss_before"]
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


def test_refit_needs_two_sequences_to_validate(tiny_sources):
    block, run, x, o = _case(tiny_sources, "llama_gqa", 8, 12)
    report = refit_per_head(block, run, _batches(x[:1], o[:1]))
    assert report["kept"] == "start" and "two-fold" in report["refit"]


def test_refit_from_fewer_tokens_than_a_heads_latent_keeps_the_closed_form(tiny_sources):
    """2 sequences of 4 tokens: each fold holds fewer tokens than a head's value map has unknowns per output
    (its latent dims), so no held-out ridge choice is trusted and nothing changes."""
    block, run, x, o = _case(tiny_sources, "llama_gqa", 8, 12)
    before = state_copy(block)
    report = refit_per_head(block, run, _batches(x[:2, :4], o[:2, :4], batch=1))
    assert report["kept"] == "start" and "4 tokens, fewer than the 12 unknowns" in report["refit"], report
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


def test_o_proj_refit_from_fewer_tokens_than_its_inputs_keeps_o_proj(tiny_sources):
    """Folds of 48 tokens: enough for each head's 12-dim latent, too few for o_proj's 64 inputs. The value maps
    are refitted; o_proj is kept bit for bit, and the report says why."""
    block, run, x, o = _case(tiny_sources, "llama_gqa", 8, 12)
    weight = block.self_attn.o_proj.weight.clone()
    report = refit_per_head(block, run, _batches(x[:4, :24], o[:4, :24], batch=1))
    assert "48 tokens, fewer than the 64 unknowns" in report["o_proj_refit"], report
    assert report["kept"] == "values refit per head" and report["loss_after"] < report["loss_before"], report
    assert torch.equal(block.self_attn.o_proj.weight, weight)


# -- in the driver ---------------------------------------------------------------------------------

@pytest.mark.parametrize("refine", [dict(refine="values", refine_compensate=1.0), dict(refine="values"),
                                    dict(refine="values-per-head")])
@pytest.mark.parametrize("allocation", ["fisher", "uniform"])
def test_kept_targets_and_a_second_source_run_give_the_same_bytes(tiny_sources, tmp_path, monkeypatch, allocation,
                                                                   refine):
    """The targets kept by the source run before the refit (the statistics pass of a two-pass plan, the
    convert pass's own run in a one-pass plan) and those of a second run of the source attention (no disk
    to spare) are the same: so are the checkpoints. A share of compensation below 1 runs the source
    attention on the converted input in both (``compensating_target``), and no more than that when kept."""
    reruns = []
    for name in ("attention_output", "attention_and_output"):
        real = getattr(refine_steps, name)
        monkeypatch.setattr(refine_steps, name, lambda *a, real=real, **k: reruns.append(1) or real(*a, **k))
    opts = ConvertOptions(kv_budget=0.4, allocation=allocation, **CALIB, **refine)
    kept = convert_streaming(str(tiny_sources["llama_gqa"]), tmp_path / "kept", opts)
    on_converted = len(reruns)
    # every layer's targets came from the run before: the only runs are the blend's, on x'
    assert (on_converted > 0) == (refine == dict(refine="values")), on_converted
    monkeypatch.setattr(driver, "KEEP_INPUTS_SHARE", 0.0)
    again = convert_streaming(str(tiny_sources["llama_gqa"]), tmp_path / "again", opts)
    assert len(reruns) - on_converted > on_converted  # the targets on x too, this time
    assert_same_bytes(tmp_path / "kept", tmp_path / "again")
    assert layer_records(kept) == layer_records(again)
    assert not list((tmp_path / "kept").glob("hidden-*"))


def test_per_head_refit_at_full_cache_stays_bit_exact(tiny_sources, tmp_path):
    base = dict(kv_budget=1.0, rope_dim=32, allocation="uniform", **CALIB)
    report = convert(str(tiny_sources["llama_gqa"]), tmp_path / "refined",
                     ConvertOptions(**base, refine="values-per-head"))
    convert(str(tiny_sources["llama_gqa"]), tmp_path / "plain", ConvertOptions(**base, refine="none"))
    assert_same_bytes(tmp_path / "refined", tmp_path / "plain")
    assert all(r["refine"]["kept"] == "start (already exact)" for r in report["layers"])


def test_cli_per_head_refit_reaches_the_report_and_the_recipe(tiny_sources, tmp_path):
    out = tmp_path / "out"
    code, text = run(tiny_sources["qwen2"], out, *fast_args(), "--refine", "values-per-head")
    assert code == 0, text
    assert yaml.safe_load((out / "recipe.yaml").read_text())["refine"] == "values-per-head"
    code, text = run(tiny_sources["qwen2"], tmp_path / "bad", *fast_args(), "--refine", "values-per-head",
                     "--refine-epochs", "1")
    assert code != 0 and "--refine-epochs" in text and not (tmp_path / "bad").exists(), text


def test_auto_steps_down_to_the_per_head_refit_then_to_none(tiny_sources, tmp_path, caplog, monkeypatch):
    """Where the joint refit's work passes its share of the forward but the per-head one's does not, auto is
    values-per-head (logged, with --refine values-per-head's bytes); where neither fits, the closed form."""
    src, setting = str(tiny_sources["llama_gqa"]), dict(kv_budget=0.4, allocation="uniform", **CALIB)
    share = run_state.REFIT_WORK_SHARE  # stand-ins for a 7B shape's estimates: the joint refit's far over
    monkeypatch.setattr(run_state, "values_refit_work", lambda *a: share * (10.0 if a[-1] == "values" else 0.5))
    caplog.set_level("INFO", logger="mlakit.pipeline.run_state")
    auto = convert(src, tmp_path / "auto", ConvertOptions(**setting))
    assert auto["settings"]["refine"] == "values-per-head"
    assert "--refine auto: values-per-head. --refine values over" in caplog.text
    convert(src, tmp_path / "named", ConvertOptions(**setting, refine="values-per-head"))
    assert_same_bytes(tmp_path / "auto", tmp_path / "named")
    monkeypatch.setattr(run_state, "values_refit_work", lambda *a: share * 10.0)
    none = convert(src, tmp_path / "none", ConvertOptions(**setting))
    assert none["settings"]["refine"] == "none" and "no value refit, the closed form only" in caplog.text


def test_heads_wider_than_the_hidden_size(tmp_path, monkeypatch):
    """A source whose heads' outputs are wider than its hidden size (H d = 96 > D = 64, head_dim set apart, as
    Mistral-Nemo has it): the kept targets are H d wide, and kept or from a source run give the same bytes."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.tiny_models import TINY_CONFIG

    MistralForCausalLM(MistralConfig(**TINY_CONFIG, num_key_value_heads=2, head_dim=24, rope_theta=1e6)).save_pretrained(
        tmp_path / "src")
    opts = ConvertOptions(kv_budget=0.4, allocation="fisher", **CALIB, refine="values-per-head")
    kept = convert_streaming(str(tmp_path / "src"), tmp_path / "kept", opts)
    assert all(r["refine"]["kept"] == "values refit per head" for r in kept["layers"])
    monkeypatch.setattr(driver, "KEEP_INPUTS_SHARE", 0.0)
    convert_streaming(str(tmp_path / "src"), tmp_path / "again", opts)
    assert_same_bytes(tmp_path / "kept", tmp_path / "again")
