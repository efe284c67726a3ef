"""Options and error handling shared by the CLI commands."""

from __future__ import annotations

import functools
import logging

import click

__all__ = ["USER_ERRORS", "rank_option_type", "setup_logging", "user_errors", "verbosity_options"]


def _user_error_types() -> tuple[type[BaseException], ...]:
    from ..convert.families import UnsupportedModelError
    from ..convert.pipeline import ConversionError
    from ..convert.source import SourceError
    from ..convert.writer import OutputExistsError

    return (SourceError, ConversionError, UnsupportedModelError, OutputExistsError, FileNotFoundError)


USER_ERRORS = _user_error_types()


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        from transformers.utils import logging as hf_logging

        if verbosity < 0:
            hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def verbosity_options(fn):
    """-q / -v; passes ``quiet: bool`` to the command and configures logging."""

    @click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors; no progress bars.")
    @click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
    @functools.wraps(fn)
    def wrapper(*args, quiet: bool, verbose: int, **kwargs):
        setup_logging(-1 if quiet else verbose)
        return fn(*args, quiet=quiet, **kwargs)

    return wrapper


def user_errors(fn):
    """Turn the errors a user can cause into a clean `Error: ...` message and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


class _RankType(click.ParamType):
    name = "INT|full"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "full":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither an integer nor 'full'", param, ctx)


rank_option_type = _RankType()
