"""``phalanx doctor``: the generations under a runtime dir, and reclaiming dead ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from phalanx.rendezvous import default_runtime_dir, list_generations, sweep
from phalanx.rendezvous.sweep import DEFAULT_LEASE_EXPIRY_S


@click.command("doctor")
@click.option("--runtime-dir", type=click.Path(path_type=Path), default=None,
              help="default: $PHALANX_RUNTIME_DIR, $XDG_RUNTIME_DIR/phalanx or /tmp/phalanx-<uid>")
@click.option("--reclaim", is_flag=True, help="remove generations whose owner is provably dead")
@click.option("--lease-expiry", default=DEFAULT_LEASE_EXPIRY_S, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="seconds after which another host's silent owner counts as dead")
@click.option("--json", "as_json", is_flag=True)
def doctor(runtime_dir: Path | None, reclaim: bool, lease_expiry: float, as_json: bool) -> None:
    """List generations with owner, liveness and file counts; --reclaim the dead ones.

    Exits non-zero if anything could not be removed.
    """
    root = runtime_dir or default_runtime_dir()
    gens = list_generations(root, lease_expiry)
    report = sweep(root, lease_expiry) if reclaim else None
    if as_json:
        out: dict[str, object] = {"runtime_dir": str(root),
                                  "generations": [g.as_dict() for g in gens]}
        if report is not None:
            out["reclaim"] = report.as_dict()
        click.echo(json.dumps(out, sort_keys=True))
    else:
        click.echo(f"runtime dir {root}: {len(gens)} generation(s)")
        for g in gens:
            pid = g.owner.get("pid") if g.owner else "?"
            host = g.owner.get("host") if g.owner else "?"
            click.echo(f"  {g.token}  {g.liveness:<28} owner pid {pid} on {host}  "
                       f"{g.files} file(s), {g.shm_names} shm name(s)")
        if report is not None:
            click.echo(f"reclaimed {len(report.generations_removed)} generation(s), "
                       f"{report.files_removed} file(s), {report.shm_removed} shm name(s); "
                       f"kept {report.live_kept} live")
            for f in report.failures:
                click.echo(f"  could not remove {f!r}", err=True)
    if report is not None and report.failures:
        sys.exit(1)
