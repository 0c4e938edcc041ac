"""Suite-wide fixtures. The session fixture fails the run on anything left behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from leaks import Snapshot, wait_settled

os.environ.setdefault("PHALANX_LOG_LEVEL", "WARNING")


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Snapshot processes, fds, threads, /dev/shm and the runtime dir; compare at the end."""
    before = Snapshot.take()
    yield
    grown = wait_settled(before)
    if grown:
        lines = [f"  {kind}: {items[:20]}" for kind, items in grown.items()]
        pytest.fail("the test suite left resources behind:\n" + "\n".join(lines), pytrace=False)
