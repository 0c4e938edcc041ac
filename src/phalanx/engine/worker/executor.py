"""What both executors (``worker/local.py``, ``multihost/executor.py``) share, written
once: the quiet gate the disk tier's background work waits on, the sentence that names
the ranks a job lost, and the size of a TP domain's windows.

When the ranks are quiet: a store of one page costs 2-12 ms of the two shared cores, and
the request just admitted would pay it. So the disk tier's store thread waits for a gap
with no step and no lookup in progress (bounded: it does not starve either).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["TP_WINDOW", "ExecutorBase", "QuietGate"]

# each rank's window of a TP domain (one host's, or a host's part of a multi-host job):
# the collectives' rounds pass through it
TP_WINDOW = 4 << 20


class QuietGate:
    """Counts the calls in progress and when the last one ended."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._calls = 0
        self._last = time.monotonic()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        with self._cv:
            self._calls += 1
        try:
            yield
        finally:
            with self._cv:
                self._calls -= 1
                self._last = time.monotonic()
                self._cv.notify_all()

    def wait(self, gap: float, timeout: float) -> bool:
        """Until no call has run for ``gap`` seconds (True), or at most ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                now = time.monotonic()
                if self._calls == 0 and now - self._last >= gap:
                    return True
                if now >= deadline:
                    return False
                wait = deadline - now
                if self._calls == 0:
                    wait = min(wait, gap - (now - self._last))
                self._cv.wait(wait)


class ExecutorBase:
    """The shared part of an executor over ``worker`` (a Worker or a MultiHostWorker:
    both answer ``alive_ranks()``)."""

    def __init__(self, tp: int, worker: Any) -> None:
        self.tp = tp
        self.worker = worker
        self.dead: BaseException | None = None
        # the parent's calls in progress: background work waits for a quiet moment
        self._quiet = QuietGate()

    def alive_ranks(self) -> list[int]:
        return list(self.worker.alive_ranks())

    def lost_ranks(self) -> str | None:
        """A sentence naming the ranks that are gone (and why, where the job knows),
        or None while every rank is alive."""
        lost = sorted(set(range(self.tp)) - set(self.alive_ranks()))
        if not lost:
            return None
        why = self._why_lost()
        names = ", ".join(f"rank {r}" for r in lost)
        return f"{names} of {self.tp} died" + (f": {why}" if why else "")

    def _why_lost(self) -> str | None:
        """Why the job lost ranks, where it knows (a lost host); None here."""
        return None

    def wait_quiet(self, gap: float, timeout: float) -> bool:
        """Wait until no step or lookup has run for ``gap`` seconds (True), or at most
        ``timeout`` (False): the disk tier's background work yields to requests so
        that a store does not take a core from the next request's step."""
        return self._quiet.wait(gap, timeout)
