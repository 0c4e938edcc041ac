"""The catalogue sweep: every failpoint of every layer, armed to raise, reached through
the public operation that passes it.

``COVERS`` maps each scenario to the points it reaches; the catalogue
(``phalanx.lifecycle.catalogue``) and the table must agree, so a new failpoint without
a scenario fails the build. For every point, the domain sweep's assertions
(tests/test_domain_faults.py, which also runs each comm point on every rank):

* the error reaches the caller naming the step (the point) and the rank that hit it;
* nothing leaks: processes, descriptors, threads, /dev/shm, runtime files (the suite's
  snapshots, tests/leaks.py), temp files in a store's directory;
* each release ran at most once (the ranks' resource ledgers), and a store's directory
  is exactly what its index says;
* afterwards the Worker or store is usable (the same operation succeeds) or cleanly
  closable (close() retries what a fault left owed, once).

Points whose path does not meet these today are in ``KNOWN`` with what goes wrong and
who fixes it; the sweep fails if one of them starts to pass (delete its line then).
Scenarios share Workers and stores where a fault leaves them usable, so the whole
sweep takes about a minute; its two heaviest scenarios are marked slow.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import phalanx
from cache_util import GEOM, Stores, page_row, record_files, temp_files
from leaks import Snapshot, wait_settled
from phalanx.kvstore.buffers import aligned_empty
from phalanx.kvstore.uring import Ring
from phalanx.lifecycle import CleanupError, failpoints
from phalanx.lifecycle.catalogue import layer_of
from phalanx.rendezvous import handshake
from replication_util import open_cache
from sweep_checks import Problems
from sweep_checks import attempt as _attempt
from sweep_checks import reached as _reached
from sweep_engine import api_points, engine_points, rank_step_points, serve_points
from test_domain_faults import _check_ledger, _cycle, _shm_of

PT = GEOM.page_tokens
TOKS = np.arange(10_000, 10_000 + 6 * PT)

# Where a point is hit: None for the parent (or the one process of a store), else the
# rank the scenario arms it in.
RANK: dict[str, int | None] = {}


def _close_worker(w: phalanx.Worker) -> list[BaseException]:
    """close(), retried: a fault fires once, so the retry finishes what it left owed."""
    errors: list[BaseException] = []
    for _ in range(3):
        try:
            w.close()
            return errors
        except CleanupError as exc:
            errors.append(exc)
    raise AssertionError(f"close() still failing after retries: {errors}")


def _ledgers_ok(w: phalanx.Worker) -> list[str]:
    """Every live rank's ledger: each resource released at most once, in order."""
    out = []
    for rank, report in w.resources()["ranks"].items():
        if not isinstance(report, dict):
            out.append(f"rank {rank} gave no ledger: {report}")
            continue
        try:
            _check_ledger(report["events"])
        except AssertionError as exc:
            out.append(f"rank {rank}: {exc}")
    return out


# -- kvstore: one store in this process ----------------------------------------------
def _store_points(points: list[str], tmp: Path) -> Problems:
    """Each write step faults once: nothing becomes visible, the next store succeeds."""
    problems: Problems = {}
    stores = Stores()
    try:
        for point in points:
            d = tmp / point
            s = stores.open(d)
            s.store(TOKS[: 3 * PT], page_row(TOKS[: 3 * PT]))
            before = record_files(d)
            failpoints.arm(point, "raise*1")
            errors = _attempt(s.store, TOKS, page_row(TOKS))
            failpoints.disarm_all()
            p = _reached(point, None, errors)
            if record_files(d) != before or temp_files(d):
                p.append(f"left files: {record_files(d)} {temp_files(d)}")
            if s.check():
                p.append(f"index and disk disagree: {s.check()}")
            if not s.store(TOKS, page_row(TOKS)).stored:
                p.append("the store did not take the row afterwards")
            problems[point] = p
    finally:
        for st in stores.opened:
            st.close()
    return problems


def _poll_then_store(s: Any, big: np.ndarray) -> None:
    while s.poll(1):  # thin faults fire here
        pass
    s.store(big, page_row(big))  # over capacity: evicts; remove faults here


def _poll_all(s: Any) -> None:
    for _ in range(4):
        s.poll()


def _maintenance_points(points: list[str], tmp: Path) -> Problems:
    """A thin or an eviction faults once: the index stays true, the next poll finishes."""
    problems: Problems = {}
    stores = Stores()
    try:
        for point in points:
            d = tmp / point
            s = stores.open(d, capacity_bytes=2_000)
            s.store(TOKS[: 3 * PT], page_row(TOKS[: 3 * PT]))
            s.store(TOKS, page_row(TOKS))  # the first row is now redundant: thinnable
            big = np.arange(50, 50 + 16 * PT)
            failpoints.arm(point, "raise*1")

            errors = _attempt(_poll_then_store, s, big)
            failpoints.disarm_all()
            p = _reached(point, None, errors)
            if s.check():
                p.append(f"index and disk disagree: {s.check()}")
            while s.poll():
                pass
            s.store(big, page_row(big))
            if s.check() or temp_files(d):
                p.append(f"after a retry: {s.check()} {temp_files(d)}")
            problems[point] = p
    finally:
        for st in stores.opened:
            st.close()
    return problems


def _recovery_points(points: list[str], tmp: Path) -> Problems:
    """What open finds (a dead writer's temp, a bad file) is cleaned by poll(); a fault
    keeps it queued and the next poll finishes it."""
    problems: Problems = {}
    stores = Stores()
    try:
        for point in points:
            d = tmp / point
            s = stores.open(d)
            s.store(TOKS, page_row(TOKS))
            s.close()
            if point == "cache.purge.unlinking":
                (d / f".{'cd' * 16}.999999.1.tmp").write_bytes(b"half a record")
            else:
                (d / f"{'ab' * 16}.kv").write_bytes(b"not a record" * 10)
                for seal in d.glob("*seal*"):
                    seal.unlink()  # every file is checked at open
            s = stores.open(d)
            failpoints.arm(point, "raise*1")
            errors = _attempt(_poll_all, s)
            failpoints.disarm_all()
            p = _reached(point, None, errors)
            while s.poll():
                pass
            if temp_files(d) or s.pending() or s.check():
                p.append(f"not finished by the next poll: {temp_files(d)} {s.check()}")
            if s.lookup(TOKS) != len(TOKS) // PT:
                p.append("the good record was lost")
            problems[point] = p
    finally:
        for st in stores.opened:
            st.close()
    return problems


def _load_points(points: list[str], tmp: Path) -> Problems:
    problems: Problems = {}
    stores = Stores()
    try:
        s = stores.open(tmp)
        s.store(TOKS, page_row(TOKS))
        for point in points:
            failpoints.arm(point, "raise*1")
            errors = _attempt(s.load, TOKS, len(TOKS) // PT)
            failpoints.disarm_all()
            p = _reached(point, None, errors)
            if bytes(s.load(TOKS, len(TOKS) // PT)) != page_row(TOKS):
                p.append("the next load did not return the row")
            problems[point] = p
    finally:
        for st in stores.opened:
            st.close()
    return problems


def _close_points(points: list[str], tmp: Path) -> Problems:
    """A close step faults once: one CleanupError names it, a second close() finishes,
    a third does nothing, and the directory opens again (the lock was released)."""
    problems: Problems = {}
    stores = Stores()
    try:
        for point in points:
            d = tmp / point
            s = stores.open(d)
            s.store(TOKS, page_row(TOKS))
            failpoints.arm(point, "raise*1")
            errors = _attempt(s.close)
            failpoints.disarm_all()
            p = _reached(point, None, errors)
            p += [f"the retry failed: {e!r}" for e in _attempt(s.close)]
            p += [f"a third close did something: {e!r}" for e in _attempt(s.close)]
            again = stores.open(d)
            if again.lookup(TOKS) != len(TOKS) // PT or again.check():
                p.append("the directory did not open again intact")
            problems[point] = p
    finally:
        for st in stores.opened:
            st.close()
    return problems


def _uring_points(points: list[str], tmp: Path) -> Problems:
    """Creating a ring fails at open (rolled back); a ring's wait fails its read, and the
    ring reads again afterwards."""
    probe = Ring.open()
    if probe is None:
        pytest.skip("this kernel or sandbox offers no io_uring")
    probe.close()
    problems: Problems = {}
    stores = Stores()
    try:
        point = "cache.uring.setup"
        failpoints.arm(point, "raise*1")
        errors = _attempt(stores.open, tmp / "setup", io_uring=True, io_threads=2)
        failpoints.disarm_all()
        p = _reached(point, None, errors)
        s = stores.open(tmp / "setup")  # the failed open released the lock
        if s.check():
            p.append(f"index and disk disagree: {s.check()}")
        problems[point] = p

        point = "cache.uring.enter"
        path = tmp / "data"
        path.write_bytes(b"x" * 4096)
        fd = os.open(path, os.O_RDONLY)
        ring = Ring.open()
        assert ring is not None
        try:
            out = aligned_empty(4096)
            args = (np.array([fd], dtype=np.int32), np.zeros(1, dtype=np.int64),
                    np.array([int(out.ctypes.data)], dtype=np.uint64),
                    np.array([4096], dtype=np.int64))
            failpoints.arm(point, "raise*1")
            errors = _attempt(ring.read, *args, deadline_s=30.0)
            failpoints.disarm_all()
            p = _reached(point, None, errors)
            if ring.read(*args, deadline_s=30.0).tolist() != [True] or bytes(out) != b"x" * 4096:
                p.append("the ring did not read again afterwards")
            problems[point] = p
        finally:
            ring.close()
            os.close(fd)
    finally:
        for st in stores.opened:
            st.close()
    return problems


# -- runtime ---------------------------------------------------------------------------
def _one() -> int:
    return 1


def _task_on(o: phalanx.Orchestrator, rank: int) -> int:
    result: int = o.submit(rank, _one).result()
    return result


def _start_points(points: list[str], tmp: Path) -> Problems:
    """A fault while the Worker starts: the constructor raises, every rank is stopped."""
    problems: Problems = {}
    for point in points:
        if point == "rank.start.before_hello":  # in every rank: rank 0 is named first
            errors = _attempt(phalanx.Worker, ranks=2, failpoints={point: "raise"})
            problems[point] = _reached(point, 0, errors)
        else:
            failpoints.arm(point, "raise*1")
            errors = _attempt(phalanx.Worker, ranks=2)
            failpoints.disarm_all()
            problems[point] = _reached(point, RANK.get(point), errors)
    return problems


def _run_points(points: list[str], tmp: Path) -> Problems:
    """A fault admitting a run or taking a task: that run fails, the Worker serves on."""
    problems: Problems = {}
    w = phalanx.Worker(ranks=2)
    try:
        for point in points:
            rank = RANK.get(point)
            if rank is None:
                failpoints.arm(point, "raise*1")
            else:
                w.arm_failpoint(point, "raise*1", ranks=rank)
            target = 1 if rank is None else rank
            errors = _attempt(w.run, _task_on, target)
            failpoints.disarm_all()
            w.disarm_failpoints()
            p = _reached(point, rank, errors)
            if w.run(_task_on, target) != 1:
                p.append("the next run did not succeed")
            problems[point] = p + _ledgers_ok(w)
    finally:
        _close_worker(w)
    return problems


def _close_step_points(points: list[str], tmp: Path) -> Problems:
    """A fault in one close step: CleanupError names it; the next close() finishes."""
    problems: Problems = {}
    for point in points:
        w = phalanx.Worker(ranks=2, rendezvous="marker")
        failpoints.arm(point, "raise*1")
        try:
            errors = _attempt(w.close)
        finally:
            failpoints.disarm_all()
        p = _reached(point, None, errors)
        p += [f"the retry failed: {e!r}" for e in _close_worker(w)]
        problems[point] = p
    return problems


# -- rendezvous ------------------------------------------------------------------------
def _handshake_all(o: phalanx.Orchestrator, tag: str, alloc_id: int, timeout: float) -> None:
    """One handshake on every rank; every participant's error, not only the first."""
    futures = [o.submit(r, handshake, tag, alloc_id, [0, 1], timeout) for r in o.ranks]
    errors = [e for e in (f.exception() for f in futures) if isinstance(e, Exception)]
    if errors:
        raise ExceptionGroup(f"handshake {tag!r} of allocation {alloc_id}", errors)


def _handshake_points(points: list[str], tmp: Path) -> Problems:
    """A marker handshake step faults on one rank: the allocation's handshake fails on
    every participant, naming the rank; the next handshake succeeds."""
    problems: Problems = {}
    w = phalanx.Worker(ranks=2, rendezvous="marker")
    try:
        for i, point in enumerate(points):
            rank = RANK[point]
            tag = "alloc" if point.endswith("publish") else "release"
            w.arm_failpoint(point, "raise*1", ranks=rank)
            errors = _attempt(w.run, _handshake_all, tag, 100 + i, 2.0)
            w.disarm_failpoints()
            p = _reached(point, rank, errors)
            p += [f"the next handshake failed: {e!r}"
                  for e in _attempt(w.run, _handshake_all, tag, 200 + i, 30.0)]
            problems[point] = p + _ledgers_ok(w)
    finally:
        _close_worker(w)
    return problems


# -- comm ------------------------------------------------------------------------------
def _domain_points(points: list[str], tmp: Path) -> Problems:
    """Each comm point once (rank points on rank 1; test_domain_faults runs each on
    every rank with a Worker of its own). A Worker is kept while faults leave it
    usable (the next cycle must then succeed) and closed, and checked for /dev/shm
    names, when one poisons it or when the point is in the base communicator."""
    problems: Problems = {}
    w: phalanx.Worker | None = None
    try:
        for point in points:
            base_init = point.startswith("base.init")
            if w is None or base_init:
                if w is not None:
                    _close_worker(w)
                w = phalanx.Worker(ranks=2, domain_timeout=10)
                if not base_init:
                    w.run(_cycle)  # the base communicator exists
            gen = w.generation
            rank = RANK.get(point)
            if rank is None:
                failpoints.arm(point, "raise*1")
            else:
                w.arm_failpoint(point, "raise*1", ranks=rank)
            errors = _attempt(w.run, _cycle)
            p = _ledgers_ok(w)
            if w.stats().poisoned is None and not point.startswith("base."):
                failpoints.disarm_all()
                w.disarm_failpoints()
                p += [f"the next cycle failed: {e!r}" for e in _attempt(w.run, _cycle)]
            else:  # base.release.* fire in close(): still armed here
                errors += _close_worker(w)
                failpoints.disarm_all()
                w = None
                if _shm_of(gen):
                    p.append(f"/dev/shm names left: {_shm_of(gen)}")
            problems[point] = _reached(point, rank, errors) + p
    finally:
        if w is not None:
            _close_worker(w)
    return problems


# -- replication -----------------------------------------------------------------------
def _replication_points(points: list[str], tmp: Path) -> Problems:
    """A link or a peer's apply faults: the cache's call fails naming the rank and the
    step (within the short deadlines set here), and the cache and Worker close."""
    problems: Problems = {}
    for point in points:
        rank = RANK[point]
        d = tmp / point
        with phalanx.Worker(ranks=2) as w:
            cache = None
            errors: list[BaseException] = []
            try:
                if point == "cache.link.connect":
                    w.arm_failpoint(point, "raise*1", ranks=rank)
                # Short deadlines only where this point's fault makes a side wait.
                cache = open_cache(
                    w, d, connect_timeout=5.0 if point == "cache.link.connect" else 60.0,
                    job_timeout=5.0 if point == "cache.link.send" else 30.0)
                w.arm_failpoint(point, "raise*1", ranks=rank)
                cache.store(TOKS)
                cache.check()
            except Exception as exc:  # noqa: BLE001  inspected below
                errors.append(exc)
            p = _reached(point, rank, errors)
            if cache is not None:
                closing = _attempt(cache.close)
                if closing and not errors:
                    p.append(f"the error came only at close: {closing[0]!r}")
            problems[point] = p
    return problems



Scenario = Callable[[list[str], Path], Problems]

# scenario -> (what drives it, the points it reaches, the rank each rank point is armed in)
COVERS: dict[str, tuple[Scenario, dict[str, int | None]]] = {
    "kvstore-store": (_store_points, dict.fromkeys(
        ["cache.store.temp_opened", "cache.store.temp_written", "cache.store.committed"])),
    "kvstore-maintenance": (_maintenance_points, dict.fromkeys(
        ["cache.thin.temp_written", "cache.thin.committed", "cache.remove.unlinking"])),
    "kvstore-recovery": (_recovery_points, dict.fromkeys(
        ["cache.purge.unlinking", "cache.quarantine.moving"])),
    "kvstore-load": (_load_points, dict.fromkeys(["cache.load.pinned"])),
    "kvstore-close": (_close_points, dict.fromkeys(["cache.close.seal", "cache.close.lock"])),
    "kvstore-uring": (_uring_points, dict.fromkeys(["cache.uring.setup", "cache.uring.enter"])),
    "runtime-start": (_start_points, {"rank.start.before_hello": 0,
                                      "worker.start.ranks_spawned": None}),
    "runtime-run": (_run_points, {"worker.run.admitted": None, "rank.task.received": 1}),
    "runtime-close": (_close_step_points, {"worker.close.stop_ranks": None,
                                           "rendezvous.remove.unlink": None}),
    "rendezvous-handshake": (_handshake_points, {"rendezvous.handshake.publish": 1,
                                                 "rendezvous.handshake.remove": 0}),
    "comm-domains": (_domain_points, {
        name: None if desc.startswith("parent") else 1
        for name, desc in failpoints.catalogue().items() if layer_of(name) == "comm"}),
    "replication": (_replication_points, {"cache.link.connect": 1, "cache.link.send": 0,
                                          "cache.replica.apply": 1}),
    "engine-lookup": (engine_points, {"engine.disk.lookup": None}),
    "serve-admit": (serve_points, {"serve.driver.admit": None}),
    # the parent's own step code fails: that request's error, the engine serves on
    "engine-encode": (serve_points, {"engine.step.encode": None}),
    "engine-rank-step": (rank_step_points, {"engine.rank.step": 0}),
    "serve-tokenize": (api_points, {"serve.api.tokenize": None}),
}
for _fn, _points in COVERS.values():
    RANK.update(_points)

# Points whose path falls short of the sweep's assertions today: point -> what goes
# wrong, and who fixes it. A point that starts passing fails the sweep: delete it here.
KNOWN: dict[str, str] = {
}


def test_every_catalogued_point_has_a_scenario() -> None:
    covered = [p for _fn, points in COVERS.values() for p in points]
    assert len(covered) == len(set(covered)), "a point is in two scenarios"
    catalogue = set(failpoints.catalogue())
    missing = sorted(catalogue - set(covered))
    assert not missing, ("failpoints without a scenario in tests/test_failpoint_sweep.py "
                         f"(add one to COVERS): {missing}")
    assert not set(covered) - catalogue, sorted(set(covered) - catalogue)
    layers = {layer_of(p) for p in covered}
    assert layers >= {"rendezvous", "runtime", "comm", "kvstore", "replication", "engine",
                      "serve"}


# The two scenarios that start many Workers (~25 s and ~15 s of the ~35-65 s sweep on a
# loaded 2-core machine) are slow: a quick run (-m 'not slow') keeps the others, and
# test_domain_faults covers every comm point on every rank as well.
_SLOW = {"comm-domains", "replication"}


@pytest.mark.parametrize("scenario", [
    pytest.param(name, marks=pytest.mark.slow) if name in _SLOW else name
    for name in sorted(COVERS)])
def test_sweep(scenario: str, tmp_path: Path) -> None:
    fn, points = COVERS[scenario]
    before = Snapshot.take()
    try:
        problems = fn(list(points), tmp_path)
    finally:
        failpoints.disarm_all()
    assert sorted(problems) == sorted(points), "the scenario skipped some of its points"
    failing = {p: v for p, v in problems.items() if v}
    unexpected = {p: v for p, v in failing.items() if p not in KNOWN}
    fixed = sorted(p for p in points if p in KNOWN and p not in failing)
    assert not unexpected, "\n".join(f"{p}: {'; '.join(v)}" for p, v in unexpected.items())
    assert not fixed, f"these now pass: delete them from KNOWN: {fixed}"
    assert wait_settled(before) == {}
