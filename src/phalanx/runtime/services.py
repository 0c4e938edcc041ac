"""The rank-service registry: long-lived state a rank process owns between tasks.

A task that opens something meant to outlive it (a store, a link, a KV pool, a
communicator) registers it here with its close step instead of keeping it in a module
global. The registry is one cleanup journal per rank process: services close LIFO, each
step runs even when an earlier one raised, a failed step stays owed (a later
``close_all`` retries only it) and every failure comes back in one
:class:`~phalanx.lifecycle.CleanupError` naming the rank and the service.

Who closes it: the Worker's close journal asks every live rank to close its services
before it stops the ranks (so a failure is reported, not lost with the process); a rank
that is told to shut down closes what is left after its serving threads finished.

Naming: a service's name says its layer and instance (``"replication.cache/<id>"``),
so two layers never collide and an error names what failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from phalanx.lifecycle.journal import CleanupJournal

from ._context import current_rank
from ._errors import ServiceExistsError, ServiceNotFoundError

__all__ = ["RankServices", "rank_services"]

T = TypeVar("T")


class RankServices:
    """Named services of one rank process, each with the step that closes it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        # Invariant: a name is in _services iff its close step is owed in _journal.
        self._services: dict[str, object] = {}
        self._journal = CleanupJournal(f"rank {rank} services")

    def register(self, name: str, service: T, close: Callable[[], None]) -> T:
        """Own ``service`` from now on; ``close`` runs once, at ``close(name)`` or
        ``close_all()``. Call it right after the acquisition succeeded."""
        with self._lock:
            if name in self._services:
                raise ServiceExistsError(
                    f"rank {self.rank}: a service named {name!r} is already registered; "
                    f"close it first or choose another name")
            self._services[name] = service
            self._journal.add(name, self._step(name, close))
        return service

    def _step(self, name: str, close: Callable[[], None]) -> Callable[[], None]:
        def step() -> None:
            close()  # raises: the entry stays owed and the service stays registered
            with self._lock:
                self._services.pop(name, None)
        return step

    def get(self, name: str, kind: type[T]) -> T:
        """The live service ``name``; a clear error if there is none or it is another type."""
        with self._lock:
            service = self._services.get(name)
        if service is None:
            raise ServiceNotFoundError(
                f"rank {self.rank}: no service named {name!r} (never opened here, or "
                f"closed); open it on this rank first")
        if not isinstance(service, kind):
            raise ServiceNotFoundError(
                f"rank {self.rank}: service {name!r} is a {type(service).__name__}, "
                f"not a {kind.__name__}")
        return service

    def find(self, name: str, kind: type[T]) -> T | None:
        """Like :meth:`get`, but None when no such service is registered."""
        with self._lock:
            service = self._services.get(name)
        return service if isinstance(service, kind) else None

    def names(self) -> list[str]:
        with self._lock:
            return list(self._services)

    def close(self, name: str) -> None:
        """Close one service now (its step runs once; a failure raises CleanupError)."""
        self._journal.run_only(name)

    def close_all(self) -> None:
        """Close every service, newest first; raises one CleanupError with every failure."""
        self._journal.run()


_SERVICES: RankServices | None = None
_SERVICES_LOCK = threading.Lock()


def rank_services() -> RankServices:
    """This rank process's registry (created on first use); refused in a parent process."""
    global _SERVICES
    rank = current_rank()
    if rank is None:
        raise ServiceNotFoundError(
            "rank services exist only in rank processes: call this from a task "
            "submitted to a rank, not from the parent")
    with _SERVICES_LOCK:
        if _SERVICES is None:
            _SERVICES = RankServices(rank)
        return _SERVICES


def existing_rank_services() -> RankServices | None:
    """The registry if this rank process made one (the shutdown path uses it)."""
    return _SERVICES
