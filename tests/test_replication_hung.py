"""A peer stopped (SIGSTOP) or killed in the middle of a maintenance burst: the job
fails fast and exits within its deadlines, naming the peer, leaving nothing behind.

The regression: with a peer SIGSTOPped during ``phalanx cache maintain``, the link
reported the stall at job_timeout, but closing the cache waited on the stopped rank's
close task without a deadline (its task timeout, 600 s), so the command exited only
when the peer was resumed. Now every close and audit task has a deadline, a stalled
link shuts its socket (a writer blocked on the hung peer's full buffer wakes), and the
Worker's close kills the rank that did not stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from phalanx.lifecycle import CleanupError
from phalanx.replication import LinkClosedError, LinkStalledError, ReplicatedCache
from phalanx.runtime import RankDiedError, Worker
from replication_util import RANKS, copy_dirs, open_cache, rank_pid, synth

# a campaign (hosts on network namespaces, faults across ranks, a benchmark's quick
# run): the full suite runs it, the inner loop (-m 'not slow') does not
pytestmark = pytest.mark.slow

JOB_TIMEOUT = 2.0
CLOSE_TIMEOUT = 3.0
WORKER_CLOSE = 5.0
MARGIN = 15.0  # a loaded 2-core machine: start-up of the error path, kill and reap


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hung-tpl") / "cache"
    synth(d, 1200, "chain")  # 1,050 thinnable rows on every rank: the burst
    return d


def _wait_applied(cache: ReplicatedCache, peer: int, at_least: int, deadline: float) -> None:
    """Until the peer applied ``at_least`` ops of the burst (it is under way)."""
    while time.monotonic() < deadline:
        if cache.stats(timeout=10)[peer].get("applied", 0) >= at_least:
            return
        time.sleep(0.05)
    pytest.fail(f"the burst did not reach peer rank {peer} in time")


@pytest.mark.parametrize("fault", ["stop", "kill"])
@pytest.mark.parametrize("peer", [1, 2])
def test_a_peer_fault_during_a_burst_fails_fast(template: Path, tmp_path: Path, peer: int,
                                                fault: str) -> None:
    d = copy_dirs(template, tmp_path / "cache")
    # the faulted peer applies slowly (2 ms an op), so the burst is still under way
    w = Worker(ranks=RANKS, close_timeout=WORKER_CLOSE)
    pid = 0
    try:
        cache = open_cache(w, d, job_timeout=JOB_TIMEOUT, close_timeout=CLOSE_TIMEOUT,
                           window=8)
        before = cache.stats()[peer]["applied"]
        w.arm_failpoint("cache.replica.apply", "delay:0.002", ranks=peer)
        pid = rank_pid(w, peer)
        errors: list[BaseException] = []
        maintaining = threading.Thread(target=_catch, args=(cache.maintain, errors))
        maintaining.start()
        _wait_applied(cache, peer, before + 20, time.monotonic() + 60)
        faulted = time.monotonic()
        os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        maintaining.join(JOB_TIMEOUT + MARGIN)
        assert not maintaining.is_alive(), "maintain() did not fail within its deadline"
        assert len(errors) == 1, errors
        # a stop: the link's watchdog; a kill: the link, or the Worker's rank monitor
        # (every task of a live run fails at once), whichever notices first
        expected = (LinkStalledError,) if fault == "stop" else (LinkClosedError, RankDiedError)
        assert isinstance(errors[0], expected), errors[0]
        assert f"rank {peer}" in str(errors[0])
        with pytest.raises(CleanupError, match=f"rank {peer}"):
            cache.close()
        # a kill: the Worker admitted no close run (it lost a rank), and closes rank 0's
        # side in its services step; the dead link was reported already (to maintain)
        w.close()
        took = time.monotonic() - faulted
        assert took < JOB_TIMEOUT + CLOSE_TIMEOUT + WORKER_CLOSE + MARGIN, took
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # never leave a stopped process behind
        with contextlib.suppress(CleanupError):
            w.close()  # the stopped rank was killed by the close above; idempotent


def _catch(fn: object, errors: list[BaseException]) -> None:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001  handed to the test thread
        errors.append(exc)
