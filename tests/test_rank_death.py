"""A dead or hung rank fails what depends on it at once (issue 13, item 6).

Every case kills (SIGKILL) or stops (SIGSTOP) one rank while every rank is busy: in a
long task, in an allreduce, in a barrier; each rank in turn. The survivors' tasks block
on something that never ends (an Event nobody sets, a collective with a 300 s deadline),
so the old behaviour (the run failed only when the survivors' tasks ended) fails the
time bound. Bounds are generous (a loaded machine cannot fail them); what they rule out
is waiting for the survivors.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import phalanx
from leaks import Snapshot, wait_settled
from phalanx.comm import DomainView
from phalanx.lifecycle import CleanupError
from phalanx.runtime import (
    RankDiedError,
    RankHungError,
    WorkerPoisonedError,
    rank_services,
)
from waits import wait_for

RANKS = 2
FAIL_BOUND_S = 20.0  # the run must fail within this (the survivors never end)
HUNG_DEADLINE_S = 6.0  # the busy tasks' deadline: a stopped rank is hung once it passes
CLOSE_TIMEOUT_S = 10.0


# -- what each rank runs (module level: shipped by reference) --------------------------
def _enter(marker_dir: str) -> None:
    Path(marker_dir, f"in-{phalanx.current_rank()}").touch()


def _block_forever(marker_dir: str) -> None:
    _enter(marker_dir)
    threading.Event().wait()


def _allreduce(d: DomainView, marker_dir: str, victim: int) -> Any:
    if phalanx.current_rank() == victim:
        _block_forever(marker_dir)  # never arrives: the others wait in the allreduce
    _enter(marker_dir)
    return d.allreduce(np.ones(1024, dtype=np.float32))


def _barrier(d: DomainView, marker_dir: str, victim: int) -> None:
    if phalanx.current_rank() == victim:
        _block_forever(marker_dir)
    _enter(marker_dir)
    d.barrier(timeout=300)


def _busy_run(kind: str, marker_dir: str, victim: int) -> Any:
    def orch(o: phalanx.Orchestrator) -> None:
        opts = o.options(timeout=HUNG_DEADLINE_S)
        if kind == "task":
            futures = [opts.submit(r, _block_forever, marker_dir) for r in o.ranks]
        else:
            d = o.allocate_domain("death", list(o.ranks), window_size=4096)
            fn = _allreduce if kind == "allreduce" else _barrier
            futures = [opts.submit(r, fn, d, marker_dir, victim) for r in o.ranks]
        for f in futures:
            f.result()
    return orch


# -- the campaign ----------------------------------------------------------------------
# The quick pass kills the last rank in each kind of wait and stops it in a task (a stop
# costs the hung deadline, HUNG_DEADLINE_S, a case); the rest of the campaign is slow.
def _campaign() -> list[Any]:
    cases = []
    for sig, sig_id in ((signal.SIGKILL, "kill"), (signal.SIGSTOP, "stop")):
        for kind in ("task", "allreduce", "barrier"):
            for victim in range(RANKS):
                quick = victim == RANKS - 1 and (sig is signal.SIGKILL or kind == "task")
                cases.append(pytest.param(sig, kind, victim, id=f"{sig_id}-{kind}-{victim}",
                                          marks=() if quick else pytest.mark.slow))
    return cases


@pytest.mark.parametrize(("sig", "kind", "victim"), _campaign())
def test_a_lost_rank_fails_the_run_at_once(sig: signal.Signals, kind: str, victim: int,
                                          tmp_path: Path) -> None:
    before = Snapshot.take()
    # domain_timeout 300: a survivor waiting on a stopped peer never gives up by itself
    w = phalanx.Worker(ranks=RANKS, domain_timeout=300, close_timeout=CLOSE_TIMEOUT_S)
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])
        outcome: list[BaseException | None] = []

        def drive() -> None:
            try:
                w.run(_busy_run(kind, str(tmp_path), victim))
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001  inspected below
                outcome.append(exc)

        runner = threading.Thread(target=drive)
        runner.start()
        wait_for(lambda: len(list(tmp_path.glob("in-*"))) == RANKS, 60, "every rank busy")
        os.kill(pids[victim], sig)
        lost_at = time.monotonic()
        runner.join(FAIL_BOUND_S + (HUNG_DEADLINE_S if sig is signal.SIGSTOP else 0))
        assert not runner.is_alive(), "Worker.run waited on the survivors' tasks"
        elapsed = time.monotonic() - lost_at
        err = outcome[0]
        expected = RankHungError if sig is signal.SIGSTOP else RankDiedError
        assert isinstance(err, expected), repr(err)
        assert err.rank == victim and err.pid == pids[victim]
        assert f"rank {victim} (pid {pids[victim]})" in str(err)
        assert sig.name in str(err)
        assert elapsed < FAIL_BOUND_S + HUNG_DEADLINE_S
        assert victim not in w.alive_ranks()
        with pytest.raises(WorkerPoisonedError, match=f"rank {victim}"):
            w.run(lambda o: None)
    finally:
        t0 = time.monotonic()
        w.close()
        closed_in = time.monotonic() - t0
    # close(): SHUTDOWN, a short grace for abandoned tasks, SIGKILL for the rest
    assert closed_in < CLOSE_TIMEOUT_S + 10
    assert wait_settled(before) == {}


def test_a_survivor_in_a_barrier_notices_a_dead_peer_and_its_task_ends(
        tmp_path: Path) -> None:
    """The survivor's own wait (pid checks every 50 ms) ends its task: its rank is not
    killed at close, it stops gracefully."""
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2, domain_timeout=300)
    futures: list[phalanx.TaskFuture] = []
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])

        def orch(o: phalanx.Orchestrator) -> None:
            d = o.allocate_domain("survivor", [0, 1], window_size=4096)
            futures.extend(o.submit(r, _barrier, d, str(tmp_path), 1) for r in (0, 1))
            for f in futures:
                f.result()

        h = w.submit(orch)
        wait_for(lambda: len(list(tmp_path.glob("in-*"))) == 2, 60, "both ranks busy")
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RankDiedError, match=r"rank 1 .*SIGKILL"):
            h.result(timeout=FAIL_BOUND_S)
        assert futures[0].wait_finished(FAIL_BOUND_S), "rank 0's barrier kept waiting"
        assert w.stats().ranks_alive == 1
        assert h.wait_retired(FAIL_BOUND_S)  # its task ended: the fence passed by itself
    finally:
        w.close()
    assert wait_settled(before) == {}


def test_submit_handle_fails_at_once_too(tmp_path: Path) -> None:
    before = Snapshot.take()
    w = phalanx.Worker(ranks=3)
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])
        h = w.submit(_busy_run("task", str(tmp_path), 2))
        wait_for(lambda: len(list(tmp_path.glob("in-*"))) == 3, 60, "every rank busy")
        os.kill(pids[2], signal.SIGKILL)
        with pytest.raises(RankDiedError, match=f"rank 2 \\(pid {pids[2]}\\) was killed by "
                                                f"SIGKILL"):
            h.result(timeout=FAIL_BOUND_S)
        assert not h.retired  # ranks 0 and 1 still run their abandoned tasks
    finally:
        w.close()
    assert h.retired
    assert wait_settled(before) == {}


# -- the seams -------------------------------------------------------------------------
def _pid_then_block(marker_dir: str) -> int:
    if phalanx.current_rank() == 1:
        _block_forever(marker_dir)
    _enter(marker_dir)
    threading.Event().wait()
    return 0


def test_call_ranks_fails_every_part_when_one_rank_dies(tmp_path: Path) -> None:
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2)
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])
        assert {r: o.unwrap() for r, o in w.call_ranks([0, 1], os.getpid).items()} == \
            dict(enumerate(pids))
        out: dict[int, Any] = {}
        caller = threading.Thread(
            target=lambda: out.update(w.call_ranks([0, 1], _pid_then_block, str(tmp_path))))
        caller.start()
        wait_for(lambda: len(list(tmp_path.glob("in-*"))) == 2, 60, "both ranks busy")
        os.kill(pids[1], signal.SIGKILL)
        caller.join(FAIL_BOUND_S)
        assert not caller.is_alive()
        assert all(isinstance(o.error, RankDiedError) and o.error.rank == 1
                   for o in out.values()), out
        assert w.alive_ranks() == [0]
    finally:
        w.close()
    assert wait_settled(before) == {}


def _open_service(path: str, fail: bool) -> None:
    def close() -> None:
        if fail:
            raise OSError(5, f"rank {phalanx.current_rank()} service says no")
        Path(path).write_text("closed")

    rank_services().register("test.service", object(), close)


def test_close_closes_every_rank_service_and_reports_a_failure_by_rank(
        tmp_path: Path) -> None:
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2)
    steps: list[str] = []
    w.add_close_step("a step of a layer above", lambda: steps.append("ran"))
    w.run(lambda o: [o.submit(r, _open_service, str(tmp_path / f"r{r}"), r == 1).result()
                     for r in o.ranks])
    with pytest.raises(CleanupError) as info:
        w.close()
    (step_error,) = info.value.exceptions
    assert isinstance(step_error, CleanupError)
    assert "rank services failed to close on ranks [1]" in str(step_error)
    (rank_error,) = step_error.exceptions
    assert "rank 1 services" in str(rank_error)
    assert "service says no" in repr(getattr(rank_error, "exceptions", rank_error))
    assert (tmp_path / "r0").read_text() == "closed"
    assert steps == ["ran"]
    w.close()  # the failed step was retried once more (it fails again: the rank closes it)
    assert wait_settled(before) == {}


def test_a_run_cannot_start_tasks_once_a_rank_died(tmp_path: Path) -> None:
    """After a loss, every live run has failed: a task submitted later (to a live rank)
    fails at once instead of being sent, so an orch function never waits on it."""
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2)
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])

        def orch(o: phalanx.Orchestrator) -> str:
            first = o.submit(1, _block_forever, str(tmp_path))
            wait_for(lambda: (tmp_path / "in-1").exists(), 60, "rank 1 busy")
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(RankDiedError, match="rank 1"):
                first.result(timeout=FAIL_BOUND_S)
            late = o.submit(0, _block_forever, str(tmp_path))
            assert late.done() and late.finished  # never sent
            with pytest.raises(RankDiedError, match=f"rank 1 \\(pid {pids[1]}\\)"):
                late.result()
            return "observed"

        assert w.run(orch) == "observed"
        assert not (tmp_path / "in-0").exists()
        assert w.call_ranks([0], os.getpid)[0].unwrap() == pids[0]  # close steps still work
    finally:
        w.close()
    assert wait_settled(before) == {}


def _block_unless_rank0(marker_dir: str) -> int:
    _enter(marker_dir)
    if phalanx.current_rank() != 0:
        threading.Event().wait()
    return 0


def test_a_stopped_rank_fails_its_call_ranks_call_once_a_deadline_passes(
        tmp_path: Path) -> None:
    before = Snapshot.take()
    w = phalanx.Worker(ranks=3)
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])
        out: dict[int, Any] = {}
        caller = threading.Thread(target=lambda: out.update(w.call_ranks(
            [0, 1, 2], _block_unless_rank0, str(tmp_path), timeout=HUNG_DEADLINE_S)))
        caller.start()
        wait_for(lambda: len(list(tmp_path.glob("in-*"))) == 3, 60, "every rank busy")
        os.kill(pids[2], signal.SIGSTOP)
        caller.join(FAIL_BOUND_S + HUNG_DEADLINE_S)
        assert not caller.is_alive()
        assert out[0].unwrap() == 0  # it had finished: its outcome stands
        for r in (1, 2):  # rank 1 runs on, but its call depends on the stopped rank 2
            err = out[r].error
            assert isinstance(err, RankHungError) and err.rank == 2, out
            assert f"rank 2 (pid {pids[2]}) is stopped by SIGSTOP" in str(err)
        assert w.alive_ranks() == [0, 1]
    finally:
        t0 = time.monotonic()
        w.close()
    assert time.monotonic() - t0 < CLOSE_TIMEOUT_S
    assert wait_settled(before) == {}


def test_close_kills_an_idle_stopped_rank_at_once() -> None:
    """Nothing waits on a stopped rank without a deadline; close() does not even try."""
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2)  # close_timeout: 30 s
    pid = w.run(lambda o: o.submit(1, os.getpid).result())
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 15  # not the 30 s close deadline
    assert w.stats().ranks_alive == 0
    assert wait_settled(before) == {}


def _stop_myself() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _open_self_stopping_service() -> None:
    rank_services().register("test.stops", object(), _stop_myself)


def test_a_rank_stopped_inside_close_is_killed_without_waiting_for_it() -> None:
    """Rank 1's service stops its own process when close() asks it to close: the close
    step does not wait out its timeout on it, and close() does not report the rank's
    services as failed (the process is killed and reaped, which is the report)."""
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2)  # close_timeout 30 s; the services step 10 s
    w.run(lambda o: o.submit(1, _open_self_stopping_service).result())
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 8
    assert w.stats().ranks_alive == 0
    assert wait_settled(before) == {}


# -- the review's findings (R1, R3, R4) -------------------------------------------------
def _fork_then_block(marker_dir: str) -> None:
    """Rank 1 forks a child that keeps every inherited descriptor, the control channel
    too: the rank's death then brings no EOF; only its pid tells."""
    if phalanx.current_rank() == 1:
        pid = os.fork()
        if pid == 0:
            time.sleep(120)  # killed by the test; bounded if the test dies first
            os._exit(0)
        Path(marker_dir, "child").write_text(str(pid))
    _block_forever(marker_dir)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")
def test_a_dead_rank_whose_child_holds_its_channel_fails_the_run_at_once(
        tmp_path: Path) -> None:
    """R1: the parent watches each rank's pid (a pidfd in the hub's selector), not only
    its channel's EOF, which a forked child delays for as long as it lives."""
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2, close_timeout=CLOSE_TIMEOUT_S)
    child = 0
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])
        outcome: list[BaseException | None] = []

        def orch(o: phalanx.Orchestrator) -> None:
            opts = o.options(timeout=60)  # the old code failed only here, TaskTimeoutError
            for f in [opts.submit(r, _fork_then_block, str(tmp_path)) for r in o.ranks]:
                f.result()

        def drive() -> None:
            try:
                w.run(orch)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001  inspected below
                outcome.append(exc)

        runner = threading.Thread(target=drive)
        runner.start()
        wait_for(lambda: (tmp_path / "child").exists() and
                  len(list(tmp_path.glob("in-*"))) == 2, 60, "both ranks busy, child forked")
        child = int((tmp_path / "child").read_text())
        os.kill(pids[1], signal.SIGKILL)
        runner.join(FAIL_BOUND_S)
        assert not runner.is_alive(), "the death went unnoticed while the child lived"
        err = outcome[0]
        assert isinstance(err, RankDiedError) and err.rank == 1, repr(err)
        assert f"rank 1 (pid {pids[1]}) was killed by SIGKILL" in str(err)
        assert w.alive_ranks() == [0]
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        w.close()
    assert wait_settled(before) == {}


def test_call_ranks_with_a_rank_already_lost_fails_every_part_at_once(
        tmp_path: Path) -> None:
    """R3: a part refused at admission (its rank is lost) fails its siblings too; none of
    them is sent (rank 0 never starts the call's function)."""
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2)
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: 1 not in w.alive_ranks(), 20, "rank 1's death noticed")
        t0 = time.monotonic()
        out = w.call_ranks([0, 1], _block_forever, str(tmp_path), timeout=30)
        assert time.monotonic() - t0 < 5, "a part waited out its timeout"
        for r in (0, 1):
            err = out[r].error
            assert isinstance(err, RankDiedError) and err.rank == 1, out
        assert not (tmp_path / "in-0").exists()
        assert w.call_ranks([0], os.getpid)[0].unwrap() == pids[0]  # live ranks still work
    finally:
        w.close()
    assert wait_settled(before) == {}


def _size(b: bytes) -> int:
    return len(b)


def test_a_large_task_for_a_stopped_rank_fails_by_its_deadline_not_never(
        tmp_path: Path) -> None:
    """R4: a send to a rank that stopped reading is bounded by the task's deadline: the
    submitter gets RankHungError then (the old code blocked in sendall forever, with the
    rank's send lock held), and close() is not held up."""
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2, close_timeout=CLOSE_TIMEOUT_S)
    outcome: list[BaseException | int] = []
    runner = None
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])
        os.kill(pids[1], signal.SIGSTOP)
        wait_for(lambda: psutil.Process(pids[1]).status() == psutil.STATUS_STOPPED, 20,
                  "rank 1 stopped")

        def drive() -> None:
            try:
                outcome.append(w.run(lambda o: o.options(timeout=HUNG_DEADLINE_S).submit(
                    1, _size, b"x" * (8 << 20)).result()))
            except BaseException as exc:  # noqa: BLE001  inspected below
                outcome.append(exc)

        runner = threading.Thread(target=drive, daemon=True)
        t0 = time.monotonic()
        runner.start()
        assert w.call_ranks([0], os.getpid)[0].unwrap() == pids[0]  # the hub still serves
        runner.join(FAIL_BOUND_S + HUNG_DEADLINE_S)
        assert not runner.is_alive(), "the submitter is still blocked in its send"
        err = outcome[0]
        assert isinstance(err, RankHungError) and err.rank == 1, repr(err)
        assert f"rank 1 (pid {pids[1]}) is stopped by SIGSTOP" in str(err)
        assert time.monotonic() - t0 >= HUNG_DEADLINE_S - 0.5  # the rule waits its deadline
    finally:
        t1 = time.monotonic()
        w.close()
        closed_in = time.monotonic() - t1
        if runner is not None:
            runner.join(5)
    assert closed_in < CLOSE_TIMEOUT_S
    assert wait_settled(before) == {}


def _fork_then_barrier(d: DomainView, marker_dir: str) -> None:
    if phalanx.current_rank() == 1:
        _fork_then_block(marker_dir)
    _enter(marker_dir)
    d.barrier(timeout=300)


def test_without_pidfd_a_survivors_symptom_does_not_hide_the_death(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """R2 (fixed by 38acf6d), on the fallback path without a pidfd: rank 1's EOF is
    delayed by its forked child, so rank 0's failed barrier (the symptom) reaches the
    parent first; the run still fails with rank 1's RankDiedError, not the
    CollectiveError, because a failed result looks for a rank on its way out first."""
    from phalanx.runtime import rank_process

    monkeypatch.setattr(rank_process, "_open_pidfd", lambda pid: None)
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2, domain_timeout=300, close_timeout=CLOSE_TIMEOUT_S)
    child = 0
    try:
        pids = w.run(lambda o: [o.submit(r, os.getpid).result() for r in o.ranks])
        outcome: list[BaseException | None] = []

        def orch(o: phalanx.Orchestrator) -> None:
            d = o.allocate_domain("blame", [0, 1], window_size=4096)
            opts = o.options(timeout=60)
            for f in [opts.submit(r, _fork_then_barrier, d, str(tmp_path)) for r in o.ranks]:
                f.result()

        def drive() -> None:
            try:
                w.run(orch)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001  inspected below
                outcome.append(exc)

        runner = threading.Thread(target=drive)
        runner.start()
        wait_for(lambda: (tmp_path / "child").exists() and
                  len(list(tmp_path.glob("in-*"))) == 2, 60, "both ranks busy, child forked")
        child = int((tmp_path / "child").read_text())
        os.kill(pids[1], signal.SIGKILL)
        runner.join(FAIL_BOUND_S)
        assert not runner.is_alive(), "the run waited for the survivor's deadline"
        err = outcome[0]
        assert isinstance(err, RankDiedError) and err.rank == 1, repr(err)
        assert f"rank 1 (pid {pids[1]}) was killed by SIGKILL" in str(err)
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        w.close()
    assert wait_settled(before) == {}
