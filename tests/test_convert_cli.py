"""`mla-convert convert`: the happy path and every bad input named in the docs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import GPT2Config, Qwen3Config

from mlakit.cli import cli

pytestmark = pytest.mark.filterwarnings("ignore")


def run(*args):
    result = CliRunner().invoke(cli, ["convert", *map(str, args), "-q"])
    return result.exit_code, result.output + (str(result.exception) if result.exception else "")


def test_convert_writes_complete_checkpoint(tiny_sources, tmp_path):
    out = tmp_path / "out"
    code, text = run(tiny_sources["llama_gqa"], out, "--kv-lora-rank", 24, "--rope-dim", 8, "--dtype", "float32",
                     "--calib", "random", "--calib-samples", 8, "--calib-seq-len", 32)
    assert code == 0, text
    summary = json.loads(text[text.index("{"):])
    assert summary["kv_values_per_token_per_layer"] == 32 and summary["source_kv_values_per_token_per_layer"] == 64
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "conversion.json", "generation_config.json",
            "modeling_mla.py", "configuration_mla.py", "decode_reference.py", "decode_dispatch.py"} <= names
    report = json.loads((out / "conversion.json").read_text())
    assert [lay["kv_lora_rank"] for lay in report["layers"]] == [24, 24]
    assert report["settings"]["kv_lora_rank"] == 24 and report["settings"]["rope_dim"] == 8
    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (24 + 8, 64)
    assert weights["model.layers.0.self_attn.kv_b_proj.weight"].shape == (4 * 2 * 16, 24)
    assert not list(tmp_path.glob(".out.partial-*"))


def test_existing_output_needs_overwrite(tiny_sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    code, text = run(tiny_sources["llama_gqa"], out)
    assert code == 1 and "already exists" in text and "--overwrite" in text
    assert (out / "keep.txt").exists()
    code, text = run(tiny_sources["llama_gqa"], out, "--overwrite", "--no-verify")  # not an mlakit output
    assert code == 1 and "not an mlakit output" in text and "rm -r" in text, text
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()  # empty: replaceable
    code, text = run(tiny_sources["llama_gqa"], out, "--overwrite", "--no-verify")
    assert code == 0, text
    assert (out / "model.safetensors").exists()
    (out / "extra.txt").write_text("old run")  # an earlier conversion (has conversion.json): replaced
    code, text = run(tiny_sources["llama_gqa"], out, "--overwrite", "--no-verify")
    assert code == 0, text
    assert not (out / "extra.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock, partial or old copy left


def test_interrupted_conversion_leaves_nothing(tiny_sources, tmp_path, monkeypatch):
    import mlakit.pipeline.api as pipeline
    import mlakit.pipeline.report as report

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "write_modeling_code", boom)
    with pytest.raises(KeyboardInterrupt):
        pipeline.convert(str(tiny_sources["llama_gqa"]), tmp_path / "out", pipeline.ConvertOptions(quiet=True))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv-lora-rank", 0], "--kv-lora-rank (kv_lora_rank) must be 'full' or an integer >= 1; got 0"),
        (["--kv-lora-rank", 200], "in [1, 32]"),
        (["--rope-dim", 8, "--kv-lora-rank", 57], "in [1, 56]"),
        (["--rope-dim", 7], "--rope-dim must be even"),
        (["--rope-dim", 34], "--rope-dim must be 'full' or an even integer in [0, 32]"),
        (["--kv-lora-rank", "abc"], "neither an integer nor 'full'"),
    ],
)
def test_rank_and_rope_dim_ranges(tiny_sources, tmp_path, args, message):
    code, text = run(tiny_sources["llama_gqa"], tmp_path / "out", *args)
    assert code != 0 and message in text, text
    assert not (tmp_path / "out").exists()


def test_missing_source(tmp_path):
    code, text = run(tmp_path / "nowhere", tmp_path / "out")
    assert code == 1 and "does not exist" in text


def test_directory_without_config(tmp_path):
    (tmp_path / "src").mkdir()
    code, text = run(tmp_path / "src", tmp_path / "out")
    assert code == 1 and "has no config.json" in text


@pytest.mark.parametrize(
    "config, arch, extra",
    [(GPT2Config(n_layer=1), "GPT2LMHeadModel", ""),
     (Qwen3Config(num_hidden_layers=1), "Qwen3ForCausalLM", "normalises q and k")],
)
def test_unsupported_architecture(tmp_path, config, arch, extra):
    config.architectures = [arch]
    config.save_pretrained(tmp_path / "src")
    code, text = run(tmp_path / "src", tmp_path / "out")
    assert code == 1 and f"architecture {arch} is not supported" in text and extra in text
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in text


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tiny_sources, tmp_path, damage):
    src = tmp_path / "src"
    shutil.copytree(tiny_sources["llama_gqa"], src)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x00garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    code, text = run(src, tmp_path / "out")
    assert code == 1 and "corrupt or truncated" in text and "re-download" in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("pipeline_name", ["streaming", "in-memory"])
@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_missing_tensor_is_reported_before_calibrating(tiny_sources, tmp_path, monkeypatch, pipeline_name, tensor):
    from safetensors.torch import save_file

    from mlakit.pipeline import run_state

    src = tmp_path / "src"
    shutil.copytree(tiny_sources["llama_gqa"], src)
    state = load_file(src / "model.safetensors")
    del state[tensor]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})

    def calibrate(*args, **kwargs):
        raise AssertionError("calibration ran before the missing tensor was reported")

    monkeypatch.setattr(run_state, "calibration_ids", calibrate)
    code, text = run(src, tmp_path / "out", "--kv-budget", "0.5", "--calib", "random", "--pipeline", pipeline_name)
    assert code == 1 and f"{tensor} is missing" in text and "re-download" in text
    assert not (tmp_path / "out").exists()


def test_pickle_checkpoint_loads_with_weights_only(tiny_sources, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_sources["llama_gqa"], src)
    state = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")
    code, text = run(src, tmp_path / "out", "--dtype", "float32")
    assert code == 0, text
    assert json.loads(text[text.index("{"):])["verify"]["max_abs_logit_diff"] < 1e-4


class _NotATensor:  # a pickle that weights_only=True must refuse
    pass


def test_unsafe_pickle_is_refused(tiny_sources, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_sources["llama_gqa"], src)
    (src / "model.safetensors").unlink()
    torch.save({"x": _NotATensor()}, src / "pytorch_model.bin")
    code, text = run(src, tmp_path / "out")
    assert code == 1 and "cannot be loaded safely with weights_only=True" in text


def test_hub_id_offline_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, text = run("someorg/some-model", tmp_path / "out")
    assert code == 1 and "could not fetch 'someorg/some-model'" in text and "--local-dir" in text


# --- options: one model (mlakit/options.py) behind the flags and the recipes ---------------------


def test_every_convert_flag_default_is_the_options_default():
    from mlakit.options import ConvertOptions

    fields = ConvertOptions.__pydantic_fields__
    params = {p.name: p for p in cli.commands["convert"].params}
    checked = [name for name in fields if name in params and name != "quiet"]
    assert len(checked) == len(fields) - 1  # every option but quiet (the shared -q) is a flag
    for name in checked:
        assert params[name].default == fields[name].default, name


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ("rope_method: best\n", "rope_method (--rope-method) must be one of 'scored', 'transmla', 'high'"),
        ("kv_budget: 0\n", "kv_budget (--kv-budget) must be a fraction in (0, 1] (or unset); got 0"),
        ("calib_seq_len: 1\n", "calib_seq_len (--calib-seq-len) must be >= 2; got 1"),
        ("mixng: pca\n", "unknown key 'mixng'; recipe keys: name, description, kv_lora_rank"),
    ],
)
def test_a_bad_recipe_fails_before_the_model_is_read(tiny_sources, tmp_path, monkeypatch, recipe, message):
    from mlakit.pipeline import run as driver_run

    monkeypatch.setattr(driver_run, "open_source", lambda *a, **k: pytest.fail("the model was read"))
    (tmp_path / "r.yaml").write_text(recipe)
    code, text = run(tiny_sources["llama_gqa"], tmp_path / "out", "--recipe", tmp_path / "r.yaml")
    assert code == 2 and "Invalid value for --recipe" in text and message in text, text
    assert not (tmp_path / "out").exists()


def test_calib_sizes_from_python_fail_when_the_options_are_made():
    from mlakit.options import ConvertOptions, OptionsError

    with pytest.raises(OptionsError, match=r"--calib-samples \(calib_samples\) must be >= 1; got 0"):
        ConvertOptions(calib_samples=0)
    with pytest.raises(OptionsError, match=r"--calib-seq-len \(calib_seq_len\) must be >= 2; got 1"):
        ConvertOptions(calib_seq_len=1)
