"""Rendezvous: bounded markers while alive, nothing after close, sweeps that never lie."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import phalanx
from leaks import _files_under
from phalanx.lifecycle import failpoints
from phalanx.rendezvous import (
    HandshakeAbortedError,
    HandshakeError,
    HandshakeTimeoutError,
    StoreBackend,
    TokenMismatchError,
    UnsafeRuntimeDirError,
    current,
    handshake,
    live_markers,
    sweep,
)
from phalanx.rendezvous.generation import OWNER_FILE
from waits import ranks_under, wait_for

BACKENDS = ["hub", "marker", "store"]


def _alloc_release(alloc_id: int, ranks: list[int]) -> None:
    handshake("alloc", alloc_id, ranks, timeout=30)
    handshake("release", alloc_id, ranks, timeout=30)


def _markers() -> int:
    return live_markers()


@pytest.mark.parametrize("backend", BACKENDS)
# two ranks in the quick pass, both backends; three are the campaign's (slow)
@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_two_thousand_handshake_pairs_stay_bounded(backend: str, ranks: int,
                                                   tmp_path: Path) -> None:
    runtime_dir = tmp_path / "rt"
    counts: list[int] = []

    def orch(o: phalanx.Orchestrator) -> None:
        members = list(o.ranks)
        for alloc_id in range(1, 2001):
            for f in [o.submit(r, _alloc_release, alloc_id, members) for r in members]:
                f.result()
            if backend == "store":
                counts.append(o.submit(0, _markers).result())
            else:
                counts.append(len(_files_under(runtime_dir)))

    with phalanx.Worker(ranks=ranks, rendezvous=backend, runtime_dir=runtime_dir) as w:
        baseline = len(_files_under(runtime_dir)) if backend != "store" else None
        w.run(orch)
    assert len(counts) == 2000
    # markers of a finished handshake are gone before its leader returns (the store's:
    # before its last participant to leave returns): the count after each pair is the
    # resting count, and it never grows with the number done
    assert max(counts) == min(counts) <= (ranks * 2 + 2)
    if baseline is not None:
        assert max(counts) == baseline == 2  # the generation dir and its owner record
    assert _files_under(runtime_dir) == frozenset()  # zero after close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_timed_out_handshake_names_missing_ranks(backend: str, tmp_path: Path) -> None:
    with phalanx.Worker(ranks=3, rendezvous=backend, runtime_dir=tmp_path) as w:
        with pytest.raises(HandshakeTimeoutError, match=r"ranks \[1, 2\] never arrived") as info:
            w.run(lambda o: o.submit(0, handshake, "alloc", 77, [0, 1, 2], 0.5).result())
        assert info.value.missing == [1, 2]
        assert "allocation 77" in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_runs_handshake_different_allocations(backend: str, tmp_path: Path) -> None:
    """Tasks of concurrent runs handshake at once on the same ranks (the store backend
    gives each serving thread its own connections); afterwards only the resting
    markers are left."""
    def orch(o: phalanx.Orchestrator, k: int) -> int:
        members = list(o.ranks)
        for i in range(40):
            alloc_id = 1000 + 100 * k + i
            for f in [o.submit(r, _alloc_release, alloc_id, members) for r in members]:
                f.result()
        return k

    with phalanx.Worker(ranks=2, rendezvous=backend, runtime_dir=tmp_path) as w:
        rest = w.run(lambda o: o.submit(0, _markers).result())
        handles = [w.submit(orch, k) for k in range(4)]
        assert [h.result(timeout=120) for h in handles] == [0, 1, 2, 3]
        assert w.run(lambda o: o.submit(0, _markers).result()) == rest


def _wait_for_abort(alloc_id: int, ranks: list[int]) -> str:
    try:
        handshake("alloc", alloc_id, ranks, timeout=120)
    except HandshakeAbortedError:
        return "aborted"
    return "released"


def _abort_after(delay: float, alloc_id: int, ranks: list[int]) -> None:
    time.sleep(delay)
    rank = phalanx.current_rank()
    assert rank is not None
    current.backend().abort(alloc_id, rank, ["alloc"], ranks)


def _purge(alloc_id: int, ranks: list[int]) -> int:
    return current.backend().purge(alloc_id, ["alloc"], ranks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_wakes_waiters_and_refuses_late_arrivals(backend: str, tmp_path: Path) -> None:
    """One participant gives up: the ones already waiting stop at once with an abort
    (not after their 120 s timeout); after a second one gives up too, one arriving later
    is still refused; the purge leaves the resting marker count."""
    def orch(o: phalanx.Orchestrator) -> tuple[list[str], int, int, int]:
        ranks = list(o.ranks)
        rest = o.submit(0, _markers).result()
        waiting = [o.submit(r, _wait_for_abort, 5, ranks) for r in ranks[:2]]
        o.submit(2, _abort_after, 0.5, 5, ranks).result()
        outcomes = [f.result() for f in waiting]
        o.submit(0, _abort_after, 0.0, 5, ranks).result()  # a second rank gives up too
        outcomes.append(o.submit(2, _wait_for_abort, 5, ranks).result())  # late
        purged = o.submit(0, _purge, 5, ranks).result()
        return outcomes, rest, o.submit(0, _markers).result(), purged

    with phalanx.Worker(ranks=3, rendezvous=backend, runtime_dir=tmp_path) as w:
        outcomes, rest, after, purged = w.run(orch)
    assert outcomes == ["aborted"] * 3
    assert after == rest
    if backend == "store":  # every participant came and left: its last removed the keys
        assert purged == 0


def _arrivals(alloc_id: int, tag: str) -> int:
    """The arrivals counted in the store backend's key of a handshake (read on a rank)."""
    backend = current.backend()
    assert isinstance(backend, StoreBackend)
    store = backend._pool.take()
    key = backend._where(tag, alloc_id, 0).key
    try:  # read, never add: a write to the key wakes its waiters
        return int(store.get(key)) & 0x7F if store.check([key]) else 0
    finally:
        backend._pool.give(store)


def test_store_rank_that_times_out_tells_the_others(tmp_path: Path) -> None:
    """A rank that gives up at its deadline has taken its arrival back, so the barrier
    can never complete: it wakes the others (aborted) instead of leaving them to wait
    out their own, much longer, timeouts."""
    def orch(o: phalanx.Orchestrator) -> tuple[str, list[int]]:
        waiting = o.submit(1, _wait_for_abort, 88, [0, 1, 2])  # 120 s timeout
        # rank 0's 1 s starts once rank 1 is in: a loaded machine can take longer than
        # that to start rank 1's task, and then two would be missing, not one
        wait_for(lambda: o.submit(0, _arrivals, 88, "alloc").result() == 1, 60,
                 "rank 1's arrival in the store")
        with pytest.raises(HandshakeTimeoutError, match="never arrived") as info:
            o.submit(0, handshake, "alloc", 88, [0, 1, 2], 1.0).result()
        return waiting.result(), info.value.missing

    with phalanx.Worker(ranks=3, rendezvous="store", runtime_dir=tmp_path) as w:
        outcome, missing = w.run(orch)
    assert outcome == "aborted"
    assert missing == [2]  # rank 1 had arrived: its bit was in the arrivals key


@pytest.mark.parametrize("backend", BACKENDS)
def test_publish_failure_names_rank_tag_and_allocation(backend: str, tmp_path: Path) -> None:
    with phalanx.Worker(ranks=2, rendezvous=backend, runtime_dir=tmp_path) as w:
        w.arm_failpoint("rendezvous.handshake.publish", "errno:28", ranks=1)
        with pytest.raises(HandshakeError) as info:
            w.run(lambda o: [f.result() for f in reversed([
                o.submit(r, handshake, "alloc", 9, [0, 1], 2.0) for r in o.ranks])])
        msg = str(info.value)
        assert "rank 1" in msg and "'alloc'" in msg and "allocation 9" in msg and "28" in msg


@pytest.mark.parametrize("backend", ["marker", "store"])
def test_remove_failure_names_rank_tag_and_allocation(backend: str, tmp_path: Path) -> None:
    # the marker backend's leader removes every marker; in the store backend, the last
    # participant to leave removes the key, whichever rank that is
    with phalanx.Worker(ranks=2, rendezvous=backend, runtime_dir=tmp_path) as w:
        w.arm_failpoint("rendezvous.handshake.remove", "errno:5",
                        ranks=0 if backend == "marker" else "all")
        with pytest.raises(HandshakeError) as info:
            w.run(lambda o: [f.result() for f in [
                o.submit(r, handshake, "release", 4, [0, 1], 5.0) for r in o.ranks]])
        msg = str(info.value)
        who = r"rank 0 \(leader\)" if backend == "marker" else r"rank [01] could not remove"
        assert re.search(who, msg) and "'release'" in msg and "allocation 4" in msg
        assert "errno 5" in msg


def test_store_peer_with_wrong_token_is_refused(tmp_path: Path) -> None:
    with phalanx.Worker(ranks=2, rendezvous="store", runtime_dir=tmp_path) as w:
        assert w.store_address is not None
        host, port = w.store_address
        with pytest.raises(TokenMismatchError, match="refused"):
            StoreBackend(host, port, "not-the-token", w.generation, is_master=False, timeout=5)


_RACES = 80


def _race(ranks: list[int]) -> dict[int, str]:
    """This rank's side of the race test: its outcome of each handshake."""
    rank = phalanx.current_rank()
    assert rank is not None
    rng = random.Random(rank)
    outcomes = {}
    for alloc_id in range(1, _RACES + 1):
        if rank == 2:
            time.sleep(rng.uniform(0, 0.04))
        try:
            handshake("race", alloc_id, ranks, 30.0 if rank == 2 else 0.02)
            outcomes[alloc_id] = "released"
        except HandshakeAbortedError:
            outcomes[alloc_id] = "aborted"
        except HandshakeTimeoutError:
            outcomes[alloc_id] = "timed out"
    return outcomes


@pytest.mark.slow  # a campaign
def test_store_handshakes_racing_their_deadlines_agree_and_leave_no_key(tmp_path: Path) -> None:
    """Ranks 0 and 1 give up after 20 ms while rank 2 arrives 0-40 ms late, 80 times:
    timeouts race the last arrival, and aborts race later arrivals. Whatever the timing,
    a handshake releases every participant or fails every one (the arrivals key's
    invariant), and once all have left, none of its keys is left."""
    def orch(o: phalanx.Orchestrator) -> tuple[list[dict[int, str]], int, int]:
        ranks = list(o.ranks)
        rest = o.submit(0, _markers).result()
        futures = [o.submit(r, _race, ranks) for r in ranks]
        return [f.result() for f in futures], rest, o.submit(0, _markers).result()

    with phalanx.Worker(ranks=3, rendezvous="store", runtime_dir=tmp_path) as w:
        outcomes, rest, after = w.run(orch)
    for alloc_id in range(1, _RACES + 1):
        seen = {per_rank[alloc_id] for per_rank in outcomes}
        assert seen == {"released"} or "released" not in seen, (alloc_id, seen)
    assert after == rest  # every handshake's keys went with its last participant


_DOOMED_PARENT = textwrap.dedent("""
    import sys, time, phalanx
    w = phalanx.Worker(ranks=2, runtime_dir=sys.argv[1], rendezvous=sys.argv[2])
    print(w.generation, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("backend", ["hub", "marker"])
def test_sigkilled_worker_generation_is_reclaimed_by_the_next(backend: str,
                                                               tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _DOOMED_PARENT, str(tmp_path), backend],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    token = parent.stdout.readline().strip()
    parent.stdout.close()
    shm = Path(f"/dev/shm/phx-{token}-leftover")  # as a domain's segment would be named
    shm.write_bytes(b"x")
    try:
        assert (tmp_path / token / OWNER_FILE).exists()
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    # its ranks follow it (parent-death signal): the sweep is asked once they are gone
    wait_for(lambda: not ranks_under(tmp_path), 30, "the killed parent's ranks to exit")
    with phalanx.Worker(ranks=1, runtime_dir=tmp_path) as w:
        report = w.sweep_report
        assert report is not None and report.generations_removed == [token]
        assert report.shm_removed == 1 and not shm.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == [w.generation]
    assert list(tmp_path.iterdir()) == []


def _dead_generation(root: Path, token: str, files: int) -> Path:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer runs
    gen = root / token
    gen.mkdir(parents=True, mode=0o700)
    owner = {"host": os.uname().nodename, "boot_id": Path(
        "/proc/sys/kernel/random/boot_id").read_text().strip(), "pid": proc.pid,
        "start_time": 1.0, "uid": os.getuid(), "created": 1.0, "version": 1}
    (gen / OWNER_FILE).write_text(json.dumps(owner))
    for i in range(files):
        (gen / f"hs-{i}-alloc-a-0").write_bytes(b"")
    return gen


def test_sweep_reports_unlink_failure_and_reclaims_the_rest(tmp_path: Path) -> None:
    _dead_generation(tmp_path, "aaaa", 3)
    _dead_generation(tmp_path, "bbbb", 3)
    failpoints.arm("rendezvous.remove.unlink", "errno:13*1")
    try:
        report = sweep(tmp_path)
    finally:
        failpoints.disarm_all()
    assert len(report.failures) == 1
    failure = report.failures[0]
    assert failure.errno == 13 and ".reclaim-aaaa" in failure.path
    assert report.generations_removed == ["bbbb"]
    assert report.files_removed == 7  # 8 files, one refused
    # the claimed remains are finished by the next sweep
    again = sweep(tmp_path)
    assert again.generations_removed == ["aaaa"] and not again.failures
    assert list(tmp_path.iterdir()) == []


def test_live_generation_survives_another_workers_sweep(tmp_path: Path) -> None:
    with phalanx.Worker(ranks=2, runtime_dir=tmp_path, rendezvous="marker") as first:
        with phalanx.Worker(ranks=1, runtime_dir=tmp_path) as second:
            assert second.sweep_report is not None
            assert second.sweep_report.live_kept == 1
            assert not second.sweep_report.generations_removed
        assert first.run(lambda o: [f.result() for f in [
            o.submit(r, handshake, "alloc", 1, [0, 1]) for r in o.ranks]]) == [None, None]


def test_directories_private_and_unsafe_ones_refused(tmp_path: Path) -> None:
    with phalanx.Worker(ranks=1, runtime_dir=tmp_path / "rt") as w:
        gen = tmp_path / "rt" / w.generation
        assert (gen.stat().st_mode & 0o777) == 0o700
        assert ((gen / OWNER_FILE).stat().st_mode & 0o777) == 0o600
        assert ((tmp_path / "rt").stat().st_mode & 0o777) == 0o700
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeRuntimeDirError, match="symlink"):
        phalanx.Worker(ranks=1, runtime_dir=tmp_path / "link")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 12345, 12345)
    with pytest.raises(UnsafeRuntimeDirError, match="owned by uid 12345"):
        phalanx.Worker(ranks=1, runtime_dir=foreign)


def test_doctor_lists_and_reclaims(tmp_path: Path) -> None:
    _dead_generation(tmp_path, "dead1", 2)
    exe = [sys.executable, "-m", "phalanx.serve.cli._main", "doctor", "--runtime-dir",
           str(tmp_path)]
    out = subprocess.run([*exe, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    gens = json.loads(out.stdout)["generations"]
    assert [(g["token"], g["dead"], g["files"]) for g in gens] == [("dead1", True, 3)]
    env = dict(os.environ, PHALANX_FAILPOINTS="rendezvous.remove.unlink=errno:5*1")
    out = subprocess.run([*exe, "--reclaim"], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 1 and "EIO" in out.stderr
    out = subprocess.run([*exe, "--reclaim"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "reclaimed 1 generation" in out.stdout
    assert list(tmp_path.iterdir()) == []
