"""The resource ledger: every resource has one owner, dependencies, a state, one release.

Contracts it keeps (docs/architecture.md, "Contracts"):

* **Owner at birth.** :meth:`Ledger.acquiring` records an entry (``ACQUIRING``) *before*
  the resource is created; the caller publishes it with :meth:`Entry.live` right after
  the creating call returned. A step that fails before ``live`` leaves nothing owned.
* **Order by dependency.** :meth:`Ledger.release_owner` releases an owner's entries
  dependents-first (a topological order over ``depends_on``), not by age.
* **Exactly once.** An entry's release runs once. Its outcome is kept: a later release
  of a released entry is a no-op, of an uncertain one re-raises the same error.
* **Failure keeps ownership.** A release that raises leaves the entry ``UNCERTAIN``:
  still owned, counted in :meth:`Ledger.stats`, its error kept. Only
  :meth:`Ledger.retry_uncertain` (an owner's explicit close path) runs it again, and only
  for entries whose kind allows retries.
* **Shared vs owned.** An entry marked ``shared`` belongs to a long-lived owner (the
  base communicator); others hold ``borrow`` entries that depend on it. Stats count the
  two separately.

Nothing here is released by ``__del__`` or garbage collection.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ._errors import CleanupError, ResourceUncertainError

__all__ = ["Entry", "Event", "Ledger", "ResourceState"]

_EVENT_LOG = 4096  # recent events kept for tests and diagnosis; bounded like everything


class ResourceState(enum.Enum):
    ACQUIRING = "acquiring"  # recorded; the creating call has not returned yet
    LIVE = "live"  # exists and is owned; its release has not started
    RELEASING = "releasing"  # its release step is running
    RELEASED = "released"  # released successfully (kept only in the event log)
    UNCERTAIN = "uncertain"  # its release failed: still owned, counted, error kept


@dataclass(frozen=True)
class Event:
    seq: int
    what: str  # "acquiring" | "live" | "abandoned" | "releasing" | "released" | "uncertain"
    rid: int
    kind: str
    name: str
    owner: str
    depends_on: tuple[int, ...]


@dataclass(eq=False)
class Entry:
    rid: int
    kind: str
    name: str
    owner: str
    depends_on: tuple[int, ...]
    shared: bool
    retry_allowed: bool
    ledger: Ledger = field(repr=False)
    state: ResourceState = ResourceState.ACQUIRING
    release_step: Callable[[], None] | None = field(default=None, repr=False)
    error: BaseException | None = None
    handle: Any = field(default=None, repr=False)

    def live(self, release: Callable[[], None], handle: Any = None) -> Entry:
        """The resource exists: record how to release it."""
        self.ledger._publish(self, release, handle)
        return self

    def abandon(self) -> None:
        """The creating call failed: nothing exists, nothing is owned."""
        self.ledger._abandon(self)

    def describe(self) -> str:
        err = f": {self.error!r}" if self.error is not None else ""
        return f"{self.kind} {self.name!r} of {self.owner} ({self.state.value}{err})"


class Ledger:
    """The resources of one process (a rank, or the parent)."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self._entries: dict[int, Entry] = {}
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._events: collections.deque[Event] = collections.deque(maxlen=_EVENT_LOG)
        # One lock for the table; a release step runs outside it so that steps may take
        # their own locks, and RELEASING marks an entry as claimed by one caller.
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)

    # -- acquisition -------------------------------------------------------------------
    def acquiring(self, kind: str, name: str, owner: str, *, depends_on: Iterable[Entry] = (),
                  shared: bool = False, retry_allowed: bool = True) -> Entry:
        deps = tuple(d.rid for d in depends_on)
        with self._lock:
            for rid in deps:
                dep = self._entries.get(rid)
                if dep is None or dep.state not in (ResourceState.LIVE, ResourceState.ACQUIRING):
                    raise ResourceUncertainError(
                        f"{self.scope}: {kind} {name!r} cannot depend on resource {rid}, which "
                        f"is {'gone' if dep is None else dep.state.value}")
            entry = Entry(next(self._ids), kind, name, owner, deps, shared, retry_allowed, self)
            self._entries[entry.rid] = entry
            self._log("acquiring", entry)
        return entry

    def _publish(self, entry: Entry, release: Callable[[], None], handle: Any) -> None:
        with self._lock:
            entry.release_step, entry.handle, entry.state = release, handle, ResourceState.LIVE
            self._log("live", entry)

    def _abandon(self, entry: Entry) -> None:
        with self._lock:
            if entry.state is ResourceState.ACQUIRING:
                del self._entries[entry.rid]
                self._log("abandoned", entry)

    # -- release ------------------------------------------------------------------------
    def release(self, entry: Entry) -> None:
        """Release one entry exactly once; replay the outcome to later callers."""
        with self._lock:
            while entry.state is ResourceState.RELEASING:
                self._released.wait()
            if entry.state is ResourceState.RELEASED:
                return
            if entry.state is ResourceState.UNCERTAIN:
                assert entry.error is not None
                raise entry.error
            if entry.state is ResourceState.ACQUIRING:
                raise ResourceUncertainError(
                    f"{self.scope}: {entry.describe()} is still being acquired")
            blockers = [e for e in self._entries.values()
                        if entry.rid in e.depends_on and e.state is not ResourceState.RELEASED]
            if blockers:
                raise ResourceUncertainError(
                    f"{self.scope}: cannot release {entry.describe()} while "
                    f"{', '.join(b.describe() for b in blockers)} depend on it")
            self._begin(entry)
        self._run(entry)

    def _begin(self, entry: Entry) -> None:
        entry.state = ResourceState.RELEASING
        self._log("releasing", entry)

    def _run(self, entry: Entry) -> None:
        assert entry.release_step is not None
        try:
            entry.release_step()
        except Exception as exc:  # the outcome is kept and replayed, never dropped
            exc.add_note(f"{self.scope}: releasing {entry.kind} {entry.name!r} of "
                         f"{entry.owner} failed; it stays owned (uncertain)")
            with self._lock:
                entry.state, entry.error = ResourceState.UNCERTAIN, exc
                self._log("uncertain", entry)
                self._released.notify_all()
            raise
        with self._lock:
            entry.state, entry.error, entry.handle = ResourceState.RELEASED, None, None
            del self._entries[entry.rid]
            self._log("released", entry)
            self._released.notify_all()

    def release_owner(self, owner: str) -> None:
        """Release every live entry of ``owner``, dependents first; collect every failure.

        An entry whose dependents failed to release stays live (releasing it would free
        something still referenced); it is reported with them.
        """
        errors: list[Exception] = []
        while True:
            with self._lock:
                pending = [e for e in self._entries.values()
                           if e.owner == owner and e.state is ResourceState.LIVE]
                held = {d for e in self._entries.values() if e.state is not
                        ResourceState.RELEASED for d in e.depends_on}
                ready = [e for e in pending if e.rid not in held]
                if not ready:
                    break
                entry = max(ready, key=lambda e: e.rid)  # among the free, newest first
                self._begin(entry)
            self._run_collecting(entry, errors)
        if errors:
            raise CleanupError(f"{self.scope}: {len(errors)} release(s) of {owner} failed",
                               errors)

    def retry_uncertain(self, owner: str | None = None) -> None:
        """Retry uncertain entries whose kind allows it (the owner's close path only)."""
        errors: list[Exception] = []
        with self._lock:
            entries = [e for e in self._entries.values() if e.state is ResourceState.UNCERTAIN
                       and e.retry_allowed and (owner is None or e.owner == owner)]
        for entry in sorted(entries, key=lambda e: -e.rid):
            with self._lock:
                if entry.state is not ResourceState.UNCERTAIN:
                    continue
                self._begin(entry)
            self._run_collecting(entry, errors)
        if errors:
            raise CleanupError(f"{self.scope}: {len(errors)} retried release(s) failed", errors)

    def _run_collecting(self, entry: Entry, errors: list[Exception]) -> None:
        try:
            self._run(entry)
        except Exception as exc:  # noqa: BLE001  the caller raises every failure together
            errors.append(exc)

    def resolve(self, entry: Entry) -> None:
        """Mark a live or uncertain entry released after its owner's close path verified, by
        other means, that the resource is gone (for example: every rank dropped its half)."""
        with self._lock:
            if entry.state in (ResourceState.UNCERTAIN, ResourceState.LIVE):
                entry.state, entry.error, entry.handle = ResourceState.RELEASED, None, None
                self._entries.pop(entry.rid, None)
                self._log("released", entry)
                self._released.notify_all()

    # -- inspection ---------------------------------------------------------------------
    def _log(self, what: str, e: Entry) -> None:
        self._events.append(Event(next(self._seq), what, e.rid, e.kind, e.name, e.owner,
                                  e.depends_on))

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def entries(self, owner: str | None = None) -> list[Entry]:
        with self._lock:
            return [e for e in self._entries.values() if owner is None or e.owner == owner]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            entries = list(self._entries.values())
        return {
            "owned": sum(1 for e in entries if not e.shared),
            "shared": sum(1 for e in entries if e.shared),
            "by_state": dict(collections.Counter(e.state.value for e in entries)),
            "uncertain": [e.describe() for e in entries if e.state is ResourceState.UNCERTAIN],
        }
