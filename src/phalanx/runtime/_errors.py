"""Errors of the runtime layer (drawn in :mod:`phalanx.errors`).

    PhalanxError
    └── WorkerError
        ├── WorkerClosedError      the worker is closing or closed: no new runs
        ├── WorkerPoisonedError    a cleanup failed or a rank died: only close() is left
        ├── RankStartError         a rank process did not become ready
        ├── RankDiedError          a rank process exited while work was outstanding
        │   └── RankHungError      a rank stopped (SIGSTOP) past a task deadline: treated as dead
        ├── TaskTimeoutError       a task ran past its deadline (also a TimeoutError)
        ├── WaitTimeoutError       a caller's own wait (result(timeout=...)) ended first
        ├── RunSlotTimeoutError    no run slot freed in time (max_concurrent_runs)
        ├── RunsStuckError         runs did not retire by the close deadline
        ├── HubStuckError          the parent's IO thread did not answer in time
        ├── ParentTimeoutError     a rank's request to the parent got no answer in time
        ├── RunClosedError         a run's orchestrator was used after its orch function returned
        ├── MessageTooLargeError   a control-channel message exceeds the size limit
        ├── RemoteTaskError        a task raised an exception that could not be sent back as is
        ├── ServiceExistsError     a rank service of that name is already registered
        └── ServiceNotFoundError   no rank service of that name (or not in a rank process)
"""

from __future__ import annotations

from phalanx.lifecycle import PhalanxError


class WorkerError(PhalanxError):
    """Base of the runtime layer's errors."""


class WorkerClosedError(WorkerError):
    """The worker no longer admits runs because ``close()`` was called."""


class WorkerPoisonedError(WorkerError):
    """A cleanup failed or a rank died; the worker admits no new runs. Call ``close()``."""


class RankStartError(WorkerError):
    """A rank process failed to start or to become ready before its deadline."""


class RankDiedError(WorkerError):
    """A rank process exited while the parent still expected it to work.

    ``rank`` and ``pid`` name the process; ``exitcode`` is its exit status (negative: the
    signal that killed it; None: not known, or still running for a hung rank).
    """

    def __init__(self, message: str, rank: int, exitcode: int | None,
                 pid: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.pid = pid

    def __reduce__(self) -> tuple[type[RankDiedError], tuple[str, int, int | None, int | None]]:
        return (type(self), (str(self), self.rank, self.exitcode, self.pid))


class RankHungError(RankDiedError):
    """A rank process is stopped (SIGSTOP, SIGTSTP, a tracer) and a task deadline passed:
    the parent treats it as dead. ``exitcode`` is None; ``stop_signal`` says what stopped it."""

    def __init__(self, message: str, rank: int, exitcode: int | None,
                 pid: int | None = None, stop_signal: int | None = None) -> None:
        super().__init__(message, rank, exitcode, pid)
        self.stop_signal = stop_signal

    def __reduce__(self) -> tuple[type[RankHungError],  # type: ignore[override]
                                  tuple[str, int, int | None, int | None, int | None]]:
        return (type(self), (str(self), self.rank, self.exitcode, self.pid, self.stop_signal))


class TaskTimeoutError(WorkerError, TimeoutError):
    """A task did not finish before its deadline. The rank may still be running it."""


class WaitTimeoutError(WorkerError, TimeoutError):
    """A caller's own wait (``result(timeout=...)``) ended before the outcome was known;
    the task or run goes on until its own deadline."""


class RunSlotTimeoutError(WorkerError, TimeoutError):
    """No run slot freed before the admission deadline (``max_concurrent_runs`` reached)."""


class RunsStuckError(WorkerError, TimeoutError):
    """Runs did not retire by the close deadline (their fences still wait on tasks)."""


class HubStuckError(WorkerError, TimeoutError):
    """The parent's IO thread did not stop or unregister a rank in time."""


class ParentTimeoutError(WorkerError, TimeoutError):
    """A rank's request to its parent (a hub-backend handshake) got no answer in time."""


class RunClosedError(WorkerError):
    """``submit`` on a run's orchestrator after its orch function returned."""


class MessageTooLargeError(WorkerError, ValueError):
    """A message for the private parent<->rank control channel is over its size limit."""


class RemoteTaskError(WorkerError):
    """Stands in for a task's exception whose type could not be pickled or unpickled."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name

    def __reduce__(self) -> tuple[type[RemoteTaskError], tuple[str, str]]:
        return (type(self), (self.type_name, str(self).partition(": ")[2]))


class RemoteTraceback(Exception):
    """Carries a remote traceback's text as the ``__cause__`` of a task's exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


class ServiceExistsError(WorkerError):
    """A rank service of that name is already registered in this rank process."""


class ServiceNotFoundError(WorkerError, LookupError):
    """No live rank service of that name here (never opened, closed, or in the parent)."""
