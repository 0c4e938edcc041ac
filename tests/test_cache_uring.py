"""The io_uring reader (kvstore/uring.py, opt-in) on real files, pipes and descriptors, and the
store's fallback to threads where the kernel offers no io_uring."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cache_util import GEOM, PB, Stores, page_row, stores
from phalanx.kvstore import StoreClosedError
from phalanx.kvstore.buffers import aligned_empty
from phalanx.kvstore.uring import SQE_MAX_BYTES, Ring, Rings, unsupported_reason
from phalanx.lifecycle import FailpointError
from phalanx.lifecycle.failpoints import arm, disarm_all

__all__ = ["stores"]  # the fixture, imported for pytest

PT = GEOM.page_tokens


@pytest.fixture
def ring() -> Iterator[Ring]:
    r = Ring.open()
    if r is None:
        pytest.skip("this kernel or sandbox offers no io_uring (the store reads with threads)")
    yield r
    r.close()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2, "test-ring") as ex:
        yield ex


def _addr(buf: np.ndarray, at: int = 0) -> int:
    return int(buf.ctypes.data) + at


def test_reads_land_whole_large_ones_in_entries_and_short_ones_are_reported(
        tmp_path: Path, ring: Ring) -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 * SQE_MAX_BYTES + 100, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    out = aligned_empty(4 * SQE_MAX_BYTES)
    out[:] = 0
    fd = os.open(path, os.O_RDONLY)
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)  # a descriptor number nobody holds
    try:
        big, small = 3 * SQE_MAX_BYTES, 4096
        whole = ring.read(
            np.array([fd, fd, fd, closed], dtype=np.int32),
            np.array([100, 5, len(data) - 10, 0], dtype=np.int64),
            np.array([_addr(out), _addr(out, big), _addr(out, big + small),
                      _addr(out, big + 2 * small)], dtype=np.uint64),
            np.array([big, small, small, small], dtype=np.int64), deadline_s=10.0)
    finally:
        os.close(fd)
    assert whole.tolist() == [True, True, False, False]  # past the end; a bad descriptor
    assert np.array_equal(out[:big], data[100 : 100 + big])  # three entries, one read
    assert np.array_equal(out[big : big + small], data[5 : 5 + small])


def test_a_read_past_its_deadline_is_cancelled_and_the_ring_goes_on(ring: Ring) -> None:
    r, w = os.pipe()  # nothing is ever written: the read never completes by itself
    out = aligned_empty(4096)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="cancelled"):
            ring.read(np.array([r], dtype=np.int32), np.zeros(1, dtype=np.int64),
                      np.array([_addr(out)], dtype=np.uint64),
                      np.array([4096], dtype=np.int64), deadline_s=0.3)
        assert time.monotonic() - t0 < 5.0
        os.write(w, b"x" * 4096)  # a read queued now completes: nothing stale is left
        whole = ring.read(np.array([r], dtype=np.int32), np.zeros(1, dtype=np.int64),
                          np.array([_addr(out)], dtype=np.uint64),
                          np.array([4096], dtype=np.int64), deadline_s=5.0)
        assert whole.tolist() == [True] and bytes(out) == b"x" * 4096
    finally:
        os.close(r)
        os.close(w)
    ring.close()
    ring.close()  # idempotent
    with pytest.raises(StoreClosedError, match="after close"):
        ring.read(np.array([0], dtype=np.int32), np.zeros(1, dtype=np.int64),
                  np.array([_addr(out)], dtype=np.uint64), np.array([1], dtype=np.int64), 1.0)


def test_rings_read_a_batch_in_parts_and_a_part_without_a_free_ring_reads_nothing(
        tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    rings = Rings.open(2)
    if rings is None:
        pytest.skip("this kernel or sandbox offers no io_uring")
    n, size = 64, 64 << 10
    data = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
    fds = []
    try:
        for i in range(n):
            (tmp_path / str(i)).write_bytes(data[i * size : (i + 1) * size].tobytes())
            fds.append(os.open(tmp_path / str(i), os.O_RDONLY))
        out = aligned_empty(n * size)
        batch = (np.array(fds, dtype=np.int32), np.zeros(n, dtype=np.int64),
                 np.array([_addr(out, i * size) for i in range(n)], dtype=np.uint64),
                 np.full(n, size, dtype=np.int64))
        assert rings.read(*batch, pool.submit, 10.0).all()
        assert np.array_equal(out, data)
        held = [r for r in rings._rings if r.lock.acquire(blocking=False)]  # another batch
        try:
            out[:] = 0
            assert not rings.read(*batch, pool.submit, 10.0).any()
            assert not out.any()  # nothing read: the caller reads those on threads
        finally:
            for r in held:
                r.lock.release()
    finally:
        rings.close()
        for fd in fds:
            os.close(fd)


def test_the_store_reads_with_threads_where_the_kernel_refuses_io_uring(
        tmp_path: Path, stores: Stores) -> None:
    arm("cache.uring.setup", "errno:38")  # ENOSYS, as under a seccomp profile
    s = stores.open(tmp_path, io_uring=True)
    assert not s.io_uring
    toks = [np.arange(i * 100, i * 100 + 3 * PT) for i in range(20)]
    s.store_many([(t, page_row(t)) for t in toks])
    got = s.load_many([(t, 3) for t in toks])
    assert [bytes(g) for g in got] == [page_row(t) for t in toks]
    st = s.statistics()
    assert st.io_uring_loaded_bytes == 0 and st.loaded_bytes == 20 * 3 * PB


def test_io_uring_is_opt_in_and_x86_64_only(tmp_path: Path, stores: Stores) -> None:
    """Off unless asked for; refused (the threads read) where the ring's unfenced index
    reads are not safe: every architecture but x86-64 (see uring.py)."""
    assert not stores.open(tmp_path / "default").io_uring
    assert unsupported_reason("x86_64") is None
    for machine in ("aarch64", "ppc64le", "riscv64", "s390x", ""):
        why = unsupported_reason(machine)
        assert why is not None and "x86-64 only" in why and "memory barriers" in why


def _until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_loads_racing_each_other_and_close_serve_right_bytes_or_refuse(
        tmp_path: Path, stores: Stores) -> None:
    """Batches at once share the rings (a part without a free ring goes to threads); a
    batch planned before close() finishes (on threads: the rings are closed); a batch
    after it is refused."""
    s = stores.open(tmp_path, io_uring=True)
    toks = [np.arange(i * 100, i * 100 + 2 * PT) for i in range(64)]
    s.store_many([(t, page_row(t)) for t in toks])
    want = [page_row(t) for t in toks]
    reqs = [(t, 2) for t in toks]
    outcomes: list[str] = []

    def loader(times: int) -> None:
        for _ in range(times):
            got = s.load_many(reqs)
            outcomes.append("ok" if [bytes(g) for g in got] == want else "WRONG BYTES")

    threads = [threading.Thread(target=loader, args=(20,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes == ["ok"] * 60

    arm("cache.load.pinned", "delay:0.5*1")  # the next batch, planned and pinned, waits
    late = threading.Thread(target=loader, args=(1,))
    late.start()
    _until(lambda: any(r.pins for r in s._core.index.records.values()), "the batch to pin")
    s.close()
    late.join(30)
    assert outcomes == ["ok"] * 61
    with pytest.raises(StoreClosedError):
        s.load_many(reqs)


def test_an_error_with_reads_in_flight_cancels_them_before_it_goes_up(ring: Ring) -> None:
    """Whatever interrupts a wait (here a failpoint; a KeyboardInterrupt alike), the
    ring cancels its reads and waits for them first: the caller frees their memory next.
    The pipe proves it: a read still pending would take the bytes written later."""
    r, w = os.pipe()
    stale, fresh = aligned_empty(4096), aligned_empty(4096)
    stale[:] = 0
    try:
        arm("cache.uring.enter", "raise@1*1")  # the wait after the submission fails
        try:
            with pytest.raises(FailpointError):
                ring.read(np.array([r], dtype=np.int32), np.zeros(1, dtype=np.int64),
                          np.array([_addr(stale)], dtype=np.uint64),
                          np.array([4096], dtype=np.int64), deadline_s=30.0)
        finally:
            disarm_all()
        os.write(w, b"y" * 4096)
        whole = ring.read(np.array([r], dtype=np.int32), np.zeros(1, dtype=np.int64),
                          np.array([_addr(fresh)], dtype=np.uint64),
                          np.array([4096], dtype=np.int64), deadline_s=5.0)
    finally:
        os.close(r)
        os.close(w)
    assert whole.tolist() == [True] and bytes(fresh) == b"y" * 4096
    assert not stale.any()


def test_a_ring_that_fails_hands_its_part_to_the_threads(tmp_path: Path, stores: Stores,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    s = stores.open(tmp_path, io_uring=True)
    if not s.io_uring:
        pytest.skip("this kernel or sandbox offers no io_uring")
    toks = [np.arange(i * 100, i * 100 + 2 * PT) for i in range(64)]
    s.store_many([(t, page_row(t)) for t in toks])
    want = [page_row(t) for t in toks]
    arm("cache.uring.enter", "errno:9*1")  # EBADF: not an answer a ring in use gives
    assert [bytes(g) for g in s.load_many([(t, 2) for t in toks])] == want
    assert "loads read with threads from now on" in caplog.text
    st = s.statistics()
    assert 0 < st.io_uring_loaded_bytes < st.loaded_bytes  # the other rings read theirs
    assert [bytes(g) for g in s.load_many([(t, 2) for t in toks])] == want
    assert s.statistics().io_uring_loaded_bytes > st.io_uring_loaded_bytes


def test_a_timeout_goes_up_through_the_rings(pool: ThreadPoolExecutor) -> None:
    """Not swallowed as a failed ring: the threads would read the hung file again,
    without a deadline."""
    rings = Rings.open(1)
    if rings is None:
        pytest.skip("this kernel or sandbox offers no io_uring")
    r, w = os.pipe()
    out = aligned_empty(4096)
    try:
        with pytest.raises(TimeoutError):
            rings.read(np.array([r], dtype=np.int32), np.zeros(1, dtype=np.int64),
                       np.array([_addr(out)], dtype=np.uint64),
                       np.array([4096], dtype=np.int64), pool.submit, 0.3)
    finally:
        rings.close()
        os.close(r)
        os.close(w)


def test_a_ring_that_fails_with_a_read_in_flight_waits_for_it_first(ring: Ring) -> None:
    """io_uring_enter failing (EBADF here) leaves a read in flight that the ring can no
    longer cancel: the error goes up only once the read has landed."""
    r, w = os.pipe()
    out = aligned_empty(4096)
    out[:] = 0
    landed = threading.Event()

    def write_once_failed() -> None:  # the read is in flight on a ring that has failed
        _until(lambda: not ring.usable, "the ring to fail")
        os.write(w, b"z" * 4096)
        landed.set()

    writer = threading.Thread(target=write_once_failed)
    try:
        arm("cache.uring.enter", "errno:9@1*1")  # the wait after the submission fails
        writer.start()
        with pytest.raises(OSError, match="io_uring_enter"):
            ring.read(np.array([r], dtype=np.int32), np.zeros(1, dtype=np.int64),
                      np.array([_addr(out)], dtype=np.uint64),
                      np.array([4096], dtype=np.int64), deadline_s=30.0)
        assert landed.is_set() and bytes(out) == b"z" * 4096
    finally:
        disarm_all()
        writer.join()
        os.close(r)
        os.close(w)
