"""The ``phalanx`` command line. Each subcommand group lives in its own module."""

from ._main import cli, main

__all__ = ["cli", "main"]
