"""Root of the ``phalanx`` CLI; subcommands register themselves from their modules."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys

import click

from phalanx import __version__

# Subcommand modules, imported lazily by the root group so `phalanx --help` stays fast
# and torch is never imported unless a subcommand needs it. Commands of layers above
# serve (``phalanx bench``) come from the ``phalanx.commands`` entry point group, so
# this layer never imports them.
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("phalanx.serve.cli.demo", "demo"),
    "doctor": ("phalanx.serve.cli.doctor", "doctor"),
    "cache": ("phalanx.serve.cli.cache", "cache"),
    "serve": ("phalanx.serve.cli.serve", "serve"),
    "model": ("phalanx.serve.cli.model", "model"),
}


def _plugins() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group="phalanx.commands"))


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(_COMMANDS) | {ep.name for ep in _plugins()}
        return sorted(name for name in names if self.get_command(ctx, name) is not None)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            plugin = next((ep for ep in _plugins() if ep.name == cmd_name), None)
            if plugin is None:
                return None
            loaded: click.Command = plugin.load()
            return loaded
        module_name, attr = target
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # subcommand not built yet
                return None
            raise
        command: click.Command = getattr(module, attr)
        return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="phalanx")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """phalanx: workers, communication domains and a replicated prefix KV cache."""
    import phalanx.rendezvous  # noqa: F401  (declares failpoints PHALANX_FAILPOINTS may name)
    from phalanx.lifecycle import failpoints

    failpoints.arm_from_env()
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def main() -> None:
    cli()
if __name__ == "__main__":
    main()
