"""Options and error handling shared by the CLI commands."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys

import click

__all__ = [
    "IntList", "byte_size_type", "compare_device_option", "compare_dtype_option", "original_option", "quiet_transformers",
    "RankType", "setup_logging", "user_errors", "verbosity_options",
]

log = logging.getLogger(__name__)


def setup_logging(verbosity: int) -> None:
    """Our log level from VERBOSITY; transformers only logs errors (and draws no bars when quiet).

    Before transformers is imported this goes through the variables it reads at import, so that
    ``--help`` and usage errors never import it (it costs seconds)."""
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    if "transformers" not in sys.modules:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        if verbosity < 0:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        return
    from transformers.utils import logging as hf_logging

    if verbosity < 0:
        hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


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
    """Turn the errors a user can cause (bad spec, path or setting: ValueError; unreadable or
    existing files: OSError) into a clean `Error: ...` and exit code 1; the traceback is logged
    at debug level (-vv)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError) as exc:
            log.debug("command failed", exc_info=True)
            raise click.ClickException(str(exc)) from exc

    return wrapper


class IntList(click.ParamType):
    """A comma-separated list of positive integers, e.g. ``128,512,1024``."""

    name = "INT,INT,..."

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return [int(v) for v in value]
        try:
            items = [int(v) for v in str(value).split(",") if v.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers (e.g. 128,512,1024)", param, ctx)
        if not items or min(items) < 1:
            self.fail(f"{value!r} must list at least one integer, each >= 1 (e.g. 128,512,1024)", param, ctx)
        return items


@contextlib.contextmanager
def quiet_transformers(quiet: bool):
    """With ``quiet``, hide the progress bars transformers draws while loading weights."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()


class _ByteSize(click.ParamType):
    """A memory size: bytes, or a number with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (of 1024)."""

    name = "SIZE"
    _UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().replace(" ", "")
        number = text.rstrip("kmgtib")
        unit = text[len(number):]
        try:
            size = float(number) * self._UNITS[unit]
        except (ValueError, KeyError):
            self.fail(f"{value!r} is not a memory size; write e.g. 4GB, 3.5GiB, 800MB or a number of bytes", param, ctx)
        if size <= 0:
            self.fail(f"{value!r} must be a positive size, e.g. 4GB", param, ctx)
        return int(size)


byte_size_type = _ByteSize()


class RankType(click.ParamType):
    """An integer or one of WORDS (a rank or d_R, or 'full', ...)."""

    def __init__(self, words: tuple[str, ...] = ("full",)):
        self.words = words
        self.name = "|".join(("INT", *words))

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value in self.words:
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither an integer nor {' nor '.join(map(repr, self.words))}", param, ctx)


# Options shared by the commands that compare a converted model with its original (eval, bench).
original_option = click.option(
    "--original",
    required=True,
    metavar="SRC",
    help="The source model: a local HF directory, a hub id, a .gguf file, or 'default'.",
)
compare_device_option = click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
compare_dtype_option = click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="Both models run in this dtype (auto: bfloat16 on CUDA, float32 on CPU).",
)
