"""When the ranks are quiet: the disk tier's background work yields to requests.

A store of one page costs 2-12 ms of the two shared cores; the request just admitted
would pay it. So the store thread waits for a gap with no step and no lookup in
progress (bounded: it does not starve either).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["QuietGate"]


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
