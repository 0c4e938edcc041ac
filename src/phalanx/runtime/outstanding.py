"""The parent's table of outstanding tasks and of lost ranks.

One lock guards both because the decision at the heart of "a dead rank fails what
depends on it at once" needs them together: when a rank is lost, which futures fail.

Invariants (under ``_lock``):
- a future is in ``_tasks`` from its submission until its rank reported back or exited:
  physically outstanding. It may be logically done already (expired, abandoned).
- a rank is in ``_lost`` once it died or hung: no task is admitted for it any more.
- a rank is in ``_exited`` once its exit was handled: none of its futures is in ``_tasks``.
- ``_fatal`` is the first loss that spread (the worker was not closing): from then on no
  task of a run is admitted on any rank, since every live run has failed with it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ._errors import RankDiedError
from .tasks import TaskFuture

__all__ = ["Loss", "Outstanding"]


@dataclass(frozen=True)
class Loss:
    """What losing a rank fails: ``finish`` (its own tasks, known to have stopped: the
    rank exited) and ``abandon`` (tasks that may still run: their outcome fails now, the
    fence waits for them). ``first``: the rank had not been lost before."""

    first: bool
    finish: list[TaskFuture]
    abandon: list[TaskFuture]


class Outstanding:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[int, TaskFuture] = {}
        self._lost: dict[int, RankDiedError] = {}
        self._exited: set[int] = set()
        self._fatal: RankDiedError | None = None

    def admit(self, fut: TaskFuture) -> RankDiedError | None:
        """Record ``fut``, or return why not (and record nothing): its rank is lost, or it
        is a run's task and a rank's loss already failed every live run."""
        with self._lock:
            lost = self._lost.get(fut.rank) or (self._fatal if fut.run_id else None)
            if lost is None:
                self._tasks[fut.task_id] = fut
            return lost

    def admit_call(self, futs: list[TaskFuture], *,
                   spread: bool) -> list[tuple[TaskFuture, RankDiedError]]:
        """Record the parts of one call_ranks call together; return those refused, each
        with why. With ``spread`` (the worker is not closing) a lost rank refuses every
        part (a part refused at admission never enters the table, so no loss would ever
        fail its siblings); without, each part is admitted or refused on its own (close
        steps free what the live ranks hold)."""
        with self._lock:
            lost = next((self._lost[f.rank] for f in futs if f.rank in self._lost), None)
            if spread and lost is not None:
                return [(f, lost) for f in futs]
            refused = [(f, self._lost[f.rank]) for f in futs if f.rank in self._lost]
            for f in futs:
                if f.rank not in self._lost:
                    self._tasks[f.task_id] = f
            return refused

    def pop(self, task_id: int) -> TaskFuture | None:
        with self._lock:
            return self._tasks.pop(task_id, None)

    def lost(self, rank: int) -> RankDiedError | None:
        with self._lock:
            return self._lost.get(rank)

    def exited(self, rank: int) -> bool:
        with self._lock:
            return rank in self._exited

    def alive(self, ranks: Iterable[int]) -> list[int]:
        with self._lock:
            return [r for r in ranks if r not in self._lost]

    def busy_ranks(self, expired_by: float | None = None) -> set[int]:
        """Ranks not lost with tasks outstanding; with ``expired_by``, none unless some
        task's deadline passed by then (the hung-rank rule's trigger)."""
        with self._lock:
            tasks = list(self._tasks.values())
            lost = set(self._lost)
        if expired_by is not None and not any(f.deadline <= expired_by for f in tasks):
            return set()
        return {f.rank for f in tasks} - lost

    def decided(self) -> list[TaskFuture]:
        """Tasks whose outcome is known (expired, abandoned) that still run in a rank."""
        with self._lock:
            return [f for f in self._tasks.values() if f.done()]

    def lose(self, rank: int, err: RankDiedError, *, exited: bool, spread: bool) -> Loss | None:
        """Record that ``rank`` exited (``exited``) or hung; None if that was handled.

        With ``spread`` (the worker is not closing), the first loss of a rank also
        abandons every outstanding task of every live run and of every call_ranks call
        the rank is part of, on every rank.
        """
        with self._lock:
            if (rank in self._exited) if exited else (rank in self._lost):
                return None
            first = rank not in self._lost
            self._lost.setdefault(rank, err)
            own = [f for f in self._tasks.values() if f.rank == rank]
            groups = {f.group for f in own if f.group}
            others = [f for f in self._tasks.values()
                      if f.rank != rank and (f.run_id or f.group in groups)]
            abandon = others if spread and first else []
            if spread and self._fatal is None:
                self._fatal = err
            if not exited:
                return Loss(first, [], abandon + own)  # a stopped rank may run them yet
            self._exited.add(rank)
            for f in own:
                del self._tasks[f.task_id]
            return Loss(first, own, abandon)
