"""Rank 0's maintenance lane keeps to a small share of each link's window while requests
are recent, and has its whole share again once they are not (replication/leader.py);
a peer hands credits back while it works through a run of ops (replica.py).

Real parts in one process: rank 0's DiskStore, a Leader and a PeerLink over a socket
pair whose peer end never acks, so what maintenance may put in flight is exactly what
stays outstanding. The Leader's clock is the test's: no timing. The peer's side: a
Replica on its own DiskStore, fed rank 0's frames through a socket pair."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cache_util import FP, GEOM, Clock, page_row
from phalanx.kvstore import DiskStore, StoreOptions
from phalanx.kvstore.keys import ROOT_KEY
from phalanx.kvstore.maintenance import Job, JobKind
from phalanx.replication.frames import Ack, Bye, Frame, FrameReader, JobOp, StoreOp, encode
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
def leader(tmp_path: Path) -> Iterator[tuple[Leader, PeerLink, _Now, socket.socket]]:
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
                     reserve=RESERVE, now=now), link, now, peer
    finally:
        link.close(10.0)
        peer.close()
        store.close()


def _outstanding(link: PeerLink) -> int:
    inflight, pending = link.outstanding()
    return inflight + pending


def test_maintenance_keeps_to_a_small_share_while_requests_are_recent(
        leader: tuple[Leader, PeerLink, _Now, socket.socket]) -> None:
    lead, link, now, _ = leader
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


def _peer_acks(tmp_path: Path, ops: Callable[[list[bytes], DiskStore], list[Frame]]
               ) -> tuple[list[int], dict[bytes, bool]]:
    """The acks a Replica sends for ``ops`` (made from the keys of twenty one-page
    records on its store) when they all reach it in one read; and its records after."""
    store = DiskStore(tmp_path / "rank-1", GEOM, FP,
                      StoreOptions(capacity_bytes=1 << 30, progress=False))
    keys = []
    for i in range(20):
        toks = np.arange(PT) + 1000 * (i + 1)
        res = store.store(toks, page_row(toks))
        assert res.stored
        keys.append(res.key)
    leader_end, peer_end = socket.socketpair()
    frames = ops(keys, store)
    # all of it buffered before the replica reads: one recv takes every frame
    leader_end.sendall(b"".join(encode(op) for op in frames))
    replica: Replica | None = None
    try:
        replica = Replica(1, store, SyntheticSource(GEOM, 1), peer_end,
                          FrameReader(peer_end, "rank 0"), StagedRows(1), 5.0)
        acks: list[int] = []
        reader = FrameReader(leader_end, "peer rank 1")
        leader_end.settimeout(10.0)
        while not acks or acks[-1] < len(frames):
            frame = reader.read()
            assert isinstance(frame, Ack) and not frame.error, frame
            acks.append(frame.seq)
        return acks, store.record_states()
    finally:
        if replica is not None:
            replica.close(10.0)  # closes peer_end, the replica's socket
        peer_end.close()  # idempotent: still ours if the replica was never made
        leader_end.close()
        store.close()


def _expire(seq: int, key: bytes) -> JobOp:
    return JobOp(seq, Job(JobKind.EXPIRE, key=key, end_page=1))


def test_a_peer_acks_a_long_run_of_ops_as_it_applies_them(tmp_path: Path) -> None:
    """Twenty expiries that reach the peer in one read are credited four at a time,
    not once at the end: a peer that acked only when its buffer ran dry kept rank 0
    waiting for credits while it worked, and the ranks took turns (BENCHMARKS.md)."""
    def ops(keys: list[bytes], store: DiskStore) -> list[Frame]:
        return [*(_expire(i + 1, k) for i, k in enumerate(keys)), Bye(len(keys) + 1)]

    acks, left = _peer_acks(tmp_path, ops)
    assert acks == [4, 8, 12, 16, 20, 21]
    assert left == {}  # every expiry applied on the peer


def test_a_peer_acks_a_requests_op_at_once(tmp_path: Path) -> None:
    """A store amid maintenance ops is acked as soon as it is applied, not with the
    next three expiries: rank 0's request is waiting for that ack."""
    new = np.arange(2 * PT) + 99_000

    def ops(keys: list[bytes], store: DiskStore) -> list[Frame]:
        span = store.chain(new).keys
        return [_expire(1, keys[0]), _expire(2, keys[1]), StoreOp(3, ROOT_KEY, 0, span),
                *(_expire(4 + i, k) for i, k in enumerate(keys[2:7])), Bye(9)]

    acks, left = _peer_acks(tmp_path, ops)
    assert acks == [3, 7, 9]  # [4, 8, 9] when the store waited for the expiries
    assert len(left) == 20 - 7 + 1  # the new record is held, seven expired


def test_maintenance_goes_on_while_a_request_waits_for_its_acks(
        leader: tuple[Leader, PeerLink, _Now, socket.socket]) -> None:
    """Once a request's op is queued, maintenance decides again while the request waits
    for its ack: what it queues lands behind the op, so it cannot delay it, and the
    ranks do not idle through every request (BENCHMARKS.md)."""
    lead, link, _, peer = leader
    toks = np.arange(2 * PT) + 7
    with ThreadPoolExecutor(1, thread_name_prefix="test-request") as pool:
        request = pool.submit(lead.store_chain, lead.store.chain(toks))
        deadline = time.monotonic() + 30
        # first its op on the link: a poll before the request began would take the
        # whole share, as no request is recent yet
        while _outstanding(link) < 1 and time.monotonic() < deadline:
            pass
        assert _outstanding(link) == 1, "the request's op was never queued"
        decided = 0  # 0 until the request leaves the order lock (the lane yields)
        while not decided and time.monotonic() < deadline:
            decided = lead.poll(1000)
        assert decided == WINDOW - lead.busy_reserve - 1  # the busy share, less the op
        assert not request.done()  # the peer never acked it
        # its op is seq 1 (the first on the link): the peer's ack ends the wait
        peer.sendall(encode(Ack(1)))
        assert request.result(timeout=30).stored
