"""Rank 0's lanes in one process (no peers): the maintenance lane holds the order lock
per slice of a few jobs and hands it to a request that arrives mid-batch (issue 13: a
request used to wait for a whole batch of up to window - reserve jobs under the lock)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cache_util import GEOM, Clock, Stores, build_tree, stores
from phalanx.kvstore.maintenance import Job
from phalanx.kvstore.store import PrefixPins
from phalanx.replication.kv_source import SyntheticSource
from phalanx.replication.leader import _SLICE, JobCollector, Leader

__all__ = ["stores"]


class _Hooked(JobCollector):
    """Collects as rank 0's does; on the first job ``hook`` runs, under the order lock."""

    def __init__(self) -> None:
        super().__init__()
        self.hook: list[Callable[[], None]] = []
        self.seen = 0

    def __call__(self, job: Job) -> None:
        super().__call__(job)
        self.seen += 1
        if self.seen == 1:
            for h in self.hook:
                h()


def _expired_leader(stores: Stores, tmp_path: Path, n: int) -> tuple[Leader, _Hooked, list[Any]]:
    clock = Clock()
    collector = _Hooked()
    store = stores.open(tmp_path / "r0", max_age=1.0, clock=clock, on_job=collector)
    built = build_tree(store, n, branchy=False, full_rows=False)
    clock.t += 100.0  # every record expired: n jobs for the lane
    leader = Leader(store, collector, SyntheticSource(GEOM, 0), {}, reserve=0)
    return leader, collector, built.tokens


def test_poll_applies_job_by_job_up_to_its_limit(stores: Stores, tmp_path: Path) -> None:
    leader, _, _ = _expired_leader(stores, tmp_path, 10)
    assert leader.poll(4) == 4
    assert leader.poll(100) == 6
    assert leader.poll(100) == 0  # nothing left
    assert leader.jobs_sent["expire"] == 10


def test_a_request_mid_batch_waits_for_one_slice_not_the_batch(stores: Stores,
                                                             tmp_path: Path) -> None:
    leader, collector, tokens = _expired_leader(stores, tmp_path, 40)
    got: list[PrefixPins] = []
    errors: list[BaseException] = []

    def request() -> None:
        try:
            pins, _ = leader.lookup_pinned([tokens[0][:GEOM.page_tokens]])
            leader.store.unpin(pins)
            got.append(pins)
        except BaseException as exc:  # noqa: BLE001  reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=request, name="test-request")

    def arrive() -> None:  # the first job is being applied, the lock held: a request comes
        thread.start()
        deadline = time.monotonic() + 10.0
        while not leader._requests:  # it announced itself and now waits for the lock
            assert time.monotonic() < deadline, "the request never announced itself"
            time.sleep(0.001)

    collector.hook.append(arrive)
    assert leader.poll(48) == _SLICE  # the lane stopped after the slice under way
    thread.join(10.0)
    assert not thread.is_alive() and not errors, errors
    assert got[0].pages == [1]  # the request was served between two jobs
    assert leader.poll(100) == 40 - _SLICE  # the lane goes on where it stopped
