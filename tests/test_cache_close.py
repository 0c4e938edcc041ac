"""One ownership discipline in the store: what open acquires is journaled; a failed
open rolls it back; close() runs every step, raises one CleanupError carrying every
failure, and a second close() retries only what failed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cache_util import GEOM, Stores, page_row, record_files, stores
from phalanx.kvstore import SEAL_NAME, StoreLockedError
from phalanx.kvstore.files import QUARANTINE_DIR
from phalanx.lifecycle import CleanupError, FailpointError, failpoints

__all__ = ["stores"]  # the fixture, imported for pytest

PT = GEOM.page_tokens


def _fds_under(directory: Path) -> list[str]:
    """Targets of this process's descriptors that lie in ``directory``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed meanwhile
        if target.startswith(str(directory)):
            out.append(target)
    return out


def _io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("phalanx-cache-io")]


def _filled(stores: Stores, d: Path) -> list[np.ndarray]:
    s = stores.open(d, io_threads=2, open_files=8)
    rows = [np.arange(i * 100, i * 100 + 2 * PT) for i in range(4)]
    s.store_many([(t, page_row(t)) for t in rows])  # two threads: the pool exists
    for t in rows:
        s.load(t, 2)  # descriptors held
    return rows


def test_two_failing_close_steps_both_come_up_and_a_second_close_retries_them(
    tmp_path: Path, stores: Stores
) -> None:
    rows = _filled(stores, tmp_path)
    s = stores.opened[-1]
    assert _io_threads() and any(p.endswith(".kv") for p in _fds_under(tmp_path))
    failpoints.arm("cache.close.seal", "raise*1")
    failpoints.arm("cache.close.lock", "raise*1")
    with pytest.raises(CleanupError) as info:
        s.close()
    err = info.value
    assert [type(e) for e in err.exceptions] == [FailpointError, FailpointError]
    assert [e.point for e in err.exceptions if isinstance(e, FailpointError)] == [
        "cache.close.seal", "cache.close.lock"]  # newest first: the seal, the lock last
    notes = [n for e in err.exceptions for n in getattr(e, "__notes__", [])]
    assert any("'header snapshot and seal'" in n for n in notes)
    assert any("'directory lock'" in n for n in notes)
    assert all(e.__context__ is None and e.__cause__ is None for e in err.exceptions)
    assert err.__context__ is None
    # the steps between them ran: threads stopped, record descriptors closed; the lock
    # and the seal stay owed (the directory is still this store's)
    assert not _io_threads()
    assert [p for p in _fds_under(tmp_path) if p.endswith(".kv")] == []
    assert not (tmp_path / SEAL_NAME).exists()
    with pytest.raises(StoreLockedError):
        stores.open(tmp_path)
    s.close()  # the retry: only the seal and the lock
    assert (tmp_path / SEAL_NAME).exists() and _fds_under(tmp_path) == []
    s.close()  # nothing owed: a no-op
    again = stores.open(tmp_path)  # sealed: recovered from the snapshot alone
    assert [again.lookup(t) for t in rows] == [2] * len(rows)
    assert again.check() == []


def test_a_failed_open_releases_what_it_had_acquired(tmp_path: Path, stores: Stores) -> None:
    """The rings are acquired after the lock and the descriptor table: a failure
    creating one releases those two, newest first, and nothing leaks."""
    failpoints.arm("cache.uring.setup", "raise*1")
    with pytest.raises(FailpointError, match=r"cache\.uring\.setup"):
        stores.open(tmp_path, io_uring=True, io_threads=2)
    assert _fds_under(tmp_path) == [] and not _io_threads()
    s = stores.open(tmp_path)  # the lock was released
    assert s.check() == []


def test_a_failed_rollback_comes_up_beside_the_open_error(tmp_path: Path) -> None:
    """In a process of its own: the lock a failed rollback keeps stays owed there."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from cache_util import GEOM, FP
        from phalanx.kvstore import DiskStore, StoreOptions
        from phalanx.lifecycle import CleanupError, failpoints
        failpoints.arm("cache.uring.setup", "raise*1")
        failpoints.arm("cache.close.lock", "raise*1")
        try:
            DiskStore({str(tmp_path)!r}, GEOM, FP,
                      StoreOptions(1 << 20, progress=False, io_uring=True, io_threads=2))
        except CleanupError as exc:
            print("points", *[e.point for e in exc.exceptions], flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["points", "cache.uring.setup", "cache.close.lock"]


def test_a_bad_file_that_cannot_be_moved_aside_stays_queued(
    tmp_path: Path, stores: Stores
) -> None:
    """cache.quarantine.moving: the error reaches the poll naming the point; the bad file
    stays where it was, queued, and the next poll moves it."""
    s = stores.open(tmp_path)
    toks = np.arange(2 * PT)
    s.store(toks, page_row(toks))
    s.close()
    bad = "ab" * 16 + ".kv"
    (tmp_path / bad).write_bytes(b"not a record" * 10)
    (tmp_path / SEAL_NAME).unlink()  # every file is checked at open
    s = stores.open(tmp_path)
    assert s.pending() == 1
    failpoints.arm("cache.quarantine.moving", "raise*1")
    with pytest.raises(FailpointError, match=r"cache\.quarantine\.moving"):
        s.poll()
    assert (tmp_path / bad).exists() and s.pending() == 1
    assert s.poll() == 1 and s.pending() == 0
    assert os.listdir(tmp_path / QUARANTINE_DIR) == [bad]
    assert len(record_files(tmp_path)) == 1  # the good record stays
    assert s.lookup(toks) == 2 and s.check() == []


def test_a_seal_still_owed_once_the_lock_went_is_never_written_into_another_stores_directory(
    tmp_path: Path, stores: Stores
) -> None:
    """The seal failed, the steps after it ran, the lock last: the directory may be
    another store's now. Only the lock holder may seal (an open consumes the seal first,
    trusting that none outlives a change), so the retry writes nothing there."""
    rows = _filled(stores, tmp_path)
    first = stores.opened[-1]
    failpoints.arm("cache.close.seal", "raise*1")
    with pytest.raises(CleanupError) as info:
        first.close()
    assert [e.point for e in info.value.exceptions if isinstance(e, FailpointError)] == [
        "cache.close.seal"]
    owner = stores.open(tmp_path)  # the lock was released: the directory is the owner's
    first.close()  # the retry of the seal
    assert not (tmp_path / SEAL_NAME).exists(), "a closed store sealed a live store's directory"
    first.close()  # nothing owed any more
    extra = np.arange(9_000, 9_000 + 2 * PT)
    owner.store(extra, page_row(extra))  # a change a stale seal would vouch against
    owner.close()
    again = stores.open(tmp_path)
    assert [again.lookup(t) for t in [*rows, extra]] == [2] * (len(rows) + 1)
    assert again.check() == []


def test_an_error_in_a_with_block_comes_up_beside_a_failing_close(
    tmp_path: Path, stores: Stores
) -> None:
    """Not hidden in the CleanupError's ``__context__``: one CleanupError carries both."""
    failpoints.arm("cache.close.lock", "raise*1")
    with pytest.raises(CleanupError) as info, stores.open(tmp_path):
        raise KeyError("the block's own error")
    kinds = [type(e) for e in info.value.exceptions]
    assert kinds == [KeyError, FailpointError], info.value.exceptions
    with pytest.raises(StoreLockedError):
        stores.open(tmp_path)  # the lock stays owed
    stores.opened[0].close()  # the retry releases it
    assert stores.open(tmp_path).check() == []


def test_close_lets_the_directory_go_only_once_a_store_in_flight_is_done(
    tmp_path: Path, stores: Stores
) -> None:
    """A store admitted before close() still writes into the directory (its temp file,
    the rename): the lock must not be released under it, or the file lands in a
    directory another store may own by then."""
    s = stores.open(tmp_path)
    toks = np.arange(2 * PT)
    failpoints.arm("cache.store.temp_written", "delay:1*1")  # written, not yet renamed
    results = []
    writer = threading.Thread(target=lambda: results.append(s.store(toks, page_row(toks))))
    writer.start()
    deadline = time.monotonic() + 30
    while not failpoints.fired("cache.store.temp_written"):
        assert time.monotonic() < deadline, "the store never reached its rename"
        time.sleep(0.001)
    s.close()
    at_close = record_files(tmp_path)
    writer.join(30)
    assert not writer.is_alive() and results and results[0].stored
    assert record_files(tmp_path) == at_close, "a record landed after close() returned"
    again = stores.open(tmp_path)
    assert again.lookup(toks) == 2 and again.check() == []
