"""Task futures: the parent's view of one task running in a rank.

A task has two outcomes that can part ways: its *logical* outcome (the future: a
value, the task's exception, or TaskTimeoutError once its deadline passed) and its
*physical* completion (the rank reported back, or the rank is gone). A timed-out task
may still be running; the run fence waits for physical completion, because only then
have the task's users of shared resources provably stopped.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ._errors import TaskTimeoutError

__all__ = ["TaskFuture"]


class TaskFuture:
    """The future of one task. ``result()`` waits at most until the task's deadline."""

    def __init__(self, rank: int, task_id: int, name: str, run_id: int, timeout: float,
                 control: bool = False) -> None:
        self.rank = rank
        self.control = control  # runtime-internal: not counted as a user task
        self.task_id = task_id
        self.name = name
        self.run_id = run_id
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self._fut: Future[Any] = Future()
        self._lock = threading.Lock()
        self._finished = threading.Event()  # physical completion
        self.observed = False  # result()/exception() was called: the caller saw a failure

    def __repr__(self) -> str:
        state = "done" if self._fut.done() else "pending"
        return f"<TaskFuture {self.name} rank={self.rank} id={self.task_id} {state}>"

    # -- for the user ---------------------------------------------------------------
    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> Any:
        self.observed = True
        self._wait(timeout)
        return self._fut.result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.observed = True
        self._wait(timeout)
        return self._fut.exception(0)

    @property
    def finished(self) -> bool:
        """The rank has stopped running this task (reported back, or died)."""
        return self._finished.is_set()

    # -- for the runtime -------------------------------------------------------------
    def _wait(self, timeout: float | None) -> None:
        remaining = self.deadline - time.monotonic()
        wait = remaining if timeout is None else min(timeout, remaining)
        try:
            self._fut.exception(max(0.0, wait))
        except FutureTimeout:
            if time.monotonic() >= self.deadline:
                self.expire()
            else:
                raise TimeoutError(
                    f"task {self.name} (id {self.task_id}) on rank {self.rank} not done after "
                    f"{timeout}s; it keeps running until its deadline"
                ) from None

    def wait_settled(self) -> None:
        """Wait for the logical outcome, expiring the task at its deadline."""
        with contextlib.suppress(TimeoutError):
            self._wait(None)

    def wait_finished(self, timeout: float) -> bool:
        return self._finished.wait(timeout)

    def expire(self) -> None:
        with self._lock:
            if not self._fut.done():
                self._fut.set_exception(
                    TaskTimeoutError(
                        f"task {self.name} (id {self.task_id}) of run {self.run_id} on rank "
                        f"{self.rank} did not finish within its {self.timeout:g}s deadline; the "
                        f"rank may still be running it (close() stops the rank)"
                    )
                )

    def set_result(self, value: Any) -> None:
        with self._lock:
            if not self._fut.done():
                self._fut.set_result(value)
        self._finished.set()

    def set_exception(self, exc: BaseException) -> None:
        with self._lock:
            if not self._fut.done():
                self._fut.set_exception(exc)
        self._finished.set()

    def failure(self) -> BaseException | None:
        """The logical failure if settled with one, without marking it observed."""
        if not self._fut.done():
            return None
        return self._fut.exception(0)
