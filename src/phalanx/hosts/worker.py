"""The multi-host Worker: node 0's view of a job whose ranks live on several hosts.

:class:`MultiHostWorker` runs on node 0. It hosts the job's rendezvous and keeps its c10d
``TCPStore`` open (torch.distributed's groups form on it), starts node 0's own ranks in a
local :class:`~phalanx.Worker`, and takes one control connection from each other node's
:class:`~phalanx.hosts.agent.HostAgent` (:mod:`phalanx.hosts.control`). Global rank ``g``
lives on node ``g // ranks_per_node``.

Work is ``submit(rank, "module:function", *args)``: typed arguments, an importable
function (:mod:`phalanx.hosts.functions`), the same path for node 0's ranks as for the
others', so a function that works on one host works on many.

Failure: a node whose connection closes, or that is silent for ``lost_after`` seconds
(a partition, a stopped host), is *lost*: every task outstanding on its ranks fails at
once with :class:`HostLostError` naming the node, its address and ranks; the job is then
over (there is no partial job: TP needs every rank), so every other node is told to stop
its ranks and exit non-zero naming the lost node, and ``dead`` says why. A rank that dies
on a node (its agent reports it in the next beat) fails the job the same way.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from phalanx.runtime import RankDiedError, WorkerError

from . import domains
from .control import (
    VERSION,
    Beat,
    Call,
    Challenge,
    Channel,
    ChannelClosedError,
    Hello,
    Reply,
    Stop,
    Stopped,
    Welcome,
    decode_value,
    encode_args,
    hello_proof,
    proofs_match,
    welcome_proof,
)
from .domains import HostDomain
from .functions import function_name, resolve, typed_result
from .local import LocalRanks
from .rendezvous import Membership, NodeSpec, local_addr_towards, rendezvous

__all__ = ["HostLostError", "MultiHostWorker"]

log = logging.getLogger("phalanx.hosts")

_FAILED_GRACE_S = 5.0  # a failed job's ranks get this long to stop before they are killed


class HostLostError(RankDiedError):
    """A node of the job is gone (its connection closed, or it fell silent): its ranks
    with it. ``node`` and ``addr`` name it; ``rank`` is the first of its ranks."""

    def __init__(self, message: str, node: int, addr: str, ranks: list[int]) -> None:
        super().__init__(message, ranks[0] if ranks else -1, None)
        self.node, self.addr, self.ranks = node, addr, ranks

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.node, self.addr, self.ranks))


class _Node:
    """One remote node as node 0 sees it."""

    def __init__(self, rank: int, addr: str, channel: Channel, ranks: list[int]) -> None:
        self.rank, self.addr, self.channel, self.ranks = rank, addr, channel, ranks
        self.last_seen = time.monotonic()
        self.pending: dict[int, concurrent.futures.Future[Any]] = {}
        self.stopped = threading.Event()
        self.stop_errors = ""
        self.lost: str | None = None
        self.dead_ranks: set[int] = set()

    @property
    def name(self) -> str:
        return f"node {self.rank} ({self.addr})"


class MultiHostWorker:
    """Node 0 of a multi-host job; see the module docstring.

    ``spec`` is node 0's :class:`NodeSpec` (``node_rank`` 0). Blocks until every node
    arrived, started its ranks and connected, or raises naming the ones that did not.
    """

    def __init__(self, spec: NodeSpec, ranks_per_node: int, *, start_timeout: float = 120.0,
                 task_timeout: float = 600.0, close_timeout: float = 30.0,
                 heartbeat: float = 0.5, lost_after: float = 5.0,
                 runtime_dir: str | None = None, env: dict[str, str] | None = None,
                 on_lost: Callable[[str], None] | None = None) -> None:
        if spec.node_rank != 0:
            raise ValueError(f"MultiHostWorker runs on node 0; node {spec.node_rank} runs a "
                             f"HostAgent (phalanx.hosts.agent)")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node}: need at least one")
        self.spec = spec
        self.ranks_per_node = ranks_per_node
        self.ranks: tuple[int, ...] = tuple(range(spec.nnodes * ranks_per_node))
        self.task_timeout = task_timeout
        self.close_timeout = close_timeout
        self._heartbeat, self._lost_after = heartbeat, lost_after
        # a node that stopped at t is declared lost by t + lost_after + heartbeat (the
        # watcher's next look); twice lost_after leaves a loaded machine its margin
        self.liveness_window = 2 * lost_after
        self._on_lost = [on_lost] if on_lost is not None else []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._domain_ids = itertools.count(1)
        self._nodes: dict[int, _Node] = {}
        self._outstanding: set[concurrent.futures.Future[Any]] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.dead: str | None = None
        self.addr = spec.addr or local_addr_towards(spec.master_addr, spec.master_port)
        self._listener = socket.create_server((self.addr, 0), backlog=spec.nnodes + 8)
        self.local: LocalRanks | None = None
        self.membership: Membership | None = None
        started = time.monotonic()
        try:
            port = self._listener.getsockname()[1]
            self.membership = rendezvous(replace(spec, port=port, addr=self.addr),
                                         keep_store=True)
            self.rendezvous_s = time.monotonic() - started
            self.local = LocalRanks(ranks_per_node, 0, runtime_dir=runtime_dir, env=env,
                                    start_timeout=start_timeout, task_timeout=task_timeout,
                                    close_timeout=close_timeout, node_addr=self.addr,
                                    token=self.spec.token)
            self._accept_all(started + start_timeout)
        except BaseException:
            self._teardown(Stop("node 0 failed to start the job", failed=True))
            raise
        self._spawn(self._watch, "phalanx-hosts-watch")
        log.info("job of %d nodes x %d ranks up in %.2fs (rendezvous %.2fs)",
                 spec.nnodes, ranks_per_node, time.monotonic() - started, self.rendezvous_s)

    # -- start ------------------------------------------------------------------------

    def _accept_all(self, deadline: float) -> None:
        assert self.membership is not None
        addrs = {p.node_rank: p.addr for p in self.membership.peers}
        while len(self._nodes) < self.spec.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.spec.nnodes)) - set(self._nodes))
                raise WorkerError(
                    f"node 0 at {self.addr}: node(s) {missing} "
                    f"({', '.join(addrs.get(r, '?') for r in missing)}) joined the "
                    f"rendezvous but did not start their ranks and connect within the start "
                    f"timeout: see their own errors")
            self._listener.settimeout(left)
            try:
                sock, where = self._listener.accept()
            except TimeoutError:
                continue
            self._handshake(Channel(sock, f"{where[0]}:{where[1]}"), addrs, left)

    def _handshake(self, channel: Channel, addrs: dict[int, str], left: float) -> None:
        nonce = os.urandom(16)
        try:
            channel.send(Challenge(VERSION, nonce))
            hello = channel.recv(timeout=min(left, 30.0))
        except (OSError, ChannelClosedError) as exc:
            log.warning("node 0: a control connection from %s failed its handshake: %s",
                        channel.peer, exc)
            channel.close()
            return
        if not (isinstance(hello, Hello) and hello.version == VERSION
                and proofs_match(hello_proof(self.spec.token, nonce, hello), hello.proof)):
            log.warning("node 0: refused a control connection from %s: it does not prove "
                        "this job's token", channel.peer)
            try:
                channel.send(Stop(f"node 0 at {self.addr} refused {channel.peer}: wrong job "
                                  f"token or protocol version", failed=True))
            except ChannelClosedError:
                pass
            channel.close()
            return
        r = hello.node_rank
        want = list(range(r * self.ranks_per_node, (r + 1) * self.ranks_per_node))
        if r not in addrs or r == 0 or r in self._nodes or hello.ranks != want:
            channel.send(Stop(f"node 0 refused node {r} from {channel.peer}: it is not an "
                              f"admitted node, is connected already, or runs ranks "
                              f"{hello.ranks} instead of {want}", failed=True))
            channel.close()
            return
        channel.send(Welcome(welcome_proof(self.spec.token, nonce, hello)))
        node = _Node(r, addrs[r], channel, want)
        self._nodes[r] = node
        self._spawn(lambda: self._read(node), f"phalanx-hosts-node{r}")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    # -- the nodes' frames ------------------------------------------------------------

    def _read(self, node: _Node) -> None:
        while True:
            try:
                frame = node.channel.recv()
            except (ChannelClosedError, OSError) as exc:
                # closed before its Stopped (which ends this loop): lost, even at close
                self._lose(node, f"its control connection closed ({exc})")
                return
            node.last_seen = time.monotonic()
            if isinstance(frame, Reply):
                with self._lock:
                    fut = node.pending.pop(frame.id, None)
                if fut is not None:
                    _settle(fut, frame, node)
            elif isinstance(frame, Beat):
                if frame.lost:
                    node.dead_ranks.update(frame.lost)
                    self._fail(f"rank(s) {frame.lost} on {node.name} died: "
                               f"{'; '.join(frame.why)}")
            elif isinstance(frame, Stopped):
                node.stop_errors = frame.errors
                node.stopped.set()
                return

    def _watch(self) -> None:
        while not self._stopping.wait(self._heartbeat):
            now = time.monotonic()
            for node in list(self._nodes.values()):
                if node.lost is not None:
                    continue
                silent = now - node.last_seen
                if silent > self._lost_after:
                    self._lose(node, f"silent for {silent:.1f}s (over {self._lost_after:g}s: "
                                     f"cut off, stopped, or overloaded)")
                    continue
                try:
                    node.channel.send(Beat())
                except ChannelClosedError as exc:
                    self._lose(node, str(exc))
            if self.local is not None:
                lost = self.local.lost()
                if lost and self.dead is None:
                    self._fail(f"rank(s) {sorted(lost)} on node 0 ({self.addr}) died")

    def _lose(self, node: _Node, why: str) -> None:
        with self._lock:
            if node.lost is not None:
                return
            node.lost = why
            pending, node.pending = node.pending, {}
        err = HostLostError(f"{node.name}, ranks {node.ranks}, lost: {why}", node.rank,
                            node.addr, node.ranks)
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        node.channel.close()
        self._fail(str(err))

    def _fail(self, reason: str) -> None:
        """The job is over: say why once, stop every other node (non-zero)."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = reason
            outstanding, self._outstanding = self._outstanding, set()
        log.error("job failed: %s", reason)
        # no partial job: whatever still runs on the other ranks waits on the lost ones
        for fut in outstanding:
            if not fut.done():
                fut.set_exception(WorkerError(f"the job failed: {reason}"))
        for node in list(self._nodes.values()):
            if node.lost is None:
                try:
                    node.channel.send(Stop(f"the job failed: {reason}", failed=True))
                except ChannelClosedError:
                    pass
        for cb in list(self._on_lost):
            cb(reason)

    def _settled(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._outstanding.discard(fut)

    def add_on_lost(self, cb: Callable[[str], None]) -> None:
        """``cb(reason)`` once when the job fails (a node or rank lost)."""
        self._on_lost.append(cb)

    # -- work -------------------------------------------------------------------------

    def node_of(self, rank: int) -> int:
        if rank not in self.ranks:
            raise ValueError(f"rank {rank}: this job has ranks 0..{len(self.ranks) - 1}")
        return rank // self.ranks_per_node

    def node_addr(self, node: int) -> str:
        assert self.membership is not None
        return self.membership.peers[node].addr

    def call_host(self, node: int, fn: Callable[..., Any] | str, *args: Any,
                  timeout: float | None = None) -> Any:
        """``fn(local, *args)`` in node ``node``'s agent (node 0: this process), where
        ``local`` is that host's :class:`~phalanx.hosts.local.LocalRanks`: a host-level
        step (a domain of the host's ranks); its result."""
        t = self.task_timeout if timeout is None else timeout
        return self.submit(node * self.ranks_per_node, fn, *args, timeout=t,
                           host=True).result(timeout=t + 30)

    def submit(self, rank: int, fn: Callable[..., Any] | str, *args: Any,
               timeout: float | None = None, host: bool = False
               ) -> concurrent.futures.Future[Any]:
        """``fn(*args)`` on global rank ``rank``; its future. ``fn``: an importable
        function or its ``module:function`` name; ``args``: plain values. ``host``: run
        it in the rank's host agent instead (see :meth:`call_host`)."""
        name = function_name(fn)
        target = resolve(name)  # importable here too: its result is typed by it
        node_rank = self.node_of(rank)
        data = encode_args(args, f"{name} on rank {rank}")
        timeout = self.task_timeout if timeout is None else timeout
        fut: concurrent.futures.Future[Any] = _TypedFuture(target, name)
        if self.dead is not None:
            fut.set_exception(WorkerError(f"the job failed: {self.dead}"))
            return fut
        with self._lock:
            self._outstanding.add(fut)
        fut.add_done_callback(self._settled)
        if node_rank == 0:
            assert self.local is not None
            local = self.local
            inner = (local.pool().submit(lambda: decode_value(local.execute_host(name, data)))
                     if host else local.submit(rank, name, data, timeout))
            inner.add_done_callback(lambda f: _copy(f, fut))
            return fut
        node = self._nodes[node_rank]
        call_id = next(self._ids)
        with self._lock:
            if node.lost is not None:
                fut.set_exception(HostLostError(f"{node.name} is lost: {node.lost}",
                                                node.rank, node.addr, node.ranks))
                return fut
            node.pending[call_id] = fut
        try:
            node.channel.send(Call(call_id, rank, name, data, timeout, host))
        except ChannelClosedError as exc:
            self._lose(node, str(exc))
        return fut

    def call(self, rank: int, fn: Callable[..., Any] | str, *args: Any,
             timeout: float | None = None) -> Any:
        t = self.task_timeout if timeout is None else timeout
        return self.submit(rank, fn, *args, timeout=t).result(timeout=t + 30)

    def alive_ranks(self) -> list[int]:
        alive: list[int] = []
        if self.local is not None:
            alive += [r for r in range(self.ranks_per_node) if r not in self.local.lost()]
        for node in self._nodes.values():
            if node.lost is None:
                alive += [r for r in node.ranks if r not in node.dead_ranks]
        return sorted(alive)

    # -- domains spanning hosts (hosts/domains.py) ------------------------------------

    def allocate_domain(self, name: str, ranks: list[int] | None = None, *,
                        window_size: int = 1 << 20, timeout: float = 60.0) -> HostDomain:
        """A domain of ``ranks`` (default: every rank), on whatever hosts they are: a
        window per member, one-sided put/get and collectives; see
        :mod:`phalanx.hosts.domains`. Pass the handle to tasks; a task's view is
        ``phalanx.hosts.view_of(domain)``."""
        return domains.allocate(self, next(self._domain_ids), name,
                                list(self.ranks if ranks is None else ranks), window_size,
                                timeout)

    def release_domain(self, domain: HostDomain) -> None:
        """Close every member's part of ``domain`` (after the tasks using it ended) and
        delete its keys from the job's store."""
        domains.release(self, domain)

    @property
    def store_address(self) -> tuple[str, int]:
        """Where the job's TCPStore listens (torch.distributed groups form there)."""
        return self.spec.master_addr, self.spec.master_port

    def store_keys(self) -> int:
        """Keys in the job's store now (the rendezvous leaves none; each torch.distributed
        group formed on it leaves the keys its backend wrote under its prefix)."""
        assert self.membership is not None
        return int(self.membership.store.num_keys())

    def drop_group_keys(self, prefix: str) -> int:
        """Delete the store keys of a torch.distributed group formed under ``prefix``,
        once every rank has left it (``destroy_process_group``), so the store holds only
        what is live however many groups come and go; how many were deleted."""
        assert self.membership is not None
        store = self.membership.store
        mine = [k for k in store.list_keys() if k.startswith(prefix.rstrip("/") + "/")]
        for k in mine:
            store.delete_key(k)
        return len(mine)

    @property
    def nodes(self) -> list[tuple[int, str]]:
        assert self.membership is not None
        return [(p.node_rank, p.addr) for p in self.membership.peers]

    # -- close ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every node's ranks (each says when they are gone), then node 0's; raise
        a WorkerError naming every node that did not confirm."""
        failed = self.dead is not None
        problems = self._teardown(Stop(f"the job failed: {self.dead}" if failed
                                       else "node 0 closed the job", failed=failed))
        if problems:
            raise WorkerError("closing the multi-host job: " + "; ".join(problems))

    def _teardown(self, stop: Stop) -> list[str]:
        problems: list[str] = []
        self._stopping.set()
        for node in self._nodes.values():
            if node.lost is None:
                try:
                    node.channel.send(stop)
                except ChannelClosedError:
                    pass
        deadline = time.monotonic() + self.close_timeout
        for node in self._nodes.values():
            if node.lost is None and not node.stopped.wait(max(0.0, deadline - time.monotonic())):
                problems.append(f"{node.name} did not confirm its ranks stopped within "
                                f"{self.close_timeout:g}s")
            elif node.stop_errors:
                problems.append(f"{node.name}: {node.stop_errors}")
            node.channel.close()
        if self.local is not None:
            try:  # after a failure, tasks still running wait on lost ranks: a short grace
                self.local.close(min(self.close_timeout, _FAILED_GRACE_S) if stop.failed
                                 else None)
            except Exception as exc:  # noqa: BLE001  reported with the others
                problems.append(f"node 0's ranks: {exc}")
        self._listener.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5.0)
        self.membership = None  # the store's last reference: its server stops
        return problems

    def __enter__(self) -> MultiHostWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TypedFuture(concurrent.futures.Future[Any]):
    """A task's future whose result is converted into its function's return type."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        super().__init__()
        self._fn, self._name = fn, name

    def set_result(self, result: Any) -> None:
        try:
            result = typed_result(self._fn, result, self._name)
        except TypeError as exc:
            super().set_exception(exc)
            return
        super().set_result(result)


def _copy(src: concurrent.futures.Future[Any], dst: concurrent.futures.Future[Any]) -> None:
    if dst.done():
        return  # failed with the job already
    exc = src.exception()
    try:
        if exc is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(src.result())
    except concurrent.futures.InvalidStateError:
        pass  # the job's failure got there first


def _settle(fut: concurrent.futures.Future[Any], reply: Reply, node: _Node) -> None:
    if fut.done():
        return
    if reply.ok:
        fut.set_result(decode_value(reply.value))
        return
    # the agent's message names the rank and the node already
    if reply.error in ("RankDiedError", "RankHungError", "HostLostError"):
        fut.set_exception(RankDiedError(reply.message, reply.rank, reply.exitcode))
    else:
        fut.set_exception(RemoteError(reply.error, reply.message))


class RemoteError(WorkerError):
    """A task on another host raised; ``kind`` is its exception's type name (exceptions
    do not cross hosts as objects: nothing is unpickled)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> Any:
        return (type(self), (self.kind, str(self)))
