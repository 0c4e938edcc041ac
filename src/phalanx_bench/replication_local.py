"""The local baselines of ``phalanx bench replication``: the lane's jobs applied with no
peers and no links, by one store in the benchmark process (``local_one``) and by one
store per rank, each in its own process, all at once (``local_all_ranks``).

Why two. A replicated job does its file work on every rank, so one store alone is the
limit only where each rank has its own disk and cores. On one host the ranks share the
disk (one filesystem journal) and the cores, so the physical limit of N ranks there is
what N stores applying the same jobs at the same time reach: ``local_all_ranks`` is that
limit, measured instead of argued. Its jobs/s is one store's share (jobs / wall time
from the common start to the last store's end), so it compares with the lane's.

Each store works on its own directory: for maintenance a copy of rank 0's closed
directory (so exactly the replicated jobs), for stores an empty one. Opening (recovery)
and the rows' chains are untimed; ``os.sync()`` runs after them, before the clock, so
no earlier phase's write-back (the copies) lands in the timed part.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from phalanx.kvstore import DiskStore, Geometry, StoreOptions
from phalanx.replication import rank_directories

from ._errors import BenchError

SMALL = Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=4)
BIG = Geometry(layers=8, kv_heads=8, head_dim=64, dtype="float16", page_tokens=16)  # 256 KiB
ROW_PAGES = (1 << 20) // BIG.page_bytes  # 4 pages: 1 MiB rows
FINGERPRINT = "bench"
# a spawned store's start (interpreter, imports, recovery of up to 100,000 records)
# and its share of the work both fit well inside this on a loaded 2-core machine
CHILD_DEADLINE_S = 600.0


class StagedRows:
    """A rank's KV source whose staging buffer already holds the bytes (every byte is
    the rank), as an engine's does: ``row`` is a view, no per-call generation."""

    def __init__(self, geometry: Geometry, rank: int) -> None:
        self.page_bytes = geometry.page_bytes
        self.rank = rank
        self._buf = np.full(0, rank & 0xFF, dtype=np.uint8)

    def row(self, keys: list[bytes], start: int) -> Any:
        n = (len(keys) - start) * self.page_bytes
        if self._buf.size < n:
            self._buf = np.full(n, self.rank & 0xFF, dtype=np.uint8)
        return self._buf[:n]

    def loaded(self, keys: list[bytes], data: memoryview) -> None:
        pass  # the benchmark loads nothing


@dataclass(frozen=True)
class Timed:
    """One measured run: jobs done (by each store, for a run of several), wall seconds,
    CPU seconds of each process (rank number, "parent", "local", or "local-<rank>")."""

    jobs: int
    seconds: float
    cpu: dict[str, float]


@dataclass(frozen=True)
class Jobs:
    """What a baseline applies: maintenance to the end (``rows`` None: every record of
    the copied directory expires, as ``max_age`` is 1 ms) or these rows, one by one."""

    rows: tuple[np.ndarray, ...] | None = None


def copy_rank0(directory: str, ranks: int, to: str) -> str:
    """A copy of rank 0's (closed) directory: a baseline applies the same jobs."""
    src = rank_directories(directory, ranks)[0]
    subprocess.run(["cp", "-a", src, to], check=True, timeout=600)
    return to


def _open(directory: str, jobs: Jobs) -> DiskStore:
    if jobs.rows is None:
        return DiskStore(directory, SMALL, FINGERPRINT, StoreOptions(
            capacity_bytes=1 << 40, max_age=1e-3, progress=False))
    return DiskStore(directory, BIG, FINGERPRINT,
                     StoreOptions(capacity_bytes=1 << 40, progress=False))


def _prepare(store: DiskStore, jobs: Jobs, rank: int) -> Callable[[], int]:
    """The timed work on an open store, its untimed set-up (the rows' chains) done."""
    if jobs.rows is None:
        def maintain() -> int:
            done = 0
            while n := store.poll(1 << 10):
                done += n
            return done
        return maintain

    source = StagedRows(BIG, rank)
    chains = [store.chain(t) for t in jobs.rows]

    def stores() -> int:
        for chain in chains:
            res = store.store(chain, source.row(chain.keys, 0))
            if not res.stored:
                raise BenchError(f"local baseline: a 1 MiB row was not stored: {res}")
        return len(chains)
    return stores


def local_one(directory: str, jobs: Jobs) -> Timed:
    """The jobs applied by one store in this process, no peers."""
    with _open(directory, jobs) as store:
        apply = _prepare(store, jobs, 0)
        os.sync()  # untimed: no earlier phase's write-back (the copies) in this one
        c0, t0 = time.process_time(), time.perf_counter()
        done = apply()
        return Timed(done, time.perf_counter() - t0, {"local": time.process_time() - c0})


def local_one_with_requests(directory: str, interval: float) -> tuple[Timed, int]:
    """Maintenance to the end by one store in this process while a thread stores one
    fresh 2-page record every ``interval`` seconds: the burst lane's request stream on
    the lane's own work, with no peers. Returns the run (its jobs include the expiries
    of the requests' records, as the lane's do) and the requests stored.

    The polls take 8 jobs at a time, the lane's chunk, so a request waits for the
    store's mutex as long as it waits for rank 0's order lock in the lane. They start
    once the first request is stored (inside the timed part), so a burst shorter than
    the interval still carries one."""
    errors: list[BaseException] = []
    stored = 0
    done, first = threading.Event(), threading.Event()
    pt = SMALL.page_tokens
    with _open(directory, Jobs()) as store:
        source = StagedRows(SMALL, 0)

        def requests() -> None:
            nonlocal stored
            due = time.monotonic()
            try:
                while not done.wait(max(0.0, due - time.monotonic())):
                    due += interval
                    chain = store.chain(np.arange(2 * pt) + 2 * pt * stored + 10**9)
                    if not store.store(chain, source.row(chain.keys, 0)).stored:
                        raise BenchError(f"local baseline: request {stored} was not stored")
                    stored += 1
                    first.set()
            except BaseException as e:  # noqa: BLE001  re-raised in the caller's thread
                errors.append(e)
            finally:
                first.set()

        os.sync()  # untimed: no earlier phase's write-back (the copies) in this one
        thread = threading.Thread(target=requests, name="bench-local-requests")
        c0, t0 = time.process_time(), time.perf_counter()
        thread.start()
        try:
            if not first.wait(CHILD_DEADLINE_S):
                raise BenchError("local baseline: the first request was not stored in time")
            jobs = 0
            while not errors and (n := store.poll(8)):
                jobs += n
        finally:
            done.set()
            thread.join()
        run = Timed(jobs, time.perf_counter() - t0, {"local": time.process_time() - c0})
    if errors:
        raise errors[0]
    return run, stored


def _child_main() -> None:
    """One store of ``local_all_ranks``, in its own process (``python -m`` this module).

    Reads (directory, jobs, rank) as one pickle on stdin, opens the store and prepares,
    says ``ready`` on stdout, waits for the go byte on stdin, applies, and reports one
    JSON line: its jobs, its end on CLOCK_MONOTONIC (one clock for every process on the
    host, so the parent times all stores from one start) and its CPU; or the error."""
    directory, jobs, rank = pickle.load(sys.stdin.buffer)
    try:
        with _open(directory, jobs) as store:
            apply = _prepare(store, jobs, rank)
            print("ready", flush=True)
            if not sys.stdin.buffer.read(1):
                raise BenchError("the parent went away before the common start")
            c0 = time.process_time()
            done = apply()
            end, cpu = time.monotonic(), time.process_time() - c0
        print(json.dumps({"jobs": done, "end": end, "cpu": cpu}), flush=True)
    except BaseException as e:  # the parent must learn why; it raises BenchError
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        raise  # and the traceback goes to stderr, which is the benchmark's


def _line(proc: subprocess.Popen[bytes], rank: int, deadline: float) -> dict[str, Any]:
    """The next line store ``rank``'s process writes (JSON, or the word ``ready``)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = proc.stdout.readline() if ready else b""
    if not line:
        why = "sent nothing in time" if not ready else f"exited ({proc.wait()})"
        raise BenchError(f"store {rank} of the all-ranks baseline {why}")
    out: dict[str, Any] = {"ready": True} if line == b"ready\n" else json.loads(line)
    if "error" in out:
        raise BenchError(f"store {rank}: {out['error']}")
    return out


def _start(directory: str, jobs: Jobs, rank: int) -> subprocess.Popen[bytes]:
    # the rank on the command line only names the process in ps
    proc = subprocess.Popen([sys.executable, "-m", __name__, str(rank)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((directory, jobs, rank)))
    proc.stdin.flush()
    return proc


def _reap(procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    """Every store process waited for, killed if it outlives the deadline."""
    for p in procs:
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def local_all_ranks(directories: list[str], jobs: Jobs) -> Timed:
    """The jobs applied by one store per directory, each in its own process (a fresh
    interpreter, as a rank is), all started at once; wall time from the common start
    to the last store's end. Every store must apply the same number of jobs."""
    deadline = time.monotonic() + CHILD_DEADLINE_S
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r, d in enumerate(directories):
            procs.append(_start(d, jobs, r))
        for r, p in enumerate(procs):
            _line(p, r, deadline)  # ready: open (recovered), chains built
        os.sync()  # untimed: no earlier phase's write-back in the timed part
        start = time.monotonic()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"g")
            p.stdin.flush()
        got = [_line(p, r, deadline) for r, p in enumerate(procs)]
    finally:
        _reap(procs, deadline)
    done = {x["jobs"] for x in got}
    if len(done) != 1:
        raise BenchError(f"the all-ranks local stores applied {sorted(done)} jobs")
    return Timed(done.pop(), max(x["end"] for x in got) - start,
                 {f"local-{r}": x["cpu"] for r, x in enumerate(got)})


if __name__ == "__main__":
    _child_main()
