"""``python -m phalanx_bench.multihost_rank MODE ...``: one host's side of a measurement of
``phalanx bench multihost``, started inside a namespace (``ip netns exec``); prints one
JSON line and exits 0, or exits non-zero with the error on stderr.

Modes (each a real process per host, as a rank on another machine would be):

- ``tcp-server`` / ``tcp-client``: the link itself: a 64-byte ping-pong (TCP_NODELAY) and
  bulk sends acknowledged by one byte; the client prints the figures.
- ``rendezvous``: ``phalanx.hosts.rendezvous`` for several rounds, each on a fresh port.
  Node 0 tells the others to start a round (a key in a side ``TCPStore``) only once its
  own store listens: a node that connects first would sleep in torch's client connect
  backoff (a fixed 1 s) and that would be measured instead of the rendezvous. Each node
  prints its ``time.monotonic()`` marks (the clock is shared by every namespace).
- ``allreduce`` / ``group-cycle``: torch.distributed gloo, initialised through a
  ``TCPStore`` on node 0 with torch's public API; rank 0's samples are reported.
- ``decode-client``: a streaming client of a ``phalanx serve`` (in node 0's namespace,
  where the server's address is reachable): a warm-up request, then greedy requests with
  ``ignore_eos``, each with a prompt of its own (no prefix-cache hit); the medians of
  TTFT (send to first token) and of decode (tokens after the first, over first to last).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from phalanx.hosts import HostDomain

PING = 64  # bytes each way of one ping-pong
_CHUNK = 1 << 20
_CONNECT_S = 30.0  # the server starts at the same time: give it this long to listen


def _recv_exact(conn: socket.socket, n: int, buf: bytearray) -> None:
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k


def _tcp_server(args: argparse.Namespace) -> dict[str, Any]:
    with socket.create_server((args.bind, args.port)) as srv:
        srv.settimeout(_CONNECT_S)
        conn, _ = srv.accept()
    with conn:
        conn.settimeout(60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(_CHUNK)
        for _ in range(args.pings):
            _recv_exact(conn, PING, buf)
            conn.sendall(buf[:PING])
        for _ in range(args.bulk_reps):
            left = args.bulk_bytes
            while left:
                k = conn.recv_into(buf, min(left, _CHUNK))
                if k == 0:
                    raise ConnectionError(f"client closed with {left} bulk bytes to come")
                left -= k
            conn.sendall(b"k")
    return {"ok": True}


def _connect(addr: str, port: int) -> socket.socket:
    """The server starts beside this process: retry a refused connect to a deadline."""
    deadline = time.monotonic() + _CONNECT_S
    while True:
        try:
            return socket.create_connection((addr, port), timeout=60)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _tcp_client(args: argparse.Namespace) -> dict[str, Any]:
    with _connect(args.addr, args.port) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(_CHUNK)
        msg = b"p" * PING
        rtts = []
        for _ in range(args.pings):
            t0 = time.perf_counter()
            conn.sendall(msg)
            _recv_exact(conn, PING, buf)
            rtts.append(time.perf_counter() - t0)
        payload = memoryview(b"b" * _CHUNK)
        rates = []
        for _ in range(args.bulk_reps):
            t0 = time.perf_counter()
            left = args.bulk_bytes
            while left:
                k = min(left, _CHUNK)
                conn.sendall(payload[:k])
                left -= k
            _recv_exact(conn, 1, buf)
            rates.append(args.bulk_bytes / (time.perf_counter() - t0) / 1e6)
    warm = rtts[len(rtts) // 10:] or rtts  # the first tenth: slow start, cold caches
    return {"rtt_us_p50": statistics.median(warm) * 1e6,
            "bulk_mb_s": statistics.median(rates)}


def _listening(port: int) -> bool:
    """Whether this namespace has a TCP socket listening on ``port`` (read from /proc,
    so no connection is made to the store under test)."""
    want = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[1].endswith(want) and cols[3] == "0A":  # 0A: LISTEN
                        return True
        except FileNotFoundError:
            continue
    return False


def _store(addr: str, port: int, world: int, master: bool) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(addr, port, world, master, timedelta(seconds=60), wait_for_workers=False)


def _rendezvous(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed  # noqa: F401  (imported before any round: not timed)

    from phalanx.hosts import NodeSpec, rendezvous

    token = os.environ["PHALANX_JOB_TOKEN"]
    sync = _store(args.master_addr, args.sync_port, args.nnodes, args.rank == 0)
    starts: list[float] = []
    ends: list[float] = []
    for k in range(args.rounds):
        port = args.port + k
        spec = NodeSpec(nnodes=args.nnodes, node_rank=args.rank, master_addr=args.master_addr,
                        master_port=port, token=token, timeout=args.timeout)
        if args.rank == 0:
            failed: list[BaseException] = []

            def lead(spec: NodeSpec = spec, failed: list[BaseException] = failed) -> None:
                try:
                    rendezvous(spec)
                except BaseException as exc:  # noqa: BLE001  (re-raised in the main thread)
                    failed.append(exc)
                ends.append(time.monotonic())

            leader = threading.Thread(target=lead, name=f"rendezvous-{k}")
            leader.start()
            deadline = time.monotonic() + args.timeout
            while not _listening(port) and leader.is_alive():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node 0: the rendezvous store on port {port} did "
                                       f"not listen within {args.timeout:g}s")
                time.sleep(0.0005)
            starts.append(time.monotonic())
            sync.set(f"go/{k}", "1")
            leader.join()
            if failed:
                raise failed[0]
        else:
            sync.wait([f"go/{k}"])
            starts.append(time.monotonic())
            rendezvous(spec)
            ends.append(time.monotonic())
    if args.rank == 0:  # the side store must outlive every node's last use of it
        sync.wait([f"bye/{r}" for r in range(1, args.nnodes)])
    else:
        sync.set(f"bye/{args.rank}", "1")
    return {"rank": args.rank, "starts": starts, "ends": ends}


def _gloo_init(args: argparse.Namespace) -> Any:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 3 ranks on a few cores: no intra-op pool fighting them
    store = _store(args.master_addr, args.port, args.world, args.rank == 0)
    dist.init_process_group(backend="gloo", store=store, rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=60))
    return store


def _allreduce(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    store = _gloo_init(args)
    out: dict[str, Any] = {"rank": args.rank}
    for size in args.sizes:
        t = torch.empty(size // 4, dtype=torch.float32)
        for _ in range(max(10, args.iters // 10)):  # warm-up: gloo's buffers, the caches
            dist.all_reduce(t)
        samples = []
        for _ in range(args.iters):
            t.fill_(1.0)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - t0)
        if float(t[0]) != float(args.world) or float(t[-1]) != float(args.world):
            raise AssertionError(f"rank {args.rank}: all-reduce of ones over {args.world} "
                                 f"ranks gave {float(t[0])}, {float(t[-1])}")
        out[str(size)] = statistics.median(samples) * 1e6
    dist.barrier()
    dist.destroy_process_group()
    del store
    return out


def _group_cycle(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    store = _gloo_init(args)
    members = list(range(args.world))
    dist.barrier()
    samples = []
    for _ in range(args.cycles):
        t0 = time.perf_counter()
        group = dist.new_group(members)
        dist.barrier(group=group)
        dist.destroy_process_group(group)
        samples.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    del store
    return {"rank": args.rank, "us_p50": statistics.median(samples) * 1e6}


def _stream(client: Any, url: str, model: str, prompt: str, max_tokens: int
            ) -> tuple[float, list[float], int]:
    """One streamed completion: its send time, the arrival of every chunk carrying a
    token (perf_counter; a token whose text is held back for the next one's bytes still
    comes as a chunk, with empty text) and the tokens generated (the usage chunk)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices"):
                stamps.append(time.perf_counter())
            if ev.get("usage"):
                tokens = int(ev["usage"]["completion_tokens"])
    if len(stamps) < 2 or tokens != max_tokens:
        raise AssertionError(f"{url}: asked {max_tokens} tokens with ignore_eos, got "
                             f"{tokens} in {len(stamps)} chunks")
    return sent, stamps, tokens


def _decode_client(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    with httpx.Client(timeout=300, trust_env=False) as c:  # no proxy for 10.77.0.x
        model = c.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        _stream(c, args.url, model, "Warm up: once upon a time", args.warmup_tokens)
        ttft, rate, itl, chunks = [], [], [], []
        for k in range(args.requests):
            sent, stamps, tokens = _stream(
                c, args.url, model, f"Request {k}: once upon a time there was", args.max_tokens)
            ttft.append(stamps[0] - sent)
            rate.append((tokens - 1) / (stamps[-1] - stamps[0]))
            # the median gap too: the first few tokens can reach the client together
            # (written out while the next steps run), which the first-to-last rate counts
            itl.append(statistics.median(b - a for a, b in itertools.pairwise(stamps)))
            chunks.append(len(stamps))
    return {"ttft_ms": statistics.median(ttft) * 1e3, "tokens_per_s": statistics.median(rate),
            "itl_ms_p50": statistics.median(itl) * 1e3, "chunks": chunks}


# -- replication: the recovered-chain burst across hosts, or on one host -------------------

def repl_geometry() -> Any:
    from phalanx.kvstore import Geometry

    return Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=4)


REPL_FINGERPRINT = "multihost-bench"


def _burst(cache: Any) -> dict[str, Any]:
    started = time.perf_counter()
    report = cache.maintain()
    seconds = time.perf_counter() - started
    problems = cache.check()
    if problems:
        raise RuntimeError(f"the ranks disagree after the burst: {problems[:3]}")
    jobs = sum(report.jobs.values())
    return {"jobs": jobs, "seconds": seconds, "jobs_per_s": jobs / seconds}


def _replication_head(args: argparse.Namespace) -> dict[str, Any]:
    """Node 0 of 3: the cache across the hosts (each rank's shard on its host), one
    maintenance burst over the veth links."""
    from phalanx.engine import HostsDiskCache
    from phalanx.hosts import MultiHostWorker, NodeSpec

    spec = NodeSpec(args.nnodes, 0, args.master_addr, args.port,
                    os.environ["PHALANX_JOB_TOKEN"], timeout=60.0)
    with MultiHostWorker(spec, 1) as w:
        cache = HostsDiskCache.open(w, args.cache, geometry=repl_geometry(),
                                    fingerprint=REPL_FINGERPRINT, capacity_bytes=args.capacity,
                                    kv_source="phalanx.replication:SyntheticSource")
        try:
            return _burst(cache)
        finally:
            cache.close()


def _replication_agent(args: argparse.Namespace) -> dict[str, Any]:
    from phalanx.hosts import HostAgent, NodeSpec

    spec = NodeSpec(args.nnodes, args.rank, args.master_addr, args.port,
                    os.environ["PHALANX_JOB_TOKEN"], timeout=60.0)
    ex = HostAgent(spec, 1).run()
    if ex.code:
        raise RuntimeError(ex.reason)
    return {"code": ex.code}


def domain_barrier(domain: HostDomain) -> None:
    """A member's part of one domain cycle (named by module:function across hosts)."""
    from phalanx.hosts import view_of

    view_of(domain).barrier()


# by name: this file runs as __main__, whose functions other hosts cannot import
_BARRIER = "phalanx_bench.multihost_rank:domain_barrier"


def _domain_head(args: argparse.Namespace) -> dict[str, Any]:
    """Node 0 of 3: phalanx domains spanning the hosts, allocated, passed through one
    barrier on every member and released, ``--cycles`` times."""
    from phalanx.hosts import MultiHostWorker, NodeSpec

    spec = NodeSpec(args.nnodes, 0, args.master_addr, args.port,
                    os.environ["PHALANX_JOB_TOKEN"], timeout=60.0)
    samples = []
    with MultiHostWorker(spec, 1) as w:
        for i in range(args.cycles + 1):
            t0 = time.perf_counter()
            d = w.allocate_domain(f"cycle{i}", window_size=4096, timeout=30)
            for f in [w.submit(r, _BARRIER, d, timeout=30) for r in d.members]:
                f.result(timeout=60)
            w.release_domain(d)
            samples.append(time.perf_counter() - t0)
        keys = w.store_keys()
    if keys:
        raise RuntimeError(f"{keys} keys left in the job's store after the cycles")
    return {"rank": 0, "us_p50": statistics.median(samples[1:]) * 1e6}  # first: connects


def _replication_local(args: argparse.Namespace) -> dict[str, Any]:
    """The same burst with the 3 ranks on one host (the local baseline)."""
    from phalanx.replication import ReplicatedCache
    from phalanx.runtime import Worker

    with Worker(ranks=args.nnodes) as w:
        cache = ReplicatedCache.open(w, args.cache, geometry=repl_geometry(),
                                     fingerprint=REPL_FINGERPRINT,
                                     capacity_bytes=args.capacity)
        try:
            return _burst(cache)
        finally:
            cache.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m phalanx_bench.multihost_rank")
    sub = p.add_subparsers(dest="mode", required=True)
    server = sub.add_parser("tcp-server")
    server.add_argument("--bind", required=True)
    client = sub.add_parser("tcp-client")
    client.add_argument("--addr", required=True)
    for s in (server, client):
        s.add_argument("--port", type=int, required=True)
        s.add_argument("--pings", type=int, required=True)
        s.add_argument("--bulk-bytes", type=int, required=True)
        s.add_argument("--bulk-reps", type=int, required=True)
    rdv = sub.add_parser("rendezvous")
    rdv.add_argument("--nnodes", type=int, required=True)
    rdv.add_argument("--sync-port", type=int, required=True)
    rdv.add_argument("--rounds", type=int, required=True)
    rdv.add_argument("--timeout", type=float, default=60.0)
    ar = sub.add_parser("allreduce")
    ar.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], required=True)
    ar.add_argument("--iters", type=int, required=True)
    cyc = sub.add_parser("group-cycle")
    cyc.add_argument("--cycles", type=int, required=True)
    dec = sub.add_parser("decode-client")
    dec.add_argument("--url", required=True)
    dec.add_argument("--max-tokens", type=int, required=True)
    dec.add_argument("--requests", type=int, required=True)
    dec.add_argument("--warmup-tokens", type=int, required=True)
    rh, ra, rl, dh = (sub.add_parser(m) for m in ("replication-head", "replication-agent",
                                                   "replication-local", "domain-head"))
    for s in (rh, ra, rl, dh):
        s.add_argument("--nnodes", type=int, required=True)
        s.add_argument("--cache", default="")
        s.add_argument("--capacity", type=int, default=1 << 30)
    for s in (rh, ra, dh):
        s.add_argument("--master-addr", required=True)
        s.add_argument("--port", type=int, required=True)
    ra.add_argument("--rank", type=int, required=True)
    dh.add_argument("--cycles", type=int, required=True)
    for s in (ar, cyc):
        s.add_argument("--world", type=int, required=True)
    for s in (rdv, ar, cyc):
        s.add_argument("--rank", type=int, required=True)
        s.add_argument("--master-addr", required=True)
        s.add_argument("--port", type=int, required=True)
    return p


_MODES = {"tcp-server": _tcp_server, "tcp-client": _tcp_client, "rendezvous": _rendezvous,
          "allreduce": _allreduce, "group-cycle": _group_cycle,
          "decode-client": _decode_client, "replication-head": _replication_head,
          "replication-agent": _replication_agent, "replication-local": _replication_local,
          "domain-head": _domain_head}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = _MODES[args.mode](args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
