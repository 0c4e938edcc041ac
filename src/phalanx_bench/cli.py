"""``phalanx bench NAME``: the benchmarks. Each lives in ``phalanx_bench.<name>``.

The ``phalanx`` CLI (``phalanx.serve``) finds this group through the ``phalanx.commands``
entry point, so the CLI never imports the layer above it.
"""

from __future__ import annotations

import importlib

import click

# name on the command line -> module under phalanx_bench exposing `command`
_BENCHES: dict[str, str] = {
    "worker": "worker",
    "rendezvous": "rendezvous",
    "domains": "domains",
    "cache-disk": "cache_disk",
    "replication": "replication",
    "engine": "engine",
    "serve": "serve",
    "multihost": "multihost",
    "llamacpp": "llamacpp",
    "fidelity": "fidelity",
    "soak": "soak",
    "structured": "structured",
}


class _BenchGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(n for n in _BENCHES if self.get_command(ctx, n) is not None)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module_name = _BENCHES.get(cmd_name)
        if module_name is None:
            return None
        full = f"phalanx_bench.{module_name}"
        try:
            module = importlib.import_module(full)
        except ModuleNotFoundError as exc:
            if exc.name == full:  # not built yet
                return None
            raise
        command: click.Command = module.command
        return command


@click.group(cls=_BenchGroup)
def bench() -> None:
    """Benchmarks that run phalanx beside its anchor in the same run and report ratios.

    The last line each prints is one JSON object (with --json).
    """
