"""Rank 0's maintenance lane keeps to a small share of each link's window while requests
are recent, and has its whole share again once they are not (replication/leader.py).

Real parts in one process: rank 0's DiskStore, a Leader and a PeerLink over a socket
pair whose peer end never acks, so what maintenance may put in flight is exactly what
stays outstanding. The Leader's clock is the test's: no timing."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cache_util import FP, GEOM, Clock, page_row
from phalanx.kvstore import DiskStore, StoreOptions
from phalanx.replication.frames import FrameReader
from phalanx.replication.kv_source import SyntheticSource
from phalanx.replication.leader import JobCollector, Leader
from phalanx.replication.link import PeerLink

WINDOW, RESERVE = 64, 16
PT = GEOM.page_tokens


class _Now:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[tuple[Leader, PeerLink, _Now]]:
    store_clock = Clock()
    collector = JobCollector()
    store = DiskStore(tmp_path / "rank-0", GEOM, FP,
                      StoreOptions(capacity_bytes=1 << 30, max_age=10.0, progress=False),
                      clock=store_clock, on_job=collector)
    mine, peer = socket.socketpair()
    link = PeerLink(1, "the test's peer", mine, FrameReader(mine, "peer rank 1"), WINDOW, 60.0)
    try:
        for i in range(100):  # 100 one-page roots: 100 leaves, each expires on its own
            toks = np.arange(PT) + 1000 * (i + 1)
            assert store.store(toks, page_row(toks)).stored
        store_clock.t += 100.0  # every record past max_age: 100 EXPIRE jobs are due
        now = _Now()
        yield Leader(store, collector, SyntheticSource(GEOM, 0), {1: link},
                     reserve=RESERVE, now=now), link, now
    finally:
        link.close(10.0)
        peer.close()
        store.close()


def _outstanding(link: PeerLink) -> int:
    inflight, pending = link.outstanding()
    return inflight + pending


def test_maintenance_keeps_to_a_small_share_while_requests_are_recent(
        leader: tuple[Leader, PeerLink, _Now]) -> None:
    lead, link, now = leader
    assert lead.busy_reserve == WINDOW - WINDOW // 8
    toks = np.arange(2 * PT) + 7  # a request: one store op on the link
    lead.store_chain(lead.store.chain(toks), wait=False)
    assert _outstanding(link) == 1
    # right after it, maintenance fills the link only to its busy share
    assert lead.poll(1000) == WINDOW - lead.busy_reserve - 1
    assert lead.poll(1000) == 0
    assert _outstanding(link) == WINDOW - lead.busy_reserve
    # a second later with no request since, the lane has its whole share again
    now.t += 1.0
    assert lead.poll(1000) == lead.busy_reserve - RESERVE
    assert _outstanding(link) == WINDOW - RESERVE
    assert lead.poll(1000) == 0  # the reserve stays the requests'
