"""``phalanx cache ...``: operator commands on a prefix-cache directory.

A plain click group: each subcommand is one function (``synth`` and ``maintain`` come
with replication). ``inspect`` and ``verify`` are read-only and take no lock, so they
are safe beside a live server; each takes one rank's store or the server's directory
(every rank's store, cache_audit.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from phalanx.kvstore.audit import (
    InspectReport,
    VerifyReport,
    inspect_directory,
    verify_directory,
)

from .cache_audit import (
    inspect_json,
    inspect_ranks,
    rank_stores,
    verify_json,
    verify_ranks,
    verify_ranks_json,
)

__all__ = ["cache"]


@click.group()
def cache() -> None:
    """Inspect and verify persistent prefix-cache directories."""


@cache.command("inspect")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def inspect_cmd(directory: str, as_json: bool) -> None:
    """Records, bytes, depth histogram, thinnable rows, skipped files with reasons, of
    one rank's store or of every rank's under a server's --prefix-cache-disk DIR."""
    stores = rank_stores(directory)
    if not stores:
        rep = inspect_directory(directory)
        if as_json:
            click.echo(json.dumps(dataclasses.asdict(rep), sort_keys=True))
        else:
            _echo_inspect(rep)
        return
    total, ranks = inspect_ranks(directory, stores)
    if as_json:
        click.echo(json.dumps(inspect_json(total, ranks), sort_keys=True))
        return
    for r, rep in ranks.items():
        click.echo(f"== rank {r}")
        _echo_inspect(rep)
    click.echo(f"== total of {len(ranks)} ranks ({', '.join(map(str, ranks))})")
    _echo_inspect(total)


def _echo_inspect(rep: InspectReport) -> None:
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
    """Check every record's header and page checksums, of one rank's store or of every
    rank's under a server's --prefix-cache-disk DIR; exit 1 on any corruption."""
    stores = rank_stores(directory)
    if stores:
        rep, ranks = verify_ranks(directory, stores)
        out = verify_ranks_json(rep, ranks)
    else:
        rep, ranks = verify_directory(directory), {}
        out = verify_json(rep)
    if as_json:
        click.echo(json.dumps(out, sort_keys=True))
    else:
        for r, rank in ranks.items():
            click.echo(f"rank {r}: {_verdict(rank)}")
        click.echo(_verdict(rep, f" ({len(ranks)} ranks)" if ranks else ""))
        for name, reason in rep.corrupt:
            click.echo(f"  {name}: {reason}", err=True)
    if not rep.ok:
        sys.exit(1)


def _verdict(rep: VerifyReport, what: str = "") -> str:
    return (f"{rep.checked} records checked in {rep.directory}{what}: "
            f"{'ok' if rep.ok else f'{len(rep.corrupt)} corrupt'}")


def _geometry(page_tokens: int) -> Any:
    from phalanx.kvstore import Geometry

    # the synthetic shard of the tests and the benchmark: small rows, many records
    return Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=page_tokens)


def _identity(model: str | None, tp: int, page_tokens: int | None,
              fingerprint: str | None) -> tuple[Any, str | bytes, int]:
    """(geometry, fingerprint, page tokens): a served model's (``--model DIR``, as
    ``phalanx serve DIR --tp N`` opens it), or the small synthetic shard's."""
    if model is None:
        pt = page_tokens or 4
        return _geometry(pt), fingerprint or "phalanx-synth", pt
    if fingerprint is not None:
        raise click.UsageError("--fingerprint is derived from --model; give one of them")
    from phalanx.engine.disk.identity import cache_identity

    pt = page_tokens or 64
    geometry, fp = cache_identity(model, tp, pt)
    return geometry, fp, pt


def _model_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--model", "model", default=None, type=click.Path(exists=True,
                     file_okay=False), help="Write/open records for this model as "
                     "'phalanx serve MODEL --tp N' serves it (its geometry and fingerprint)."
                     )(f)
    f = click.option("--page-tokens", type=click.IntRange(1), default=None,
                     help="Tokens per page [default: 64 with --model, else 4].")(f)
    return click.option("--fingerprint", default=None,
                        help="Model fingerprint without --model [default: phalanx-synth].")(f)


@cache.command("synth")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--tp", type=click.IntRange(1), required=True, help="Ranks (DIR/rank-<i>/).")
@click.option("--records", type=click.IntRange(1), required=True)
@click.option("--shape", type=click.Choice(["chain", "tree"]), default="chain")
@_model_options
@click.option("--uncompacted", is_flag=True,
              help="Write overlapping rows as older versions did (7 of 8 rows redundant).")
@click.option("--seed", type=int, default=0, show_default=True)
def synth_cmd(directory: str, tp: int, records: int, shape: str, model: str | None,
              page_tokens: int | None, fingerprint: str | None, uncompacted: bool,
              seed: int) -> None:
    """Write the per-rank directories a TP-N job would have left, through the real
    replicated store path with the synthetic KV source."""
    from phalanx.replication import ReplicatedCache
    from phalanx.runtime import Worker

    geometry, fp, _ = _identity(model, tp, page_tokens, fingerprint)
    with _exit_on_error("synth"), Worker(ranks=tp) as w:
        rc = ReplicatedCache.open(w, directory, geometry=geometry,
                                  fingerprint=fp, capacity_bytes=1 << 60)
        rep = _closing(rc, lambda: rc.synth(records, shape, seed=seed,
                                            group=8 if uncompacted else 1))
    click.echo(f"{rep.records} records ({rep.redundant_rows} redundant rows) on {tp} ranks "
               f"in {rep.seconds:.2f}s under {directory}")


T = TypeVar("T")


def _closing(rc: Any, body: Callable[[], T]) -> T:
    """``body()``, then ``rc.close()`` whatever happened (a close that fails after
    ``body`` failed is a note on body's error, never hidden in ``__context__``)."""
    from phalanx.lifecycle import PhalanxError

    try:
        out = body()
    except BaseException as exc:
        try:
            rc.close()
        except PhalanxError as cleanup:
            exc.add_note(f"closing the cache then failed too: {cleanup}")
        raise
    rc.close()
    return out


@contextlib.contextmanager
def _exit_on_error(what: str) -> Iterator[None]:
    """A phalanx error (a stalled or dead peer, a close that failed) exits 1 with one
    message naming it, after the Worker closed (its ranks stopped or killed)."""
    from phalanx.lifecycle import PhalanxError

    try:
        yield
    except PhalanxError as exc:
        click.echo(f"phalanx cache {what}: {type(exc).__name__}: {exc}", err=True)
        for note in getattr(exc, "__notes__", []):
            click.echo(f"  {note}", err=True)
        sys.exit(1)


@cache.command("maintain")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--tp", type=click.IntRange(1), required=True)
@click.option("--max-age", type=click.FloatRange(0, min_open=True), default=None,
              help="Expire leaf records older (s).")
@click.option("--capacity", type=click.IntRange(1), default=1 << 60, help="Bytes per rank.")
@_model_options
@click.option("--window", type=click.IntRange(2), default=64, show_default=True)
@click.option("--job-timeout", type=click.FloatRange(min=0.001), default=30.0,
              show_default=True, help="Seconds a peer may make no progress before it fails.")
@click.option("--close-timeout", type=click.FloatRange(min=0.1), default=30.0,
              show_default=True, help="Seconds closing the cache and the ranks may take.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def maintain_cmd(directory: str, tp: int, max_age: float | None, capacity: int,
                 model: str | None, page_tokens: int | None, fingerprint: str | None,
                 window: int, job_timeout: float, close_timeout: float,
                 as_json: bool) -> None:
    """Open the replicated cache as a server would at start-up, reconcile, run
    maintenance to completion through the links, print the counts and exit (1 with the
    error when a peer stalls or dies: within job timeout + close timeouts)."""
    import time

    from phalanx.replication import ReplicatedCache
    from phalanx.runtime import Worker

    geometry, fp, _ = _identity(model, tp, page_tokens, fingerprint)
    t0 = time.monotonic()
    with _exit_on_error("maintain"), Worker(ranks=tp, close_timeout=close_timeout) as w:
        rc = ReplicatedCache.open(w, directory, geometry=geometry, fingerprint=fp,
                                  capacity_bytes=capacity, max_age=max_age, window=window,
                                  job_timeout=job_timeout, close_timeout=close_timeout)

        def body() -> dict[str, Any]:
            before = {r: s["stats"]["records"] for r, s in rc.stats().items()}
            report = rc.maintain()
            after = {r: s["stats"]["records"] for r, s in rc.stats().items()}
            return {"records_before": before, "records_after": after, "jobs": report.jobs,
                    "maintain_seconds": round(report.seconds, 3), "problems": rc.check()}

        out = _closing(rc, body)
    out["reconciled"] = rc.reconciled
    out["seconds"] = round(time.monotonic() - t0, 3)
    if as_json:
        click.echo(json.dumps(out, sort_keys=True, default=str))
    else:
        for key, value in out.items():
            click.echo(f"{key:16} {value}")
    if out["problems"]:
        sys.exit(1)
