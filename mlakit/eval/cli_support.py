"""Small helpers shared by the ``eval`` and ``bench`` click commands."""

from __future__ import annotations

import contextlib
import logging

import click

__all__ = ["IntList", "quiet_transformers", "user_errors"]

logger = logging.getLogger(__name__)


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
def user_errors():
    """Turn the errors a user can cause (bad spec, path, setting: ValueError; unreadable
    files: OSError) into a click error without a traceback, logged at debug level."""
    try:
        yield
    except (ValueError, OSError) as exc:
        logger.debug("command failed", exc_info=True)
        raise click.ClickException(str(exc)) from exc


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
