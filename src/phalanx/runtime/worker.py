"""The Worker: starts and supervises rank processes and runs orchestration functions.

Lifecycle (``WorkerState``) and the contracts it keeps (docs/architecture.md, "Contracts"):
a failed task fails its run, never the worker; a failed cleanup or a dead rank poisons
the worker (runs are refused with the reason; ``close()`` is still possible); ``close()``
is idempotent, bounded, and retries only what its cleanup journal still owes.

A lost rank fails what depends on it at once: a rank that died (EOF, or an exit found
when a task fails) or hung (stopped by a signal once a task deadline passed) fails every
outstanding task of every live run, on every rank, and every part of a ``call_ranks``
call that includes it (outstanding.py decides which); the caller learns at once and
close() stops the ranks that still run those tasks. Layers above use the public seams
``call_ranks``, ``alive_ranks`` and ``add_close_step``.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from phalanx.lifecycle import CleanupError, CleanupJournal, failpoints
from phalanx.lifecycle.failpoints import Failpoint
from phalanx.lifecycle.journal import close_on_exit
from phalanx.rendezvous import (
    BACKENDS,
    Generation,
    HubCoordinator,
    SweepReport,
    default_runtime_dir,
    ensure_private_dir,
    handshake,
    sweep,
)
from phalanx.rendezvous.sweep import DEFAULT_LEASE_EXPIRY_S

from ._errors import (
    RankDiedError,
    RankStartError,
    RemoteTaskError,
    RunSlotTimeoutError,
    RunsStuckError,
    TaskTimeoutError,
    WorkerClosedError,
    WorkerPoisonedError,
)
from .channel import DEFAULT_MAX_MESSAGE_BYTES, Kind, check_size, encode
from .codec import decode_error, encode_task
from .hub import Hub
from .losses import Losses
from .outstanding import Outstanding
from .rank_calls import arm_in_ranks, close_services_here
from .rank_process import RankProcess, shutdown
from .run import Orchestrator, Run, RunHandle, RunState
from .sending import Sender, SendTimeoutError
from .state import WorkerState
from .stats import WorkerStats
from .tasks import Outcome, TaskFuture

__all__ = ["Worker", "WorkerState"]

log = logging.getLogger("phalanx.runtime")

_RUN_ADMITTED = Failpoint("worker.run.admitted", "the parent admitted a run, before its thread")
_RANKS_SPAWNED = Failpoint("worker.start.ranks_spawned", "rank processes exist, not yet ready")
_RANKS_STOPPING = Failpoint("worker.close.stop_ranks", "close() is about to stop the ranks")

_KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the kernel to reap
# At close, how long a rank running a task nobody waits for any more (past its deadline,
# or abandoned after a rank died or hung) may take to finish it before it is killed.
_ABANDONED_GRACE_S = 1.0
_SERVICES_CLOSE_S = 10.0  # the close step that closes each rank's services, at most
_MIN_CLOSE_CALL_S = 1.0  # a call made by a close step gets at least this long


class Worker:
    """Starts ``ranks`` rank processes and runs orchestration functions over them.

    >>> with Worker(ranks=2) as w:
    ...     w.run(lambda o: [f.result() for f in (o.submit(r, abs, -r) for r in o.ranks)])
    [0, 1]
    """

    #: The ``o`` orch functions receive; layers above extend it (comm adds domains).
    orchestrator_class: type[Orchestrator] = Orchestrator

    def __init__(
        self,
        ranks: int,
        *,
        start_timeout: float = 60.0,
        task_timeout: float = 600.0,
        close_timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        rank_threads: int = 8,
        max_concurrent_runs: int = 64,
        failpoints: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        rendezvous: str = "hub",
        runtime_dir: str | os.PathLike[str] | None = None,
        lease_expiry_s: float = DEFAULT_LEASE_EXPIRY_S,
        job_token: str | None = None,
        store_host: str = "127.0.0.1",
        rank_scheduler: str = "batch",
    ) -> None:
        if ranks < 1:
            raise ValueError(f"Worker(ranks={ranks}): need at least one rank")
        if rank_scheduler not in ("batch", "other"):
            raise ValueError(f"Worker(rank_scheduler={rank_scheduler!r}): 'batch' or 'other'")
        self._rank_scheduler = rank_scheduler
        if rendezvous not in BACKENDS:
            raise ValueError(f"Worker(rendezvous={rendezvous!r}): choose one of {BACKENDS}")
        self.rendezvous = rendezvous
        self.runtime_dir = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
        self._lease_expiry_s = lease_expiry_s
        self._job_token = job_token or secrets.token_hex(16)
        self._store_host = store_host
        self._generation: Generation | None = None
        self._spec: dict[str, Any] = {}
        self._coordinator = HubCoordinator()
        self._next_heartbeat = 0.0
        self.sweep_report: SweepReport | None = None
        self.ranks: tuple[int, ...] = tuple(range(ranks))
        self.task_timeout = task_timeout
        self.close_timeout = close_timeout
        self.max_message_bytes = max_message_bytes
        self._started_at = time.monotonic()
        self._state = WorkerState.STARTING
        self._poison: str | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._run_ids = itertools.count(1)
        self._outstanding = Outstanding()  # tasks still running, ranks lost
        self._runs: dict[int, Run] = {}  # admitted, not yet retired
        self._run_slots = threading.BoundedSemaphore(max_concurrent_runs)
        self._call_ids = itertools.count(1)
        self._close_prepared = False
        self._procs: dict[int, RankProcess] = {}
        self._losses = Losses(self._procs, self._outstanding, lambda: self._state,
                              self._first_loss, self._task_failed)
        self._ready: set[int] = set()  # ranks that said READY: only they can stop gracefully
        self._sender = Sender(lambda r: self._outstanding.lost(r) is not None,
                              self._send_timed_out)
        self._counts = dict.fromkeys(
            ("runs_admitted", "runs_retired", "runs_failed", "tasks_submitted",
             "tasks_succeeded", "tasks_failed"), 0)
        self.generation = ""
        self._journal = CleanupJournal("worker")
        try:
            self._start(start_timeout, rank_threads, dict(failpoints or {}), dict(env or {}))
        except BaseException as exc:
            try:
                self._journal.run()
            except CleanupError as cleanup:
                exc.add_note(f"and rolling back the start failed too: {cleanup!r}")
            self._state = WorkerState.CLOSED
            raise

    # -- start-up ---------------------------------------------------------------------
    def _start(self, timeout: float, threads: int, fps: dict[str, str],
               env: dict[str, str]) -> None:
        deadline = time.monotonic() + timeout
        failpoints.check(fps)  # a typo fails here, by name, not as ranks that never start
        ensure_private_dir(self.runtime_dir)
        self.sweep_report = sweep(self.runtime_dir, self._lease_expiry_s)
        self._hub = Hub(self._on_frame, self._losses.lost, self._on_stderr, self.max_message_bytes,
                        on_tick=self._on_tick)
        self._hub.start()
        self._journal.add("stop the hub thread", self._hub.stop)
        self._journal.add("join run threads", self._join_runs)
        self._journal.add("remove the generation directory", self._remove_generation)
        self._journal.add("stop rank processes", self._stop_ranks)
        self._journal.add("close every live rank's services", self._close_rank_services)
        for r in self.ranks:
            proc = RankProcess(r, max_message_bytes=self.max_message_bytes,
                               failpoints=fps, env=env, scheduler=self._rank_scheduler)
            self._procs[r] = proc
            self._sender.add(r, proc.sock.send, proc.sock.fileno())
            self._hub.add(r, proc.sock, proc.proc.stderr, proc.pidfd)
        _RANKS_SPAWNED.hit()
        hellos = {r: self._procs[r].await_startup(Kind.HELLO, deadline) for r in self.ranks}
        token = hellos[0][2]
        self.generation = token
        self._generation = Generation.create(self.runtime_dir, token)
        spec = self._spec = self._rendezvous_spec(token)
        # The store backend's server lives in rank 0: it must exist (and say its port)
        # before the others join. The other backends start every rank at once.
        first = [0] if self.rendezvous == "store" else list(self.ranks)
        for group in (first, [r for r in self.ranks if r not in first]):
            init = pickle.dumps({"sys_path": list(sys.path), "world_size": len(self.ranks),
                                 "generation": token, "threads": threads, "rendezvous": spec,
                                 "job_token": self._job_token})
            for r in group:
                self._send(r, Kind.INIT, 0, init, deadline)
            for r in group:
                ready = self._procs[r].await_startup(Kind.READY, deadline)
                self._ready.add(r)
                if r == 0 and ready["store_port"] is not None:
                    spec["port"] = ready["store_port"]
        self._state = WorkerState.RUNNING
        # The base start-up handshake: every rank meets every other through the backend.
        left = max(1.0, deadline - time.monotonic())
        outcomes = self.call_ranks(list(self.ranks), handshake, "start", 0, list(self.ranks),
                                   left, timeout=left + 5)
        failed = {r: o.error for r, o in outcomes.items() if o.error is not None}
        if failed:
            raise RankStartError(f"the start-up handshake failed on ranks {sorted(failed)}: "
                                 f"{failed[min(failed)]}") from failed[min(failed)]
        log.info("worker %s: %d ranks ready in %.0f ms", token, len(self.ranks),
                 (time.monotonic() - self._started_at) * 1e3)

    def _rendezvous_spec(self, token: str) -> dict[str, Any]:
        if self.rendezvous == "marker":
            assert self._generation is not None
            return {"kind": "marker", "dir": str(self._generation.path)}
        if self.rendezvous == "store":
            return {"kind": "store", "host": self._store_host, "port": 0,
                    "token": self._job_token, "generation": token}
        return {"kind": "hub"}

    def _remove_generation(self) -> None:
        if self._generation is not None:
            self._generation.remove()

    def _on_tick(self) -> None:
        self._losses.check_hung(expired_only=True)  # when nobody waits on the expired task
        now = time.monotonic()
        for rank, rid, missing in self._coordinator.expire(now):
            self._reply_rdv(rank, rid, missing)
        if self._generation is not None and now >= self._next_heartbeat:
            self._next_heartbeat = now + min(30.0, self._lease_expiry_s / 10)
            try:
                self._generation.heartbeat()
            except OSError as err:
                log.warning("worker %s: lease heartbeat of %s failed: %s", self.generation,
                            self._generation.owner_path, err)

    def _reply_rdv(self, rank: int, request_id: int, missing: list[int] | None) -> None:
        # Often on the hub thread, which must never wait on a rank that does not read.
        try:
            self._sender.send_from_hub(rank, encode(Kind.RDV_REPLY, request_id,
                                                    pickle.dumps(missing)))
        except OSError:
            pass  # that rank is gone; its EOF is handled on its own

    # -- hub callbacks (hub thread) ---------------------------------------------------
    def _on_frame(self, rank: int, kind: Kind, msg_id: int, payload: bytes) -> None:
        if kind in (Kind.RESULT_OK, Kind.RESULT_ERR):
            if kind is Kind.RESULT_ERR:
                # A peer's death often fails a task (a barrier notices it) before the
                # dead rank's EOF is read: handle the death first, while this task is
                # still outstanding, so the run fails with the death, not the symptom.
                self._losses.notice_exits()
            fut = self._outstanding.pop(msg_id)
            if fut is None:
                log.error("rank %d: reply for unknown task id %d", rank, msg_id)
                return
            if kind is Kind.RESULT_OK:
                try:
                    value = pickle.loads(payload)
                except Exception as exc:  # noqa: BLE001  a result type the parent cannot import
                    fut.set_exception(RemoteTaskError(type(exc).__name__,
                                                      f"could not unpickle the result: {exc}"))
                else:
                    fut.set_result(value)
                    if not fut.control:
                        self._count("tasks_succeeded")
                    return
            else:
                fut.set_exception(decode_error(rank, fut.name, fut.task_id, payload))
            if not fut.control:
                self._count("tasks_failed")
        elif kind is Kind.RDV:
            op, alloc_id, tag, participants, who, timeout = pickle.loads(payload)
            for r, rid, missing in self._coordinator.request(msg_id, op, alloc_id, tag,
                                                             participants, who, timeout):
                self._reply_rdv(r, rid, missing)
        else:
            self._procs[rank].startup.put((kind, payload))

    def _first_loss(self, rank: int, err: RankDiedError, closing: bool) -> None:
        with self._lock:
            if not closing and self._state is not WorkerState.STARTING \
                    and self._poison is None:
                self._poison = str(err).partition(". stderr tail")[0]
        for r, rid, missing in self._coordinator.abort_rank(rank):
            self._reply_rdv(r, rid, missing)
        if not closing and self._state is WorkerState.RUNNING:
            log.error("%s", err)

    def _task_failed(self, fut: TaskFuture) -> None:
        if not fut.control:
            self._count("tasks_failed")

    def _on_stderr(self, rank: int, text: str) -> None:
        self._procs[rank].remember_stderr(text)

    # -- runs -------------------------------------------------------------------------
    def _check_admitting(self) -> None:
        if self._state is not WorkerState.RUNNING:
            raise WorkerClosedError(f"worker {self.generation} is {self._state.value}: no new runs")
        if self._poison is not None:
            raise WorkerPoisonedError(
                f"worker {self.generation} is poisoned: {self._poison}. It admits no new runs; "
                f"only close() is left"
            )

    def _admit(self, orch_fn: Callable[..., Any]) -> Run:
        with self._lock:
            self._check_admitting()
        if not self._run_slots.acquire(timeout=self.task_timeout):
            raise RunSlotTimeoutError(f"worker {self.generation}: no run slot freed within "
                               f"{self.task_timeout}s (max_concurrent_runs reached)")
        run = Run(next(self._run_ids), getattr(orch_fn, "__qualname__", repr(orch_fn)), self)
        with self._lock:
            try:
                self._check_admitting()
                _RUN_ADMITTED.hit()
            except BaseException:
                self._run_slots.release()
                raise
            self._runs[run.run_id] = run
            self._counts["runs_admitted"] += 1
        return run

    def submit(self, orch_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> RunHandle:
        """Start ``orch_fn(orch, *args, **kwargs)`` on a run thread; returns its handle."""
        run = self._admit(orch_fn)
        threading.Thread(
            target=run.execute, args=(orch_fn, args, kwargs, self.orchestrator_class(run)),
            name=f"phalanx-run-{run.run_id}", daemon=True,
        ).start()
        return RunHandle(run)

    def run(self, orch_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``orch_fn(orch, *args, **kwargs)`` to its fence and return its value.

        The same as ``submit(...).result()``, executed in the calling thread: the caller
        would block anyway, and it saves a thread start and a wake-up per run.
        """
        run = self._admit(orch_fn)
        run.execute(orch_fn, args, kwargs, self.orchestrator_class(run), wait_fence=False)
        return RunHandle(run).result()

    def _run_retired(self, run: Run) -> None:
        with self._lock:
            self._counts["runs_retired"] += 1
            if run.error is not None:
                self._counts["runs_failed"] += 1
            if run.cleanup_error is not None and self._poison is None:
                self._poison = f"cleanup of run {run.run_id} failed: {run.cleanup_error!r}"
            self._runs.pop(run.run_id, None)
        self._run_slots.release()

    # -- seams for the layers above (comm, replication) -----------------------------
    def call_ranks(self, ranks: Sequence[int], fn: Callable[..., Any], *args: Any,
                   timeout: float | None = None, **kwargs: Any) -> dict[int, Outcome]:
        """Run ``fn(*args, **kwargs)`` on each of ``ranks`` outside any run and wait for
        every rank's :class:`Outcome` (its value, or the exception it raised).

        For runtime-internal steps of the layers above: physical releases at a fence,
        close steps, one-off calls. ``timeout`` (default ``task_timeout``) bounds each
        rank's part; while the worker closes it is cut to what the close deadline leaves
        (at least ``_MIN_CLOSE_CALL_S``). A rank that dies or hangs fails every other
        rank's part of the call at once, with its RankDiedError; so does a rank lost
        before the call (then no part is sent). While the worker closes, a part for a
        lost rank fails alone and the others run (close steps free what they can).
        """
        closing = self._state in (WorkerState.CLOSING, WorkerState.CLOSED)
        if self._state is WorkerState.CLOSING:
            left = getattr(self, "_close_deadline", 0.0) - time.monotonic()
            cap = max(_MIN_CLOSE_CALL_S, left)
            timeout = cap if timeout is None else min(timeout, cap)
        group = next(self._call_ids)
        parts = {r: self._new_task(None, r, fn, args, kwargs, timeout, control=True,
                                   group=group) for r in ranks}
        # Admitted together: a rank lost already fails every part at once, unsent.
        refused = self._outstanding.admit_call([f for f, _ in parts.values()],
                                               spread=not closing)
        for f, err in refused:
            f.set_exception(err)
        unsent = {f.task_id for f, _ in refused}
        for f, payload in parts.values():
            if f.task_id not in unsent:
                self._dispatch(f, Kind.CONTROL, payload)
        futures = {r: f for r, (f, _) in parts.items()}
        out: dict[int, Outcome] = {}
        for r, f in futures.items():
            try:
                out[r] = Outcome(value=f.result())
            except Exception as exc:  # noqa: BLE001  returned per rank, the caller decides
                out[r] = Outcome(error=exc)
        return out

    def alive_ranks(self) -> list[int]:
        """Ranks that have neither died nor hung (close steps address only these)."""
        return self._outstanding.alive(self.ranks)

    def add_close_step(self, name: str, step: Callable[[], None]) -> None:
        """Add ``step`` to this worker's close journal. Steps run last-in first-out, so a
        step added after the worker started runs before the ranks are stopped (their
        control channels still work, see :meth:`call_ranks`); a failed step is reported in
        close()'s CleanupError and stays owed, and the next close() retries only it."""
        self._journal.add(name, step)

    def _submit_task(self, run: Run | None, rank: int, fn: Callable[..., Any],
                     args: tuple[Any, ...],
                     kwargs: dict[str, Any], timeout: float | None,
                     control: bool = False, group: int = 0) -> TaskFuture:
        fut, payload = self._new_task(run, rank, fn, args, kwargs, timeout, control, group)
        if run is not None:
            run.add_task(fut)
        dead = self._outstanding.admit(fut)
        if not control:
            self._count("tasks_submitted")
        if dead is not None:
            fut.set_exception(dead)
            return fut
        self._dispatch(fut, Kind.CONTROL if control else Kind.TASK, payload)
        return fut

    def _new_task(self, run: Run | None, rank: int, fn: Callable[..., Any],
                  args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None,
                  control: bool, group: int) -> tuple[TaskFuture, bytes]:
        if rank not in self._procs:
            raise ValueError(f"rank {rank} is not a rank of this worker (ranks {self.ranks})")
        name = getattr(fn, "__qualname__", type(fn).__name__)
        payload = encode_task(fn, args, kwargs)
        check_size(len(payload), self.max_message_bytes, f"task {name} for rank {rank}")
        fut = TaskFuture(rank, next(self._ids), name, 0 if run is None else run.run_id,
                         self.task_timeout if timeout is None else timeout, control, group,
                         self._losses.check_hung, None if run is None else run.task_finished)
        return fut, payload

    def _dispatch(self, fut: TaskFuture, kind: Kind, payload: bytes) -> None:
        """Send an admitted task by its deadline; if it cannot go, fail it, finished."""
        rank = fut.rank
        try:
            self._send(rank, kind, fut.task_id, payload, fut.deadline)
        except SendTimeoutError as err:
            # The rank did not read its channel by the task's deadline (or was lost
            # meanwhile): _send_timed_out applied the hung-rank rule already.
            self._outstanding.pop(fut.task_id)
            fut.set_exception(self._outstanding.lost(rank) or TaskTimeoutError(
                f"task {fut.name} (id {fut.task_id}) could not be sent to rank {rank} "
                f"(pid {self._procs[rank].pid}) within its {fut.timeout:g}s deadline: {err}"))
        except OSError as err:
            # The rank is gone. Its EOF handler may have failed the task already, or may
            # never run (close() unregisters stopped ranks): fail it here either way.
            self._outstanding.pop(fut.task_id)
            cause = self._outstanding.lost(rank)
            fut.set_exception(cause or RankDiedError(
                f"rank {rank} (pid {self._procs[rank].pid}): its control channel is closed "
                f"({err.strerror}); the rank is gone", rank, None, self._procs[rank].pid))

    def _send(self, rank: int, kind: Kind, msg_id: int, payload: bytes,
              deadline: float) -> None:
        """Send one frame by ``deadline`` (SendTimeoutError if not; never unbounded)."""
        self._sender.send(rank, encode(kind, msg_id, payload), deadline)

    def _send_timed_out(self, err: SendTimeoutError) -> None:
        """A send to a rank gave up: a stopped rank is hung (the rule's deadline passed);
        a frame that went out in part leaves a channel nothing can use again, so the rank
        is killed (its death is then handled as any other)."""
        proc = self._procs[err.rank]
        signo = proc.stop_signal()
        if signo is not None:
            self._losses.lost(err.rank, stop_signal=signo)
        if err.sent:
            log.error("rank %d (pid %d): %s; its control channel is torn: killing it",
                      err.rank, proc.pid, err)
            proc.kill()

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    # -- failpoints -------------------------------------------------------------------
    def arm_failpoint(self, name: str, spec: str = "raise", *, ranks: Any = "all") -> None:
        """Arm failpoint ``name`` in rank processes (``ranks``: "all", an int or a list)."""
        targets = self.ranks if ranks == "all" else ([ranks] if isinstance(ranks, int) else ranks)
        failpoints.parse_spec(spec)
        self.run(arm_in_ranks, list(targets), name, spec)

    def disarm_failpoints(self) -> None:
        self.run(arm_in_ranks, list(self.ranks), None, None)

    # -- stats ------------------------------------------------------------------------
    def stats(self) -> WorkerStats:
        with self._lock:
            alive = sum(1 for p in self._procs.values() if p.proc.poll() is None)
            return WorkerStats(
                ranks=len(self.ranks), ranks_alive=alive, state=self._state.value,
                poisoned=self._poison, runs_in_flight=len(self._runs),
                uptime_s=time.monotonic() - self._started_at, generation=self.generation,
                rendezvous=self.rendezvous,
                sweep_failures=len(self.sweep_report.failures) if self.sweep_report else 0,
                runs_admitted=self._counts["runs_admitted"],
                runs_retired=self._counts["runs_retired"],
                runs_failed=self._counts["runs_failed"],
                tasks_submitted=self._counts["tasks_submitted"],
                tasks_succeeded=self._counts["tasks_succeeded"],
                tasks_failed=self._counts["tasks_failed"],
                tasks_retained=sum(r.tasks_retained for r in self._runs.values()),
            )

    @property
    def job_token(self) -> str:
        """The secret peers of this job authenticate with (links, stores). Never log it."""
        return self._job_token

    @property
    def store_address(self) -> tuple[str, int] | None:
        """(host, port) of the job's TCP store when the store backend is in use."""
        port = self._spec.get("port") if self.rendezvous == "store" else None
        return (self._store_host, int(port)) if port else None

    @property
    def state(self) -> WorkerState:
        return self._state

    # -- close ------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Stop admitting runs, drain in-flight ones, release, stop and reap the ranks.

        Bounded by ``timeout`` (default ``close_timeout``). Every failure is reported in
        one CleanupError; a second call retries only the steps still owed.
        """
        with self._lock:
            if self._state is WorkerState.CLOSED:
                return
            self._state = WorkerState.CLOSING
        self._close_deadline = time.monotonic() + (self.close_timeout if timeout is None
                                                   else timeout)
        for run in list(self._runs.values()):
            # A run that settled with tasks still running (abandoned, or past their
            # deadline) cannot retire until its ranks stop: the first step sees to it.
            if run.settled.wait(self._close_left()) and run.state is RunState.ABANDONED:
                continue
            run.retired.wait(self._close_left())
        if not self._close_prepared:  # added last, so it runs first
            self._journal.add("stop ranks that run abandoned tasks", self._stop_abandoned)
            self._close_prepared = True
        self._journal.run()
        self._state = WorkerState.CLOSED

    def _close_left(self) -> float:
        deadline = getattr(self, "_close_deadline", time.monotonic() + self.close_timeout)
        return max(0.0, deadline - time.monotonic())

    def _stop_abandoned(self) -> None:
        """Close's first step: a rank still running a task whose outcome is decided (past
        its deadline, or abandoned because a rank it depends on died or hung), or a
        stopped rank, gets a short grace to finish; then it is killed and reaped. Such a
        task may be using the domains and services the next steps release, and nothing
        else would ever stop it; a stopped rank cannot even take a close step."""
        grace_end = time.monotonic() + min(_ABANDONED_GRACE_S, self._close_left())
        for f in self._outstanding.decided():
            f.wait_finished(max(0.0, grace_end - time.monotonic()))
        doomed = {f.rank for f in self._outstanding.decided()}
        doomed |= {r for r, p in self._procs.items()
                   if not self._outstanding.exited(r) and p.stop_signal() is not None}
        for r in sorted(doomed):
            log.warning("rank %d (pid %d) still runs abandoned tasks or is stopped at "
                        "close: killing it", r, self._procs[r].pid)
            self._procs[r].kill()
        self._reap(sorted(doomed))
        for run in list(self._runs.values()):
            if run.state is RunState.ABANDONED:
                run.retired.wait(self._close_left())  # its fence can pass now

    def _reap(self, ranks: list[int]) -> None:
        """Wait for killed ranks to exit, then fail and finish their outstanding tasks."""
        stuck = [self._procs[r].describe() for r in ranks
                 if self._procs[r].wait_exit(_KILL_WAIT_S) is None]
        for r in ranks:
            if self._procs[r].proc.poll() is not None:
                self._losses.lost(r, flush=False)
        if stuck:
            raise RankDiedError(f"could not reap {', '.join(stuck)} within {_KILL_WAIT_S:g}s "
                                f"of SIGKILL", -1, None)

    def _close_rank_services(self) -> None:
        """Ask every live rank to close its rank services (phalanx.runtime.rank_services)
        before the ranks stop, so a failure is reported here rather than lost in a rank's
        log at its exit."""
        # a rank that never said READY (a failed start) ran no task, so holds no
        # service, and would not answer: asking it cost the services' whole deadline
        ready = [r for r in self.alive_ranks() if r in self._ready]
        outcomes = self.call_ranks(ready, close_services_here, timeout=_SERVICES_CLOSE_S)
        failures = {r: o.error for r, o in outcomes.items() if o.error is not None}
        for r, exc in list(failures.items()):
            if isinstance(exc, RankDiedError) and exc.rank == r:
                # died or stopped meanwhile: its services went with the process; close
                # kills and reaps it in the next step, which is the report
                log.warning("worker %s: rank %d was lost while closing its services: %s",
                            self.generation, r, str(exc).partition(". stderr tail")[0])
                del failures[r]
                continue
            exc.add_note(f"closing the rank services of rank {r} (pid {self._procs[r].pid})")
        if failures:
            raise CleanupError(
                f"worker {self.generation}: rank services failed to close on ranks "
                f"{sorted(failures)}", list(failures.values()))

    def _stop_ranks(self) -> None:
        _RANKS_STOPPING.hit()
        shutdown(list(self._procs.values()), self._ready, self._send_shutdown, self._close_left)
        self._reap([p.rank for p in self._procs.values()])
        for p in self._procs.values():
            self._hub.remove(p.sock, p.proc.stderr, pidfd=p.pidfd)
            p.close_fds()

    def _send_shutdown(self, rank: int) -> None:
        self._send(rank, Kind.SHUTDOWN, 0, b"", time.monotonic() + self._close_left())

    def _join_runs(self) -> None:
        stuck = []
        for run in list(self._runs.values()):
            if not run.retired.wait(self._close_left()):
                stuck.append(f"run {run.run_id} ({run.name}, {run.state.value})")
        if stuck:
            raise RunsStuckError(f"worker {self.generation}: runs did not retire by the close "
                                 f"deadline: {', '.join(stuck)}")

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # the with block's own error comes up beside close()'s, never in its __context__
        close_on_exit(self.close, exc, f"worker {self.generation}")

    def __repr__(self) -> str:
        return f"<Worker {self.generation} ranks={len(self.ranks)} {self._state.value}>"
