"""The runtime layer: the Worker, rank processes, runs and their fences."""

from . import _rank_points  # noqa: F401  (rank-side failpoints join the catalogue)
from ._context import current_rank, generation, job_token, world_size
from ._errors import (
    HubStuckError,
    MessageTooLargeError,
    ParentTimeoutError,
    RankDiedError,
    RankHungError,
    RankStartError,
    RemoteTaskError,
    RunClosedError,
    RunSlotTimeoutError,
    RunsStuckError,
    ServiceExistsError,
    ServiceNotFoundError,
    TaskTimeoutError,
    WaitTimeoutError,
    WorkerClosedError,
    WorkerError,
    WorkerPoisonedError,
)
from .run import Orchestrator, RunHandle, RunState
from .services import RankServices, rank_services
from .state import WorkerState
from .stats import WorkerStats
from .tasks import Outcome, TaskFuture
from .worker import Worker

__all__ = [
    "HubStuckError",
    "MessageTooLargeError",
    "Orchestrator",
    "Outcome",
    "ParentTimeoutError",
    "RankDiedError",
    "RankHungError",
    "RankServices",
    "RankStartError",
    "RemoteTaskError",
    "RunClosedError",
    "RunHandle",
    "RunSlotTimeoutError",
    "RunState",
    "RunsStuckError",
    "ServiceExistsError",
    "ServiceNotFoundError",
    "TaskFuture",
    "TaskTimeoutError",
    "WaitTimeoutError",
    "Worker",
    "WorkerClosedError",
    "WorkerError",
    "WorkerPoisonedError",
    "WorkerState",
    "WorkerStats",
    "current_rank",
    "generation",
    "job_token",
    "rank_services",
    "world_size",
]
