"""``phalanx cache ...``: operator commands on a prefix-cache directory.

A plain click group: each subcommand is one function (``synth`` and ``maintain`` come
with replication). ``inspect`` and ``verify`` are read-only and take no lock, so they
are safe beside a live server.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import click

from phalanx.kvstore.audit import inspect_directory, verify_directory

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


def _geometry(page_tokens: int) -> Any:
    from phalanx.kvstore import Geometry

    # the synthetic shard of the tests and the benchmark: small rows, many records
    return Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=page_tokens)


@cache.command("synth")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--tp", type=click.IntRange(1), required=True, help="Ranks (DIR/rank-<i>/).")
@click.option("--records", type=click.IntRange(1), required=True)
@click.option("--shape", type=click.Choice(["chain", "tree"]), default="chain")
@click.option("--page-tokens", type=click.IntRange(1), default=4, show_default=True)
@click.option("--uncompacted", is_flag=True,
              help="Write overlapping rows as older versions did (7 of 8 rows redundant).")
@click.option("--fingerprint", default="phalanx-synth", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def synth_cmd(directory: str, tp: int, records: int, shape: str, page_tokens: int,
              uncompacted: bool, fingerprint: str, seed: int) -> None:
    """Write the per-rank directories a TP-N job would have left, through the real
    replicated store path with the synthetic KV source."""
    from phalanx.replication import ReplicatedCache
    from phalanx.runtime import Worker

    with Worker(ranks=tp) as w:
        rc = ReplicatedCache.open(w, directory, geometry=_geometry(page_tokens),
                                  fingerprint=fingerprint, capacity_bytes=1 << 60)
        try:
            rep = rc.synth(records, shape, seed=seed, group=8 if uncompacted else 1)
        finally:
            problems = rc.close()
    click.echo(f"{rep.records} records ({rep.redundant_rows} redundant rows) on {tp} ranks "
               f"in {rep.seconds:.2f}s under {directory}")
    for p in problems:
        click.echo(f"  {p}", err=True)
    if problems:
        sys.exit(1)


@cache.command("maintain")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--tp", type=click.IntRange(1), required=True)
@click.option("--max-age", type=float, default=None, help="Expire leaf records older (s).")
@click.option("--capacity", type=click.IntRange(1), default=1 << 60, help="Bytes per rank.")
@click.option("--page-tokens", type=click.IntRange(1), default=4, show_default=True)
@click.option("--fingerprint", default="phalanx-synth", show_default=True)
@click.option("--window", type=click.IntRange(2), default=64, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def maintain_cmd(directory: str, tp: int, max_age: float | None, capacity: int,
                 page_tokens: int, fingerprint: str, window: int, as_json: bool) -> None:
    """Open the replicated cache as a server would at start-up, reconcile, run
    maintenance to completion through the links, print the counts and exit."""
    import time

    from phalanx.replication import ReplicatedCache
    from phalanx.runtime import Worker

    t0 = time.monotonic()
    with Worker(ranks=tp) as w:
        rc = ReplicatedCache.open(w, directory, geometry=_geometry(page_tokens),
                                  fingerprint=fingerprint, capacity_bytes=capacity,
                                  max_age=max_age, window=window)
        try:
            before = {r: s["stats"]["records"] for r, s in rc.stats().items()}
            report = rc.maintain()
            after = {r: s["stats"]["records"] for r, s in rc.stats().items()}
            problems = rc.check()
        finally:
            problems_close = rc.close()
    out = {"records_before": before, "records_after": after, "jobs": report.jobs,
           "reconciled": rc.reconciled, "maintain_seconds": round(report.seconds, 3),
           "seconds": round(time.monotonic() - t0, 3),
           "problems": problems + problems_close}
    if as_json:
        click.echo(json.dumps(out, sort_keys=True, default=str))
    else:
        for key, value in out.items():
            click.echo(f"{key:16} {value}")
    if out["problems"]:
        sys.exit(1)
