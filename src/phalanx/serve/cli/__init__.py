"""The ``phalanx`` command line. Each subcommand group lives in its own module; the
option types in ``params`` are shared with the commands of layers above (``phalanx
bench``)."""

from ._main import cli, main
from .params import BYTE_SIZE, INT_LIST, SHAPE, parse_size

__all__ = ["BYTE_SIZE", "INT_LIST", "SHAPE", "cli", "main", "parse_size"]
