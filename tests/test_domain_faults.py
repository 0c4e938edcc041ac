"""Fault injection through every domain failpoint, and SIGKILL at every phase.

For every failpoint of the base communicator and of a domain, in the parent and in
each rank: the error reaches Worker.run's (or close's) caller naming the point and its
rank; every resource was released at most once and in dependency order; after
close() nothing is left.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import phalanx
from leaks import Snapshot, wait_settled
from phalanx.comm import DomainView
from phalanx.lifecycle import CleanupError, failpoints


def _points() -> list[tuple[str, int | None]]:
    cases: list[tuple[str, int | None]] = []
    for name, desc in failpoints.catalogue().items():
        if not name.startswith(("domain.", "base.")):
            continue
        if desc.startswith("parent"):
            cases.append((name, None))
        else:
            cases.extend((name, r) for r in (0, 1))
    return cases


def test_catalogue_has_enough_points() -> None:
    assert len({name for name, _ in _points()}) >= 25


def _barrier_n(d: DomainView, n: int) -> int:
    for _ in range(n):
        d.barrier()
    return d.domain_rank


def _cycle(o: phalanx.Orchestrator) -> None:
    d = o.allocate_domain("f", [0, 1], window_size=4096, buffers=[("x", 64)])
    for f in [o.submit(r, _barrier_n, d, 3) for r in (0, 1)]:
        f.result()
    o.release_domain(d)


def _texts(exc: BaseException, seen: set[int] | None = None) -> Iterator[str]:
    seen = set() if seen is None else seen
    if id(exc) in seen:
        return
    seen.add(id(exc))
    yield f"{type(exc).__name__}: {exc}"
    yield from getattr(exc, "__notes__", [])
    for sub in [exc.__cause__, exc.__context__, *getattr(exc, "exceptions", ()),
                *getattr(exc, "failures", {}).values()]:
        if sub is not None:
            yield from _texts(sub, seen)


def _check_ledger(events: list[list[Any]]) -> None:
    """Each resource released at most once; never before what depends on it."""
    deps: dict[int, list[int]] = {}
    released_at: dict[int, int] = {}
    for seq, what, rid, _kind, _name, _owner, depends_on in events:
        if what == "acquiring":
            deps[rid] = depends_on
        if what == "released":
            assert rid not in released_at, f"resource {rid} released twice"
            released_at[rid] = seq
    for rid, seq in released_at.items():
        for dependent, their_deps in deps.items():
            if rid in their_deps and dependent in released_at:
                assert released_at[dependent] < seq, (
                    f"resource {rid} released before its dependent {dependent}")


def _shm_of(gen: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"phx-{gen}-"))


def _close(w: phalanx.Worker) -> list[BaseException]:
    errors: list[BaseException] = []
    for _ in range(3):  # close() retries only what is left; injected faults fire once
        try:
            w.close()
            return errors
        except CleanupError as exc:
            errors.append(exc)
    raise AssertionError(f"close() still failing after retries: {errors}")


@pytest.mark.parametrize(("point", "rank"), _points(), ids=lambda v: str(v))
def test_every_failpoint(point: str, rank: int | None) -> None:
    before = Snapshot.take()
    w = phalanx.Worker(ranks=2, domain_timeout=10)
    gen = w.generation
    errors: list[BaseException] = []
    try:
        w.run(_cycle)  # warm: the base communicator exists unless the point is in it
        if point.startswith("base.init"):
            w.close()
            w = phalanx.Worker(ranks=2, domain_timeout=10)
            gen = w.generation
        if rank is None:
            failpoints.arm(point, "raise*1")
        else:
            w.arm_failpoint(point, "raise*1", ranks=rank)
        try:
            w.run(_cycle)
        except Exception as exc:  # noqa: BLE001  inspected below
            errors.append(exc)
        reports = w.resources()["ranks"]
        for report in reports.values():
            if isinstance(report, dict):
                _check_ledger(report["events"])
    finally:
        errors.extend(_close(w))
        failpoints.disarm_all()
    text = "\n".join(t for e in errors for t in _texts(e))
    assert point in text, f"{point} never reached the caller: {text or 'no error at all'}"
    if rank is not None:
        assert f"rank {rank}" in text
    assert _shm_of(gen) == []
    assert wait_settled(before) == {}


def _kill_self(d: DomainView) -> None:
    os.kill(os.getpid(), 9)


@pytest.mark.parametrize("phase", ["allocation", "use", "release"])
def test_sigkill_of_a_member(phase: str) -> None:
    before = Snapshot.take()
    w = phalanx.Worker(ranks=3, domain_timeout=10)
    gen = w.generation
    w.run(_cycle)
    if phase == "allocation":
        w.arm_failpoint("domain.alloc.segment_created", "kill", ranks=1)
    elif phase == "release":
        w.arm_failpoint("domain.release.quiesced", "kill", ranks=1)

    def orch(o: phalanx.Orchestrator) -> None:
        d = o.allocate_domain("k", [0, 1, 2], window_size=1 << 16)
        if phase == "use":
            futures = [o.submit(r, _barrier_n, d, 100_000) for r in (0, 2)]
            o.submit(1, _kill_self, d)
            for f in futures:
                f.result()
        o.release_domain(d)

    with pytest.raises(Exception) as info:
        w.run(orch)
    text = "\n".join(_texts(info.value))
    clear = ("SIGKILL", "never arrived", "is dead")
    assert "rank 1" in text and any(w in text for w in clear), text
    _close(w)
    assert _shm_of(gen) == []
    assert wait_settled(before) == {}
