"""The options model (mlakit/options.py): one declaration read by the CLI, recipes and Python."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mlakit.cli import cli
from mlakit.commands.option_flags import FLAG_FIELDS
from mlakit.options import RECIPE_FIELDS, ConvertOptions, OptionsError
from mlakit.recipes import BUILTIN_RECIPES, Recipe, RecipeError
from tests.cli_process import cli_in_fresh_interpreter

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ConvertOptions.__pydantic_fields__


# --- the model ----------------------------------------------------------------------------------


def test_fields_and_defaults_are_the_former_dataclasses_plus_refinement():
    want = dict(
        kv_lora_rank="full", rope_dim="full", kv_budget=None, allocation="auto", rope_method="scored",
        lowrank_method="auto", fold=0, mixing="pca", stock_rope=False, target="any", refine="auto",
        refine_inputs="auto", refine_compensate=0.5, refine_epochs=0.0, refine_lr=1e-3, refine_batch=4,
        refine_sequences=None, calib="builtin", calib_samples=256, calib_seq_len=512, dtype="auto", device="cpu",
        seed=0, overwrite=False, verify=True, quiet=False,
    )  # fmt: skip
    assert dataclasses.asdict(ConvertOptions()) == want
    assert [f.name for f in dataclasses.fields(ConvertOptions)] == list(want)
    assert {
        f.name: f.default for f in dataclasses.fields(ConvertOptions)
    } == want  # engine_target reads these


def test_options_are_frozen_and_replace_validates():
    opts = ConvertOptions(kv_lora_rank=24, rope_dim=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.fold = 2
    assert dataclasses.replace(opts, fold=2).fold == 2
    with pytest.raises(OptionsError, match=r"--rope-dim must be even .*got 7, use 6 or 8"):
        dataclasses.replace(opts, rope_dim=7)
    assert hash(opts) == hash(ConvertOptions(kv_lora_rank=24, rope_dim=8))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"calib_samples": 0}, "--calib-samples (calib_samples) must be >= 1; got 0"),
        ({"calib_seq_len": 1}, "--calib-seq-len (calib_seq_len) must be >= 2; got 1"),
        ({"kv_budget": 1.5}, r"--kv-budget (kv_budget) must be a fraction in (0, 1] (or unset); got 1.5"),
        ({"kv_budget": 0}, r"--kv-budget (kv_budget) must be a fraction in (0, 1]"),
        ({"kv_lora_rank": 0}, "--kv-lora-rank (kv_lora_rank) must be 'full' or an integer >= 1; got 0"),
        ({"rope_dim": "half"}, "--rope-dim (rope_dim) must be 'full', 'measured', 'measured-per-layer' or an even integer >= 0; got 'half'"),
        (
            {"rope_method": "best"},
            "--rope-method (rope_method) must be one of 'scored', 'transmla', 'high', ",
        ),
        ({"lowrank_method": "pca"}, "--lowrank-method (lowrank_method) must be one of 'auto', 'rrr', "),
        ({"dtype": "int8"}, "--dtype (dtype) must be one of 'auto', 'float32'"),
        ({"device": "gpu"}, "--device (device) must be one of cpu, cuda, cuda:N, auto; got 'gpu'"),
        ({"fold": -1}, "--fold (fold) must be >= 0; got -1"),
        (
            {"kv_budget": 0.3, "kv_lora_rank": 64},
            "--kv-budget 0.3 and --kv-lora-rank 64 both set the latent rank",
        ),
        (
            {"stock_rope": True, "rope_method": "norm"},
            "--stock-rope works with --rope-method scored or transmla",
        ),
        ({"kv_budgt": 0.3}, "unknown option 'kv_budgt'"),
        ({"refine_compensate": 1.5}, "--refine-compensate (refine_compensate) must be a share in [0, 1]; got 1.5"),
        (
            {"refine_compensate": 1.0, "refine": "layer"},
            "--refine-compensate 1 sets the target of --refine values on the converted stream; --refine layer",
        ),
        (
            {"refine_compensate": 0.0, "refine": "values", "refine_inputs": "source"},
            "--refine values --refine-inputs source does not fit one: drop --refine-compensate",
        ),
    ],
)
def test_bad_values_name_the_flag_and_what_it_accepts(fields, message):
    with pytest.raises(OptionsError) as info:
        ConvertOptions(**fields)
    assert message in str(info.value), str(info.value)
    assert "Traceback" not in str(info.value) and "pydantic" not in str(info.value)


def test_options_module_is_torch_free_and_recipes_do_not_import_the_pipeline():
    code = (
        "import sys, mlakit.options, mlakit.recipes, mlakit.commands.convert_cmd;"
        "print(sorted(m for m in ('torch', 'transformers', 'mlakit.pipeline.api') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# --- the flags ----------------------------------------------------------------------------------


def _params(command_name: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in cli.commands[command_name].params}


@pytest.mark.parametrize("command_name", ["convert", "inspect"])
def test_every_flag_default_choices_and_help_come_from_the_model(command_name):
    params = _params(command_name)
    generated = [n for n in FLAG_FIELDS if n in params]
    assert generated, command_name
    if command_name == "convert":
        assert set(FLAG_FIELDS) <= set(params)  # every option with a flag is a convert flag
    for name in generated:
        param, info = params[name], FIELDS[name]
        assert param.default == info.default, name
        if command_name == "convert" or name != "kv_budget":
            assert param.help == info.description, name
        if typing.get_origin(info.annotation) is typing.Literal:
            assert tuple(param.type.choices) == typing.get_args(info.annotation), name
    # a field's bound is its flag's range: click refuses the value before the command runs
    assert params["calib_seq_len"].type.min == FIELDS["calib_seq_len"].metadata[0].ge
    if command_name == "convert":
        assert "--no-verify" in params["verify"].secondary_opts


def test_quiet_is_the_shared_verbosity_flag_not_a_generated_one():
    assert "quiet" not in FLAG_FIELDS and _params("convert")["quiet"].opts == ["-q", "--quiet"]


# --- recipes ------------------------------------------------------------------------------------


def test_a_bad_method_name_in_a_recipe_names_the_key_and_the_allowed_values():
    with pytest.raises(RecipeError) as info:
        Recipe.from_yaml("rope_method: best\n", "r.yaml")
    text = str(info.value)
    assert (
        "r.yaml is invalid" in text
        and "rope_method (--rope-method) must be one of 'scored', 'transmla'" in text
    )
    with pytest.raises(
        RecipeError, match=r"method.rope \(rope_method, --rope-method\) must be one of 'scored'"
    ):
        Recipe.from_yaml("method: {rope: best}\n")  # the legacy nested key is the one named


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kv_budgt: 0.3\n", "unknown key 'kv_budgt'; recipe keys: name, description, kv_lora_rank"),
        ("device: cuda\n", "unknown key 'device'"),  # run-time fields are flags, not recipe keys
        ("kv_budget: 1.2\n", "kv_budget (--kv-budget) must be a fraction in (0, 1] (or unset); got 1.2"),
        ("calibration: {samples: 0}\n", "calibration.samples (calib_samples, --calib-samples) must be >= 1"),
        ("method: {lowrnk: rrr}\n", "method.lowrnk is not a recipe key; method takes rope, lowrank"),
        (
            "kv_budget: 0.3\nkv_lora_rank: 64\n",
            "--kv-budget 0.3 and --kv-lora-rank 64 both set the latent rank",
        ),
    ],
)
def test_recipe_errors_name_the_key_and_fix(text, message):
    with pytest.raises(RecipeError) as info:
        Recipe.from_yaml(text)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("name", BUILTIN_RECIPES)
def test_builtin_recipes_are_flat_option_fields_and_round_trip(name):
    recipe = Recipe.load(name)
    text = (ROOT / "mlakit" / "recipes" / f"{name}.yaml").read_text()
    assert not re.search(r"^(method|calibration):", text, re.M)  # migrated to the option fields
    assert Recipe.from_yaml(recipe.to_yaml()) == recipe
    assert set(Recipe.from_yaml(recipe.to_yaml()).model_dump()["options"]) >= set(RECIPE_FIELDS)


def test_legacy_nested_recipe_means_the_same_as_the_flat_one():
    legacy = Recipe.from_yaml(
        "kv_budget: 0.25\nkv_lora_rank: null\nrope_dim: null\n"
        "method: {rope: transmla, lowrank: bkv_pca, fold: 2, mixing: none, stock_rope: true}\n"
        "calibration: {data: random, samples: 16, seq_len: 64}\n"
    )
    flat = Recipe.from_yaml(
        "kv_budget: 0.25\nrope_method: transmla\nlowrank_method: bkv_pca\nfold: 2\nmixing: none\n"
        "stock_rope: true\ncalib: random\ncalib_samples: 16\ncalib_seq_len: 64\n"
    )
    assert legacy == flat and legacy.options.kv_lora_rank == "full"


def test_from_options_keeps_the_recipe_fields_and_drops_the_run_fields():
    opts = ConvertOptions(
        kv_budget=0.5, lowrank_method="rrr", device="auto", seed=3, overwrite=True, verify=False
    )
    recipe = Recipe.from_options(opts, name="mine")
    back = Recipe.from_yaml(recipe.to_yaml()).to_options()
    assert back == dataclasses.replace(opts, device="cpu", seed=0, overwrite=False, verify=True)
    assert recipe.to_options(target="vllm").target == "vllm"  # overrides win


# --- the CLI refuses bad values before the source is opened -------------------------------------


@pytest.fixture
def no_source(monkeypatch):
    """Fail the test if a conversion opens or resolves a source."""
    from mlakit.io import source
    from mlakit.pipeline import run

    def fail(*args, **kwargs):
        pytest.fail("the source was opened before the options were checked")

    for module in (run, source):
        monkeypatch.setattr(module, "open_source", fail)
        monkeypatch.setattr(module, "resolve_source", fail)


def _recipe(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return ["--recipe", path]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--calib-samples", 0], 2, "Invalid value for '--calib-samples': 0 is not in the range x>=1"),
        (["--calib-seq-len", 1], 2, "Invalid value for '--calib-seq-len': 1 is not in the range x>=2"),
        (["--kv-budget", 1.5], 2, "Invalid value for '--kv-budget': 1.5 is not in the range 0<x<=1"),
        (["--kv-budget", 0], 2, "0 is not in the range 0<x<=1"),
        (["--rope-method", "best"], 2, "'best' is not one of 'scored', 'transmla'"),
        (["--rope-dim", 7], 1, "--rope-dim must be even (rotary dims come in pairs); got 7, use 6 or 8"),
        (["--kv-lora-rank", 0], 1, "--kv-lora-rank (kv_lora_rank) must be 'full' or an integer >= 1; got 0"),
        (["--device", "gpu"], 1, "--device (device) must be one of cpu, cuda, cuda:N, auto; got 'gpu'"),
        (
            ["--stock-rope", "--rope-method", "high"],
            1,
            "--stock-rope works with --rope-method scored or transmla",
        ),
        ("recipe:rope_method: best\n", 2, "rope_method (--rope-method) must be one of 'scored', 'transmla'"),
        (
            "recipe:method: {lowrank: best}\n",
            2,
            "method.lowrank (lowrank_method, --lowrank-method) must be one of",
        ),
        ("recipe:kv_budgt: 0.3\n", 2, "unknown key 'kv_budgt'; recipe keys:"),
        (["--refine-compensate", -0.5], 2, "Invalid value for '--refine-compensate': -0.5 is not in the range 0<=x<=1"),
        (["--refine-compensate", 0, "--refine", "none"], 1, "--refine-compensate 0 sets the target of --refine values"),
        (
            "recipe:kv_budget: 3\n",
            2,
            "kv_budget (--kv-budget) must be a fraction in (0, 1] (or unset); got 3",
        ),
    ],
)
def test_bad_flags_and_recipes_fail_before_the_source_is_opened(no_source, tmp_path, args, code, message):
    if isinstance(args, str):
        args = _recipe(tmp_path, args.removeprefix("recipe:"))
    result = CliRunner().invoke(
        cli, ["convert", str(tmp_path / "no-such-model"), str(tmp_path / "out"), *map(str, args), "-q"]
    )
    text = result.output + (str(result.exception) if result.exception else "")
    assert result.exit_code == code and message in text, text
    assert "does not exist" not in text and not (tmp_path / "out").exists()


def test_bad_values_are_refused_in_a_fraction_of_a_second_without_torch(tmp_path):
    """In a fresh interpreter: the refusal comes before torch or transformers is imported."""
    for args in (["--calib-seq-len", "1"], ["--rope-dim", "7"], ["--recipe", str(tmp_path / "r.yaml")]):
        (tmp_path / "r.yaml").write_text("lowrank_method: best\n")
        stderr = cli_in_fresh_interpreter(["convert", str(tmp_path / "missing"), str(tmp_path / "out"), *args])
        assert stderr.strip().endswith(("2 False False", "1 False False")), stderr
        assert "Error" in stderr


def _convert_with_recipe(tiny_sources, tmp_path, *flags):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: mine\nkv_lora_rank: 24\nrope_dim: 8\nlowrank_method: bkv_pca\ncalib: random\n"
                      "calib_samples: 4\ncalib_seq_len: 8\ndtype: float32\n")  # fmt: skip
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["convert", str(tiny_sources["llama_gqa"]), str(out), "--recipe", str(recipe), *flags, "-q"]
    )
    assert result.exit_code == 0, result.output
    return Recipe.load(out / "recipe.yaml"), json.loads((out / "conversion.json").read_text())["settings"]


def test_flags_override_a_recipe_and_the_saved_recipe_round_trips(tiny_sources, tmp_path):
    saved, settings = _convert_with_recipe(tiny_sources, tmp_path, "--lowrank-method", "rrr", "--seed", "2",
                                           "--no-verify")  # fmt: skip
    assert (saved.name, saved.kv_lora_rank, saved.rope_dim, saved.lowrank_method) == ("mine", 24, 8, "rrr")
    assert saved.calib_samples == 4 and saved.dtype == "float32"  # the flags left out kept the recipe's
    assert Recipe.from_yaml(saved.to_yaml()) == saved
    assert saved.options == ConvertOptions(**{k: v for k, v in settings.items() if k in RECIPE_FIELDS})
    assert settings["seed"] == 2 and settings["verify"] is False  # run-time flags reach the options


def test_a_budget_with_a_fixed_rope_dim_is_saved_in_the_recipe(tiny_sources, tmp_path):
    saved, settings = _convert_with_recipe(
        tiny_sources, tmp_path, "--kv-budget", "0.5", "--allocation", "uniform"
    )
    assert (settings["kv_budget"], settings["kv_lora_rank"], settings["rope_dim"]) == (0.5, "full", 8)
    assert (saved.kv_budget, saved.kv_lora_rank, saved.rope_dim) == (0.5, "full", 8)


def test_measured_rope_dim_chooses_within_a_recipes_budget(tiny_sources, tmp_path):
    """``--rope-dim measured`` needs a budget and is no shape of its own: a recipe's budget stays (a number given
    as --rope-dim is a shape, and replaces it: the test above)."""
    recipe = _recipe(tmp_path, "kv_budget: 0.5\nallocation: planned\ncalib: random\ncalib_samples: 4\n"
                               "calib_seq_len: 8\ndtype: float32\n")  # fmt: skip
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(tiny_sources["llama_gqa"]), str(out), *map(str, recipe),
                                      "--rope-dim", "measured", "--no-verify", "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    settings = json.loads((out / "conversion.json").read_text())["settings"]
    assert (settings["kv_budget"], settings["rope_dim"]) == (0.5, "measured")
