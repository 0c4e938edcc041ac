"""``phalanx bench replication``: replicated-cache job throughput and latency beside a
raw loopback TCP request/response baseline of the same frame size and window.

small: THIN jobs of a recovered uncompacted chain (maintenance lane, ``maintain``).
store_1mib: stores whose rows are 1 MiB on every rank (request lane, pipelined through
``synth``); its raw baseline carries 1 MiB frames. burst: one maintenance burst of
``--burst`` jobs; peak RSS of rank 0 (its memory is bounded by the index, not the burst).
Latency p50/p99 comes from timed single-job calls (``poll(1)``, ``store``), which
include the parent->rank-0 task round trip.
"""

from __future__ import annotations

import resource
import socket
import tempfile
import threading
import time
from typing import Any

import click
import numpy as np

from phalanx.cache import Geometry, ReplicatedCache
from phalanx.runtime import Worker

from ._stats import emit, percentile

SMALL = Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=4)
BIG = Geometry(layers=8, kv_heads=8, head_dim=64, dtype="float16", page_tokens=16)  # 256 KiB


def _raw(frame: int, window: int, n: int) -> float:
    """Request/response over loopback TCP with ``window`` requests in flight: jobs/s."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:
        conn, _ = srv.accept()
        with conn:
            got = 0
            while got < n * frame:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    return
                before = got // frame
                got += len(chunk)
                if got // frame > before:
                    conn.sendall(b"a" * (got // frame - before))

    t = threading.Thread(target=echo)
    t.start()
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
    t.join(10)
    srv.close()
    return n / secs


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@click.command()
@click.option("--peers", type=click.IntRange(1), default=2, show_default=True)
@click.option("--records", type=int, default=4000, show_default=True)
@click.option("--stores", type=int, default=100, show_default=True)
@click.option("--burst", type=int, default=100_000, show_default=True)
@click.option("--window", type=int, default=64, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(peers: int, records: int, stores: int, burst: int, window: int,
            as_json: bool) -> None:
    """Replication throughput/latency vs raw loopback TCP; rank 0's memory in a burst."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, Worker(ranks=peers + 1) as w:
        kw: dict[str, Any] = {"fingerprint": "bench", "capacity_bytes": 1 << 40,
                              "window": window}
        rc = ReplicatedCache.open(w, f"{tmp}/small", geometry=SMALL, **kw)
        rc.synth(records, "chain", group=8)
        rc.close()
        rc = ReplicatedCache.open(w, f"{tmp}/small", geometry=SMALL, **kw)
        lat = []
        for _ in range(200):
            t0 = time.perf_counter()
            rc.poll(1)
            lat.append(time.perf_counter() - t0)
        rep = rc.maintain()
        n = sum(rep.jobs.values())
        rc.close()
        out["small"] = {"jobs_per_s": round(n / rep.seconds), "p50_us": round(
            percentile(lat, 50) * 1e6), "p99_us": round(percentile(lat, 99) * 1e6),
            "raw_jobs_per_s": round(_raw(64, window, 20_000))}
        rc = ReplicatedCache.open(w, f"{tmp}/big", geometry=BIG, **kw)
        rep_s = rc.synth(stores, "tree")
        lat = []
        for i in range(20):
            toks = np.arange(4 * BIG.page_tokens) + 10**7 * (i + 1)
            t0 = time.perf_counter()
            rc.store(toks)
            lat.append(time.perf_counter() - t0)
        rc.close()
        out["store_1mib"] = {"jobs_per_s": round(stores / rep_s.seconds, 1),
                             "p50_us": round(percentile(lat, 50) * 1e6),
                             "p99_us": round(percentile(lat, 99) * 1e6),
                             "raw_jobs_per_s": round(_raw(1 << 20, window, 300), 1)}
        rc = ReplicatedCache.open(w, f"{tmp}/burst", geometry=SMALL, **kw)
        rc.synth(burst, "chain", group=8)
        rc.close()
        rc = ReplicatedCache.open(w, f"{tmp}/burst", geometry=SMALL, **kw)
        rep = rc.maintain()
        rss = rc.stats()[0]["stats"]
        del rss
        peak = w.run(lambda o: o.submit(0, _rss_mb).result())
        rc.close()
        out["burst"] = {"jobs": sum(rep.jobs.values()), "seconds": round(rep.seconds, 2),
                        "peak_rss_mb": round(peak, 1)}
    emit(out, as_json)
