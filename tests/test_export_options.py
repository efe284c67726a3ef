"""The export options model (mlakit/export_options.py): the export command's flags come from it, and a
bad value is refused, naming the field and its flag, before the native checkpoint or source is read."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mlakit.cli import cli
from mlakit.export_options import ExportOptions
from mlakit.option_schema import field_flag, flag_fields
from mlakit.options import OptionsError
from tests.cli_process import cli_in_fresh_interpreter

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ExportOptions.__pydantic_fields__


def _params(command_name: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in cli.commands[command_name].params}


# --- the model ----------------------------------------------------------------------------------


def test_fields_and_defaults_are_the_former_dataclasses():
    want = dict(
        format="deepseek-v3", dtype="auto", biases="refuse", rope_scaling="refuse", target="any",
        clip_context=False, overwrite=False, verify=True,
    )  # fmt: skip
    assert dataclasses.asdict(ExportOptions()) == want  # export.json's "settings" keep their keys


def test_export_options_are_frozen_and_replace_validates():
    opts = ExportOptions(biases="hf-exact")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.dtype = "float32"
    assert dataclasses.replace(opts, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(OptionsError, match=r"--biases hf-exact and --target vllm contradict"):
        dataclasses.replace(opts, target="vllm")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"biases": "keep"}, "--biases (biases) must be one of 'refuse', 'drop' or 'hf-exact'; got 'keep'"),
        ({"rope_scaling": "yarn"}, "--rope-scaling (rope_scaling) must be one of 'refuse' or 'hf-exact'"),
        ({"format": "gguf"}, "--format (format) must be one of 'deepseek-v3'; got 'gguf'"),
        ({"target": "sglang"}, "--target (target) must be one of 'any' or 'vllm'; got 'sglang'"),
        ({"dtype": "int8"}, "--dtype (dtype) must be one of 'auto', 'float32'"),
        ({"dtype": "float16"}, "--dtype (dtype) must not be float16: "),
        ({"dtype": "fp16"}, "use --dtype bfloat16 or --dtype float32; got 'fp16'"),
        (
            {"biases": "hf-exact", "target": "vllm"},
            "--biases hf-exact and --target vllm contradict each other",
        ),
        (
            {"rope_scaling": "hf-exact", "target": "vllm"},
            "--rope-scaling hf-exact and --target vllm contradict each other",
        ),
        ({"clip_contxt": True}, "unknown option 'clip_contxt'"),
    ],
)
def test_bad_values_name_the_flag_and_what_it_accepts(fields, message):
    with pytest.raises(OptionsError) as info:
        ExportOptions(**fields)
    assert message in str(info.value), str(info.value)
    assert "Traceback" not in str(info.value) and "pydantic" not in str(info.value)


def test_verify_is_named_by_its_off_switch():
    assert field_flag(ExportOptions, "verify") == "--no-verify"
    assert field_flag(ExportOptions, "clip_context") == "--clip-context"


# --- the flags ----------------------------------------------------------------------------------


def test_every_export_flag_default_choices_and_help_come_from_the_model():
    params = _params("export")
    assert set(flag_fields(ExportOptions)) == set(FIELDS)  # every field is a flag
    for name, info in FIELDS.items():
        param = params[name]
        assert param.default == info.default and param.help == info.description, name
        if typing.get_origin(info.annotation) is typing.Literal:
            assert tuple(param.type.choices) == typing.get_args(info.annotation), name
    assert params["verify"].secondary_opts == ["--no-verify"] and params["clip_context"].is_flag


def test_export_help_lists_every_flag_with_its_help():
    result = CliRunner().invoke(cli, ["export", "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for name, info in FIELDS.items():
        assert field_flag(ExportOptions, name) in text, name
        assert " ".join(info.description.split()[:4]) in text, name  # click rewraps, words stay in order


def test_convert_shares_the_export_policy_flags():
    params = _params("convert")
    for name in ("biases", "rope_scaling", "clip_context"):
        assert params[name].help == FIELDS[name].description and params[name].default == FIELDS[name].default
    # convert's dtype, target, overwrite and verify are the conversion's own, passed on to the export
    assert params["dtype"].help != FIELDS["dtype"].description


# --- the CLI refuses bad values before anything is read -----------------------------------------


@pytest.fixture
def no_reads(monkeypatch):
    """Fail the test if an export opens its native checkpoint or a conversion its source."""
    from mlakit.export import run as export_run
    from mlakit.io import source
    from mlakit.pipeline import run

    def fail(*args, **kwargs):
        pytest.fail("a checkpoint was opened before the options were checked")

    monkeypatch.setattr(export_run, "read_native", fail)
    monkeypatch.setattr(export_run, "resolve_source", fail)
    for module in (run, source):
        monkeypatch.setattr(module, "open_source", fail)
        monkeypatch.setattr(module, "resolve_source", fail)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["--biases", "keep"],
            2,
            "Invalid value for '--biases': 'keep' is not one of 'refuse', 'drop', 'hf-exact'",
        ),
        (["--format", "gguf"], 2, "Invalid value for '--format': 'gguf' is not 'deepseek-v3'"),
        (["--dtype", "float16"], 1, "--dtype (dtype) must not be float16"),
        (["--target", "vllm", "--biases", "hf-exact"], 1, "--biases hf-exact and --target vllm contradict"),
        (["--target", "vllm", "--rope-scaling", "hf-exact"], 1, "--rope-scaling hf-exact and --target vllm"),
    ],
)
def test_bad_export_flags_fail_before_the_checkpoint_is_read(no_reads, tmp_path, args, code, message):
    native = tmp_path / "native"
    native.mkdir()  # exists (click checks that), but is never opened
    result = CliRunner().invoke(cli, ["export", str(native), str(tmp_path / "dest"), *args, "-q"])
    text = result.output + (str(result.exception) if result.exception else "")
    assert result.exit_code == code and message in text, text
    assert not (tmp_path / "dest").exists()


def test_convert_format_refuses_contradicting_export_flags_before_the_source_is_opened(no_reads, tmp_path):
    result = CliRunner().invoke(
        cli,
        ["convert", str(tmp_path / "no-such-model"), str(tmp_path / "out"), "--format", "deepseek-v3",
         "--target", "vllm", "--biases", "hf-exact", "-q"],
    )  # fmt: skip
    text = result.output + (str(result.exception) if result.exception else "")
    assert result.exit_code == 1 and "--biases hf-exact and --target vllm contradict" in text, text
    assert "does not exist" not in text and not (tmp_path / "out").exists()


def test_bad_export_values_are_refused_without_torch(tmp_path):
    """In a fresh interpreter: the refusal comes before torch or transformers is imported."""
    (tmp_path / "native").mkdir()
    stderr = cli_in_fresh_interpreter(["export", str(tmp_path / "native"), str(tmp_path / "dest"), "--dtype", "fp16"])
    assert stderr.strip().endswith("1 False False"), stderr
    assert "--dtype (dtype) must not be float16" in stderr
