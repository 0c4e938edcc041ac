"""Suite-wide fixtures. The session fixture fails the run on anything left behind."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from leaks import Snapshot, wait_settled
from phalanx.comm.rank_state import pid_alive

os.environ.setdefault("PHALANX_LOG_LEVEL", "WARNING")
# A runtime dir of this session's own: Workers, CLI runs and ranks started by the tests
# inherit it, so a concurrent session on the same machine can neither hide nor cause a
# leak here. The session fixture requires it empty at the end, then removes it.
_PREFIX = "phalanx-suite-"


def _sweep_killed_sessions() -> list[str]:
    """Remove the runtime dirs of earlier sessions that were killed (SIGKILL, a timeout)
    before their teardown could run: their name carries the session's pid, and nothing
    else ever reaps them (each session has a dir of its own). Returns what it removed."""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(_PREFIX + "*"):
        pid = d.name[len(_PREFIX):].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


_SWEPT = _sweep_killed_sessions()
_RUNTIME_DIR = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
os.environ["PHALANX_RUNTIME_DIR"] = str(_RUNTIME_DIR)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Snapshot processes, fds, threads, /dev/shm and the runtime dir; compare at the end."""
    if _SWEPT:  # not this session's leak, but one to see: a killed run left it
        print(f"\nconftest: removed the runtime dirs of killed test sessions: {_SWEPT}",
              file=sys.stderr)
    before = Snapshot.take()
    yield
    grown = wait_settled(before)
    if grown:
        lines = [f"  {kind}: {items[:20]}" for kind, items in grown.items()]
        pytest.fail("the test suite left resources behind:\n" + "\n".join(lines), pytrace=False)
    _RUNTIME_DIR.rmdir()  # fails (and so fails the run) if anything is left in it


def pytest_unconfigure(config: pytest.Config) -> None:
    """A session whose tests were all skipped or deselected never set the fixture above
    up, so its (empty) runtime dir goes here; the fixture removed it otherwise."""
    if _RUNTIME_DIR.is_dir():
        _RUNTIME_DIR.rmdir()  # a leak in it fails loudly here too
