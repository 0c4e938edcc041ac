"""Domains spanning hosts: the same view API as a same-host domain, over the network.

Node 0 allocates (:meth:`MultiHostWorker.allocate_domain`): every member rank, on
whatever host, opens its part at once (:func:`open_member`): a window in its own memory,
a :class:`~phalanx.hosts.windows.WindowServer` serving it to the other members on the
host's job address, and a gloo process group of the members on the job's ``TCPStore``
under the domain's own prefix. A task gets the domain as a typed :class:`HostDomain`
argument and its rank's :class:`HostDomainView` from :func:`view_of`:

* ``window`` / ``array`` / ``tensor``: this member's window, zero-copy;
* ``put`` / ``get`` / ``get_into`` to any member: its own window directly, a remote one
  through that member's window server (one-sided: the peer's task takes no part);
* ``barrier``, ``broadcast``, ``allreduce``, ``allgather``: gloo on the members' group
  (torch.distributed, the field's engine), in place on numpy arrays as on one host.

Release (:meth:`MultiHostWorker.release_domain`) after the tasks using it ended: each
member closes its clients, its server (joining its threads) and its group; then node 0
deletes every key the domain wrote in the store, so the store holds only live domains.
A dead member fails what waits on it: a put or get names the member and its address, a
collective names the domain (gloo's own error, or its timeout, which is the domain's).

Same-host members of a spanning domain also go through the network here (loopback):
the shared-memory path of a same-host domain is ``phalanx.comm``'s.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import numpy as np

from phalanx.comm import (
    CollectiveError,
    DomainAllocationError,
    DomainError,
    DomainReleasedError,
)

from .windows import WindowClient, WindowError, WindowServer

__all__ = ["HostDomain", "HostDomainView", "close_member", "open_member", "view_of"]

def _op(name: str) -> Callable[[], Any]:
    def get() -> Any:
        import torch.distributed as dist

        return getattr(dist.ReduceOp, name)
    return get


_OPS = {"sum": _op("SUM"), "max": _op("MAX"), "min": _op("MIN"), "prod": _op("PRODUCT")}
_REDUCIBLE = {"float16", "float32", "float64", "bfloat16", "int8", "int32", "int64", "uint8",
              "bool"}


class HostDomain(msgspec.Struct, frozen=True):
    """A live domain of a multi-host job: what tasks receive (a typed value that crosses
    hosts) and what :meth:`MultiHostWorker.release_domain` takes back."""

    alloc_id: int
    name: str
    members: list[int]
    window_size: int
    prefix: str  # its keys in the job's store
    store_addr: str
    store_port: int
    timeout: float


# -- the rank side ----------------------------------------------------------------------

# A rank's parts of spanning domains are rank services (phalanx.runtime.rank_services):
# owned from their open, closed at release, or by the Worker's close before its ranks
# stop, every failure reported naming the rank and the domain.
_LOCK = threading.Lock()


def _service(alloc_id: int) -> str:
    return f"hosts.domain/{alloc_id}"


class _StoreClient:
    """This rank's one client of the job's store, shared by its domains."""

    def __init__(self, addr: str, port: int, timeout: float) -> None:
        import torch.distributed as dist

        self.store: Any = dist.TCPStore(  # type: ignore[attr-defined]
            addr, port, None, False, timedelta(seconds=timeout), use_libuv=True)

    def close(self) -> None:
        self.store = None  # its connection closes with the last reference


def _store(addr: str, port: int, timeout: float) -> Any:
    from phalanx.runtime import rank_services

    services, name = rank_services(), f"hosts.store/{addr}:{port}"
    with _LOCK:
        client = services.find(name, _StoreClient)
        if client is None:
            client = _StoreClient(addr, port, timeout)
            services.register(name, client, client.close)
        return client.store


def open_member(domain: HostDomain, rank: int) -> str:
    """This rank's part of ``domain`` (run on every member at once); its window
    server's address."""
    import torch.distributed as dist

    from .dist import interface_of

    addr = os.environ.get("PHALANX_NODE_ADDR", "127.0.0.1")
    token = os.environ.get("PHALANX_JOB_TOKEN", "")
    if not token:
        raise DomainAllocationError(f"rank {rank}: PHALANX_JOB_TOKEN is not set in this rank "
                                    f"(its host's agent sets it): a window server needs "
                                    f"the job's token", {})
    if addr != "127.0.0.1" and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(addr)  # see dist.py
    me = domain.members.index(rank)
    where = f"domain {domain.name!r} (id {domain.alloc_id}): rank {rank} on {addr}"
    window = bytearray(domain.window_size)
    server = WindowServer(memoryview(window), addr, token, domain.alloc_id, domain.members,
                          lambda: f"the window of rank {rank} in {where}")
    try:
        store = _store(domain.store_addr, domain.store_port, domain.timeout)
        store.set(f"{domain.prefix}/addr/{me}", server.address)
        group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{domain.prefix}/pg", store),  # type: ignore[attr-defined]
            me, len(domain.members), timedelta(seconds=domain.timeout))
        # every member published its address before it joined the group
        peers = [store.get(f"{domain.prefix}/addr/{i}").decode()
                 for i in range(len(domain.members))]
    except Exception as exc:  # noqa: BLE001  the store's or gloo's error, named here
        server.close()
        raise DomainAllocationError(f"{where}: the domain did not form on the store at "
                                    f"{domain.store_addr}:{domain.store_port}: {exc}",
                                    {rank: exc}) from None
    from phalanx.runtime import rank_services

    view = HostDomainView(domain, rank, window, server, peers, group, token)
    rank_services().register(_service(domain.alloc_id), view, view.revoke)
    return server.address


def close_member(domain: HostDomain) -> None:
    """Release this rank's part of ``domain`` (after every task using it ended)."""
    from phalanx.runtime import rank_services

    services = rank_services()
    if services.find(_service(domain.alloc_id), HostDomainView) is not None:
        services.close(_service(domain.alloc_id))


def view_of(domain: HostDomain) -> HostDomainView:
    """This rank's view of ``domain``, from a task that got it as an argument."""
    from phalanx.runtime import rank_services

    view = rank_services().find(_service(domain.alloc_id), HostDomainView)
    if view is None:
        raise DomainError(f"this rank holds no view of domain {domain.name!r} (id "
                          f"{domain.alloc_id}): it is not a member, or it was released")
    return view


class HostDomainView:
    """A task's view of a domain spanning hosts; see the module docstring. The methods
    and their meaning are :class:`phalanx.comm.DomainView`'s."""

    def __init__(self, domain: HostDomain, rank: int, window: bytearray,
                 server: WindowServer, peers: list[str], group: Any, token: str) -> None:
        self.domain = domain
        self.name = domain.name
        self.members = list(domain.members)
        self.domain_rank = domain.members.index(rank)
        self.domain_size = len(domain.members)
        self.timeout = domain.timeout
        self._window = window
        self._server = server
        self._peers = peers  # domain rank -> its window server's address
        self._clients: dict[int, WindowClient] = {}
        self._group = group
        self._token = token
        self._lock = threading.Lock()
        self._revoked = False

    def __repr__(self) -> str:
        return (f"<HostDomainView {self.name!r} id={self.domain.alloc_id} "
                f"rank {self.domain_rank}/{self.domain_size}>")

    def _who(self, domain_rank: int) -> str:
        return (f"domain rank {domain_rank} (rank {self.members[domain_rank]}, "
                f"{self._peers[domain_rank]}) of domain {self.name!r}")

    def _check(self, domain_rank: int | None = None) -> None:
        if self._revoked:
            raise DomainReleasedError(f"domain {self.name!r} (id {self.domain.alloc_id}) "
                                      f"was released; its view is no longer usable")
        if domain_rank is not None and not 0 <= domain_rank < self.domain_size:
            raise DomainError(f"domain {self.name!r} has no domain rank {domain_rank} "
                              f"(size {self.domain_size})")

    # -- memory -----------------------------------------------------------------------
    @property
    def window(self) -> memoryview:
        """This member's window: writable, zero-copy."""
        self._check()
        return memoryview(self._window)

    def array(self, dtype: Any = np.uint8, domain_rank: int | None = None) -> Any:
        """This member's window as a numpy array, no copy. Another member's window is
        on its own host: read it with :meth:`get_into`."""
        if domain_rank not in (None, self.domain_rank):
            return self.peer_window(domain_rank)  # raises, saying why
        return np.frombuffer(self.window, dtype=dtype)

    def tensor(self, dtype: Any = None) -> Any:
        import torch

        return torch.frombuffer(self.window, dtype=dtype or torch.uint8)

    def peer_window(self, domain_rank: int) -> memoryview:
        self._check(domain_rank)
        if domain_rank == self.domain_rank:
            return self.window
        raise DomainError(f"{self._who(domain_rank)} is reached over the network, not "
                          f"mapped here: use put, get or get_into")

    def _bounds(self, peer: int, offset: int, nbytes: int) -> None:
        self._check(peer)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.domain.window_size:
            raise DomainError(f"domain {self.name!r}: [{offset}, {offset + nbytes}) is "
                              f"outside the {self.domain.window_size}-byte window of "
                              f"domain rank {peer}")

    def _client(self, peer: int) -> WindowClient:
        with self._lock:
            client = self._clients.get(peer)
            if client is None:
                client = self._clients[peer] = WindowClient(
                    self._peers[peer], self._token, self.domain.alloc_id,
                    self.members[self.domain_rank], self._who(peer), self.timeout)
            return client

    def put(self, peer: int, offset: int, data: Any) -> None:
        """Write ``data`` (any buffer) into ``peer``'s window at ``offset``; in it when
        this returns."""
        src = memoryview(data).cast("B")
        self._bounds(peer, offset, len(src))
        if peer == self.domain_rank:
            self.window[offset:offset + len(src)] = src
            return
        self._remote(peer, "put into", lambda c: c.put(offset, src))

    def get(self, peer: int, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self.get_into(peer, offset, out)
        return bytes(out)

    def get_into(self, peer: int, offset: int, out: Any) -> None:
        """Read ``len(out)`` bytes of ``peer``'s window at ``offset`` into ``out``."""
        dst = memoryview(out).cast("B")
        self._bounds(peer, offset, len(dst))
        if peer == self.domain_rank:
            dst[:] = self.window[offset:offset + len(dst)]
            return
        self._remote(peer, "get from", lambda c: c.get_into(offset, dst))

    def _remote(self, peer: int, what: str, request: Callable[[WindowClient], None]) -> None:
        """``request`` on ``peer``'s window client; a failed one is dropped (its
        failure closed it), so the next call reconnects."""
        client = self._client(peer)
        try:
            request(client)
        except WindowError as exc:
            with self._lock:
                if self._clients.get(peer) is client:
                    del self._clients[peer]
            client.close()
            raise DomainError(f"domain rank {self.domain_rank}: {what} {exc}") from None

    # -- synchronisation and collectives (gloo on the members' group) ---------------------
    def _wait(self, what: str, issue: Callable[[], Any], timeout: float | None = None) -> None:
        """``issue()`` (the collective's call on the group) and its end, or a
        CollectiveError naming the domain, whether gloo refused it or it failed."""
        try:
            issue().wait(timedelta(seconds=self.timeout if timeout is None else timeout))
        except Exception as exc:  # noqa: BLE001  gloo's RuntimeError, named here
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise CollectiveError(f"domain {self.name!r} {what}: domain rank "
                                  f"{self.domain_rank} (rank {self.members[self.domain_rank]})"
                                  f" failed waiting on members {self.members}: {first}"
                                  ) from None

    def barrier(self, timeout: float | None = None) -> None:
        """Every member arrives before any leaves."""
        import torch.distributed as dist

        self._check()
        opts = dist.BarrierOptions()
        opts.timeout = timedelta(seconds=self.timeout if timeout is None else timeout)
        self._wait("barrier", lambda: self._group.barrier(opts), timeout)

    def _writable(self, arr: Any, what: str) -> Any:
        """``arr`` as the numpy array a collective writes into, in place."""
        a = np.asarray(arr)
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise DomainError(f"domain {self.name!r}: {what} needs a writable "
                              f"C-contiguous array")
        return a

    def broadcast(self, arr: Any, root: int = 0) -> Any:
        """Copy ``arr`` of domain rank ``root`` into ``arr`` of every member, in place."""
        self._check(root)
        import torch

        # its bytes, whatever the dtype (as on one host)
        flat = torch.from_numpy(self._writable(arr, "broadcast").reshape(-1).view(np.uint8))
        self._wait("broadcast", lambda: self._group.broadcast(flat, root))
        return arr

    def allreduce(self, arr: Any, op: str = "sum") -> Any:
        """Reduce ``arr`` over every member (sum, max, min, prod), in place; dtypes
        gloo reduces: float16/32/64, bfloat16, int8/32/64, uint8, bool."""
        import torch
        import torch.distributed as dist

        if op not in _OPS:
            raise DomainError(f"allreduce op {op!r}: choose one of {sorted(_OPS)}")
        self._check()
        a = self._writable(arr, "allreduce")
        if a.dtype.name not in _REDUCIBLE or not a.dtype.isnative:
            raise DomainError(f"domain {self.name!r}: allreduce of {a.dtype}: gloo reduces "
                              f"{sorted(_REDUCIBLE)} (native byte order) only")
        t = torch.from_numpy(a.reshape(-1))
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]()
        self._wait("allreduce", lambda: self._group.allreduce([t], opts))
        return arr

    def allgather(self, arr: Any) -> Any:
        """Every member's ``arr`` stacked in domain-rank order."""
        import torch

        self._check()
        a = np.ascontiguousarray(arr)
        src = torch.from_numpy(a.copy().reshape(-1).view(np.uint8))
        outs = [torch.empty_like(src) for _ in range(self.domain_size)]
        self._wait("allgather", lambda: self._group.allgather([outs], [src]))
        return np.stack([o.numpy().view(a.dtype).reshape(a.shape) for o in outs])

    def revoke(self) -> None:
        """Close this member's part: its clients, its window server (threads joined),
        its group. Idempotent."""
        with self._lock:
            if self._revoked:
                return
            self._revoked = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        self._server.close()
        group, self._group = self._group, None
        try:
            group.shutdown()
        except Exception:  # noqa: BLE001  a dead peer's group: nothing to flush
            pass


# -- node 0's side --------------------------------------------------------------------

def allocate(worker: Any, alloc_id: int, name: str, ranks: list[int], window_size: int,
             timeout: float) -> HostDomain:
    """Open ``domain`` on every member at once; the handle, or an error naming every
    member that failed (the others' parts closed, the keys deleted)."""
    if len(set(ranks)) != len(ranks) or not ranks:
        raise DomainError(f"domain {name!r}: members {ranks} must be distinct, at least one")
    unknown = [r for r in ranks if r not in worker.ranks]
    if unknown:
        raise DomainError(f"domain {name!r}: ranks {unknown} are not in this job (ranks "
                          f"0..{len(worker.ranks) - 1})")
    if window_size < 0:
        raise DomainError(f"domain {name!r}: window_size={window_size} is negative")
    addr, port = worker.store_address
    domain = HostDomain(alloc_id, name, list(ranks), window_size, f"phx/dom/{alloc_id}",
                        addr, port, timeout)
    futs = {r: worker.submit(r, open_member, domain, r, timeout=timeout + 30) for r in ranks}
    concurrent.futures.wait(futs.values(), timeout=timeout + 60)
    failed = {r: f.exception() if f.done() else TimeoutError(f"no answer in "
                                                               f"{timeout + 60:g}s")
              for r, f in futs.items() if not f.done() or f.exception() is not None}
    if failed:
        # every member: one whose answer failed on the way may have opened; closing a
        # part never opened is a no-op
        problems = _close(worker, domain, list(ranks))
        raise DomainAllocationError(
            f"domain {name!r} (id {alloc_id}) over ranks {ranks}: "
            + "; ".join(f"rank {r} on node {worker.node_of(r)}: {e}" for r, e in failed.items())
            + (f"; and closing the others: {'; '.join(problems)}" if problems else ""),
            {r: e if isinstance(e, BaseException) else RuntimeError(str(e))
             for r, e in failed.items()})
    return domain


def release(worker: Any, domain: HostDomain) -> None:
    """Every member's part closed, then the domain's keys deleted; one error naming every
    member that failed."""
    problems = _close(worker, domain, domain.members)
    if problems:
        raise DomainError(f"releasing domain {domain.name!r} (id {domain.alloc_id}): "
                          + "; ".join(problems))


def _close(worker: Any, domain: HostDomain, ranks: list[int]) -> list[str]:
    if worker.dead is not None:
        return []  # the job is over: its agents stop the ranks, and the domains with them
    futs = {r: worker.submit(r, close_member, domain, timeout=domain.timeout + 30)
            for r in ranks}
    problems = []
    for r, f in futs.items():
        try:
            f.result(timeout=domain.timeout + 60)
        except Exception as exc:  # noqa: BLE001  every member is asked; all reported
            problems.append(f"rank {r}: {exc}")
    if worker.dead is None:
        worker.drop_group_keys(domain.prefix)
    return problems
