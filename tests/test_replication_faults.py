"""Replication under bursts and faults: eviction bursts, paused and killed peers, a
wrong job token, and stores issued in the middle of a maintenance burst."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from phalanx.kvstore import DiskStore, StoreOptions
from phalanx.lifecycle import CleanupError
from phalanx.replication import LinkAuthError, LinkClosedError, LinkStalledError
from phalanx.replication.frames import RecordSet
from phalanx.replication.link import accept_peer, connect_leader, listen
from phalanx.runtime import RankDiedError, Worker
from replication_util import (
    FP,
    GEOM,
    RANKS,
    assert_identical,
    copy_dirs,
    dir_bytes,
    open_cache,
    rank_pid,
    synth,
)

# a campaign (hosts on network namespaces, faults across ranks, a benchmark's quick
# run): the full suite runs it, the inner loop (-m 'not slow') does not
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("faults-tpl") / "cache"
    synth(d, 2000, "chain")  # 1,750 thinnable rows on every rank
    return d


def _maintain_in_thread(cache: object) -> tuple[threading.Thread, list[BaseException], list[float]]:
    errors: list[BaseException] = []
    done: list[float] = []

    def body() -> None:
        try:
            cache.maintain()  # type: ignore[attr-defined]
        except BaseException as exc:  # noqa: BLE001  handed to the test thread
            errors.append(exc)
        done.append(time.monotonic())

    t = threading.Thread(target=body)
    t.start()
    return t, errors, done


def test_eviction_burst_for_one_large_store(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    synth(d, 5000, "tree", group=1)  # 5,000 small records
    cap = dir_bytes(d / "rank-0") * 101 // 100  # nearly full
    pages = int(cap * 0.8) // (GEOM.page_bytes + 24)  # one row needing most of the space
    # (a page costs its bytes plus its key and CRC in the header)
    with Worker(ranks=RANKS) as w:
        cache = open_cache(w, d, capacity_bytes=cap)
        try:
            res = cache.store(np.arange(pages * GEOM.page_tokens) + 10**6)
            assert res.stored
            assert cache.lookup(np.arange(pages * GEOM.page_tokens) + 10**6) == pages
            stats = cache.stats()
            assert stats[0]["stats"]["evictions"] > 3000  # one burst far beyond the window
            assert cache.check() == []
            crcs = cache.load(np.arange(pages * GEOM.page_tokens) + 10**6, pages)
            assert len(set(crcs.values())) == RANKS  # each rank loaded its own shard
            assert all(s.get("source", {}).get("bad_loads", 0) == 0 for s in stats.values())
        finally:
            cache.close()
    assert_identical(d)


@pytest.mark.parametrize("paused_for", [2.0, None])  # half the timeout; past it
def test_paused_peer(template: Path, tmp_path: Path, paused_for: float | None) -> None:
    timeout = 4.0
    d = copy_dirs(template, tmp_path / "cache")
    with Worker(ranks=RANKS) as w:
        cache = open_cache(w, d, job_timeout=timeout)
        pid = rank_pid(w, 2)
        try:
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            t, errors, done = _maintain_in_thread(cache)
            if paused_for is not None:
                time.sleep(paused_for)
                os.kill(pid, signal.SIGCONT)
                t.join(120)
                assert not t.is_alive() and errors == []
                assert cache.check() == []
            else:
                t.join(timeout + 10)
                os.kill(pid, signal.SIGCONT)
                assert not t.is_alive()
                assert len(errors) == 1 and isinstance(errors[0], LinkStalledError), errors
                assert done[0] - stopped < timeout + 3.0  # the error came within the margin
                msg = str(errors[0])
                for word in ("peer rank 2", "outstanding", "pending", "oldest", "no progress"):
                    assert word in msg, msg
        finally:
            os.kill(pid, signal.SIGCONT)
            # the stall was raised to maintain()'s caller: close does not report it twice
            cache.close(timeout=10)
    if paused_for is not None:
        assert_identical(d)


def test_killed_peer_then_restart_reconciles(template: Path, tmp_path: Path) -> None:
    d = copy_dirs(template, tmp_path / "cache")
    with Worker(ranks=RANKS) as w:
        cache = open_cache(w, d, window=8)
        # rank 1 dies mid-burst, at its sixth apply of rank 0's ops (not after a sleep
        # that a fast machine outruns and a slow one overshoots)
        w.arm_failpoint("cache.replica.apply", "kill@5", ranks=1)
        t, errors, _ = _maintain_in_thread(cache)
        t.join(60)
        assert not t.is_alive()
        # the link, or the Worker's rank monitor, whichever noticed first
        assert len(errors) == 1, errors
        assert isinstance(errors[0], LinkClosedError | RankDiedError), errors
        assert "rank 1" in str(errors[0])
        with pytest.raises(CleanupError, match="rank 1"):  # the Worker lost a rank
            cache.close(timeout=5)
    with DiskStore(d / "rank-0", GEOM, FP, StoreOptions(1 << 30, progress=False)) as rank0:
        assert rank0.check() == []  # rank 0's store stayed consistent
    with Worker(ranks=RANKS) as w:  # the job restarts: reconcile, then maintain
        cache = open_cache(w, d)
        try:
            cache.maintain()
            assert cache.check() == []
        finally:
            cache.close()
    assert_identical(d)


def test_wrong_token_is_refused_at_connect() -> None:
    listener = listen()
    port = listener.getsockname()[1]
    leader_error: list[BaseException] = []

    def accept() -> None:
        try:
            accept_peer(listener, "right-token", {1}, time.monotonic() + 10)
        except BaseException as exc:  # noqa: BLE001  handed to the test thread
            leader_error.append(exc)

    t = threading.Thread(target=accept)
    t.start()
    try:
        with pytest.raises(LinkAuthError, match=r"refused at connect.*job-token proof"):
            connect_leader("127.0.0.1", port, 1, "wrong-token", socket.gethostname(),
                           RecordSet([], []), time.monotonic() + 10)
    finally:
        t.join(10)
        listener.close()
    assert len(leader_error) == 1 and isinstance(leader_error[0], LinkAuthError)
    assert "peer rank 1" in str(leader_error[0])


def test_stores_during_a_maintenance_burst(template: Path, tmp_path: Path) -> None:
    d = copy_dirs(template, tmp_path / "cache")
    with Worker(ranks=RANKS) as w:
        cache = open_cache(w, d)
        try:
            t, errors, done = _maintain_in_thread(cache)
            latencies = []
            for i in range(20):
                t0 = time.monotonic()
                res = cache.store(np.arange(8 * GEOM.page_tokens) + 10_000 * (i + 1))
                latencies.append(time.monotonic() - t0)
                assert res.stored
            during = not done  # at least the first stores overlapped the burst
            t.join(120)
            assert errors == []
            assert max(latencies) < 10.0, latencies  # bounded: never behind the whole burst
            assert during or max(latencies) < 10.0
            assert cache.check() == []
        finally:
            cache.close()
    assert_identical(d)
