"""The retryable cleanup journal.

A journal is an ordered list of cleanup steps an owner still owes. ExitStack semantics
(CPython ``contextlib``): a step is added only after the acquisition it undoes
succeeded; steps run last-in first-out; every step runs even when an earlier one
raised. Unlike ExitStack, a step is removed only when it *succeeded*: a failed step
stays in the journal, so the owner's next ``close()`` retries exactly what is left
and nothing that already succeeded runs twice. Failures are collected explicitly into
one :class:`CleanupError` (never chained through ``__context__``, cpython#102201).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ._errors import CleanupError

__all__ = ["CleanupJournal", "JournalEntry", "close_on_exit"]

log = logging.getLogger("phalanx.lifecycle")


@dataclass
class JournalEntry:
    name: str
    step: Callable[[], None]
    attempts: int = 0
    last_error: BaseException | None = field(default=None, repr=False)


class CleanupJournal:
    """Cleanup steps of one owner, run LIFO, each removed only once it succeeded."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._entries: list[JournalEntry] = []
        # One lock for entries and run(): a second concurrent run() (close() from two
        # threads) waits for the first, then retries only what the first left owed.
        self._lock = threading.Lock()

    def add(self, name: str, step: Callable[[], None]) -> None:
        """Record a cleanup owed for something that was just acquired."""
        with self._lock:
            self._entries.append(JournalEntry(name, step))

    def pending(self) -> list[str]:
        """Names of the steps still owed, in the order they will run."""
        with self._lock:
            return [e.name for e in reversed(self._entries)]

    def failures(self) -> dict[str, BaseException]:
        with self._lock:
            return {e.name: e.last_error for e in self._entries if e.last_error is not None}

    def __len__(self) -> int:
        return len(self._entries)

    def run(self) -> None:
        """Run every owed step, newest first; raise one CleanupError naming each failure.

        Steps that fail stay owed; a later call retries them (and only them).
        """
        self._run_entries(None)

    def run_only(self, name: str) -> None:
        """Run the owed steps named ``name`` (newest first), like :meth:`run`."""
        self._run_entries(name)

    def _run_entries(self, name: str | None) -> None:
        with self._lock:
            errors: list[Exception] = []
            failed: list[str] = []
            for entry in list(reversed(self._entries)):
                if name is not None and entry.name != name:
                    continue
                entry.attempts += 1
                try:
                    entry.step()
                except Exception as exc:  # noqa: BLE001  every step runs even if an earlier one failed
                    entry.last_error = exc
                    exc.add_note(f"cleanup step {entry.name!r} of {self.owner} failed "
                                 f"(attempt {entry.attempts}); it stays owed")
                    log.warning("%s: cleanup %r failed: %s", self.owner, entry.name, exc)
                    errors.append(exc)
                    failed.append(repr(entry.name))
                else:
                    self._entries.remove(entry)
            if errors:
                raise CleanupError(
                    f"{self.owner}: {len(errors)} cleanup step(s) failed ({', '.join(failed)}); "
                    f"they stay "
                    f"owed and the next close() retries them",
                    errors,
                )


def close_on_exit(close: Callable[[], None], exc: BaseException | None, what: str) -> None:
    """An owner's ``__exit__``: ``close()``, with the with block's own error ``exc`` kept.

    If closing fails too, both come up in one CleanupError (never the block's error
    hidden in the CleanupError's ``__context__``); an interrupt (not an Exception) stays
    the interrupt, with a note naming the close's failures. ``what`` names the owner
    ("worker 1a2b", "cache store /d").
    """
    try:
        close()
    except CleanupError as failed:
        if exc is None:
            raise
        if not isinstance(exc, Exception):
            exc.add_note(f"and closing {what} failed: {failed}: "
                         + "; ".join(repr(e) for e in failed.exceptions))
            return
        raise CleanupError(f"{what}: the with block failed ({exc!r}) and closing it failed "
                           f"too; those steps stay owed", [exc, *failed.exceptions]) from None
