"""The runtime layer: the Worker, rank processes, runs and their fences."""

from . import _rank_points  # noqa: F401  (rank-side failpoints join the catalogue)
from ._context import current_rank
from ._errors import (
    MessageTooLargeError,
    RankDiedError,
    RankStartError,
    RemoteTaskError,
    RunClosedError,
    ServiceExistsError,
    ServiceNotFoundError,
    TaskTimeoutError,
    WorkerClosedError,
    WorkerError,
    WorkerPoisonedError,
)
from .run import Orchestrator, RunHandle, RunState
from .services import RankServices, rank_services
from .stats import WorkerStats
from .tasks import TaskFuture
from .worker import Worker, WorkerState

__all__ = [
    "MessageTooLargeError",
    "Orchestrator",
    "RankDiedError",
    "RankServices",
    "RankStartError",
    "RemoteTaskError",
    "RunClosedError",
    "RunHandle",
    "RunState",
    "ServiceExistsError",
    "ServiceNotFoundError",
    "TaskFuture",
    "TaskTimeoutError",
    "Worker",
    "WorkerClosedError",
    "WorkerError",
    "WorkerPoisonedError",
    "WorkerState",
    "WorkerStats",
    "current_rank",
    "rank_services",
]
