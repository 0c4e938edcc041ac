"""The replication benchmark's raw baseline: request/response over loopback TCP with a
window of requests in flight, to an echo in its own process (as a peer rank is).

No file work at all: it bounds what the links could carry, not what a replicated job
costs (that is the local baseline's job; see replication.py).
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from typing import Any

from ._errors import BenchError

__all__ = ["raw_jobs_per_s"]


def _echo(port: Any, frame: int, n: int) -> None:
    """The raw baseline's peer: one byte back per ``frame`` bytes received."""
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


def raw_jobs_per_s(frame: int, window: int, n: int) -> float:
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
        with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
            t0 = time.perf_counter()
            sent = acked = 0
            while acked < n:
                while sent < n and sent - acked < window:
                    c.sendall(payload)
                    sent += 1
                got = c.recv(65536)
                if not got:
                    raise BenchError(f"raw baseline: the echo (pid {peer.pid}) closed "
                                     f"after {acked} of {n} acks")
                acked += len(got)
            secs = time.perf_counter() - t0
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()
            peer.join()
        port_q.close()
        port_q.join_thread()
    return n / secs
