"""Waiting for a peer's flag in shared memory: spin, then yield, then sleep.

One loop for barriers and notify-pool handshakes. On a machine with fewer cores than
busy processes, spinning alone starves the very peer we wait for, and sleeping alone
costs a timer tick per wait; so: a short spin (the peer is running on another core),
then ``sched_yield`` (the peer may be runnable on ours), then sleeps with a capped
backoff. Every wait has a deadline and notices a dead peer within
``LIVENESS_CHECK_S``.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable

from .rank_state import LIVENESS_CHECK_S, pid_alive

__all__ = ["Waited", "wait_for"]

_SPINS = 200
_YIELDS = 2_000
# Short enough that a late peer costs little latency, long enough that a waiter does not
# steal a core from the peer it waits for.
_MAX_BACKOFF_S = 100e-6


class Waited(enum.Enum):
    READY = "ready"
    DEAD = "peer dead"
    TIMEOUT = "timeout"


def wait_for(ready: Callable[[], bool], pid: int, deadline: float) -> Waited:
    """Wait until ``ready()``; give up if process ``pid`` dies or ``deadline`` passes."""
    polls = 0
    delay = 5e-6
    next_check = time.monotonic() + LIVENESS_CHECK_S
    while not ready():
        polls += 1
        if polls < _SPINS:
            continue
        if polls < _SPINS + _YIELDS:
            os.sched_yield()
        else:
            time.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF_S)
        if polls % 64 == 0 or polls >= _SPINS + _YIELDS:
            now = time.monotonic()
            if now > next_check:
                next_check = now + LIVENESS_CHECK_S
                if not pid_alive(pid):
                    return Waited.DEAD
            if now > deadline:
                return Waited.TIMEOUT
    return Waited.READY
