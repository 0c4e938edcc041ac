"""Node 0 of a multi-host test job, and the rank functions its tests send across hosts.

Run in a namespace as ``python tests/hosts_job.py SCENARIO --nnodes N ...`` (the other
nodes run ``python -m phalanx.hosts.agent``); prints JSON lines: ``{"event": ...}``.
The rank functions are module-level so every host imports them by name
(``hosts_job:where``), with ``tests/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

from phalanx.hosts import HostDomain

# -- rank functions (run on every host) ------------------------------------------------

def where(rank: int) -> dict[str, Any]:
    return {"rank": rank, "pid": os.getpid(), "node_addr": os.environ.get("PHALANX_NODE_ADDR"),
            "node_rank": os.environ.get("PHALANX_NODE_RANK")}


def gloo_sum(store_addr: str, port: int, prefix: str, rank: int, world: int) -> float:
    """Join a gloo group on the job's store, all-reduce rank + 1, leave it."""
    import torch

    from phalanx.hosts.dist import destroy, join_group

    join_group(store_addr, port, prefix, rank, world, timeout=30.0)
    try:
        t = torch.tensor([float(rank + 1)])
        import torch.distributed as dist

        dist.all_reduce(t)
        return float(t.item())
    finally:
        destroy()


def domain_round(domain: HostDomain, rank: int) -> dict[str, Any]:
    """One round on a domain spanning the hosts: one-sided puts and gets into the other
    members' windows, a barrier, every collective, and the refusals."""
    import numpy as np

    from phalanx.comm import DomainError
    from phalanx.hosts import view_of

    v = view_of(domain)
    me, n = v.domain_rank, v.domain_size
    words = v.array(np.int64)
    words[0] = 10 * rank
    v.barrier()
    nxt, prev = (me + 1) % n, (me - 1) % n
    v.put(nxt, 8, np.array([100 + rank], dtype=np.int64))  # into the next one's window
    got_prev = int(np.frombuffer(v.get(prev, 0, 8), dtype=np.int64)[0])  # its slot 0
    v.barrier()
    put_by_prev = int(words[1])
    total = v.allreduce(np.array([rank + 1.0]))
    top = v.allreduce(np.array([rank], dtype=np.int64), op="max")
    prod = v.allreduce(np.array([rank + 1.0]), op="prod")
    root = v.broadcast(np.array([rank * 7], dtype=np.int16), root=n - 1)  # any dtype
    gathered = v.allgather(np.array([rank, -rank], dtype=np.float16))
    refused = []
    for bad in (lambda: v.put(nxt, domain.window_size - 4, b"12345678"),
                lambda: v.peer_window(nxt), lambda: v.get(n, 0, 1),
                lambda: v.allreduce(np.array([1], dtype=np.uint16))):
        try:
            bad()
            refused.append(None)
        except DomainError as exc:
            refused.append(str(exc))
    v.barrier()
    return {"prev": got_prev, "put_by_prev": put_by_prev, "sum": float(total[0]),
            "max": int(top[0]), "prod": float(prod[0]), "root": int(root[0]),
            "gathered": gathered.tolist(),
            "refused": refused}


def domain_barrier(domain: HostDomain, timeout: float) -> str:
    from phalanx.hosts import view_of

    view_of(domain).barrier(timeout)
    return "passed"


def window_threads() -> int:
    return sum(t.name.startswith("phalanx-window") for t in threading.enumerate())


def hold(marker: str) -> str:
    """Block until ``marker`` exists (the test never creates it for a host it kills)."""
    deadline = time.monotonic() + 120.0
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "released"


def fail(message: str) -> None:
    raise ValueError(message)


class Opaque:
    pass


# -- node 0 ------------------------------------------------------------------------------

def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _basic(w: Any) -> None:
    from phalanx.hosts import HostLostError  # noqa: F401  (the public name exists)

    keys_before = w.store_keys()
    got = [w.call(r, "hosts_job:where", r, timeout=30) for r in w.ranks]
    addr, port = w.store_address
    futs = [w.submit(r, "hosts_job:gloo_sum", addr, port, "t/basic", r, len(w.ranks),
                     timeout=60) for r in w.ranks]
    sums = [f.result(timeout=90) for f in futs]
    keys_after = w.store_keys()
    dropped = w.drop_group_keys("t/basic")
    churn = []  # groups formed and dropped in turn: the store holds only the live one
    for i in range(3):
        fs = [w.submit(r, "hosts_job:gloo_sum", addr, port, f"t/churn{i}", r, len(w.ranks),
                       timeout=60) for r in w.ranks]
        [f.result(timeout=90) for f in fs]
        churn.append((w.store_keys(), w.drop_group_keys(f"t/churn{i}"), w.store_keys()))
    domains = _domains(w)
    errors = {}
    last = len(w.ranks) - 1
    for name, call in (("main", lambda: w.submit(1, _local_only)),
                       ("opaque", lambda: w.submit(1, "hosts_job:where", Opaque())),
                       ("remote", lambda: w.call(last, "hosts_job:fail", "no such thing")),
                       ("typed", lambda: w.call(last, "hosts_job:where", "not a rank"))):
        try:
            call()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001  reported to the test
            errors[name] = f"{type(exc).__name__}: {exc}"
    _emit(event="done", where=got, sums=sums, errors=errors, nodes=w.nodes,
          rendezvous_s=w.rendezvous_s, alive=w.alive_ranks(), keys=[keys_before, keys_after,
                                                                 dropped, w.store_keys()],
          churn=churn, domains=domains)


def _domains(w: Any) -> dict[str, Any]:
    """Domains spanning the hosts: a round on each member, churn, a late member."""
    d = w.allocate_domain("span", window_size=64, timeout=30)
    rounds = [f.result(timeout=90) for f in
              [w.submit(r, "hosts_job:domain_round", d, r, timeout=60) for r in w.ranks]]
    live = [w.store_keys(), [w.call(r, "hosts_job:window_threads") for r in w.ranks]]
    w.release_domain(d)
    for i in range(20):  # allocated and released in turn: nothing accumulates
        d = w.allocate_domain(f"churn{i}", ranks=list(w.ranks)[i % 2:], window_size=64)
        [f.result(timeout=60) for f in [w.submit(r, "hosts_job:domain_barrier", d, 30.0)
                                        for r in d.members]]
        w.release_domain(d)
    late_error = None
    d = w.allocate_domain("late", window_size=64, timeout=30)
    try:  # the last member never arrives: the others' barrier ends at its deadline
        [f.result(timeout=60) for f in [w.submit(r, "hosts_job:domain_barrier", d, 2.0)
                                        for r in d.members[:-1]]]
    except Exception as exc:  # noqa: BLE001  reported to the test
        late_error = f"{type(exc).__name__}: {exc}"
    w.release_domain(d)
    return {"rounds": rounds, "live": live, "late_error": late_error,
            "after": [w.store_keys(), [w.call(r, "hosts_job:window_threads")
                                       for r in w.ranks]]}


def _local_only() -> None:
    """Defined where the test runs it as __main__: refused for other hosts."""


def _hold(w: Any, marker: str) -> None:
    futs = {r: w.submit(r, "hosts_job:hold", marker, timeout=120) for r in w.ranks}
    _emit(event="holding")
    outcome: dict[int, str] = {}
    started = time.monotonic()
    lost_at: list[float] = []
    w.add_on_lost(lambda reason: lost_at.append(time.monotonic() - started))
    for r, f in futs.items():
        try:
            outcome[r] = str(f.result(timeout=150))
        except Exception as exc:  # noqa: BLE001  reported to the test
            outcome[r] = f"{type(exc).__name__}: {exc}"
    _emit(event="done", outcome=outcome, dead=w.dead, alive=w.alive_ranks())


def _incident(w: Any, cache_dir: str, capacity: int, cut_marker: str) -> None:
    """The recovered-chain incident across hosts: every rank's directory (a copy of one
    synthesized chain) needs maintenance at start-up; the burst must complete and leave
    every host's directory identical. With ``cut_marker``: the test cuts a host off once
    the cache is open (it answers by creating the marker), then the burst runs."""
    from phalanx.engine.multihost.disk import HostsDiskCache
    from replication_util import FP, GEOM

    cache = HostsDiskCache.open(w, cache_dir, geometry=GEOM, fingerprint=FP,
                                capacity_bytes=capacity, window=64,
                                kv_source="phalanx.replication:SyntheticSource")
    _emit(event="opened", report=cache.report)
    if cut_marker:
        deadline = time.monotonic() + 60
        while not os.path.exists(cut_marker) and time.monotonic() < deadline:
            time.sleep(0.05)
    started = time.monotonic()
    try:
        report = cache.maintain()
        _emit(event="maintained", jobs=report.jobs, problems=cache.check(),
              seconds=time.monotonic() - started)
    except Exception as exc:  # noqa: BLE001  reported to the test
        _emit(event="failed", error=f"{type(exc).__name__}: {exc}",
              seconds=time.monotonic() - started)
    try:
        cache.close()
    except Exception as exc:  # noqa: BLE001  reported to the test
        _emit(event="close_failed", error=str(exc))


def allreduce_us(store_addr: str, store_port: int, prefix: str, rank: int, world: int,
                 per_node: int, alloc_id: int, name: str, nbytes: int,
                 iters: int) -> dict[str, float]:
    """Median µs of one all-reduce of ``nbytes`` float32 over the whole job's gloo group
    and over the tiered path, measured in turn in this rank (the tiered scenario's rank task)."""
    import torch

    from phalanx.engine.worker.rank import tiered_comm
    from phalanx.engine.worker.tp import TorchDistComm
    from phalanx.hosts.dist import destroy, join_group

    group = join_group(store_addr, store_port, prefix, rank, world, 60.0)
    try:
        comms = {"gloo": TorchDistComm(group), "tiered": tiered_comm(group, per_node,
                                                                     alloc_id, name)}
        t = torch.ones(nbytes // 4)
        out: dict[str, float] = {}
        for label, comm in comms.items():
            step = getattr(comm, "step", None)
            with step() if step is not None else contextlib.nullcontext():
                for _ in range(5):
                    comm.all_reduce(t)
                    t.fill_(1.0)
                times = []
                for _ in range(iters):
                    start = time.perf_counter()
                    comm.all_reduce(t)
                    times.append((time.perf_counter() - start) * 1e6)
                    if not bool((t == float(world)).all()):
                        raise RuntimeError(f"rank {rank}: the {label} all-reduce of ones "
                                           f"over {world} ranks did not give {world}")
                    t.fill_(1.0)
            out[label] = statistics.median(times)
            if hasattr(comm, "close"):
                comm.close()
        return out
    finally:
        destroy()


def _tiered(w: Any, iters: int) -> None:
    """The same-host domains of a job of hosts with several ranks each, and one
    all-reduce's cost over gloo alone and over the tiered path, measured on every rank."""
    from phalanx.engine.multihost.domains import open_host_domain, release_host_domain
    from phalanx.engine.worker.executor import TP_WINDOW

    nodes = len(w.nodes)
    ids = [w.call_host(n, open_host_domain, "t_tiered", TP_WINDOW, 60.0) for n in range(nodes)]
    addr, port = w.store_address
    per = w.ranks_per_node
    out: dict[str, Any] = {}
    for nbytes in (4096, 65536):
        futs = [w.submit(r, "hosts_job:allreduce_us", addr, port,
                         f"t/tiered{nbytes}", r, len(w.ranks), per, ids[r // per],
                         "t_tiered", nbytes, iters, timeout=300) for r in w.ranks]
        out[str(nbytes)] = [f.result(timeout=330) for f in futs]
        w.drop_group_keys(f"t/tiered{nbytes}")
    released = [w.call_host(n, release_host_domain, "t_tiered") for n in range(nodes)]
    _emit(event="done", allreduce_us=out, released=released, keys=w.store_keys())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["basic", "hold", "incident", "tiered"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--cache", default="")
    p.add_argument("--capacity", type=int, default=1 << 30)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--marker", default="")
    args = p.parse_args()
    from phalanx.hosts import MultiHostWorker, NodeSpec

    spec = NodeSpec(args.nnodes, 0, args.master_addr, args.master_port,
                    os.environ["PHALANX_JOB_TOKEN"], timeout=30.0)
    w = MultiHostWorker(spec, args.ranks_per_node, lost_after=3.0)
    code = 0
    try:
        _emit(event="up", ranks=list(w.ranks))
        if args.scenario == "basic":
            _basic(w)
        elif args.scenario == "tiered":
            _tiered(w, args.iters)
        elif args.scenario == "incident":
            _incident(w, args.cache, args.capacity, args.marker)
        else:
            _hold(w, args.marker)
    finally:
        try:
            w.close()
        except Exception as exc:  # noqa: BLE001  reported to the test
            _emit(event="close_failed", error=str(exc))
            code = 1
    _emit(event="closed", threads=[t.name for t in threading.enumerate()])
    return code


if __name__ == "__main__":
    sys.exit(main())
