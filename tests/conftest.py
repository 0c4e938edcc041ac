"""Suite-wide fixtures. The session fixture fails the run on anything left behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from leaks import Snapshot, wait_settled

os.environ.setdefault("PHALANX_LOG_LEVEL", "WARNING")
# A runtime dir of this session's own: Workers, CLI runs and ranks started by the tests
# inherit it, so a concurrent session on the same machine can neither hide nor cause a
# leak here. The session fixture requires it empty at the end, then removes it.
_RUNTIME_DIR = Path(tempfile.mkdtemp(prefix="phalanx-suite-"))
os.environ["PHALANX_RUNTIME_DIR"] = str(_RUNTIME_DIR)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Snapshot processes, fds, threads, /dev/shm and the runtime dir; compare at the end."""
    before = Snapshot.take()
    yield
    grown = wait_settled(before)
    if grown:
        lines = [f"  {kind}: {items[:20]}" for kind, items in grown.items()]
        pytest.fail("the test suite left resources behind:\n" + "\n".join(lines), pytrace=False)
    _RUNTIME_DIR.rmdir()  # fails (and so fails the run) if anything is left in it
