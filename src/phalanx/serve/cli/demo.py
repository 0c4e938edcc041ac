"""``phalanx demo``: a short multi-rank run that prints what it did."""

from __future__ import annotations

import os
import time

import click

from phalanx.runtime import Orchestrator, Worker, current_rank


def _whoami(x: int) -> tuple[int | None, int, int]:
    return current_rank(), os.getpid(), x * x


def _orch(o: Orchestrator, n: int) -> list[tuple[int | None, int, int]]:
    futures = [o.submit(r, _whoami, n + r) for r in o.ranks]
    return [f.result() for f in futures]


@click.command("demo")
@click.option("--ranks", type=click.IntRange(1), default=3, show_default=True,
              help="rank processes to start")
def demo(ranks: int) -> None:
    """Start a Worker, run one task per rank, print the answers and the stats, close."""
    t0 = time.perf_counter()
    with Worker(ranks=ranks) as worker:
        click.echo(f"started {ranks} ranks (generation {worker.generation}) in "
                   f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
        for rank, pid, sq in worker.run(_orch, 10):
            click.echo(f"  rank {rank} (pid {pid}) squared its input: {sq}")
        stats = worker.stats()
        click.echo(f"runs {stats.runs_retired} retired, tasks {stats.tasks_succeeded} ok, "
                   f"{stats.tasks_failed} failed")
        t1 = time.perf_counter()
    click.echo(f"closed in {(time.perf_counter() - t1) * 1e3:.0f} ms; nothing left behind")
