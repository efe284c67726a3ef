"""Click flags generated from an options model (``ConvertOptions``, ``ExportOptions``, ``HealOptions``):
one declaration, every command.

Each field becomes ``--field-name`` with the field's type, default, choices, range and help; a switch
that is on by default becomes ``--name/--no-name`` (``verify``), a field without a default a required
flag. ``given_options`` tells which of them the user typed, so that a recipe's value is replaced only
by a flag given on the command line. The command builds the model from the flags it receives, which
checks every cross-field rule before anything is read.
"""

from __future__ import annotations

import types
import typing

import annotated_types
import click
from click.core import ParameterSource

from ..option_schema import field_flag, flag_fields
from ..options import ConvertOptions
from .common import RankType

__all__ = ["FLAG_FIELDS", "given_options", "option_flags"]

FLAG_FIELDS = flag_fields(ConvertOptions)


def _bounds(metadata) -> dict:
    out = {}
    for item in metadata:
        for key in ("ge", "gt", "le", "lt"):
            if getattr(item, key, None) is not None and isinstance(item, annotated_types.BaseMetadata):
                out[key] = getattr(item, key)
    return out


def _click_type(annotation, metadata):
    """The click type of a field: Choice for a Literal, a range for bounded numbers, rank-or-'full'."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return click.Choice(args)
    if origin in (typing.Union, types.UnionType):
        words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if "full" in words:
            return RankType(tuple(words))  # bounds and evenness are checked by the model
        (annotation,) = [a for a in args if a is not type(None)]  # optional: None is the default, not a value
    bounds = _bounds(metadata)
    if annotation is int:
        return click.IntRange(min=bounds.get("ge"), max=bounds.get("le")) if bounds else int
    if annotation is float:
        if not bounds:
            return float
        return click.FloatRange(
            min=bounds.get("ge", bounds.get("gt")), max=bounds.get("le", bounds.get("lt")),
            min_open="gt" in bounds, max_open="lt" in bounds,
        )  # fmt: skip
    return None


def _option(model, name: str, help_text: str | None = None):
    info = model.__pydantic_fields__[name]
    flag, extra = field_flag(model, name), info.json_schema_extra or {}
    help_text = help_text or info.description
    if info.annotation is bool:
        if info.default:
            return click.option(
                f"--{name.replace('_', '-')}/{flag}", name, default=True, show_default=True, help=help_text
            )
        return click.option(flag, name, is_flag=True, default=False, help=help_text)
    if info.is_required():
        return click.option(
            flag, name, required=True, type=_click_type(info.annotation, info.metadata),
            metavar=extra.get("metavar"), help=help_text,
        )  # fmt: skip
    return click.option(
        flag,
        name,
        type=_click_type(info.annotation, info.metadata),
        default=info.default,
        show_default=info.default is not None,
        metavar=extra.get("metavar"),
        help=help_text,
    )


def option_flags(*names: str, model=ConvertOptions, help: dict[str, str] | None = None):  # noqa: A002 (click's word)
    """Decorator adding the flags of MODEL's fields NAMES (all its fields with a flag when empty), in
    field order; the command receives each as a keyword named like the field. HELP: field -> the help
    text for a command that uses the option differently (inspect's --kv-budget only shows a plan)."""
    flagged = flag_fields(model)
    names = names or flagged
    unknown = set(names) - set(flagged)
    assert not unknown, f"not {model.__name__} fields with a flag: {sorted(unknown)}"

    def decorate(fn):
        for name in reversed([n for n in flagged if n in names]):
            fn = _option(model, name, (help or {}).get(name))(fn)
        return fn

    return decorate


def given_options(values: dict) -> dict:
    """The entries of VALUES (field -> flag value) that the user gave (command line or environment)."""
    ctx = click.get_current_context()
    return {
        k: v
        for k, v in values.items()
        if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)
    }
