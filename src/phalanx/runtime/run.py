"""Runs: an orchestration function, the tasks it submits, and the run fence.

A run *retires* when its orch function has returned, every task it submitted has
physically finished, and its run-scoped cleanups (physical releases deferred to the
fence) have completed. Later layers hang physical releases on that fence with
:meth:`Orchestrator.defer`.

A run holds what its fence and outcome still depend on, never its whole history: a
task that is outstanding (logically or physically), and one that failed with nobody
having looked (it fails the run at the drain). A task that finished and succeeded, or
whose failure its caller saw, is let go as it finishes or is looked at (``TaskFuture``'s
``on_finished``). One run may serve for a process's life (the engine's holds its
ranks' runners; before issue 43's step channel it submitted every step as tasks):
when a run kept every future it made, that server grew 4 MB per 1,000 short requests
for as long as it ran (issue 45). ``Worker.stats().tasks_retained`` shows what runs hold.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.lifecycle import CleanupError, CleanupJournal

from ._errors import RunClosedError, WaitTimeoutError
from .tasks import TaskFuture

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["Orchestrator", "Run", "RunHandle", "RunState"]

log = logging.getLogger("phalanx.runtime")

_FENCE_REPORT_S = 30.0  # how often a run stuck behind a timed-out task says so


class TaskSubmitter(Protocol):
    """What a run needs from its worker (kept narrow so runs never touch worker internals)."""

    ranks: tuple[int, ...]

    def _submit_task(
        self, run: Run | None, rank: int, fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any], timeout: float | None, control: bool = False,
    ) -> TaskFuture: ...

    def _run_retired(self, run: Run) -> None: ...


class RunState(enum.Enum):
    QUEUED = "queued"  # admitted, waiting for a run thread
    RUNNING = "running"  # the orch function executes; it may submit tasks
    DRAINING = "draining"  # orch returned; waiting for its tasks' outcomes
    ABANDONED = "abandoned"  # settled, but tasks that timed out or depend on a dead or hung
    # rank still run in their ranks: the fence waits until they finish or close() stops
    # those ranks (close() does not wait for such a run before it does)
    CLEANING = "cleaning"  # tasks finished; run-scoped releases execute
    RETIRED = "retired"  # the fence passed: tasks and releases are done


class Run:
    """One run's state. Created by the worker; users see a RunHandle and an Orchestrator."""

    def __init__(self, run_id: int, name: str, worker: TaskSubmitter) -> None:
        self.run_id = run_id
        self.name = name
        self.worker = worker
        self.state = RunState.QUEUED
        # Invariant (under _lock): every task of this run not yet finished is here, and
        # every finished one that failed with nobody having looked; a task leaves when it
        # finished with no failure, or with one seen (at its finish or its first look
        # after). Insertion order is submission order: the drain names the first failure.
        self._held: dict[int, TaskFuture] = {}
        self.cleanups = CleanupJournal(f"run {run_id} ({name})")
        self.value: Any = None
        self.error: BaseException | None = None
        self.cleanup_error: CleanupError | None = None
        self.started_at = time.monotonic()
        # Invariant: settled is set once value/error are final; retired implies settled.
        self.settled = threading.Event()
        self.retired = threading.Event()
        self._lock = threading.Lock()

    def add_task(self, future: TaskFuture) -> None:
        with self._lock:
            if self.state is not RunState.RUNNING:
                raise RunClosedError(
                    f"run {self.run_id} ({self.name}) is {self.state.value}: tasks can be "
                    f"submitted only while its orch function runs"
                )
            # the worker adds a task before it admits or sends it, so its finish (and
            # on_finished) always comes after this
            self._held[future.task_id] = future

    @property
    def tasks_retained(self) -> int:
        """How many of its tasks this run holds (outstanding, or failed unseen)."""
        return len(self._held)

    def task_finished(self, future: TaskFuture) -> None:
        """``on_finished`` of this run's tasks: called by the thread that settled one
        (often the hub's), or that looked at its failure after. Idempotent."""
        with self._lock:
            self._let_go(future)

    def _let_go(self, future: TaskFuture) -> None:
        """Under _lock: forget a finished task unless it failed with nobody looking."""
        if future.failure() is None or future.observed:
            self._held.pop(future.task_id, None)

    def _snapshot(self) -> list[TaskFuture]:
        with self._lock:
            return list(self._held.values())

    def execute(self, orch_fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                orchestrator: Orchestrator, wait_fence: bool = True) -> None:
        """Run the orch function and drain its tasks. With ``wait_fence`` False (the
        caller's own thread, ``Worker.run``) a fence that still waits on tasks running
        past their outcome continues on a thread of its own, so the caller learns the
        outcome at once instead of waiting for close() to stop a rank."""
        with self._lock:
            self.state = RunState.RUNNING
        try:
            self.value = orch_fn(orchestrator, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001  the run fails; the worker does not
            self.error = exc
        with self._lock:
            self.state = RunState.DRAINING
        if self._drain() or wait_fence:
            self._finish()
        else:
            threading.Thread(target=self._finish, name=f"phalanx-run-{self.run_id}-fence",
                             daemon=True).start()

    def _finish(self) -> None:
        self._wait_physical()
        with self._lock:
            self.state = RunState.CLEANING
        try:
            self.cleanups.run()
        except CleanupError as exc:
            self.cleanup_error = exc
            if self.error is None:
                self.error = exc
        with self._lock:
            self.state = RunState.RETIRED
            self._held.clear()  # the outcome is final: a failure left here was used
        self.settled.set()
        self.retired.set()
        self.worker._run_retired(self)

    def _drain(self) -> bool:
        """Wait for every task's outcome; True if every task also finished physically.

        No task is added from now on (the state is DRAINING), so one snapshot of the
        held tasks covers every task that can still matter: those let go finished with
        no failure, or with one their caller saw."""
        held = self._snapshot()
        for task in held:
            task.wait_settled()
        if self.error is None:
            # A task failure nobody looked at fails the run rather than vanish.
            for task in held:
                failure = task.failure()
                if failure is not None and not task.observed:
                    self.error = failure
                    break
        # Looked at once: a task may finish (on the hub thread) while we look, and a
        # second look could then find none unfinished (StopIteration escaped execute()
        # and the run never settled).
        unfinished = [t for t in held if not t.finished]
        if not unfinished:
            return True
        # A task ran past its deadline or was abandoned (a rank it depends on died or
        # hung): the caller learns now; the fence still waits until the rank stops
        # running it (close() kills the rank if need be).
        if self.error is None:
            self.error = next((f for t in unfinished if (f := t.failure()) is not None), None)
        with self._lock:
            self.state = RunState.ABANDONED
        self.settled.set()
        return False

    def _wait_physical(self) -> None:
        for task in self._snapshot():
            while not task.wait_finished(_FENCE_REPORT_S):
                log.warning(
                    "run %d (%s) cannot retire: task %s on rank %d is still running %.0fs past "
                    "its deadline", self.run_id, self.name, task.name, task.rank,
                    time.monotonic() - task.deadline,
                )


class Orchestrator:
    """The ``o`` an orch function receives: submits tasks to ranks within one run."""

    def __init__(self, run: Run, timeout: float | None = None) -> None:
        self._run = run
        self._timeout = timeout

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._run.worker.ranks

    @property
    def worker(self) -> TaskSubmitter:
        """The Worker this run belongs to (a layer's orchestrator reaches its own state
        there, as comm's reaches the domain manager)."""
        return self._run.worker

    @property
    def run_id(self) -> int:
        return self._run.run_id

    def submit(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> TaskFuture:
        """Run ``fn(*args, **kwargs)`` in rank ``rank``; returns its future."""
        return self._run.worker._submit_task(self._run, rank, fn, args, kwargs, self._timeout)

    def control(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> TaskFuture:
        """Like submit, for runtime-internal steps (failpoints, domain set-up): these
        bypass the user-task failpoint so that injected faults never block recovery."""
        return self._run.worker._submit_task(self._run, rank, fn, args, kwargs, self._timeout,
                                             control=True)

    def options(self, *, timeout: float) -> Orchestrator:
        """An orchestrator whose tasks have this deadline (seconds) instead of the default."""
        return type(self)(self._run, timeout)

    def defer(self, name: str, release: Callable[[], None]) -> None:
        """Run ``release`` when this run's fence retires (after all its tasks finished)."""
        self._run.cleanups.add(name, release)


class RunHandle:
    """What ``Worker.submit`` returns."""

    def __init__(self, run: Run) -> None:
        self._run = run

    @property
    def run_id(self) -> int:
        return self._run.run_id

    @property
    def state(self) -> RunState:
        return self._run.state

    @property
    def retired(self) -> bool:
        """True once the run fence passed: tasks finished and releases done."""
        return self._run.retired.is_set()

    def wait_retired(self, timeout: float | None = None) -> bool:
        return self._run.retired.wait(timeout)

    def done(self) -> bool:
        return self._run.settled.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the run's outcome is known; True if it is."""
        return self._run.settled.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The orch function's return value, or its (or a task's) exception."""
        if not self._run.settled.wait(timeout):
            raise WaitTimeoutError(
                f"run {self.run_id} ({self._run.name}) not done after {timeout}s")
        if self._run.error is not None:
            raise self._run.error
        return self._run.value
