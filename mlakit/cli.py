"""`mla-convert`: a thin click entry point; each command parses, validates and calls one function."""

from __future__ import annotations

import click

from .commands.bench_cmd import bench_command
from .commands.common import setup_logging
from .commands.convert_cmd import convert_command
from .commands.eval_cmd import eval_command
from .commands.export_cmd import export_command
from .commands.heal_cmd import heal_command
from .commands.inspect_cmd import inspect_command

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlakit")
def cli():
    """Convert GQA/MHA checkpoints into Multi-head Latent Attention (MLA) models."""


for command in (convert_command, eval_command, bench_command, inspect_command, heal_command, export_command):
    cli.add_command(command)


def main():
    setup_logging(0)
    cli()


if __name__ == "__main__":  # `python -m mlakit.cli ...` ran nothing and exited 0 without this
    main()
