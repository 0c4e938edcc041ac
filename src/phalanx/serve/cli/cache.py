"""``phalanx cache ...``: operator commands on a prefix-cache directory.

A plain click group: each subcommand is one function (``synth`` and ``maintain`` come
with replication). ``inspect`` and ``verify`` are read-only and take no lock, so they
are safe beside a live server.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from phalanx.cache.audit import inspect_directory, verify_directory

__all__ = ["cache"]


@click.group()
def cache() -> None:
    """Inspect and verify persistent prefix-cache directories."""


@cache.command("inspect")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def inspect_cmd(directory: str, as_json: bool) -> None:
    """Records, bytes, depth histogram, thinnable rows, skipped files with reasons."""
    rep = inspect_directory(directory)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(rep), sort_keys=True))
        return
    click.echo(f"directory  {rep.directory}")
    click.echo(f"geometry   {rep.geometry or 'unknown (no manifest)'}")
    click.echo(f"records    {rep.records} ({rep.thinned} thinned to their header)")
    click.echo(f"bytes      {rep.bytes}")
    click.echo(f"thinnable  {rep.thinnable}")
    click.echo(f"orphans    {rep.orphans}")
    click.echo(f"temp files {rep.temps}")
    click.echo("depth (pages at a record's end): records")
    for bucket, n in rep.depth_histogram.items():
        click.echo(f"  {bucket:>11}: {n}")
    click.echo(f"skipped    {len(rep.skipped)}")
    for name, reason in rep.skipped:
        click.echo(f"  {name}: {reason}")


@cache.command("verify")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def verify_cmd(directory: str, as_json: bool) -> None:
    """Check every record's header and page checksums; exit 1 on any corruption."""
    rep = verify_directory(directory)
    if as_json:
        out = {"directory": rep.directory, "checked": rep.checked, "ok": rep.ok,
               "corrupt": [list(c) for c in rep.corrupt]}
        click.echo(json.dumps(out, sort_keys=True))
    else:
        click.echo(f"{rep.checked} records checked in {rep.directory}: "
                   f"{'ok' if rep.ok else f'{len(rep.corrupt)} corrupt'}")
        for name, reason in rep.corrupt:
            click.echo(f"  {name}: {reason}", err=True)
    if not rep.ok:
        sys.exit(1)
