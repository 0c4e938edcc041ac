"""The command-line arguments every node of a job is started with (torchrun's names)."""

from __future__ import annotations

import argparse

__all__ = ["add_node_arguments"]


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """``--nnodes --node-rank --master-addr --master-port``, all required."""
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
