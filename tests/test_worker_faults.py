"""Rank death, parent death, and 50 Workers in a row: nothing may be left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import psutil
import pytest

import phalanx
from leaks import Snapshot, wait_settled
from phalanx.lifecycle import CleanupError
from phalanx.runtime import RankDiedError, WorkerPoisonedError
from phalanx.runtime.run import Orchestrator, Run, RunHandle
from phalanx.runtime.tasks import TaskFuture


@pytest.mark.slow  # a campaign
def test_fifty_workers_in_a_row_leave_nothing() -> None:
    with phalanx.Worker(ranks=2) as w:  # warm imports and lazily created singletons
        w.run(lambda o: None)
    before = Snapshot.take()
    for _ in range(50):
        with phalanx.Worker(ranks=2) as w:
            assert w.run(lambda o: [o.submit(r, abs, -r).result() for r in o.ranks]) == [0, 1]
    assert wait_settled(before) == {}


@pytest.mark.parametrize("how", ["sigkill", "segfault", "os_exit"])
def test_rank_death_mid_run_fails_run_naming_rank(how: str) -> None:
    def die() -> None:
        time.sleep(0.2)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            import ctypes

            ctypes.string_at(0)
        else:
            os._exit(7)

    expect = {"sigkill": "killed by SIGKILL", "segfault": "killed by SIGSEGV",
              "os_exit": "exited with code 7"}[how]
    before = Snapshot.take()
    w = phalanx.Worker(ranks=3)
    t0 = time.monotonic()
    def orch(o: phalanx.Orchestrator) -> None:
        futures = [o.submit(0, time.sleep, 0.5), o.submit(1, time.sleep, 0.5), o.submit(2, die)]
        for f in futures:
            f.result()

    with pytest.raises(RankDiedError, match=f"rank 2 .*{expect}") as info:
        w.run(orch)
    assert info.value.rank == 2
    assert time.monotonic() - t0 < 10
    with pytest.raises(WorkerPoisonedError, match="rank 2"):
        w.submit(lambda o: None)
    w.close()
    assert wait_settled(before) == {}


_PARENT_SCRIPT = textwrap.dedent("""
    import sys, threading, time, phalanx
    def busy():
        time.sleep(600)
    def main():
        w = phalanx.Worker(ranks=3)
        w.submit(lambda o: [o.submit(r, busy) for r in o.ranks])
        time.sleep(0.3)
        print(" ".join(str(p.pid) for p in w._procs.values()), flush=True)
        time.sleep(600)
    if sys.argv[1] == "thread":
        threading.Thread(target=main).start()
    else:
        main()
""")


@pytest.mark.parametrize("where", ["main", "thread"])
def test_parent_sigkill_takes_every_rank_within_two_seconds(where: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_SCRIPT, where],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    killed_at = time.monotonic()
    while time.monotonic() - killed_at < 2.0 and any(_alive(p) for p in pids):
        time.sleep(0.02)
    assert not any(_alive(p) for p in pids), "ranks outlived their parent by 2 s"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_leak_detector_sees_an_unclosed_worker() -> None:
    before = Snapshot.take()
    w = phalanx.Worker(ranks=1)
    try:
        grown = Snapshot.take().grown_since(before)
        assert {"children", "threads", "fds"} <= grown.keys()
    finally:
        w.close()
    assert wait_settled(before) == {}


# -- the review's findings (R5, R6) -----------------------------------------------------
class _FinishesWhileDrainLooks(TaskFuture):
    """Unfinished at the drain's first look, finished at every later one: the rank's
    report landing (on the hub thread) between two looks, made deterministic."""

    __slots__ = ("looks",)

    @property
    def finished(self) -> bool:  # type: ignore[override]
        self.looks = getattr(self, "looks", 0) + 1
        return self.looks > 1


def test_a_task_finishing_while_the_drain_looks_still_settles_the_run() -> None:
    """R5: Run._drain looked twice at which tasks were unfinished; a task finishing in
    between made the second look find none, StopIteration escaped Run.execute and the
    run never settled (result() blocked forever)."""
    retired: list[Run] = []

    class _Submitter:
        ranks = (0,)

        def _run_retired(self, run: Run) -> None:
            retired.append(run)

    run = Run(1, "orch", _Submitter())  # type: ignore[arg-type]
    fut = _FinishesWhileDrainLooks(0, 1, "t", 1, 60.0)

    def orch(o: Orchestrator) -> str:
        run.add_task(fut)
        fut.abandon(RankDiedError("rank 1 died", 1, None))
        assert fut.exception() is not None  # the orch saw the failure and handled it
        return "handled"

    run.execute(orch, (), {}, Orchestrator(run), wait_fence=False)
    assert run.settled.wait(10), "the run never settled"
    with pytest.raises(RankDiedError, match="rank 1 died"):  # it was unfinished at the look
        RunHandle(run).result(timeout=0)
    fut.set_exception(RankDiedError("rank 1 died", 1, None))  # the report: its fence passes
    assert run.retired.wait(10) and retired == [run]


def _failing_once() -> Callable[[], None]:
    calls = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "a close step says no")
    return step


def test_an_error_in_a_with_block_comes_up_beside_a_failing_close() -> None:
    """R6: the with block's error is in close()'s CleanupError, not hidden in its
    __context__; an interrupt stays an interrupt, with the close failure in a note."""
    before = Snapshot.take()
    w = phalanx.Worker(ranks=1)
    w.add_close_step("a step that fails once", _failing_once())
    with pytest.raises(CleanupError) as info, w:
        raise ValueError("the block failed")
    kinds = [type(e) for e in info.value.exceptions]
    assert ValueError in kinds, info.value.exceptions
    assert "the with block failed (ValueError('the block failed'))" in str(info.value)
    w.close()  # retries the failed step: it passes now

    w = phalanx.Worker(ranks=1)
    w.add_close_step("a step that fails once", _failing_once())
    with pytest.raises(KeyboardInterrupt) as interrupt, w:
        raise KeyboardInterrupt
    assert any("closing worker" in n and "a close step says no" in n
               for n in getattr(interrupt.value, "__notes__", [])), interrupt.value
    w.close()

    w = phalanx.Worker(ranks=1)
    with pytest.raises(ValueError, match="plain"), w:  # a clean close: the error as it is
        raise ValueError("plain")
    assert wait_settled(before) == {}
