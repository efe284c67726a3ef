"""--target vllm plans 512 + 64 in every layer, and a stock export resolves a recipe's per-layer allocation.

Both pipelines honour the target; recipe values give way with a logged note, explicit ones are refused."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from mlakit.arch import AttentionShape
from mlakit.cli import cli
from mlakit.convert.engine_target import TargetError, check_target_shape, fit_target
from mlakit.options import OptionsError
from mlakit.pipeline.api import ConvertOptions, StreamOptions, convert, convert_streaming
from mlakit.recipes import BUILTIN_RECIPES, Recipe

CALIB = dict(calib="random", calib_samples=8, calib_seq_len=32, dtype="float32", quiet=True)
CALIB_FLAGS = [
    "--calib",
    "random",
    "--calib-samples",
    "8",
    "--calib-seq-len",
    "32",
    "--dtype",
    "float32",
    "-q",
]


def wide_source(directory: Path) -> Path:
    """A small Llama that caches 1024 values per token per layer (8 KV heads x head_dim 64), more than 576,
    and whose hidden size holds a 512-dim latent."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=512,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(str(directory))
    return directory


# --- option resolution ---------------------------------------------------------------------------


def test_target_vllm_replaces_a_recipes_budget_with_a_note(caplog):
    recipe = ConvertOptions(kv_budget=0.3125, allocation="fisher", target="vllm")
    with caplog.at_level(logging.WARNING, logger="mlakit.convert.engine_target"):
        opts = fit_target(recipe, explicit={"target"})
    assert (opts.kv_budget, opts.kv_lora_rank, opts.rope_dim, opts.allocation) == (None, 512, 64, "uniform")
    assert "recipe's kv_budget 0.3125 is replaced by r = 512 + d_R = 64" in caplog.text
    assert fit_target(opts) == opts  # idempotent: the pipelines re-check what the CLI resolved


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("kv_budget", 0.5, "--kv-budget 0.5"),
        ("kv_lora_rank", 256, "--kv-lora-rank 256"),
        ("rope_dim", 32, "--rope-dim 32"),
    ],
)
def test_target_vllm_refuses_explicit_conflicting_shapes(field, value, flag):
    opts = ConvertOptions(target="vllm", **{field: value})
    with pytest.raises(TargetError, match=f"{flag} contradicts --target vllm.*drop {flag.split()[0]}"):
        fit_target(opts, explicit={field, "target"})
    with pytest.raises(TargetError, match="contradicts --target vllm"):
        fit_target(opts)  # Python callers: every non-default field is explicit


def test_target_vllm_keeps_matching_flags_and_refuses_per_layer_allocations():
    opts = fit_target(ConvertOptions(target="vllm", kv_lora_rank=512, rope_dim=64))
    assert (opts.kv_lora_rank, opts.rope_dim, opts.kv_budget) == (512, 64, None)
    with pytest.raises(
        TargetError, match="--allocation fisher gives each layer its own rank, which vLLM's MLA"
    ):
        fit_target(ConvertOptions(target="vllm", allocation="fisher"), explicit={"allocation", "target"})
    with pytest.raises(OptionsError, match=r"--target \(target\) must be one of 'any' or 'vllm'; got 'sglang'"):
        ConvertOptions(target="sglang")  # refused when the options are made, before fit_target


def test_stock_export_resolves_a_recipes_allocation_and_refuses_an_explicit_one(caplog):
    recipe = ConvertOptions(kv_budget=0.3125, allocation="fisher")
    with caplog.at_level(logging.WARNING, logger="mlakit.convert.engine_target"):
        opts = fit_target(recipe, explicit=set(), stock_export=True)
    assert opts.allocation == "uniform" and opts.stock_rope and opts.kv_budget == 0.3125
    assert (
        "allocation fisher gives each layer its own rank, which deepseek-v3 cannot hold: using uniform"
        in caplog.text
    )
    assert fit_target(ConvertOptions(kv_budget=0.5), stock_export=True).allocation == "uniform"  # auto
    with pytest.raises(
        TargetError, match="--allocation planned gives each layer its own rank, which deepseek-v3"
    ):
        fit_target(
            ConvertOptions(kv_budget=0.5, allocation="planned"), explicit={"allocation"}, stock_export=True
        )


def test_small_caches_are_refused_naming_what_is_gained_and_lost():
    smollm2 = AttentionShape("LlamaForCausalLM", num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                             qkv_bias=False, o_bias=False, window=None)
    with pytest.raises(TargetError) as err:
        check_target_shape(ConvertOptions(target="vllm"), smollm2)
    text = str(err.value)
    for part in (
        "caches 384 values",
        "exactly 576",
        "320 or 512",
        "serve the source model itself",
        "`vllm serve OUT`",
        "1.50x the source's cache",
    ):
        assert part.lower() in text.lower(), (part, text)
    llama3_8b = replace(smollm2, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096)
    check_target_shape(ConvertOptions(target="vllm"), llama3_8b)
    with pytest.raises(TargetError, match="with hidden_size 256 no layer can use more than 257"):
        check_target_shape(ConvertOptions(target="vllm"), replace(llama3_8b, hidden_size=256))
    check_target_shape(ConvertOptions(), smollm2)  # no target: nothing to check


# --- both pipelines ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("target")
    src = wide_source(root / "src")
    opts = ConvertOptions(target="vllm", **CALIB)
    reports = {
        "in-memory": convert(str(src), root / "mem", opts),
        "streaming": convert_streaming(str(src), root / "stream", opts, StreamOptions()),
    }
    return root, reports


@pytest.mark.parametrize("pipeline", ["in-memory", "streaming"])
def test_both_pipelines_plan_512_plus_64_and_record_the_target(target_outputs, pipeline):
    root, reports = target_outputs
    out = root / ("mem" if pipeline == "in-memory" else "stream")
    report = json.loads((out / "conversion.json").read_text())
    assert report["settings"]["target"] == "vllm" and reports[pipeline]["settings"]["target"] == "vllm"
    assert [(r["kv_lora_rank"], r["qk_rope_head_dim"]) for r in report["layers"]] == [(512, 64), (512, 64)]
    assert Recipe.load(out / "recipe.yaml").target == "vllm"


def test_both_pipelines_write_the_same_weights_for_a_target(target_outputs):
    root, _ = target_outputs
    mem = {k: v for f in sorted((root / "mem").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    stream = {
        k: v for f in sorted((root / "stream").glob("*.safetensors")) for k, v in load_file(str(f)).items()
    }
    assert mem.keys() == stream.keys()
    assert all(torch.equal(mem[k], stream[k]) for k in mem), [
        k for k in mem if not torch.equal(mem[k], stream[k])
    ]


@pytest.mark.parametrize("pipeline", ["in-memory", "streaming"])
def test_both_pipelines_refuse_a_small_cache_before_calibrating(
    tiny_sources, tmp_path, monkeypatch, pipeline
):
    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran before the target was checked")

    monkeypatch.setattr("mlakit.pipeline.run_state.calibration_ids", no_calibration)
    opts = ConvertOptions(target="vllm", **CALIB)
    run = convert if pipeline == "in-memory" else convert_streaming
    with pytest.raises(TargetError, match="caches 64 values per token per layer"):
        run(str(tiny_sources["llama_gqa"]), tmp_path / "x", opts)
    assert not list(tmp_path.iterdir())


# --- CLI and recipes -----------------------------------------------------------------------------


def test_cli_readme_command_recipe_with_format_deepseek_v3(tiny_sources, tmp_path):
    """`convert SRC OUT --recipe smollm2-135m --format deepseek-v3` (the README's command): the recipe's
    fisher allocation becomes uniform with a note instead of failing."""
    out = tmp_path / "ds"
    args = [
        "convert",
        str(tiny_sources["llama_gqa"]),
        str(out),
        "--recipe",
        "smollm2-135m",
        "--format",
        "deepseek-v3",
        *CALIB_FLAGS,
    ]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "the recipe's allocation fisher gives each layer its own rank" in res.stderr, res.stderr
    native = json.loads((out / "native_conversion.json").read_text())
    assert native["settings"]["allocation"] == "uniform" and native["settings"]["stock_rope"] is True
    assert native["settings"]["kv_budget"] == 0.3125  # the recipe's budget is kept
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 20
    assert json.loads((out / "export.json").read_text())["verify"]["max_abs_logit_diff_fp32"] <= 1e-3


def test_cli_refuses_an_explicit_per_layer_allocation_with_format_deepseek_v3(tiny_sources, tmp_path):
    args = [
        "convert",
        str(tiny_sources["llama_gqa"]),
        str(tmp_path / "x"),
        "--recipe",
        "smollm2-135m",
        "--allocation",
        "fisher",
        "--format",
        "deepseek-v3",
        *CALIB_FLAGS,
    ]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1 and "--allocation fisher gives each layer its own rank" in res.output, (
        res.output
    )
    assert not list(tmp_path.iterdir())


def test_cli_target_errors_name_the_fix(tiny_sources, tmp_path):
    runner = CliRunner()
    src = str(tiny_sources["llama_gqa"])
    res = runner.invoke(cli, ["convert", src, str(tmp_path / "a"), "--target", "vllm", *CALIB_FLAGS])
    assert res.exit_code == 1 and "caches 64 values per token per layer" in res.output, res.output
    res = runner.invoke(
        cli, ["convert", src, str(tmp_path / "b"), "--target", "vllm", "--kv-budget", "0.5", *CALIB_FLAGS]
    )
    assert res.exit_code == 1 and "--kv-budget 0.5 contradicts --target vllm" in res.output, res.output
    assert not list(tmp_path.iterdir())
    help_text = runner.invoke(cli, ["convert", "--help"]).output
    assert "--target [any|vllm]" in help_text and "512" in help_text


def test_recipe_target_field_round_trips_and_the_512_plus_64_recipes_set_it():
    r = Recipe(kv_lora_rank=512, rope_dim=64, target="vllm")
    assert Recipe.from_yaml(r.to_yaml()) == r and r.to_options().target == "vllm"
    assert r.to_options(target="any").target == "any"  # a flag overrides the recipe
    for name in BUILTIN_RECIPES:
        recipe = Recipe.load(name)
        at_engine_shape = (recipe.kv_lora_rank, recipe.rope_dim) == (512, 64)
        assert (recipe.target == "vllm") == at_engine_shape, name


def test_format_deepseek_v3_with_target_vllm_writes_an_export_vllm_serves(target_outputs, tmp_path):
    from mlakit.export import convert_to_format

    root, _ = target_outputs
    report = convert_to_format(
        "deepseek-v3", str(root / "src"), tmp_path / "ds", ConvertOptions(target="vllm", **CALIB)
    )
    export = report["export"]
    assert export["engines"]["vllm"] == {"serves_exactly": True, "problems": []}
    assert export["verify"]["max_abs_logit_diff_fp32"] <= 1e-3 and export["settings"]["target"] == "vllm"
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["rope_parameters"]["rope_type"]) == (
        512,
        64,
        "yarn",
    )
    assert not (tmp_path / "ds" / "README.md").exists()  # nothing to warn about
