"""``phalanx bench replication``: replicated-cache job throughput and latency beside a
raw loopback TCP request/response baseline of the same frame size and window.

Every lane is measured inside rank 0 (one task drives the whole loop: no parent->rank-0
round trip per job); a job counts once every peer acked it.

small: EXPIRE jobs of tiny records (maintenance lane, ``Leader.maintain``): the cheapest
real job, one unlink per rank, so the figure is the link's and the lane's cost. Its raw
baseline carries frames of the size of one such job's frame, to an echo process.
store_1mib: stores of 1 MiB rows (4 pages of 256 KiB) on every rank (request lane,
pipelined up to the window); each rank writes 1 MiB from its own staging buffer
(``StagedSource``), only keys cross the link; the raw baseline carries 1 MiB frames,
what moving the row would cost. p50/p99: single jobs, each waited for (decide, apply,
send, apply on every peer, ack).
burst: one maintenance burst of ``--burst`` EXPIRE jobs on a reopened (recovered)
directory; peak RSS of rank 0 during the burst (VmHWM reset before it).
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import socket
import tempfile
import time
from typing import Any

import click
import numpy as np

from phalanx.kvstore import Geometry
from phalanx.kvstore.maintenance import Job, JobKind
from phalanx.replication import ReplicatedCache
from phalanx.replication import _rank_tasks as rt
from phalanx.replication.frames import JobOp, encode
from phalanx.replication.kv_source import StagedSource
from phalanx.replication.leader import Leader
from phalanx.runtime import Worker

from ._stats import emit, percentile

SMALL = Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=4)
BIG = Geometry(layers=8, kv_heads=8, head_dim=64, dtype="float16", page_tokens=16)  # 256 KiB
ROW_PAGES = (1 << 20) // BIG.page_bytes  # 4 pages: 1 MiB rows


def _echo(port: Any, frame: int, n: int) -> None:
    """The raw baseline's peer, in its own process as a rank is: one byte back per
    ``frame`` bytes received."""
    srv = socket.create_server(("127.0.0.1", 0))
    port.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    with conn, srv:
        got = 0
        while got < n * frame:
            chunk = conn.recv(1 << 20)
            if not chunk:
                return
            before = got // frame
            got += len(chunk)
            if got // frame > before:
                conn.sendall(b"a" * (got // frame - before))


def _raw(frame: int, window: int, n: int) -> float:
    """Request/response over loopback TCP with ``window`` requests in flight: jobs/s.

    The echo runs in a separate process, like a peer rank: an echo thread in this
    process would share its GIL, and the baseline then swung 80,000-400,000 jobs/s
    with how the two threads happened to hand the GIL over."""
    ctx = multiprocessing.get_context("spawn")  # this process has threads: no fork
    port_q = ctx.Queue()
    peer = ctx.Process(target=_echo, args=(port_q, frame, n), daemon=True)
    peer.start()
    try:
        port = port_q.get(timeout=60)
        payload = b"x" * frame
        with socket.create_connection(("127.0.0.1", port)) as c:
            t0 = time.perf_counter()
            sent = acked = 0
            while acked < n:
                while sent < n and sent - acked < window:
                    c.sendall(payload)
                    sent += 1
                acked += len(c.recv(65536))
            secs = time.perf_counter() - t0
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()
            peer.join()
        port_q.close()
        port_q.join_thread()
    return n / secs


def _job_frame_bytes() -> int:
    job = Job(JobKind.EXPIRE, key=b"k" * 16, start_page=1000, end_page=1001, row_bytes=128)
    return len(encode(JobOp(1 << 20, job)))


# -- run on rank 0 (leader_run) -----------------------------------------------------------
def _latency(leader: Leader, one: Any, n: int) -> list[float]:
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        one(i)
        left = leader.drain(None)
        assert not left, left
        lat.append(time.perf_counter() - t0)
    return lat


def _small_lane(leader: Leader, lat_jobs: int) -> dict[str, Any]:
    lat = _latency(leader, lambda _: leader.poll(1), lat_jobs)
    rep = leader.maintain()
    n = sum(rep.jobs.values())
    return {"jobs": n, "seconds": rep.seconds, "lat": lat, "kinds": rep.jobs}


def _store_lane(leader: Leader, stores: int, lat_n: int) -> dict[str, Any]:
    pt = leader.store.geometry.page_tokens
    chains = [leader.store.chain(np.arange(ROW_PAGES * pt) + 10**7 * (i + 1))
              for i in range(stores + lat_n)]
    lat = _latency(leader, lambda i: leader.store_chain(chains[stores + i]), lat_n)
    t0 = time.perf_counter()
    for chain in chains[:stores]:
        leader.wait_room()
        res = leader.store_chain(chain, wait=False)
        assert res.stored and res.end_page - res.start_page == ROW_PAGES, res
    left = leader.drain(None)
    assert not left, left
    return {"jobs": stores, "seconds": time.perf_counter() - t0, "lat": lat,
            "row_bytes": ROW_PAGES * BIG.page_bytes}


def _peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _peak_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _burst(leader: Leader) -> dict[str, Any]:
    reset = _peak_reset()
    before = _peak_mb()
    rep = leader.maintain()
    return {"jobs": sum(rep.jobs.values()), "seconds": rep.seconds, "peak_mb": _peak_mb(),
            "rss_before_mb": before, "peak_reset": reset, "kinds": rep.jobs,
            "pid": os.getpid()}


def _on_leader(w: Worker, rc: ReplicatedCache, fn: Any, *args: Any) -> Any:
    return w.run(lambda o: o.submit(0, rt.leader_run, rc.cache_id, fn, *args).result())


def _lane(res: dict[str, Any], raw: float) -> dict[str, Any]:
    lat = res.pop("lat")
    jps = res["jobs"] / res["seconds"]
    return {"jobs_per_s": round(jps, 1), "p50_us": round(percentile(lat, 50) * 1e6),
            "p99_us": round(percentile(lat, 99) * 1e6), "raw_jobs_per_s": round(raw, 1),
            "of_raw": round(jps / raw, 3), "jobs": res["jobs"],
            "seconds": round(res["seconds"], 3)}


@click.command()
@click.option("--peers", type=click.IntRange(1), default=2, show_default=True)
@click.option("--records", type=int, default=20_000, show_default=True,
              help="tiny records expired in the small lane")
@click.option("--stores", type=int, default=300, show_default=True)
@click.option("--burst", type=int, default=100_000, show_default=True)
@click.option("--window", type=int, default=64, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(peers: int, records: int, stores: int, burst: int, window: int,
            as_json: bool) -> None:
    """Replication throughput/latency vs raw loopback TCP; rank 0's memory in a burst."""
    out: dict[str, Any] = {}
    lat_n = 200
    with tempfile.TemporaryDirectory() as tmp, Worker(ranks=peers + 1) as w:
        kw: dict[str, Any] = {"fingerprint": "bench", "capacity_bytes": 1 << 40,
                              "window": window, "kv_source_factory": StagedSource}
        rc = ReplicatedCache.open(w, f"{tmp}/small", geometry=SMALL, max_age=1e-3, **kw)
        rc.synth(records + lat_n, "tree")
        small = _on_leader(w, rc, _small_lane, lat_n)
        assert rc.close() == []
        frame = _job_frame_bytes()
        out["small"] = _lane(small, _raw(frame, window, 100_000))
        out["small"]["frame_bytes"] = frame
        rc = ReplicatedCache.open(w, f"{tmp}/big", geometry=BIG, **kw)
        big = _on_leader(w, rc, _store_lane, stores, 20)
        assert rc.close() == []
        out["store_1mib"] = _lane(big, _raw(1 << 20, window, 500))
        out["store_1mib"]["row_bytes"] = big["row_bytes"]
        rc = ReplicatedCache.open(w, f"{tmp}/burst", geometry=SMALL, **kw)
        t0 = time.perf_counter()
        rc.synth(burst, "tree")
        synth_s = time.perf_counter() - t0
        assert rc.close() == []
        t0 = time.perf_counter()
        rc = ReplicatedCache.open(w, f"{tmp}/burst", geometry=SMALL, max_age=1e-3, **kw)
        open_s = time.perf_counter() - t0
        b = _on_leader(w, rc, _burst)
        assert rc.close() == []
        out["burst"] = {"jobs": b["jobs"], "seconds": round(b["seconds"], 2),
                        "peak_rss_mb": round(b["peak_mb"], 1),
                        "rss_before_mb": round(b["rss_before_mb"], 1),
                        "jobs_per_s": round(b["jobs"] / b["seconds"]),
                        "setup_synth_s": round(synth_s, 1), "reopen_s": round(open_s, 1)}
    emit(out, as_json)
