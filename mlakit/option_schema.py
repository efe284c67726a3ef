"""What every options model shares: its flags, its error text, and validation when it is made.

An options model (``ConvertOptions``, ``ExportOptions``, ``HealOptions``) is a frozen pydantic
dataclass whose fields declare type, default, bounds, literals and help (``Field(description=...)``)
once; ``commands/option_flags.py`` turns them into click flags. A field's ``json_schema_extra`` may add

- ``flag``: ``None`` for a field without a flag of its own (``quiet`` is the shared -q/--quiet);
- ``accepts``: what the field accepts, in words, where pydantic would list a union's members one by one;
- ``metavar``: the placeholder ``--help`` shows for the value.

``strict_init`` makes a bad value an ``OptionsError`` naming the field, its flag, what it accepts and
the value given, raised when the options are made: before any model or checkpoint is read.
Torch-free, so ``mla-convert --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import fields

from pydantic import ValidationError

__all__ = ["OptionsError", "field_flag", "flag_fields", "format_errors", "strict_init"]

_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


class OptionsError(ValueError):
    """An option value is out of range or contradicts another; the message names field, flag and fix."""


def _extra(model, name: str) -> dict:
    return model.__pydantic_fields__[name].json_schema_extra or {}


def field_flag(model, name: str) -> str | None:
    """The CLI flag of MODEL's field NAME (``calib_seq_len`` -> ``--calib-seq-len``); a switch that
    is on by default is named by its off form (``verify`` -> ``--no-verify``); None: no flag."""
    extra = _extra(model, name)
    if "flag" in extra:
        return extra["flag"]
    info = model.__pydantic_fields__[name]
    stem = name.replace("_", "-")
    return f"--no-{stem}" if info.annotation is bool and info.default is True else f"--{stem}"


def flag_fields(model) -> tuple[str, ...]:
    """MODEL's fields that have a flag, in field order."""
    return tuple(n for n in model.__pydantic_fields__ if field_flag(model, n))


def _describe(error: dict) -> str:
    """One pydantic error as 'must be ...' text."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _BOUNDS:
        return f"must be {_BOUNDS[kind]} {next(iter(ctx.values()))}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx['pattern']}"
    msg = str(error["msg"]).removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def format_errors(exc: ValidationError, model, prefix: tuple = (), aliases: dict | None = None) -> list[str]:
    """Lines naming each bad option of MODEL: field, flag, what it accepts and the value given.

    PREFIX: the location of the options inside a larger model (a recipe's ``("options",)``: its keys
    are named first; otherwise the flags are);
    ALIASES: field -> the key the user wrote (a legacy recipe's ``method.rope``)."""
    known = model.__pydantic_fields__
    by_field: dict[str, list[dict]] = {}
    other = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        if loc[: len(prefix)] == prefix and len(loc) > len(prefix) and loc[len(prefix)] in known:
            by_field.setdefault(loc[len(prefix)], []).append(error)
        else:
            other.append(error)
    lines = []
    for name, errors in by_field.items():
        given = errors[0].get("input")
        flag = field_flag(model, name)
        if prefix:  # a recipe: its key first, then the field it maps to and the flag
            key = aliases.get(name, name) if aliases else name
            head = f"{key} ({', '.join(n for n in (name if key != name else None, flag) if n)})"
        else:  # Python or CLI: the flag first
            head = f"{flag} ({name})" if flag else name
        accepts = _extra(model, name).get("accepts") or _describe(errors[0])
        lines.append(f"{head} {accepts}; got {given!r}")
    for error in other:
        loc = error["loc"][len(prefix) :] if tuple(error["loc"][: len(prefix)]) == prefix else error["loc"]
        loc = ".".join(map(str, loc))
        if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            lines.append(f"unknown option {loc!r}")
        else:
            lines.append(f"{loc + ': ' if loc else ''}{_describe(error)}")
    return lines


def strict_init(model, what: str):
    """Make MODEL's constructor (and so ``dataclasses.replace``) raise an ``OptionsError`` that names
    the flags, not pydantic's text; WHAT names the options in the message ('conversion')."""
    validated_init = model.__init__

    def __init__(self, *args, **kwargs):
        try:
            validated_init(self, *args, **kwargs)
        except ValidationError as exc:
            names = ", ".join(f.name for f in fields(model))
            raise OptionsError(
                f"invalid {what} options:\n  "
                + "\n  ".join(format_errors(exc, model))
                + f"\noptions: {names}"
            ) from None

    model.__init__ = __init__
    return model
