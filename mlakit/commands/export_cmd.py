"""`mla-convert export OUT DEST --format deepseek-v3`: flags generated from ``ExportOptions``."""

from __future__ import annotations

import json

import click

from ..export_options import ExportOptions
from .common import user_errors, verbosity_options
from .option_flags import option_flags

__all__ = ["export_command", "export_flags"]

# The export policies `convert --format deepseek-v3` takes too (its dtype, target, overwrite and
# verify flags are the conversion's, passed on to the export).
export_flags = option_flags("biases", "rope_scaling", "clip_context", model=ExportOptions)


@click.command("export")
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@option_flags(model=ExportOptions)
@verbosity_options
@user_errors
def export_command(out, dest, quiet, **flags):
    """Export the native mlakit checkpoint OUT (written by `mla-convert convert`) to DEST in another format."""
    opts = ExportOptions(**flags)  # every value and rule checked before OUT is read
    # imported here, not at the top: --help and usage errors answer without torch
    from ..export import export

    report = export(out, dest, opts)
    click.echo(
        json.dumps(
            {
                "output": str(dest),
                "format": opts.format,
                "checks": report["checks"],
                "engines": report["engines"],
                "verify": report.get("verify"),
                "seconds": report["seconds"],
            },
            indent=2,
            allow_nan=False,
        )
    )
