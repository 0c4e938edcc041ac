"""The Worker with real rank processes: runs, tasks, failures, fences."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

import phalanx
from phalanx.lifecycle import CleanupError, FailpointError
from phalanx.runtime import (
    MessageTooLargeError,
    RankStartError,
    RunClosedError,
    TaskTimeoutError,
    WorkerClosedError,
    WorkerPoisonedError,
)
from phalanx.runtime._errors import RemoteTraceback


def double(x: int) -> int:
    return 2 * x


def fail(msg: str) -> None:
    raise KeyError(msg)


def test_issue_example_three_ranks() -> None:
    def orch(o: phalanx.Orchestrator, n: int) -> list[int]:
        futures = [o.submit(rank, double, n + rank) for rank in o.ranks]
        return [f.result() for f in futures]

    with phalanx.Worker(ranks=3) as worker:
        assert worker.run(orch, 10) == [20, 22, 24]


def test_tasks_run_in_their_rank_process() -> None:
    with phalanx.Worker(ranks=2) as w:
        got = w.run(lambda o: [o.submit(r, lambda: (phalanx.current_rank(), os.getpid()))
                               .result() for r in o.ranks])
        assert [r for r, _ in got] == [0, 1]
        assert len({pid for _, pid in got} | {os.getpid()}) == 3


def test_task_exception_keeps_type_and_remote_traceback() -> None:
    with phalanx.Worker(ranks=2) as w:
        with pytest.raises(KeyError) as info:
            w.run(lambda o: o.submit(1, fail, "nope").result())
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "in fail" in cause.tb and "KeyError: 'nope'" in cause.tb
        assert any("rank 1" in note for note in info.value.__notes__)
        # a failed task fails its run, not the worker
        assert w.run(lambda o: o.submit(0, double, 4).result()) == 8
        assert w.stats().poisoned is None


def test_unobserved_task_failure_fails_the_run() -> None:
    with phalanx.Worker(ranks=1) as w, pytest.raises(KeyError):
        w.run(lambda o: o.submit(0, fail, "silent") and None)


def test_many_runs_in_a_row_and_stats() -> None:
    with phalanx.Worker(ranks=2) as w:
        for i in range(300):
            assert w.run(lambda o, i=i: o.submit(i % 2, double, i).result()) == 2 * i
        s = w.stats()
        assert (s.runs_admitted, s.runs_retired, s.runs_failed) == (300, 300, 0)
        assert (s.tasks_submitted, s.tasks_succeeded, s.ranks_alive) == (300, 300, 2)


def test_concurrent_runs() -> None:
    def orch(o: phalanx.Orchestrator, k: int) -> list[int]:
        fs = [o.submit(r, _sleep_then, 0.05, k * 10 + r) for r in o.ranks]
        return [f.result() for f in fs]

    with phalanx.Worker(ranks=3) as w:
        handles = [w.submit(orch, k) for k in range(12)]
        assert [h.result(timeout=30) for h in handles] == [
            [k * 10, k * 10 + 1, k * 10 + 2] for k in range(12)]
        assert all(h.retired for h in handles)


def _sleep_then(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


def test_orch_raising_after_submit_still_drains_its_tasks() -> None:
    futures = []

    def orch(o: phalanx.Orchestrator) -> None:
        futures.append(o.submit(0, _sleep_then, 0.3, 7))
        raise ValueError("orch gave up")

    with phalanx.Worker(ranks=1) as w:
        h = w.submit(orch)
        with pytest.raises(ValueError, match="orch gave up"):
            h.result(timeout=30)
        # the fence: the run retired only after its task physically finished
        assert h.retired and futures[0].finished and futures[0].result() == 7


def test_submit_after_orch_returned_is_refused() -> None:
    leaked = []
    with phalanx.Worker(ranks=1) as w:
        w.run(lambda o: leaked.append(o))
        with pytest.raises(RunClosedError):
            leaked[0].submit(0, double, 1)


def test_task_past_deadline_fails_run_and_close_stops_rank() -> None:
    w = phalanx.Worker(ranks=2)
    try:
        h = w.submit(lambda o: o.options(timeout=0.5).submit(1, time.sleep, 60).result())
        with pytest.raises(TaskTimeoutError, match="rank 1"):
            h.result(timeout=30)
        assert not h.retired  # the rank is still running it: the fence has not passed
        assert w.run(lambda o: o.submit(0, double, 2).result()) == 4  # others still work
    finally:
        w.close(timeout=1.0)
    assert h.retired


def test_message_size_limit() -> None:
    with phalanx.Worker(ranks=1, max_message_bytes=1 << 20) as w:
        with pytest.raises(MessageTooLargeError, match="over the control channel's limit"):
            w.run(lambda o: o.submit(0, len, b"x" * (2 << 20)))
        with pytest.raises(MessageTooLargeError, match="result of task"):
            w.run(lambda o: o.submit(0, bytes, 2 << 20).result())
        assert w.run(lambda o: o.submit(0, len, b"x" * 1000).result()) == 1000


def test_failed_cleanup_poisons_and_close_still_works() -> None:
    def bad_release() -> None:
        raise OSError(5, "device said no")

    w = phalanx.Worker(ranks=1)
    with pytest.raises(CleanupError, match="window release"):
        w.run(lambda o: o.defer("window release", bad_release))
    with pytest.raises(WorkerPoisonedError, match=r"window release.*only close"):
        w.run(lambda o: None)
    assert "window release" in (w.stats().poisoned or "")
    w.close()
    with pytest.raises(WorkerClosedError):
        w.submit(lambda o: None)


def test_rank_that_cannot_start_is_named_with_exit_code_and_stderr() -> None:
    with pytest.raises(RankStartError) as info:
        phalanx.Worker(ranks=2, failpoints={"rank.start.before_hello": "raise"})
    msg = str(info.value)
    assert "rank 0" in msg and "exited with code 1" in msg
    assert "FailpointError" in msg  # the tail of the rank's stderr


def test_rank_start_deadline() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankStartError, match="did not send HELLO before the start deadline"):
        phalanx.Worker(ranks=1, start_timeout=1.0,
                       failpoints={"rank.start.before_hello": "hang:30"})
    assert time.monotonic() - t0 < 20


def test_failpoint_armed_in_one_rank() -> None:
    with phalanx.Worker(ranks=2) as w:
        w.arm_failpoint("rank.task.received", "raise", ranks=1)
        with pytest.raises(FailpointError) as info:
            w.run(lambda o: o.submit(1, double, 1).result())
        assert info.value.rank == 1 and info.value.point == "rank.task.received"
        assert w.run(lambda o: o.submit(0, double, 1).result()) == 2
        w.disarm_failpoints()
        assert w.run(lambda o: o.submit(1, double, 1).result()) == 2


def test_close_is_idempotent_and_retries_only_what_is_left() -> None:
    from phalanx.lifecycle import failpoints

    w = phalanx.Worker(ranks=2)
    failpoints.arm("worker.close.stop_ranks", "raise*1")
    try:
        with pytest.raises(CleanupError, match="stop rank processes"):
            w.close()
    finally:
        failpoints.disarm_all()
    assert w.stats().ranks_alive == 2  # the failed step stays owed
    w.close()
    assert w.stats().ranks_alive == 0 and w.state.value == "closed"
    w.close()


def test_rank_log_lines_are_tagged(capfd: pytest.CaptureFixture[str]) -> None:
    def shout() -> None:
        logging.getLogger("user").warning("hello from a task")

    with phalanx.Worker(ranks=2) as w:
        w.run(lambda o: o.submit(1, shout).result())
    deadline = time.monotonic() + 5
    err = ""
    while time.monotonic() < deadline and "hello from a task" not in err:
        err += capfd.readouterr().err
        time.sleep(0.05)
    assert "[rank 1] WARNING user: hello from a task" in err


def test_worker_created_off_the_main_thread() -> None:
    out: list[int] = []

    def make() -> None:
        with phalanx.Worker(ranks=1) as w:
            out.append(w.run(lambda o: o.submit(0, double, 21).result()))

    t = threading.Thread(target=make)
    t.start()
    t.join(30)
    assert out == [42]


def test_rank_scheduler_policy() -> None:
    with phalanx.Worker(ranks=1) as w:  # default: batch (docs/design.md, Runtime)
        assert w.run(lambda o: o.submit(0, os.sched_getscheduler, 0).result()) == \
            os.SCHED_BATCH
    with phalanx.Worker(ranks=1, rank_scheduler="other") as w:
        assert w.run(lambda o: o.submit(0, os.sched_getscheduler, 0).result()) == \
            os.SCHED_OTHER
    with pytest.raises(ValueError, match="rank_scheduler"):
        phalanx.Worker(ranks=1, rank_scheduler="fifo")
