"""--refine layer in the one driver: same bytes in memory and streaming, lossless at full cache,
resumable, reported, and settable from the CLI and recipes."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import yaml

from mlakit.convert.refine import RefineSettings
from mlakit.options import OptionsError
from mlakit.pipeline.api import ConvertOptions, StreamOptions, convert, convert_streaming
from mlakit.recipes import Recipe
from tests import test_streaming
from tests.convert_helpers import (
    Interrupt,
    assert_same_bytes,
    assert_same_checkpoint,
    checkpoint_tensors,
    fast_args,
    layer_records,
    run,
    stop_at,
)

pytestmark = pytest.mark.filterwarnings("ignore")

CALIB = dict(calib="random", calib_samples=12, calib_seq_len=24, dtype="float32", quiet=True)
REFINE = dict(refine="layer", refine_epochs=1.0, refine_batch=4)
deep_source = test_streaming.deep_source  # the 5-layer fixture


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
@pytest.mark.parametrize("setting", [dict(kv_lora_rank=20, rope_dim=8), dict(kv_budget=0.4, allocation="fisher")])
def test_refined_conversion_is_the_same_in_memory_and_streaming(tiny_sources, tmp_path, family, setting):
    opts = ConvertOptions(**setting, **CALIB, **REFINE)
    mem = convert(str(tiny_sources[family]), tmp_path / "mem", opts)
    got = convert_streaming(str(tiny_sources[family]), tmp_path / "stream", opts)
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")
    assert layer_records(got) == layer_records(mem)
    for rec in got["layers"]:
        assert rec["refine"]["loss_after"] <= rec["refine"]["loss_before"], rec
    assert any(r["refine"]["kept"] != "start" for r in got["layers"])
    # the refined weights are what was written: they differ from the closed form's
    plain = convert(str(tiny_sources[family]), tmp_path / "plain", ConvertOptions(**setting, **CALIB, refine="none"))
    a, b = checkpoint_tensors(tmp_path / "mem"), checkpoint_tensors(tmp_path / "plain")
    assert any(not (a[k] == b[k]).all() for k in a if ".self_attn.o_proj." in k)
    assert all((a[k] == b[k]).all() for k in a if ".self_attn." not in k)
    assert "refine" not in plain["layers"][0]


def test_refinement_at_full_cache_stays_bit_exact(tiny_sources, tmp_path):
    """Calibrated, but at full rank with every rotary dim kept the closed form is exact: every layer
    is left as it was, byte for byte."""
    base = dict(kv_budget=1.0, rope_dim=32, allocation="uniform", **CALIB)  # 2 KV heads x head_dim 16
    report = convert(str(tiny_sources["llama_gqa"]), tmp_path / "refined", ConvertOptions(**base, **REFINE))
    convert(str(tiny_sources["llama_gqa"]), tmp_path / "plain", ConvertOptions(**base, refine="none"))
    assert_same_bytes(tmp_path / "refined", tmp_path / "plain")
    assert all(r["refine"]["kept"].startswith("start") and r["refine"]["steps"] == 0 for r in report["layers"])
    assert report["verify"]["max_abs_logit_diff"] < 1e-4


def test_interrupted_refined_conversion_resumes_to_identical_output(deep_source, tmp_path):
    opts = ConvertOptions(kv_lora_rank=20, rope_dim=8, **CALIB, **REFINE)
    convert_streaming(str(deep_source), tmp_path / "reference", opts)
    with pytest.raises(Interrupt):
        convert_streaming(str(deep_source), tmp_path / "out", opts, on_layer=stop_at("convert", 3))
    report = convert_streaming(str(deep_source), tmp_path / "out", opts, StreamOptions(resume=True))
    assert report["pipeline"]["resumed_from_layer"] == 3
    assert_same_checkpoint(tmp_path / "out", tmp_path / "reference")


@pytest.mark.parametrize("phase", ["statistics", "convert"])
def test_interrupted_two_pass_values_refit_resumes_to_identical_output(deep_source, tmp_path, phase):
    """Fisher + --refine values keeps each layer's source inputs and targets from the statistics pass; a
    run stopped in either pass resumes from what it kept to the same checkpoint."""
    opts = ConvertOptions(kv_budget=0.4, allocation="fisher", **CALIB, refine="values")
    convert_streaming(str(deep_source), tmp_path / "reference", opts)
    with pytest.raises(Interrupt):
        convert_streaming(str(deep_source), tmp_path / "out", opts, on_layer=stop_at(phase, 3))
    convert_streaming(str(deep_source), tmp_path / "out", opts, StreamOptions(resume=True))
    assert_same_checkpoint(tmp_path / "out", tmp_path / "reference")


def test_cli_refine_flags_reach_the_report_and_the_saved_recipe(tiny_sources, tmp_path):
    out = tmp_path / "out"
    code, text = run(tiny_sources["llama_gqa"], out, *fast_args(), "--refine", "layer", "--refine-epochs", "0.5",
                     "--refine-lr", "0.002", "--refine-batch", "2", "--refine-sequences", "3")
    assert code == 0, text
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert {k: recipe[k] for k in ("refine", "refine_epochs", "refine_lr", "refine_batch", "refine_sequences")} == {
        "refine": "layer", "refine_epochs": 0.5, "refine_lr": 0.002, "refine_batch": 2, "refine_sequences": 3}
    report = json.loads((out / "conversion.json").read_text())
    assert report["settings"]["refine"] == "layer" and report["settings"]["refine_sequences"] == 3
    assert all({"loss_before", "loss_after", "kept", "steps"} <= set(r["refine"]) for r in report["layers"])
    assert all(r["refine"]["steps"] == 1 for r in report["layers"])  # ceil(0.5 epochs x 3 sequences / 2)
    # the saved recipe reproduces the conversion's settings
    again = Recipe.from_yaml((out / "recipe.yaml").read_text()).to_options()
    assert (again.refine, again.refine_epochs, again.refine_lr, again.refine_batch, again.refine_sequences) == (
        "layer", 0.5, 0.002, 2, 3)


@pytest.mark.parametrize("args, message", [
    (["--refine", "adam"], "'adam' is not one of 'auto', 'none', 'layer'"),
    (["--refine", "layer", "--refine-lr", "2"], "--refine-lr"),
    (["--refine", "layer", "--refine-batch", "0"], "--refine-batch"),
    (["--refine", "layer", "--refine-inputs", "source"], "--refine layer always reads the converted stream"),
    (["--refine", "values-per-head", "--refine-inputs", "converted"], "it reads the source stream"),
    (["--refine", "none", "--refine-inputs", "converted"], "--refine none refines nothing"),
    (["--refine", "values", "--refine-inputs", "both"], "'both' is not one of 'auto', 'converted', 'source'"),
])
def test_cli_refine_errors_name_the_flag(tiny_sources, tmp_path, args, message):
    code, text = run(tiny_sources["llama_gqa"], tmp_path / "out", *fast_args(), *args)
    assert code != 0 and message in text, text
    assert not (tmp_path / "out").exists()


def test_bad_refine_options_fail_before_any_work():
    with pytest.raises(OptionsError, match="refine"):
        ConvertOptions(refine="adam", **CALIB)
    with pytest.raises(OptionsError, match="refine_batch"):
        ConvertOptions(refine="layer", refine_batch=0, **CALIB)


def test_options_defaults_are_the_refinement_defaults():
    settings = RefineSettings()
    opts = {f.name: f.default for f in fields(ConvertOptions)}
    assert opts["refine"] == "auto"
    assert (opts["refine_epochs"], opts["refine_lr"], opts["refine_batch"], opts["refine_sequences"],
            opts["refine_compensate"]) == (settings.epochs, settings.lr, settings.batch, settings.sequences,
                                           settings.compensate)


@pytest.mark.parametrize("setting", [dict(kv_lora_rank=20, rope_dim=8), dict(kv_budget=0.4, allocation="fisher")])
def test_refining_on_fewer_sequences_carries_only_those_and_stays_identical(tiny_sources, tmp_path, setting):
    """--refine-sequences 5 of 12: the streams beyond the statistics carry 5 sequences (not a
    multiple of the batch); both storage policies still write the same bytes, and each layer
    reports refining on what it was given."""
    opts = ConvertOptions(**setting, **CALIB, **(REFINE | dict(refine_sequences=5)))
    mem = convert(str(tiny_sources["qwen2"]), tmp_path / "mem", opts)
    convert_streaming(str(tiny_sources["qwen2"]), tmp_path / "stream", opts)
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")
    assert all(r["refine"]["steps"] == 2 for r in mem["layers"])  # ceil(1 epoch x 5 sequences / 4)
    full = convert(str(tiny_sources["qwen2"]), tmp_path / "all", ConvertOptions(**setting, **CALIB, **REFINE))
    assert [r["refine"]["loss_before"] for r in full["layers"]] != [r["refine"]["loss_before"] for r in mem["layers"]]
