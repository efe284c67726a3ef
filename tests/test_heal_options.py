"""The heal options model (mlakit/heal_options.py): `mla-convert heal`'s flags come from it, and a bad
value is refused, naming the field and its flag, before the student, teacher or data is opened."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mlakit.cli import cli
from mlakit.heal_options import HealOptions
from mlakit.option_schema import field_flag, flag_fields
from mlakit.options import OptionsError
from tests.cli_process import cli_in_fresh_interpreter

ROOT = Path(__file__).resolve().parent.parent
FIELDS = HealOptions.__pydantic_fields__


def test_fields_and_defaults_are_the_former_dataclasses():
    want = dict(
        teacher="t", data="builtin", tokens=200_000, seq_len=256, lr=1e-4, batch_size=4, grad_accum=1,
        train="attention", save_every=0, resume=False, temperature=1.0, lm_weight=0.0, warmup=None, seed=0,
        weight_decay=0.0, max_grad_norm=1.0, val_sequences=16, chunk_tokens=4096, work_dir=None,
        keep_checkpoints=1, overwrite=False, quiet=False,
    )  # fmt: skip
    assert (
        dataclasses.asdict(HealOptions(teacher="t")) == want
    )  # conversion.json's heal settings keep their keys
    assert HealOptions(teacher=Path("/m"), work_dir=Path("/w")).teacher == "/m"  # paths are taken as text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tokens": 0}, "--tokens (tokens) must be >= 1; got 0"),
        ({"seq_len": 1}, "--seq-len (seq_len) must be >= 2; got 1"),
        ({"lr": 0.0}, "--lr (lr) must be > 0.0; got 0.0"),
        ({"temperature": -1.0}, "--temperature (temperature) must be > 0.0; got -1.0"),
        ({"warmup": -1}, "--warmup (warmup) must be >= 0; got -1"),
        ({"train": "mlp"}, "--train (train) must be one of 'attention' or 'all'; got 'mlp'"),
        ({"val_sequences": 0}, "val_sequences must be >= 1; got 0"),  # no flag: named by its field
        ({"lr_warmup": 3}, "unknown option 'lr_warmup'"),
    ],
)
def test_bad_values_name_the_flag_and_what_it_accepts(fields, message):
    with pytest.raises(OptionsError) as info:
        HealOptions(teacher="t", **fields)
    assert message in str(info.value), str(info.value)
    assert "pydantic" not in str(info.value)


def test_every_heal_flag_default_range_and_help_come_from_the_model():
    params = {p.name: p for p in cli.commands["heal"].params}
    flagged = flag_fields(HealOptions)
    assert set(flagged) == set(FIELDS) - {"val_sequences", "chunk_tokens", "keep_checkpoints", "quiet"}
    for name in flagged:
        param, info = params[name], FIELDS[name]
        assert param.help == info.description, name
        assert param.required == info.is_required() and (param.required or param.default == info.default), (
            name
        )
        if typing.get_origin(info.annotation) is typing.Literal:
            assert tuple(param.type.choices) == typing.get_args(info.annotation), name
    assert isinstance(params["seq_len"].type, click.IntRange) and params["seq_len"].type.min == 2
    assert params["lr"].type.min == 0 and params["lr"].type.min_open
    assert params["quiet"].opts == ["-q", "--quiet"]
    result = CliRunner().invoke(cli, ["heal", "--help"])
    text = " ".join(result.output.split())
    for name in flagged:
        assert field_flag(HealOptions, name) in text, name


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--tokens", "0"], 2, "Invalid value for '--tokens': 0 is not in the range x>=1"),
        (["--train", "mlp"], 2, "'mlp' is not one of 'attention', 'all'"),
        (["--data", ""], 1, "--data (data) string should have at least 1 character"),
    ],
)
def test_bad_heal_flags_fail_before_anything_is_opened(monkeypatch, tmp_path, args, code, message):
    from mlakit.heal import trainer

    def fail(*a, **k):
        pytest.fail("a model was opened before the options were checked")

    monkeypatch.setattr(trainer, "read_student_config", fail)
    monkeypatch.setattr(trainer, "load_models", fail)
    (tmp_path / "student").mkdir()
    result = CliRunner().invoke(
        cli, ["heal", str(tmp_path / "student"), str(tmp_path / "dest"), "--teacher", "missing", *args, "-q"]
    )
    text = result.output + (str(result.exception) if result.exception else "")
    assert result.exit_code == code and message in text, text


def test_bad_heal_values_are_refused_without_torch(tmp_path):
    (tmp_path / "student").mkdir()
    stderr = cli_in_fresh_interpreter(
        ["heal", str(tmp_path / "student"), str(tmp_path / "dest"), "--teacher", "x", "--data", ""]
    )
    assert stderr.strip().endswith("1 False False"), stderr
