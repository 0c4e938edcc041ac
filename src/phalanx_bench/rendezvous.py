"""``phalanx bench rendezvous``: handshake latency and leftovers, phalanx vs torch stores.

Every system runs the same thing in its own rank processes: N back-to-back
handshakes (barriers) among all ranks, each with a fresh id as a domain allocation
would have, in --rounds rounds that visit every system in turn (a fresh Worker, and
store, per system and round), so the drift of a shared VM hits all of them alike.
torch's side is its store-based barrier (what ``new_group`` runs) over a ``FileStore``
and a ``TCPStore``, with a fresh group name per barrier as ``new_group`` uses: a
private torch function, so it is called from :mod:`phalanx_bench.anchors.torch_store`;
this module uses phalanx's public API only. Rank 0's per-handshake times are reported.
"""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import click

from phalanx.rendezvous import BACKENDS, handshake, live_markers
from phalanx.runtime import Orchestrator, Worker

from ._stats import emit, percentile
from .anchors import torch_store


def _phalanx_loop(first: int, n: int, ranks: list[int]) -> list[float]:
    samples = []
    for i in range(first, first + n):
        t0 = time.perf_counter()
        handshake("bench", i, ranks)
        samples.append(time.perf_counter() - t0)
    return samples


def _figures(samples: list[float], left: int, left_after_close: int) -> dict[str, float]:
    return {"handshake_us_p50": round(percentile(samples, 50) * 1e6, 1),
            "handshake_us_p99": round(percentile(samples, 99) * 1e6, 1),
            "left_after": left, "left_after_close": left_after_close}


def _count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def _phalanx_round(backend: str, ranks: int, first: int, n: int,
                   tmp: Path) -> tuple[list[float], int, int]:
    """``n`` handshakes on a fresh Worker: rank 0's times, the markers left right after
    them and after close. The store backend's job key is not a marker: not counted."""
    runtime_dir = tmp / f"rt-{backend}"

    def orch(o: Orchestrator) -> tuple[list[float], int]:
        futures = [o.submit(r, _phalanx_loop, first, n, list(o.ranks)) for r in o.ranks]
        rank0: list[float] = [f.result() for f in futures][0]  # noqa: RUF015
        # counted once every rank has returned from its last handshake: the store
        # backend's last participant to leave (any rank) removes the keys
        return rank0, o.submit(0, live_markers).result()

    with Worker(ranks=ranks, rendezvous=backend, runtime_dir=runtime_dir) as w:
        samples, left = w.run(orch)
        if backend == "store":
            left -= 1  # the job key
        else:  # count files: what would fill /tmp
            left = _count_files(runtime_dir) - 1  # less the owner record
    return samples, left, _count_files(runtime_dir)


def _torch_round(kind: str, ranks: int, first: int, n: int,
                 tmp: Path) -> tuple[list[float], int, int]:
    path = str(tmp / "torch-filestore")

    def orch(o: Orchestrator) -> tuple[list[float], int]:
        port = o.submit(0, torch_store.open_store, kind, 0, ranks, path, 0).result()
        for f in [o.submit(r, torch_store.open_store, kind, r, ranks, path, port)
                  for r in o.ranks[1:]]:
            f.result()
        futures = [o.submit(r, torch_store.barriers, first, n, r, ranks) for r in o.ranks]
        result: tuple[list[float], int] = [f.result() for f in futures][0]  # noqa: RUF015
        for f in [o.submit(r, torch_store.close) for r in o.ranks]:
            f.result()
        return result

    with Worker(ranks=ranks) as w:
        samples, left = w.run(orch)
    # FileStore's file: is it still there?
    after = int(os.path.exists(path)) if kind == "filestore" else 0
    if after:
        os.unlink(path)  # the next round's store starts afresh
    return samples, left, after


@click.command("rendezvous")
@click.option("--ranks", type=click.IntRange(1), default=2, show_default=True)
@click.option("--handshakes", type=click.IntRange(1), default=10_000, show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=5, show_default=True,
              help="Visit the systems in turn this many times (drift hits all alike).")
@click.option("--json", "as_json", is_flag=True)
def command(ranks: int, handshakes: int, rounds: int, as_json: bool) -> None:
    """Handshake latency p50/p99 and leftovers: phalanx backends vs torch FileStore/TCPStore.

    ``left_after``: markers (files, keys) the handshakes left, summed over the rounds
    (each round is a fresh job; summed, what one job doing them all would hold);
    ``left_after_close``: the most any round left after its Worker closed."""
    per_round = [handshakes // rounds + (i < handshakes % rounds) for i in range(rounds)]
    runners: dict[str, Any] = {b: partial(_phalanx_round, b) for b in BACKENDS}
    runners["torch_filestore"] = partial(_torch_round, "filestore")
    runners["torch_tcpstore"] = partial(_torch_round, "tcpstore")
    samples: dict[str, list[float]] = {name: [] for name in runners}
    left = dict.fromkeys(runners, 0)
    after_close = dict.fromkeys(runners, 0)
    first = 1
    with tempfile.TemporaryDirectory(prefix="phx-bench-rdv-") as tmp:
        for n in per_round:  # every system, round after round
            for name, run_round in runners.items():
                got, lft, aft = run_round(ranks, first, n, Path(tmp))
                samples[name] += got
                left[name] += lft
                after_close[name] = max(after_close[name], aft)
            first += n
    emit({name: _figures(samples[name], left[name], after_close[name]) for name in runners},
         as_json)
