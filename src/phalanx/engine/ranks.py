"""The TP ranks of one engine: a Worker whose one long-lived run holds the TP domain and
every rank's runner, and serves one step plan at a time.

On CPU the ranks reduce over phalanx's shared-memory domain. On CUDA (engine/devices.py)
they form a torch.distributed group instead (NCCL, or gloo where named), on a
``TCPStore`` the group holds in the parent: the same ``join_group`` and
``TorchDistComm`` as the multi-host path, on loopback.

The rank-side functions are module-level so tasks ship them by reference.
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
from typing import Any, Protocol, TypeVar, cast

from ._errors import EngineDeadError, EngineError
from .devices import DevicePlan
from .quiet import QuietGate

__all__ = ["RankGroup", "TPRanks"]

log = logging.getLogger("phalanx.engine")
T = TypeVar("T")

TP_WINDOW = 4 << 20  # per-rank staging window of a TP domain (one host's, or a host's part)


# -- the rank side (module-level: tasks are shipped by reference) -------------------------

# a rank's place in the local torch.distributed group: (store port, key prefix, rank,
# world, timeout, backend)
_DistArgs = tuple[int, str, int, int, float, str]


def _rank_open(runner_id: str, model_dir: str, view: Any, kwargs: dict[str, Any],
               seed: int, staging: bool, dist: _DistArgs | None = None) -> dict[str, Any]:
    import torch

    from .runner import open_runner
    from .staging import rank_staging
    from .tp import DomainComm, SoloComm, TPComm

    torch.manual_seed(seed)
    comm: TPComm
    if dist is not None:
        comm = _join_local_group(str(kwargs.get("device", "cpu")), *dist)
    else:
        comm = DomainComm(view) if view is not None else SoloComm()
    try:
        runner = open_runner(runner_id, model_dir, comm, **kwargs)
    except BaseException:
        if dist is not None:
            from phalanx.hosts.dist import destroy

            destroy()
        raise
    if staging:
        # the disk tier's pages pass through this rank's staging (see engine.staging)
        runner.tier = rank_staging(runner.geometry())
    return runner.memory()


def _join_local_group(device: str, port: int, prefix: str, rank: int, world: int,
                      timeout: float, backend: str) -> Any:
    """This rank's TorchDistComm in the group of the engine's local ranks (loopback)."""
    import torch

    from phalanx.hosts.dist import join_group

    from .tp import TorchDistComm

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))  # NCCL's communicator takes this GPU
    group = join_group("127.0.0.1", port, prefix, rank, world, timeout, backend=backend,
                       node_addr="127.0.0.1")
    return TorchDistComm(group, device)


# A rank's runner is used by one step at a time; closing it waits for the step in
# progress (after a peer died, rank 0's step ends at its next barrier) so the runner's
# views of the TP domain's windows are gone before the domain is released.
_EXEC_LOCK = threading.Lock()
_CLOSE_WAIT_S = 60.0


def _rank_execute(runner_id: str, plan: bytes, disk: Any = None) -> bytes | None:
    """One step on this rank. ``disk`` (a ``disk_tier.DiskLoads`` or None): the pages
    this step's ``PageLoad``s read from the disk tier, with rank 0's leases; this rank
    reads its own shard of them straight from its store while executing the plan. A
    read that fails on any rank is no error: every rank skips the forward and rank 0's
    result says why (``StepResult.load_failures``); the leases are released either way."""
    from .plan import decode_plan, encode_result
    from .runner import get_runner

    failed: str | None = None
    with _EXEC_LOCK:
        runner = get_runner(runner_id)
        rank = runner.comm.rank
        try:
            if disk is not None:
                from .staging import expect_loads

                expect_loads(runner.tier, disk)
            result = runner.execute(decode_plan(plan))
            if disk is not None and rank == 0:
                # every rank is past its loads: the all-gather that agreed on them (and the
                # forward's collectives, if it ran) came after them
                from .disk_tier import release_leases

                release_leases(disk.cache_id, disk.leases())
        except Exception as exc:  # noqa: BLE001  re-raised below, without its frames
            # the traceback's frames hold tensors over the domain's windows: keep only
            # the message, so nothing maps the windows once the step is over
            failed = f"{type(exc).__name__}: {exc}"
    if failed is not None:
        raise EngineError(f"rank {rank}: step failed: {failed}")
    return encode_result(result) if rank == 0 else None


def _rank_close(runner_id: str, leave_group: bool = False) -> None:
    """Close this rank's runner; ``leave_group``: then leave its torch.distributed group."""
    import gc

    from .runner import close_runner

    if not _EXEC_LOCK.acquire(timeout=_CLOSE_WAIT_S):
        raise EngineError(f"runner {runner_id}: a step still runs after {_CLOSE_WAIT_S:g}s; "
                          "cannot close it")
    try:
        close_runner(runner_id)
    finally:
        _EXEC_LOCK.release()
        if leave_group:
            from phalanx.hosts.dist import destroy

            destroy()
    gc.collect()   # frames of a failed step may sit in reference cycles


# -- the parent side ------------------------------------------------------------------

_ids = itertools.count(1)
@dataclass(frozen=True)
class _Step:
    """One encoded step plan for every rank, with its disk loads."""

    plan: bytes
    disk: Any


@dataclass(frozen=True)
class _OnRank0:
    """A call on rank 0 alone (the disk tier's lookup): its error is the caller's."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]


_Job = tuple[_Step | _OnRank0, concurrent.futures.Future[Any]]


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
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True,  # type: ignore[attr-defined]
                         timedelta(seconds=timeout), wait_for_workers=False, use_libuv=False)


class TPRanks(Protocol):
    """What the engine and its disk tier use of their ranks: :class:`RankGroup` on one
    host, :class:`~phalanx.engine.host_ranks.HostRankGroup` across hosts."""

    tp: int
    memory: list[dict[str, Any]]
    dead: BaseException | None

    @property
    def worker(self) -> Any: ...

    def execute(self, plan: bytes, disk: Any = None) -> bytes: ...

    def on_rank0(self, fn: Callable[..., T], *args: Any) -> T: ...

    def wait_quiet(self, gap: float, timeout: float) -> bool: ...

    def lost_ranks(self) -> str | None: ...

    def close(self, timeout: float = 60.0) -> None: ...


class RankGroup:
    """The TP ranks: one long-lived run holds the domain and the runners, serving steps.

    :meth:`execute` hands one encoded plan to the run's thread, which submits it to every
    rank and returns rank 0's encoded result. A failure (a dead rank, a failed task) is
    raised to the caller and ends the run: the group is then dead.

    ``devices``: each rank's device and the communicator (engine/devices.py); None: on
    CPU over the shared-memory domain.
    """

    def __init__(self, model_dir: str, tp: int, runner_kwargs: dict[str, Any], *,
                 step_timeout: float, start_timeout: float, seed: int,
                 staging: bool = False, devices: DevicePlan | None = None) -> None:
        from phalanx.comm import Worker

        self.tp = tp
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
        self._opened: concurrent.futures.Future[list[dict[str, Any]]] = (
            concurrent.futures.Future())
        self.dead: BaseException | None = None
        # Jobs are queued and the queue is drained under this lock, and once the serving
        # run has stopped taking jobs (_refusing) a submission fails at once: a job
        # queued after the drain would otherwise wait out the backstop (issue 34).
        self._jobs_lock = threading.Lock()
        self._refusing: BaseException | None = None
        # the parent's calls in progress: background work (the disk tier's stores and
        # maintenance) waits for a quiet moment (wait_quiet)
        self._quiet = QuietGate()
        self.worker = Worker(ranks=tp, task_timeout=step_timeout, start_timeout=start_timeout,
                             env=rank_env())
        try:
            self._handle = self.worker.submit(self._serve, model_dir, runner_kwargs, seed,
                                              staging)
            self.memory = self._opened.result(timeout=start_timeout)
        except BaseException:
            self._jobs.put(None)
            self.worker.close()
            self._store = None
            raise

    def _dist_args(self, rank: int) -> _DistArgs | None:
        if self._store is None:
            return None
        return (int(self._store.port), f"phx/tp/{self.runner_id}", rank, self.tp,
                self._start_timeout, self.devices.comm)

    def _serve(self, o: Any, model_dir: str, kwargs: dict[str, Any], seed: int,
               staging: bool) -> None:
        domain = None
        opened = False
        try:
            if self.devices.comm == "shm":
                domain = o.allocate_domain(f"{self.runner_id}_tp", ranks=list(o.ranks),
                                           window_size=TP_WINDOW)
            futs = [o.submit(r, _rank_open, self.runner_id, model_dir, domain,
                             {**kwargs, "device": self.devices.devices[r]}, seed, staging,
                             self._dist_args(r)) for r in o.ranks]
            mem = [f.result() for f in futs]
            opened = True
            self._opened.set_result(mem)
            while True:
                job = self._jobs.get()
                if job is None:
                    break
                what, fut = job
                if isinstance(what, _OnRank0):
                    try:
                        fut.set_result(o.submit(0, what.fn, *what.args).result())
                    except Exception as exc:  # noqa: BLE001  handed to the caller
                        fut.set_exception(exc)
                    continue
                try:
                    outs = [o.submit(r, _rank_execute, self.runner_id, what.plan, what.disk)
                            for r in o.ranks]
                    first = outs[0].result()
                    for f in outs[1:]:
                        f.result()
                except BaseException as exc:
                    self.dead = exc
                    fut.set_exception(exc)
                    raise
                fut.set_result(first)
        except BaseException as exc:
            self.dead = self.dead or exc
            if not self._opened.done():
                self._opened.set_exception(exc)
            raise
        finally:  # what is queued fails now, and what comes later at once
            self._stop_taking(self.dead or EngineDeadError("the engine's ranks were closed"))
            if opened:
                self._close_runners(o)
            if domain is not None:
                o.release_domain(domain)

    def _close_runners(self, o: Any) -> None:
        # The runners map the domain's windows: they must be gone before the domain's
        # release (at this run's fence), on every rank still alive after a failure too.
        # After a rank died this run takes no new task: close through call_ranks then.
        leave = self.devices.dist
        if self.dead is None:
            for f in [o.submit(r, _rank_close, self.runner_id, leave) for r in o.ranks]:
                f.result()
            return
        alive = self.worker.alive_ranks()
        outcomes = self.worker.call_ranks(alive, _rank_close, self.runner_id, leave,
                                          timeout=_CLOSE_WAIT_S + 10)
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

    def _refuse(self, exc: BaseException) -> None:
        """Under ``_jobs_lock``: later submissions fail with ``exc`` (the first reason
        given stays)."""
        if self._refusing is None:
            self._refusing = exc

    def execute(self, plan: bytes, disk: Any = None) -> bytes:
        """Run one encoded plan on every rank (``disk``: its disk loads); rank 0's
        encoded result."""
        return bytes(self._submit(_Step(plan, disk)))

    def on_rank0(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` as a task on rank 0, through the run that serves the steps (no
        run of its own to start): the disk tier's lookups."""
        return cast(T, self._submit(_OnRank0(fn, args)))

    def _submit(self, what: _Step | _OnRank0) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._quiet.call():
            with self._jobs_lock:
                refused = self.dead or self._refusing
                if refused is not None:
                    raise refused
                self._jobs.put((what, fut))
            # the tasks carry the step deadline; this one only backs it up
            return fut.result(timeout=self._step_timeout * 2 + 30)

    def lost_ranks(self) -> str | None:
        """A sentence naming the ranks that are gone, or None while all live."""
        lost = sorted(set(range(self.tp)) - set(self.worker.alive_ranks()))
        return f"rank(s) {lost} of {self.tp} died" if lost else None

    def wait_quiet(self, gap: float, timeout: float) -> bool:
        """Wait until no step or lookup has run for ``gap`` seconds (True), or at most
        ``timeout`` (False): the disk tier's background work yields to requests so
        that a store does not take a core from the next request's step."""
        return self._quiet.wait(gap, timeout)

    def close(self, timeout: float = 60.0) -> None:
        with self._jobs_lock:  # what is queued runs first; nothing is queued after
            self._refuse(EngineDeadError("the engine's ranks were closed"))
            self._jobs.put(None)
        try:
            self._handle.wait(timeout)
        finally:
            self.worker.close()
            self._store = None  # every rank is gone: the store's server stops with it
