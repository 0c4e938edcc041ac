"""The executor of an engine whose TP ranks are on this host: :class:`RankGroup`, a
Worker whose one long-lived run holds the TP domain, every rank's runner and its step
loop. Steps never ride the run: they go through the step channel
(``worker/step_channel.py``), the data plane; the run is the control plane (start, the
disk tier's lookups on rank 0, close).

On CPU the ranks reduce over phalanx's shared-memory domain. On CUDA
(``worker/devices.py``) they form a torch.distributed group instead (NCCL, or gloo
where named), on a ``TCPStore`` the group holds in the parent: the same ``join_group``
and ``TorchDistComm`` as the multi-host path, on loopback. The rank side is
``worker/rank.py``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

from phalanx.comm import Worker

from .._errors import EngineDeadError, EngineError
from ..core.executor import RankMemory
from .devices import DevicePlan
from .executor import TP_WINDOW, ExecutorBase
from .rank import CLOSE_WAIT_S, DistArgs, close_rank, open_local_rank, serve_steps
from .step_channel import StepChannel, StepMessage, channel_name

__all__ = ["RankGroup", "rank_env"]

log = logging.getLogger("phalanx.engine")
T = TypeVar("T")

_ids = itertools.count(1)


# the step loops are tasks of the engine's whole life: no deadline of their own (each
# step has one, in the channel)
_LOOP_TIMEOUT_S = 10.0 ** 9


@dataclass(frozen=True)
class _OnRank0:
    """A call on rank 0 alone (the disk tier's lookup): its error is the caller's."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]


_Job = tuple[_OnRank0, concurrent.futures.Future[Any]]


def rank_env() -> dict[str, str]:
    """The environment an engine's rank processes get on top of the parent's.

    One malloc arena: a rank's steps run on whichever of its serving threads read the
    task, and with an arena per thread the memory one step freed (a layer's K/V gather,
    its scores, its activations: megabytes per layer) sat in another thread's arena, so
    the next step faulted fresh pages in for all of it (~1,100 faults, ~3 us each here,
    per 128-token step; ``index_select`` of 1 MiB at 1.2-2 ms instead of 0.1). Only one
    thread computes at a time, so the shared arena's lock costs nothing. A value the
    user set is kept.
    """
    return {} if "MALLOC_ARENA_MAX" in os.environ else {"MALLOC_ARENA_MAX": "1"}


def _local_store(timeout: float) -> Any:
    """A torch.distributed ``TCPStore`` on loopback, on a free port (the group's ranks
    connect to it as clients). Not the libuv server: its first store in a process leaves
    a pipe pair open in it for good (torch 2.13), and the parent outlives many engines."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True,  # type: ignore[attr-defined]
                         timedelta(seconds=timeout), wait_for_workers=False, use_libuv=False)


class RankGroup(ExecutorBase):
    """The TP ranks: one long-lived run holds the domain, the runners and their step
    loops; steps go through the step channel.

    :meth:`execute` writes one encoded plan into the channel and returns rank 0's
    encoded result. A failure (a dead rank, a failed step) is raised to the caller and
    makes the group dead: its run ends and :meth:`close` releases everything.

    ``devices``: each rank's device and the communicator (engine/worker/devices.py); None: on
    CPU over the shared-memory domain.
    """

    def __init__(self, model_dir: str, tp: int, runner_kwargs: dict[str, Any], *,
                 step_timeout: float, start_timeout: float, seed: int,
                 disk_staging: bool = False, devices: DevicePlan | None = None) -> None:
        self.devices = devices or DevicePlan(("cpu",) * tp, "solo" if tp == 1 else "shm")
        if len(self.devices.devices) != tp:
            raise EngineError(f"a device plan for {len(self.devices.devices)} ranks given "
                              f"to {tp} ranks")
        self._start_timeout = start_timeout
        # the local torch.distributed group's store (its keys under this group's prefix)
        self._store: Any = _local_store(start_timeout) if self.devices.dist else None
        self.runner_id = f"engine_{next(_ids)}"
        self._step_timeout = step_timeout
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._opened: concurrent.futures.Future[list[RankMemory]] = (
            concurrent.futures.Future())
        # Jobs are queued and the queue is drained under this lock, and once the serving
        # run has stopped taking jobs (_refusing) a submission fails at once: a job
        # queued after the drain would otherwise wait out the backstop (issue 34).
        self._jobs_lock = threading.Lock()
        self._refusing: BaseException | None = None
        self._channel: StepChannel | None = None
        self._loops: list[Any] = []
        # held by a step in flight: the channel is unmapped only when none is
        self._step_lock = threading.Lock()
        super().__init__(tp, Worker(ranks=tp, task_timeout=step_timeout,
                                    start_timeout=start_timeout, env=rank_env()))
        try:
            self._handle = self.worker.submit(self._serve, model_dir, runner_kwargs, seed,
                                              disk_staging)
            self.memory = self._opened.result(timeout=start_timeout)
        except BaseException:
            self._jobs.put(None)
            self.worker.close()
            self._store = None
            raise

    def _dist_args(self, rank: int) -> DistArgs | None:
        if self._store is None:
            return None
        return (int(self._store.port), f"phx/tp/{self.runner_id}", rank, self.tp,
                self._start_timeout, self.devices.comm)

    def _serve(self, o: Any, model_dir: str, kwargs: dict[str, Any], seed: int,
               disk_staging: bool) -> None:
        domain = None
        opened = False
        try:
            if self.devices.comm == "shm":
                domain = o.allocate_domain(f"{self.runner_id}_tp", ranks=list(o.ranks),
                                           window_size=TP_WINDOW)
            futs = [o.submit(r, open_local_rank, self.runner_id, model_dir, domain,
                             {**kwargs, "device": self.devices.devices[r]}, seed,
                             disk_staging, self._dist_args(r)) for r in o.ranks]
            mem = [f.result() for f in futs]
            opened = True
            self._start_loops(o)
            self._opened.set_result(mem)
            while True:
                job = self._jobs.get()
                if job is None:
                    break
                what, fut = job
                try:
                    fut.set_result(o.submit(0, what.fn, *what.args).result())
                except Exception as exc:  # noqa: BLE001  handed to the caller
                    fut.set_exception(exc)
        except BaseException as exc:
            self.dead = self.dead or exc
            if not self._opened.done():
                self._opened.set_exception(exc)
            raise
        finally:  # what is queued fails now, and what comes later at once
            self._stop_taking(self.dead or EngineDeadError("the engine's ranks were closed"))
            self._stop_loops()
            if opened:
                self._close_runners(o)
            if domain is not None:
                o.release_domain(domain)

    def _start_loops(self, o: Any) -> None:
        """The channel, and every rank's step loop on it; its name goes once every loop
        has mapped it."""
        tp = len(o.ranks)
        self._channel = StepChannel(channel_name(self.worker.generation, self.runner_id), tp)
        self._loops = [o.options(timeout=_LOOP_TIMEOUT_S).submit(
            r, serve_steps, self.runner_id, self._channel.name, tp) for r in o.ranks]
        self._channel.hello(self._start_timeout, self._check_ranks)

    def _stop_loops(self) -> None:
        """End the step loops (each answers STOP, or is gone) and drop the channel."""
        with self._jobs_lock:
            channel, self._channel = self._channel, None
        if channel is None:
            return
        # a step in flight sees the refusal at its next wait slice and ends
        if not self._step_lock.acquire(timeout=self._step_timeout):
            log.warning("engine: a step still runs after %g s; its channel stays mapped",
                        self._step_timeout)
            return
        try:
            channel.stop()
            for f in self._loops:
                if self.dead is None:
                    f.result()
                else:  # after a failure a loop may be gone with its rank: not awaited
                    f.exception(timeout=CLOSE_WAIT_S)
        except Exception as exc:  # noqa: BLE001  the close reports it; the runners still close
            log.warning("engine: a rank's step loop ended with %r", exc)
            self.dead = self.dead or exc
        finally:
            self._loops = []
            channel.close()
            self._step_lock.release()

    def _check_ranks(self) -> None:
        """Between a step's wait slices: every rank alive and its loop still running,
        and the group not closing."""
        if self._refusing is not None:
            raise self._refusing
        for r, f in enumerate(self._loops):  # a dead rank's loop fails saying how it died
            if f.done():
                raise EngineDeadError(f"engine: rank {r}'s step loop ended: "
                                      f"{f.exception() or 'without an error'}")
        lost = self.lost_ranks()
        if lost:
            raise EngineDeadError(f"engine: {lost}")

    def _close_runners(self, o: Any) -> None:
        # The runners map the domain's windows: they must be gone before the domain's
        # release (at this run's fence), on every rank still alive after a failure too.
        # After a rank died this run takes no new task: close through call_ranks then.
        leave = self.devices.dist
        if self.dead is None:
            for f in [o.submit(r, close_rank, self.runner_id, leave) for r in o.ranks]:
                f.result()
            return
        alive = self.worker.alive_ranks()
        outcomes = self.worker.call_ranks(alive, close_rank, self.runner_id, leave,
                                          timeout=CLOSE_WAIT_S + 10)
        for rank, out in outcomes.items():
            if out.error is not None:
                log.warning("engine: closing the runner on rank %d after a failure: %r",
                            rank, out.error)

    def _stop_taking(self, exc: BaseException) -> None:
        """From now on a submission fails with ``exc`` (the first reason given stays);
        what is queued fails with it now."""
        with self._jobs_lock:
            self._refuse(exc)
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    return
                if job is not None:
                    job[1].set_exception(self._refusing)

    def _raise_if_refused(self) -> None:
        """Under ``_jobs_lock``: raise why the group takes no more work, if it does not."""
        refused = self.dead or self._refusing
        if refused is not None:
            raise refused

    def _refuse(self, exc: BaseException) -> None:
        """Under ``_jobs_lock``: later submissions fail with ``exc`` (the first reason
        given stays)."""
        if self._refusing is None:
            self._refusing = exc

    def execute(self, plan: bytes, loads: object | None = None) -> bytes:
        """Run one encoded plan on every rank (``loads``: its disk loads); rank 0's
        encoded result. Through the step channel, on the caller's thread."""
        with self._quiet.call():
            with self._jobs_lock:
                self._raise_if_refused()
                channel = self._channel
            if channel is None:
                raise EngineDeadError("the engine's ranks were closed")
            disk = cast(Any, loads)
            with self._step_lock:
                try:
                    return channel.step(StepMessage(plan, disk), self._step_timeout,
                                        self._check_ranks)
                except BaseException as exc:
                    self.dead = self.dead or exc
                    raise

    def on_rank0(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` as a task on rank 0, through the run that holds the ranks (no
        run of its own to start): the disk tier's lookups."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._quiet.call():
            with self._jobs_lock:
                self._raise_if_refused()
                self._jobs.put((_OnRank0(fn, args), fut))
            # the task carries the step deadline; this one only backs it up
            return cast(T, fut.result(timeout=self._step_timeout * 2 + 30))

    def on_each_rank(self, fn: Callable[..., T], *args: Any, timeout: float
                     ) -> dict[int, T | BaseException]:
        """``fn(*args)`` on every rank at once, in a run of its own beside the serving
        run; a rank that failed or did not answer within ``timeout`` gives its error."""
        out: dict[int, T | BaseException] = {}
        handle = self.worker.submit(_each_rank, fn, args, timeout, out)
        handle.wait(timeout + _SETTLE_S)
        return dict(out)

    def parent_uncertain(self) -> int:
        stats = self.worker.stats()
        return len(stats.extra.get("parent_resources", {}).get("uncertain", []))

    def close(self, timeout: float = 60.0) -> None:
        with self._jobs_lock:  # what is queued runs first; nothing is queued after
            self._refuse(EngineDeadError("the engine's ranks were closed"))
            self._jobs.put(None)
        try:
            self._handle.wait(timeout)
        finally:
            self.worker.close()
            self._store = None  # every rank is gone: the store's server stops with it


_SETTLE_S = 5.0  # a run whose tasks all have deadlines settles this soon after them


def _each_rank(o: Any, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float,
               out: dict[int, Any]) -> None:
    futs = {r: o.options(timeout=timeout).submit(r, fn, *args) for r in o.ranks}
    for r, f in futs.items():
        exc = f.exception()  # a rank that does not answer is left out, the rest reported
        out[r] = f.result() if exc is None else exc
