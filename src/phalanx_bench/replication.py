"""``phalanx bench replication``: replicated-cache jobs beside the same jobs applied by
one local store (the physical limit) and beside raw loopback TCP (the links' limit).

A replicated job does its file work on every rank: rank 0 decides and applies it, each
peer applies it to its own directory, and it counts once every peer acked it. So its
ceiling is not what TCP carries but what the ranks' file work costs on the cores they
share: the **local baseline** applies the same jobs with one ``DiskStore`` in this
process, no peers, no links (``local_jobs_per_s``; ``of_local`` is the ratio). With 3
ranks on 2 cores, each job's file work done 3 times, the ceiling is about 0.67x.

Where the time goes, per lane: ``cpu_us_per_job`` (CPU of each rank process, of the
parent and of the local baseline, per job) and ``cores_busy`` (their CPU over the
lane's wall time): a lane at 2.0 on 2 cores is bound by CPU, not by waiting.

Everything goes through the public API: ``ReplicatedCache`` from the parent (each call
is one run; rank 0's ``maintain`` times itself), tasks on ranks through the
``Orchestrator``, and a KV source of this module's own (``StagedRows``: a rank's
staging buffer that already holds the bytes, as an engine's does).

small: EXPIRE jobs of tiny records (one unlink per rank: the cheapest real job, so the
lane's and the link's cost). jobs/s from rank 0's ``maintain`` of ``--records``
recovered records; p50/p99 of one job (a record stored, then a ``maintain`` that
expires only it: decide, apply, send, apply on every peer, ack; rank 0's own timing).
Local: the same directory (a copy of rank 0's, taken while closed) polled to the end;
every local baseline runs once before its lane and once after it, on its own copy.
store_1mib: stores of 1 MiB rows (4 pages of 256 KiB) on every rank, each from its own
staging buffer; only keys cross the links. Throughput with ``--concurrency`` stores in
flight from the parent (a server's concurrent requests); p50/p99 of single stores,
each waited for, seen from the parent. Local: the same rows stored one by one.
burst: one maintenance burst of ``--burst`` EXPIRE jobs on a reopened (recovered)
directory, with store requests issued from the parent all through it
(``requests_during_burst``: their p99 against the p99 of the same requests issued
just before and just after it, with no maintenance running; one every
``--request-interval-ms``); peak RSS of every rank during the burst (VmHWM reset
first). Local: the same directory copied and polled to the end.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from phalanx.kvstore import DiskStore, Geometry, StoreOptions
from phalanx.replication import ReplicatedCache, rank_directories
from phalanx.runtime import Orchestrator, Worker

from ._errors import BenchError
from ._raw_tcp import raw_jobs_per_s
from ._rss import peak_rss, reset_peak_rss
from ._stats import emit, percentile

SMALL = Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=4)
BIG = Geometry(layers=8, kv_heads=8, head_dim=64, dtype="float16", page_tokens=16)  # 256 KiB
ROW_PAGES = (1 << 20) // BIG.page_bytes  # 4 pages: 1 MiB rows
# the raw baseline's frame for a small job: about one EXPIRE job's frame (107 B when
# measured through the replication wire format; the raw figure hardly moves with it)
SMALL_FRAME = 128
FINGERPRINT = "bench"


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
class Links:
    """The links' flow control: ops in flight per peer, and how many of them only the
    request lane may take (None: the cache's default, window // 4)."""

    window: int
    reserve: int | None


def _open(w: Worker, directory: str, geometry: Geometry, links: Links,
          max_age: float | None) -> ReplicatedCache:
    return ReplicatedCache.open(w, directory, geometry=geometry, fingerprint=FINGERPRINT,
                                capacity_bytes=1 << 40, max_age=max_age,
                                window=links.window, reserve=links.reserve,
                                kv_source_factory=StagedRows)


def _copy_rank0(directory: str, ranks: int, to: str) -> str:
    """A copy of rank 0's (closed) directory: the local baseline applies the same jobs."""
    src = rank_directories(directory, ranks)[0]
    subprocess.run(["cp", "-a", src, to], check=True, timeout=600)
    return to


@dataclass(frozen=True)
class Timed:
    """One measured run: jobs done, wall seconds, CPU seconds of each process
    (rank number, "parent" or "local")."""

    jobs: int
    seconds: float
    cpu: dict[str, float]


def _local_maintain(directory: str) -> Timed:
    """Maintenance to the end by one store in this process, no peers."""
    with DiskStore(directory, SMALL, FINGERPRINT, StoreOptions(
            capacity_bytes=1 << 40, max_age=1e-3, progress=False)) as store:
        jobs = 0
        os.sync()  # untimed: no earlier phase's write-back (the copies) in this one
        c0, t0 = time.process_time(), time.perf_counter()
        while n := store.poll(1 << 10):
            jobs += n
        return Timed(jobs, time.perf_counter() - t0, {"local": time.process_time() - c0})


def _local_stores(directory: str, tokens: list[np.ndarray]) -> Timed:
    """``tokens``' rows stored one by one in one store, from a staged buffer."""
    source = StagedRows(BIG, 0)
    with DiskStore(directory, BIG, FINGERPRINT,
                   StoreOptions(capacity_bytes=1 << 40, progress=False)) as store:
        chains = [store.chain(t) for t in tokens]
        os.sync()  # untimed: no earlier phase's write-back (the copies) in this one
        c0, t0 = time.process_time(), time.perf_counter()
        for chain in chains:
            res = store.store(chain, source.row(chain.keys, 0))
            if not res.stored:
                raise BenchError(f"local baseline: a 1 MiB row was not stored: {res}")
        return Timed(len(chains), time.perf_counter() - t0,
                     {"local": time.process_time() - c0})


def _cpu_now(w: Worker) -> dict[str, float]:
    """CPU seconds so far of every rank process (all its threads) and of this one."""
    ranks = _on_every_rank(w, time.process_time)
    return {**{str(r): t for r, t in ranks.items()}, "parent": time.process_time()}


def _cpu_since(w: Worker, before: dict[str, float]) -> dict[str, float]:
    now = _cpu_now(w)
    return {k: now[k] - before[k] for k in before}


def _maintained(rc: ReplicatedCache) -> tuple[int, float]:
    rep = rc.maintain()
    return sum(rep.jobs.values()), rep.seconds


def _one_job_latency(rc: ReplicatedCache, n: int) -> list[float]:
    """Rank 0's time for ``maintain`` runs that each expire exactly one record."""
    lat: list[float] = []
    pt = SMALL.page_tokens
    for i in range(n):
        rc.store(np.arange(pt) + 10**8 + i * pt)
        deadline = time.monotonic() + 30
        while True:  # the record expires 1 ms after its store
            jobs, secs = _maintained(rc)
            if jobs:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"record {i} of the latency loop never expired")
        if jobs != 1:
            raise BenchError(f"latency loop: maintain ran {jobs} jobs, not 1")
        lat.append(secs)
    return lat


def _timed_stores(rc: ReplicatedCache, tokens: list[np.ndarray]) -> list[float]:
    lat = []
    for t in tokens:
        t0 = time.perf_counter()
        res = rc.store(t)
        lat.append(time.perf_counter() - t0)
        if not res.stored:
            raise BenchError(f"a store request was not stored: {res}")
    return lat


def _paced_stores(rc: ReplicatedCache, tokens: Callable[[], np.ndarray], interval: float,
                  done: threading.Event, count: int | None = None) -> list[float]:
    """Latencies of store requests issued one every ``interval`` seconds, ``count`` of
    them or until ``done`` is set; a request still running when it is set does not
    count (only requests wholly inside the burst do).

    Paced, not back to back: a server's requests arrive at their own rate, and back to
    back they would hold the maintenance lane, which yields to every request in
    progress."""
    lat: list[float] = []
    due = time.monotonic()
    while (count is None or len(lat) < count) and not done.wait(
            max(0.0, due - time.monotonic())):
        due += interval
        t = tokens()
        t0 = time.perf_counter()
        res = rc.store(t)
        if not res.stored:
            raise BenchError(f"a store request was not stored: {res}")
        if not done.is_set():
            lat.append(time.perf_counter() - t0)
    return lat


def _lane(run: Timed, local: list[Timed]) -> dict[str, Any]:
    """A lane's throughput beside its local baseline's, run once before the lane and
    once after it, so the drift of a shared machine shows; and where the CPU went:
    µs of CPU per job in each process, and the cores the lane kept busy."""
    jps = run.jobs / run.seconds
    local_jps = sum(x.jobs for x in local) / sum(x.seconds for x in local)
    cpu = {k: round(v / run.jobs * 1e6, 1) for k, v in run.cpu.items()}
    cpu["local"] = round(sum(x.cpu["local"] for x in local)
                         / sum(x.jobs for x in local) * 1e6, 1)
    return {"jobs": run.jobs, "seconds": round(run.seconds, 3), "jobs_per_s": round(jps, 1),
            "local_jobs": local[0].jobs, "local_jobs_per_s": round(local_jps, 1),
            "local_runs_jobs_per_s": [round(x.jobs / x.seconds, 1) for x in local],
            "of_local": round(jps / local_jps, 3), "cpu_us_per_job": cpu,
            "cores_busy": round(sum(run.cpu.values()) / run.seconds, 2)}


def _same_jobs(jobs: int, local: list[Timed]) -> None:
    if any(x.jobs != jobs for x in local):
        raise BenchError(f"the local baseline applied {[x.jobs for x in local]} jobs, the "
                         f"lane {jobs}")


def _latency_and_raw(lane: dict[str, Any], lat: list[float], raw: float) -> None:
    lane.update({"p50_us": round(percentile(lat, 50) * 1e6),
                 "p99_us": round(percentile(lat, 99) * 1e6),
                 "raw_jobs_per_s": round(raw, 1),
                 "of_raw": round(lane["jobs_per_s"] / raw, 3)})


def _small(w: Worker, tmp: str, records: int, links: Links, ranks: int) -> dict[str, Any]:
    d = f"{tmp}/small"
    rc = _open(w, d, SMALL, links, None)
    rc.synth(records, "tree")
    rc.close()  # raises CleanupError naming every rank that failed
    copies = [_copy_rank0(d, ranks, f"{tmp}/small-local-{i}") for i in range(2)]
    local = [_local_maintain(copies[0])]
    rc = _open(w, d, SMALL, links, 1e-3)
    try:
        os.sync()  # untimed, as before every local baseline
        cpu = _cpu_now(w)
        jobs, secs = _maintained(rc)
        run = Timed(jobs, secs, _cpu_since(w, cpu))
        local.append(_local_maintain(copies[1]))
        lat = _one_job_latency(rc, 200)
    finally:
        rc.close()  # raises CleanupError naming every rank that failed
    _same_jobs(jobs, local)
    out = _lane(run, local)
    _latency_and_raw(out, lat, raw_jobs_per_s(SMALL_FRAME, links.window, 100_000))
    return out


def _stores(w: Worker, tmp: str, stores: int, links: Links,
            concurrency: int) -> dict[str, Any]:
    pt = BIG.page_tokens
    tokens = [np.arange(ROW_PAGES * pt) + 10**7 * (i + 1) for i in range(stores + 20)]
    local = [_local_stores(f"{tmp}/big-local-0", tokens[:stores])]
    rc = _open(w, f"{tmp}/big", BIG, links, None)
    try:
        lat = _timed_stores(rc, tokens[stores:])
        os.sync()  # untimed, as before every local baseline
        cpu = _cpu_now(w)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="bench-store") as pool:
            shares = [tokens[i:stores:concurrency] for i in range(concurrency)]
            for f in [pool.submit(_timed_stores, rc, share) for share in shares]:
                f.result()
        run = Timed(stores, time.perf_counter() - t0, _cpu_since(w, cpu))
        local.append(_local_stores(f"{tmp}/big-local-1", tokens[:stores]))
    finally:
        rc.close()  # raises CleanupError naming every rank that failed
    out = _lane(run, local)
    _latency_and_raw(out, lat, raw_jobs_per_s(1 << 20, links.window, 500))
    out["row_bytes"] = ROW_PAGES * BIG.page_bytes
    out["concurrency"] = concurrency
    return out


def _on_every_rank(w: Worker, fn: Callable[[], Any]) -> dict[int, Any]:
    def orch(o: Orchestrator) -> dict[int, Any]:
        futs = {r: o.submit(r, fn) for r in o.ranks}
        return {r: f.result() for r, f in futs.items()}

    out: dict[int, Any] = w.run(orch)
    return out


def _burst(w: Worker, tmp: str, burst: int, links: Links, ranks: int, requests: int,
           interval: float) -> dict[str, Any]:
    d = f"{tmp}/burst"
    rc = _open(w, d, SMALL, links, None)
    t0 = time.perf_counter()
    rc.synth(burst, "tree")
    synth_s = time.perf_counter() - t0
    rc.close()  # raises CleanupError naming every rank that failed
    copies = [_copy_rank0(d, ranks, f"{tmp}/burst-local-{i}") for i in range(2)]
    local = [_local_maintain(copies[0])]
    t0 = time.perf_counter()
    rc = _open(w, d, SMALL, links, 1e-3)
    open_s = time.perf_counter() - t0
    pt = SMALL.page_tokens
    fresh = iter(range(10**9))  # store requests: new single-page records, 2 pages deep

    def request_tokens() -> np.ndarray:
        return np.arange(2 * pt) + 2 * pt * next(fresh) + 10**9

    try:
        # idle: half the requests before the burst, half after it (drift shows in both)
        os.sync()  # untimed: the copies' write-back must not land on the idle requests
        idle = _paced_stores(rc, request_tokens, interval, threading.Event(), requests // 2)
        rss_before = _on_every_rank(w, reset_peak_rss)
        done = threading.Event()
        os.sync()  # untimed, as before every local baseline
        cpu = _cpu_now(w)
        with ThreadPoolExecutor(1, thread_name_prefix="bench-requests") as pool:
            fut = pool.submit(_paced_stores, rc, request_tokens, interval, done)
            try:
                jobs, secs = _maintained(rc)
            finally:
                done.set()
            during = fut.result()
        run = Timed(jobs, secs, _cpu_since(w, cpu))
        peaks = _on_every_rank(w, peak_rss)
        idle += _paced_stores(rc, request_tokens, interval, threading.Event(),
                              requests - requests // 2)
        local.append(_local_maintain(copies[1]))
    finally:
        rc.close()  # raises CleanupError naming every rank that failed
    if not during:
        raise BenchError("no store request completed during the burst")
    # jobs: the burst's and the expiries of the requests' own records (a few hundred)
    out = _lane(run, local)
    out.update({"peak_rss_mb": {str(r): round(v, 1) for r, v in peaks.items()},
                "rss_before_mb": {str(r): round(v[1], 1) for r, v in rss_before.items()},
                "peak_reset": all(v[0] for v in rss_before.values()),
                "setup_synth_s": round(synth_s, 1), "reopen_s": round(open_s, 1)})
    req: dict[str, float] = {"idle_p50_us": round(percentile(idle, 50) * 1e6),
                             "idle_p99_us": round(percentile(idle, 99) * 1e6),
                             "burst_p50_us": round(percentile(during, 50) * 1e6),
                             "burst_p99_us": round(percentile(during, 99) * 1e6),
                             "idle_requests": len(idle), "burst_requests": len(during),
                             "interval_ms": interval * 1e3}
    req["p99_ratio"] = round(req["burst_p99_us"] / req["idle_p99_us"], 2)
    return {"burst": out, "requests_during_burst": req}


@click.command()
@click.option("--peers", type=click.IntRange(1), default=2, show_default=True)
@click.option("--records", type=int, default=20_000, show_default=True,
              help="tiny records expired in the small lane")
@click.option("--stores", type=int, default=300, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=4, show_default=True,
              help="store requests in flight in the store lane")
@click.option("--burst", type=int, default=100_000, show_default=True)
@click.option("--requests", type=int, default=300, show_default=True,
              help="idle store requests timed (half before the burst, half after)")
@click.option("--request-interval-ms", "interval_ms", type=click.FloatRange(0), default=20.0,
              show_default=True, help="time between store requests, idle and in the burst")
@click.option("--window", type=int, default=64, show_default=True)
@click.option("--reserve", type=int, default=None,
              help="credits only requests may take (default: the cache's, window // 4)")
@click.option("--rank-scheduler", type=click.Choice(["batch", "other"]), default="batch",
              show_default=True, help="the ranks' CPU scheduling policy (Worker's option)")
@click.option("--json", "as_json", is_flag=True)
def command(peers: int, records: int, stores: int, concurrency: int, burst: int,
            requests: int, interval_ms: float, window: int, reserve: int | None,
            rank_scheduler: str,
            as_json: bool) -> None:
    """Replication vs one local store and raw TCP; requests and memory in a burst."""
    ranks = peers + 1
    out: dict[str, Any] = {"ranks": ranks, "cpus": os.cpu_count(),
                           "rank_scheduler": rank_scheduler, "window": window,
                           "reserve": reserve}
    links = Links(window, reserve)
    with (tempfile.TemporaryDirectory() as tmp,
          Worker(ranks=ranks, rank_scheduler=rank_scheduler) as w):
        out["small"] = _small(w, tmp, records, links, ranks)
        out["store_1mib"] = _stores(w, tmp, stores, links, concurrency)
        out.update(_burst(w, tmp, burst, links, ranks, requests, interval_ms / 1e3))
    emit(out, as_json)
