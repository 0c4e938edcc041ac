"""Rank 0's maintenance lane keeps to a small share of each link's window while requests
are recent, and has its whole share again once they are not (replication/leader.py);
a peer hands credits back while it works through a run of ops (replica.py).

Real parts in one process: rank 0's DiskStore, a Leader and a PeerLink over a socket
pair whose peer end never acks, so what maintenance may put in flight is exactly what
stays outstanding. The Leader's clock is the test's: no timing. The peer's side: a
Replica on its own DiskStore, fed rank 0's frames through a socket pair."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cache_util import FP, GEOM, Clock, page_row
from phalanx.kvstore import DiskStore, StoreOptions
from phalanx.kvstore.maintenance import Job, JobKind
from phalanx.replication.frames import Ack, Bye, Frame, FrameReader, JobOp, encode
from phalanx.replication.kv_source import SyntheticSource
from phalanx.replication.leader import JobCollector, Leader
from phalanx.replication.link import PeerLink
from phalanx.replication.replica import Replica
from phalanx.replication.staging import StagedRows

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
    assert lead.busy_reserve == WINDOW - WINDOW // 4
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


def test_a_peer_acks_a_long_run_of_ops_as_it_applies_them(tmp_path: Path) -> None:
    """Twenty expiries that reach the peer in one read are credited four at a time,
    not once at the end: a peer that acked only when its buffer ran dry kept rank 0
    waiting for credits while it worked, and the ranks took turns (BENCHMARKS.md)."""
    store = DiskStore(tmp_path / "rank-1", GEOM, FP,
                      StoreOptions(capacity_bytes=1 << 30, progress=False))
    keys = []
    for i in range(20):
        toks = np.arange(PT) + 1000 * (i + 1)
        res = store.store(toks, page_row(toks))
        assert res.stored
        keys.append(res.key)
    leader_end, peer_end = socket.socketpair()
    ops: list[Frame] = [JobOp(i + 1, Job(JobKind.EXPIRE, key=k, end_page=1))
                        for i, k in enumerate(keys)]
    ops.append(Bye(len(ops) + 1))
    # all of it buffered before the replica reads: one recv takes every frame
    leader_end.sendall(b"".join(encode(op) for op in ops))
    replica: Replica | None = None
    try:
        replica = Replica(1, store, SyntheticSource(GEOM, 1), peer_end,
                          FrameReader(peer_end, "rank 0"), StagedRows(1), 5.0)
        acks: list[int] = []
        reader = FrameReader(leader_end, "peer rank 1")
        leader_end.settimeout(10.0)
        while not acks or acks[-1] < len(ops):
            frame = reader.read()
            assert isinstance(frame, Ack) and not frame.error, frame
            acks.append(frame.seq)
        assert acks == [4, 8, 12, 16, 20, 21]
        assert store.record_states() == {}  # every expiry applied on the peer
    finally:
        if replica is not None:
            replica.close(10.0)  # closes peer_end, the replica's socket
        peer_end.close()  # idempotent: still ours if the replica was never made
        leader_end.close()
        store.close()
