"""``phalanx bench replication``: replicated-cache jobs beside the same jobs applied
locally, with no peers (the physical limit), and beside raw loopback TCP (the links').

A replicated job does its file work on every rank: rank 0 decides and applies it, each
peer applies it to its own directory, and it counts once every peer acked it. So its
ceiling is not what TCP carries but what the ranks' file work costs on the disk and
cores they share. Two **local baselines** (``replication_local.py``) apply the same
jobs with no peers and no links: one ``DiskStore`` in this process
(``local_jobs_per_s``; ``of_local`` is the lane's ratio to it: the limit where each
rank has its own disk and cores), and one store per rank, each in its own process, all
started at once (``local_all_ranks_jobs_per_s``, one store's share; ``of_local_all_ranks``:
the limit on this host, where the ranks share one disk and the cores).
``local_all_ranks_of_local`` is how much running them together costs each.

Where the time goes, per lane: ``cpu_us_per_job`` (CPU of each rank process, of the
parent, of the one local store and, mean of its processes, of the all-ranks stores, per
job) and ``cores_busy`` (the lane's processes' CPU over its wall time; the all-ranks
baseline's is ``local_all_ranks_cores_busy``): 2.0 on 2 cores is bound by CPU, not by
waiting.

Everything goes through the public API: ``ReplicatedCache`` from the parent (each call
is one run; rank 0's ``maintain`` times itself), tasks on ranks through the
``Orchestrator``, and a KV source of the benchmark's own (``StagedRows``: a rank's
staging buffer that already holds the bytes, as an engine's does).

small: EXPIRE jobs of tiny records (one unlink per rank: the cheapest real job, so the
lane's and the link's cost). jobs/s from rank 0's ``maintain`` of ``--records``
recovered records; p50/p99 of one job (a record stored, then a ``maintain`` that
expires only it: decide, apply, send, apply on every peer, ack; rank 0's own timing).
Local: the same directory (a copy of rank 0's, taken while closed) polled to the end;
every local baseline runs once before its lane and once after it, on its own copies
(one store alone farthest from the lane on both sides, so drift weighs on both alike).
store_1mib: stores of 1 MiB rows (4 pages of 256 KiB) on every rank, each from its own
staging buffer; only keys cross the links. Throughput with ``--concurrency`` stores in
flight from the parent (a server's concurrent requests); p50/p99 of single stores,
each waited for, seen from the parent. Local: the same rows stored one by one.
burst: one maintenance burst of ``--burst`` EXPIRE jobs on a reopened (recovered)
directory, with store requests issued from the parent all through it
(``requests_during_burst``: their p99 against the p99 of the same requests issued
just before and just after it, with no maintenance running; one every
``--request-interval-ms``); peak RSS of every rank during the burst (VmHWM reset
first). Local: the same directory copied and polled to the end; and once more, after
the lane, with the lane's request stream (one fresh record stored every
``--request-interval-ms`` while it polls: ``local_with_requests_jobs_per_s``, and the
lane's ratio to it, ``of_local_with_requests``). The lane's requests are work the plain
baselines never do; this one does it too, on one store.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from phalanx.kvstore import Geometry
from phalanx.replication import ReplicatedCache
from phalanx.runtime import Orchestrator, Worker

from ._errors import BenchError
from ._raw_tcp import raw_jobs_per_s
from ._rss import peak_rss, reset_peak_rss
from ._stats import emit, percentile
from .replication_local import (
    BIG,
    FINGERPRINT,
    ROW_PAGES,
    SMALL,
    Jobs,
    StagedRows,
    Timed,
    copy_rank0,
    local_all_ranks,
    local_one,
    local_one_with_requests,
)

# the raw baseline's frame for a small job: about one EXPIRE job's frame (107 B when
# measured through the replication wire format; the raw figure hardly moves with it)
SMALL_FRAME = 128


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


@dataclass(frozen=True)
class Baselines:
    """A lane's two local baselines, one store alone and one store per rank at once,
    each run once before the lane and once after it."""

    one: list[Timed]
    all_ranks: list[Timed]


def _baselines(one: str, all_ranks: list[str], jobs: Jobs,
               before: Baselines | None = None) -> Baselines:
    """Both baselines on their own directories. Before the lane (``before`` None) the
    one-store baseline runs first, after it last: each baseline then sits as near the
    lane on average, so a drift of the shared machine weighs on neither more."""
    if before is None:
        return Baselines([local_one(one, jobs)], [local_all_ranks(all_ranks, jobs)])
    all_after = local_all_ranks(all_ranks, jobs)
    return Baselines([*before.one, local_one(one, jobs)], [*before.all_ranks, all_after])


def _jps(runs: list[Timed]) -> float:
    return sum(x.jobs for x in runs) / sum(x.seconds for x in runs)


def _lane(run: Timed, base: Baselines, ranks: int) -> dict[str, Any]:
    """A lane's throughput beside its local baselines', run once before the lane and
    once after it, so the drift of a shared machine shows; and where the CPU went:
    µs of CPU per job in each process, and the cores the lane kept busy.
    ``local_all_ranks_jobs_per_s`` is one store's share (each applies every job), so
    it compares with the lane's jobs/s as ``local_jobs_per_s`` does; its CPU per job
    is the mean of its ``ranks`` processes."""
    jps, local_jps, all_jps = run.jobs / run.seconds, _jps(base.one), _jps(base.all_ranks)
    cpu = {k: round(v / run.jobs * 1e6, 1) for k, v in run.cpu.items()}
    cpu["local"] = round(sum(x.cpu["local"] for x in base.one)
                         / sum(x.jobs for x in base.one) * 1e6, 1)
    all_cpu = sum(sum(x.cpu.values()) for x in base.all_ranks)
    cpu["local_all_ranks"] = round(
        all_cpu / (ranks * sum(x.jobs for x in base.all_ranks)) * 1e6, 1)
    return {"jobs": run.jobs, "seconds": round(run.seconds, 3), "jobs_per_s": round(jps, 1),
            "local_jobs": base.one[0].jobs, "local_jobs_per_s": round(local_jps, 1),
            "local_runs_jobs_per_s": [round(x.jobs / x.seconds, 1) for x in base.one],
            "of_local": round(jps / local_jps, 3),
            "local_all_ranks_jobs_per_s": round(all_jps, 1),
            "local_all_ranks_runs_jobs_per_s": [round(x.jobs / x.seconds, 1)
                                                for x in base.all_ranks],
            "of_local_all_ranks": round(jps / all_jps, 3),
            "local_all_ranks_of_local": round(all_jps / local_jps, 3),
            "local_all_ranks_cores_busy": round(
                all_cpu / sum(x.seconds for x in base.all_ranks), 2),
            "cpu_us_per_job": cpu,
            "cores_busy": round(sum(run.cpu.values()) / run.seconds, 2)}


def _same_jobs(jobs: int, base: Baselines) -> None:
    done = [x.jobs for x in base.one + base.all_ranks]
    if any(n != jobs for n in done):
        raise BenchError(f"the local baselines applied {done} jobs, the lane {jobs}")


def _copies(d: str, ranks: int, name: str) -> tuple[list[str], list[list[str]]]:
    """Copies of rank 0's closed directory for both baselines, before and after the
    lane: one each for the one-store runs, ``ranks`` each for the all-ranks runs."""
    one = [copy_rank0(d, ranks, f"{name}-local-{i}") for i in range(2)]
    every = [[copy_rank0(d, ranks, f"{name}-all-{i}-{r}") for r in range(ranks)]
             for i in range(2)]
    return one, every


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
    one, every = _copies(d, ranks, f"{tmp}/small")
    base = _baselines(one[0], every[0], Jobs())
    rc = _open(w, d, SMALL, links, 1e-3)
    try:
        os.sync()  # untimed, as before every local baseline
        cpu = _cpu_now(w)
        jobs, secs = _maintained(rc)
        run = Timed(jobs, secs, _cpu_since(w, cpu))
        base = _baselines(one[1], every[1], Jobs(), base)
        lat = _one_job_latency(rc, 200)
    finally:
        rc.close()  # raises CleanupError naming every rank that failed
    _same_jobs(jobs, base)
    out = _lane(run, base, ranks)
    _latency_and_raw(out, lat, raw_jobs_per_s(SMALL_FRAME, links.window, 100_000))
    return out


def _stores(w: Worker, tmp: str, stores: int, links: Links, concurrency: int,
            ranks: int) -> dict[str, Any]:
    pt = BIG.page_tokens
    tokens = [np.arange(ROW_PAGES * pt) + 10**7 * (i + 1) for i in range(stores + 20)]
    rows = Jobs(tuple(tokens[:stores]))

    def empty(i: int) -> list[str]:  # the all-ranks stores' directories, one per rank
        return [f"{tmp}/big-all-{i}-{r}" for r in range(ranks)]

    base = _baselines(f"{tmp}/big-local-0", empty(0), rows)
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
        base = _baselines(f"{tmp}/big-local-1", empty(1), rows, base)
    finally:
        rc.close()  # raises CleanupError naming every rank that failed
    _same_jobs(stores, base)
    out = _lane(run, base, ranks)
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
    one, every = _copies(d, ranks, f"{tmp}/burst")
    with_requests = copy_rank0(d, ranks, f"{tmp}/burst-local-requests")
    base = _baselines(one[0], every[0], Jobs())
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
        base = _baselines(one[1], every[1], Jobs(), base)
    finally:
        rc.close()  # raises CleanupError naming every rank that failed
    local_req, local_requests = local_one_with_requests(with_requests, interval)
    if not during:
        raise BenchError("no store request completed during the burst")
    # the lane's jobs: the burst's and the expiries of the requests' own records (a few
    # hundred), so only the baselines must agree among themselves
    _same_jobs(base.one[0].jobs, base)
    out = _lane(run, base, ranks)
    req_jps = local_req.jobs / local_req.seconds
    out.update({"local_with_requests_jobs_per_s": round(req_jps, 1),
                "local_with_requests_requests": local_requests,
                "of_local_with_requests": round(out["jobs_per_s"] / req_jps, 3)})
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
@click.option("--records", type=click.IntRange(1), default=20_000, show_default=True,
              help="tiny records expired in the small lane")
@click.option("--stores", type=click.IntRange(1), default=300, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=4, show_default=True,
              help="store requests in flight in the store lane")
@click.option("--burst", type=click.IntRange(1), default=100_000, show_default=True)
@click.option("--requests", type=click.IntRange(1), default=300, show_default=True,
              help="idle store requests timed (half before the burst, half after)")
@click.option("--request-interval-ms", "interval_ms", type=click.FloatRange(0), default=20.0,
              show_default=True, help="time between store requests, idle and in the burst")
@click.option("--window", type=click.IntRange(2), default=64, show_default=True)
@click.option("--reserve", type=click.IntRange(0), default=None,
              help="credits only requests may take (default: the cache's, window // 4)")
@click.option("--rank-scheduler", type=click.Choice(["batch", "other"]), default="batch",
              show_default=True, help="the ranks' CPU scheduling policy (Worker's option)")
@click.option("--json", "as_json", is_flag=True)
def command(peers: int, records: int, stores: int, concurrency: int, burst: int,
            requests: int, interval_ms: float, window: int, reserve: int | None,
            rank_scheduler: str,
            as_json: bool) -> None:
    """Replication vs local stores (one alone, one per rank at once) and raw TCP;
    requests and memory in a burst."""
    ranks = peers + 1
    out: dict[str, Any] = {"ranks": ranks, "cpus": os.cpu_count(),
                           "rank_scheduler": rank_scheduler, "window": window,
                           "reserve": reserve}
    links = Links(window, reserve)
    with (tempfile.TemporaryDirectory() as tmp,
          Worker(ranks=ranks, rank_scheduler=rank_scheduler) as w):
        out["small"] = _small(w, tmp, records, links, ranks)
        out["store_1mib"] = _stores(w, tmp, stores, links, concurrency, ranks)
        out.update(_burst(w, tmp, burst, links, ranks, requests, interval_ms / 1e3))
    emit(out, as_json)
