"""Task futures: the parent's view of one task running in a rank.

A task has two outcomes that can part ways: its *logical* outcome (a value, the task's
exception, or TaskTimeoutError once its deadline passed) and its *physical* completion
(the rank reported back, or the rank is gone). A timed-out task may still be running;
the run fence waits for physical completion, because only then have the task's users
of shared resources provably stopped.

One Event per future on the common path (the round trip is what the Worker benchmark
measures against multiprocessing.Pool); a second one exists only for a task that
expired and must still be waited out.

A run's task tells its run when it finished (``on_finished``), and, if it failed, again
once its caller looked at the failure, so the run can let go of it: a run holds only
what is outstanding (run.py), however long it lives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import TaskTimeoutError, WaitTimeoutError

__all__ = ["Outcome", "TaskFuture"]

# Guards the outcome fields of every future: critical sections are a few assignments.
_OUTCOME = threading.Lock()


class TaskFuture:
    """The future of one task. ``result()`` waits at most until the task's deadline."""

    __slots__ = ("_done", "_error", "_expired_wait", "_finished", "_on_expire",
                 "_on_finished", "_value", "control", "deadline", "group", "name",
                 "observed", "rank", "run_id", "task_id", "timeout")

    def __init__(self, rank: int, task_id: int, name: str, run_id: int, timeout: float,
                 control: bool = False, group: int = 0,
                 on_expire: Callable[[], None] | None = None,
                 on_finished: Callable[[TaskFuture], None] | None = None) -> None:
        self.rank = rank
        self.control = control  # runtime-internal: not counted as a user task
        # A Worker.call_ranks call's id (0: a run's task): a rank's death fails the other
        # members of its call at once, as it fails every task of every live run.
        self.group = group
        # Called (outside any lock) when the deadline passes, before the TaskTimeoutError
        # is set: the worker looks for a stopped rank to blame instead (RankHungError).
        self._on_expire = on_expire
        # Called (outside any lock) when the task finished physically, and for a failure
        # again once it was looked at: its run lets go of it then (an unseen failure is
        # the run's to raise). Dropped when it can matter no more, so no cycle outlives it.
        self._on_finished = on_finished
        self.task_id = task_id
        self.name = name
        self.run_id = run_id
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.observed = False  # result()/exception() was called: the caller saw a failure
        self._done = threading.Event()  # the logical outcome is known
        self._value: Any = None
        self._error: BaseException | None = None
        self._finished = False  # physical completion
        self._expired_wait: threading.Event | None = None  # only for expired tasks

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "pending"
        return f"<TaskFuture {self.name} rank={self.rank} id={self.task_id} {state}>"

    # -- for the user ---------------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        self.observed = True
        self._wait(timeout)
        if self._error is not None:
            self._seen()
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.observed = True
        self._wait(timeout)
        if self._error is not None:
            self._seen()
        return self._error

    @property
    def finished(self) -> bool:
        """The rank has stopped running this task (reported back, or died)."""
        return self._finished

    # -- for the runtime -------------------------------------------------------------
    def _wait(self, timeout: float | None) -> None:
        if self._done.is_set():
            return
        remaining = self.deadline - time.monotonic()
        wait = remaining if timeout is None else min(timeout, remaining)
        if self._done.wait(max(0.0, wait)):
            return
        if time.monotonic() >= self.deadline:
            self.expire()
            return
        raise WaitTimeoutError(
            f"task {self.name} (id {self.task_id}) on rank {self.rank} not done after "
            f"{timeout}s; it keeps running until its deadline")

    def wait_settled(self) -> None:
        """Wait for the logical outcome, expiring the task at its deadline."""
        try:
            self._wait(None)
        except TimeoutError:
            pass

    def wait_finished(self, timeout: float) -> bool:
        with _OUTCOME:
            if self._finished:
                return True
            if self._expired_wait is None:
                self._expired_wait = threading.Event()
            event = self._expired_wait
        return event.wait(timeout)

    def expire(self) -> None:
        if self._on_expire is not None and not self._done.is_set():
            self._on_expire()  # may settle us (logically) with a RankHungError
        with _OUTCOME:
            if self._done.is_set():
                return
            self._error = TaskTimeoutError(
                f"task {self.name} (id {self.task_id}) of run {self.run_id} on rank "
                f"{self.rank} did not finish within its {self.timeout:g}s deadline; the "
                f"rank may still be running it (close() stops the rank)")
            self._done.set()

    def abandon(self, error: BaseException) -> None:
        """Fail the logical outcome now (a rank this task depends on died or hung); the
        task may still run in its rank, so it is not finished: the fence still waits."""
        with _OUTCOME:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()

    def _settle(self, value: Any, error: BaseException | None) -> None:
        with _OUTCOME:
            if not self._done.is_set():
                self._value, self._error = value, error
                self._done.set()
            self._finished = True
            event = self._expired_wait
            on_finished = self._on_finished
            if self._error is None or self.observed:  # no later look can matter
                self._on_finished = None
        if event is not None:
            event.set()
        if on_finished is not None:
            on_finished(self)

    def _seen(self) -> None:
        """A failure was looked at: once finished, its run need not hold it any more
        (the run's hook is idempotent; a look before the finish is seen at the finish)."""
        with _OUTCOME:
            if not self._finished:
                return
            on_finished, self._on_finished = self._on_finished, None
        if on_finished is not None:
            on_finished(self)

    def set_result(self, value: Any) -> None:
        self._settle(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(None, exc)

    def failure(self) -> BaseException | None:
        """The logical failure if settled with one, without marking it observed."""
        return self._error if self._done.is_set() else None


@dataclass(frozen=True)
class Outcome:
    """What one rank's part of :meth:`Worker.call_ranks` came to: a value or an error."""

    value: Any = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Any:
        """The value, or raise the error."""
        if self.error is not None:
            raise self.error
        return self.value
