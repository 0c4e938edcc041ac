"""The TP ranks of an engine whose ranks live on several hosts.

:class:`HostRankGroup` is :class:`~phalanx.engine.worker.local.RankGroup`'s counterpart over a
:class:`~phalanx.hosts.MultiHostWorker`: the same methods, so the engine and its
scheduler do not know how many hosts there are. The ranks form one torch.distributed
group (gloo on CPU, NCCL where the runner is on CUDA) on the job's ``TCPStore`` under a
prefix of this group's own, and TP's collectives run on it (``TorchDistComm``).

Steps are the data plane, as on one host, never tasks: rank 0 lives on this host (node
0's ranks are the parent's own), so the parent writes each step into a step channel
(``worker/step_channel.py``) that rank 0 alone reads; rank 0 broadcasts it over the TP
group and every rank runs it (``worker/rank.py``'s ``serve_host_steps``, one long task
per rank for the engine's life); rank 0 answers through the channel. The control plane
(the multi-host Worker's typed calls) opens and closes the ranks and carries the disk
tier's lookups on rank 0.

A lost host or rank fails the step in progress at once (the multi-host Worker fails every
outstanding task of the job, the step loops' too, and the step's wait checks them
between its slices), and the group is dead from then on. A step that fails on a rank
waits, at most the Worker's liveness window, for a lost host to explain it: a rank whose
peer's host died sees only its collective fail, often before the control plane has lost
that host, and the error a user reads must name the host.

The disk tier's loads travel with the step (typed ``DiskLoads``), as on one host; its
cache is :class:`~phalanx.engine.multihost.disk.HostsDiskCache`. The rank side is
``worker/rank.py``, as for one host.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from phalanx.hosts.worker import HostLostError

from .._errors import EngineDeadError, EngineError
from ..core.executor import RankMemory
from ..worker.executor import TP_WINDOW, ExecutorBase
from ..worker.rank import close_rank, open_host_rank, serve_host_steps
from ..worker.step_channel import StepChannel, StepMessage, channel_name
from .domains import open_host_domain, release_host_domain

__all__ = ["HostRankGroup"]

log = logging.getLogger("phalanx.engine")
T = TypeVar("T")
_ids = itertools.count(1)
_SETTLE_S = 5.0  # a call's deadline, then this long for its answer to arrive
# the step loops are tasks of the engine's whole life: no deadline of their own (each
# step has one, in the channel)
_LOOP_TIMEOUT_S = 10.0 ** 9
_KEEPALIVE_S = 10.0  # an idle rank 0 broadcasts this often at most


# -- node 0's side ----------------------------------------------------------------------

class HostRankGroup(ExecutorBase):
    """The TP ranks of a multi-host job; see the module docstring."""

    def __init__(self, hosts: Any, model_dir: str, tp: int, runner_kwargs: dict[str, Any], *,
                 step_timeout: float, start_timeout: float, seed: int,
                 disk_staging: bool = False, same_host_shm: bool = True) -> None:
        if tp != len(hosts.ranks):
            raise EngineError(f"tensor_parallel_size={tp} but the job has "
                              f"{len(hosts.ranks)} ranks ({len(hosts.nodes)} nodes x "
                              f"{hosts.ranks_per_node}): TP spans every rank of the job")
        super().__init__(tp, hosts)
        self.runner_id = f"engine_hosts_{os.getpid()}_{next(_ids)}"
        self._step_timeout = step_timeout
        self._opened = False
        self._channel: StepChannel | None = None
        self._loops: list[concurrent.futures.Future[Any]] = []
        # held by a step in flight: the channel is unmapped only when none is; a close
        # sets _closing first, which that step's wait sees at its next slice
        self._step_lock = threading.Lock()
        self._closing = False
        addr, port = hosts.store_address
        prefix = self._prefix = f"phx/tp/{self.runner_id}"
        per_node, nodes = hosts.ranks_per_node, len(hosts.nodes)
        # same-host peers keep shared memory where a host has several ranks
        self._domain = (f"{self.runner_id}_host" if same_host_shm and per_node > 1
                        and nodes > 1 else None)
        futs: list[concurrent.futures.Future[Any]] = []
        try:
            ids = ([hosts.call_host(n, open_host_domain, self._domain, TP_WINDOW,
                                    start_timeout) for n in range(nodes)]
                   if self._domain is not None else [])
            futs = [hosts.submit(r, open_host_rank, self.runner_id, model_dir, runner_kwargs,
                                 seed, addr, port, prefix, r, tp, per_node, start_timeout,
                                 disk_staging, (ids[r // per_node], self._domain) if ids else None,
                                 timeout=start_timeout + 30) for r in hosts.ranks]
            self.memory: list[RankMemory] = self._gather(futs, start_timeout + 60)
            self._start_loops(start_timeout)
        except BaseException as exc:
            self.dead = exc
            self._stop_loops()
            self._close_opened(futs)
            self._release_domains()
            raise
        self._opened = True

    def _start_loops(self, timeout: float) -> None:
        """The channel to rank 0, and every rank's step loop; the channel's name goes
        once rank 0 has mapped it. Rank 0 keeps its peers' waits under the group's
        timeout (``timeout``, the one ``join_group`` was given) while idle."""
        local = self.worker.local
        self._channel = StepChannel(channel_name(local.worker.generation, self.runner_id), 1)
        keepalive = min(_KEEPALIVE_S, timeout / 4)
        self._loops = [self.worker.submit(r, serve_host_steps, self.runner_id,
                                          self._channel.name, keepalive,
                                          timeout=_LOOP_TIMEOUT_S)
                       for r in self.worker.ranks]
        self._channel.hello(timeout, self._check_loops)

    def _check_loops(self) -> None:
        """Between a step's wait slices: every rank's loop still running and the job
        alive (a loop that ended says why: a lost host, or its rank's failed step)."""
        if self._closing:
            raise EngineDeadError("the engine's ranks were closed")
        for r, f in enumerate(self._loops):
            if f.done():
                exc = f.exception()
                if exc is not None:
                    raise exc
                raise EngineDeadError(f"engine: rank {r}'s step loop ended without an error")
        if self.worker.dead is not None:
            raise EngineDeadError(f"engine: the job failed: {self.worker.dead}")

    def _stop_loops(self) -> None:
        """End the loops (STOP through rank 0), then drop the channel. After a failure a
        loop may be gone with its rank, or stuck in a collective: not awaited long."""
        self._closing = True
        if not self._step_lock.acquire(timeout=self._step_timeout):
            log.warning("engine: a step still runs after %g s; its channel stays mapped",
                        self._step_timeout)
            return
        channel, self._channel = self._channel, None
        if channel is None:
            self._step_lock.release()
            return
        try:
            channel.stop()
            wait = self._step_timeout if self.dead is None else _SETTLE_S
            concurrent.futures.wait(self._loops, timeout=wait)
        finally:
            self._loops = []
            channel.close()
            self._step_lock.release()

    def _gather(self, futs: list[concurrent.futures.Future[Any]], timeout: float) -> list[Any]:
        """Every result, or the failure's cause as soon as it is known (not when the
        slowest rank ends)."""
        done, pending = concurrent.futures.wait(
            futs, timeout=timeout, return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in futs:
            if f in done and f.exception() is not None:
                raise self._cause(futs, cast(BaseException, f.exception()))
        if pending:
            raise EngineError(f"ranks {[i for i, f in enumerate(futs) if f in pending]} did "
                              f"not answer within {timeout:g}s")
        return [f.result() for f in futs]

    def _cause(self, futs: list[concurrent.futures.Future[Any]],
               first: BaseException) -> BaseException:
        """The error that names why a step failed. A rank whose peer's host died sees
        only its collective fail (gloo: "connection closed by peer"), often before the
        control plane has lost that host: the lost host, once the liveness window has
        had the chance to name it, is the cause; the rank's error goes with it."""
        if isinstance(first, HostLostError):
            return first
        # every outstanding task fails when the job does, so this ends the moment the
        # host is lost; a plain bug waits the window, its peers stuck in a collective
        concurrent.futures.wait(futs, timeout=self.worker.liveness_window)
        for f in futs:
            exc = f.exception() if f.done() else None
            if isinstance(exc, HostLostError):
                lost = HostLostError(f"{exc} (rank error: {first})", exc.node, exc.addr,
                                     exc.ranks)
                lost.__cause__ = first
                return lost
        if self.worker.dead is not None and self.worker.dead not in str(first):
            failed = EngineError(f"{first}; the job failed: {self.worker.dead}")
            failed.__cause__ = first
            return failed
        return first

    def _check_usable(self) -> None:
        """A failed or closed group refuses at once: its ranks' runners are gone."""
        if self.dead is not None:
            raise self.dead
        if not self._opened:
            raise EngineDeadError("the engine's ranks were closed")

    def execute(self, plan: bytes, loads: object | None = None) -> bytes:
        """Run one encoded plan on every rank (through rank 0's channel); rank 0's
        encoded result."""
        self._check_usable()
        with self._quiet.call(), self._step_lock:
            channel = self._channel
            if channel is None:
                raise EngineDeadError("the engine's ranks were closed")
            try:
                return channel.step(StepMessage(plan, cast(Any, loads)), self._step_timeout,
                                    self._check_loops)
            except BaseException as exc:
                self.dead = cause = self._cause(self._loops, exc)
                if cause is not exc:   # a lost host explains it (the cause chains exc)
                    raise cause from exc
                raise

    def on_rank0(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on rank 0 (the disk tier's lookups); its typed result."""
        self._check_usable()
        with self._quiet.call():
            return cast(T, self.worker.call(0, fn, *args, timeout=self._step_timeout))

    def on_each_rank(self, fn: Callable[..., T], *args: Any, timeout: float
                     ) -> dict[int, T | BaseException]:
        """``fn(*args)`` on every rank at once, one typed call each (no runs across
        hosts); a rank that failed or did not answer within ``timeout`` gives its
        error."""
        futs = {r: self.worker.submit(r, fn, *args, timeout=timeout) for r in self.worker.ranks}
        out: dict[int, T | BaseException] = {}
        for r, f in futs.items():
            try:
                out[r] = f.result(timeout=timeout + _SETTLE_S)
            except Exception as exc:  # noqa: BLE001  the rest are still reported
                out[r] = exc
        return out

    def parent_uncertain(self) -> int:
        """Node 0's own parent ledger is its host Worker's."""
        local = self.worker.local
        if local is None:
            return 0
        stats = local.worker.stats()
        return len(stats.extra.get("parent_resources", {}).get("uncertain", []))

    def _why_lost(self) -> str | None:
        return self.worker.dead  # type: ignore[no-any-return]

    def _close_opened(self, futs: list[concurrent.futures.Future[Any]]) -> None:
        concurrent.futures.wait(futs, timeout=self._step_timeout)
        opened = [r for r, f in enumerate(futs) if f.done() and f.exception() is None]
        self._close_ranks(opened)

    def _close_ranks(self, ranks: list[int]) -> None:
        if self.worker.dead is not None:
            return  # the job is over: its agents stop the ranks, runners and all
        closing = [self.worker.submit(r, close_rank, self.runner_id, True, timeout=60)
                   for r in ranks]
        for r, f in zip(ranks, closing, strict=True):
            try:
                f.result(timeout=90)
            except Exception as exc:  # noqa: BLE001  reported, the others still closed
                log.warning("engine: closing the runner on rank %d: %s", r, exc)

    def _release_domains(self) -> None:
        if self._domain is None or self.worker.dead is not None:
            return  # none, or the job is over: each agent releases what its host holds
        for n in range(len(self.worker.nodes)):
            try:
                self.worker.call_host(n, release_host_domain, self._domain, timeout=60)
            except Exception as exc:  # noqa: BLE001  the other hosts are still asked
                log.warning("engine: releasing the TP domain on node %d: %s", n, exc)

    def close(self, timeout: float = 60.0) -> None:
        if self._opened:
            self._opened = False
            self._stop_loops()
            self._close_ranks(list(self.worker.ranks))
            self._release_domains()  # after the runners: they map the domains' windows
            if self.worker.dead is None:  # every rank left the group: its keys go too
                self.worker.drop_group_keys(self._prefix)
