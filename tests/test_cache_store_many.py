"""``store_many``: a batch of rows admitted in order, written at once, indexed in order;
and the admission rule both store paths share: a store never evicts its own prefix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cache_util import GEOM, Clock, Stores, page_row, record_files, stores, temp_files
from phalanx.kvstore import CapacityError, DiskStore, RecordCorruptError, RowSpanError
from phalanx.lifecycle import FailpointError, failpoints

__all__ = ["stores"]  # the fixture, imported for pytest

PT = GEOM.page_tokens


def tree_rows(n: int, seed: int) -> list[tuple[np.ndarray, int]]:
    """n prefixes of a random tree, each with the page its row starts at: suffix rows
    (only the new pages) for odd ones, full rows from page 0 for even ones."""
    rng = np.random.default_rng(seed)
    out: list[tuple[np.ndarray, int]] = []
    for i in range(n):
        parent = int(rng.integers(-1, i)) if i else -1
        base = out[parent][0] if parent >= 0 else np.zeros(0, dtype=np.int64)
        toks = np.concatenate([base, rng.integers(0, 50_000, PT * int(rng.integers(1, 4)))])
        out.append((toks, len(base) // PT if i % 2 else 0))
    return out


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_store_many_serves_what_single_stores_would(tmp_path: Path, stores: Stores,
                                                    threads: int) -> None:
    s = stores.open(tmp_path, clock=Clock(), io_threads=threads)
    rows = tree_rows(80, seed=threads)
    items = [(t, page_row(t[start * PT :])) for t, start in rows]
    results = []
    for i in range(0, len(items), 9):  # batches whose rows extend rows of the same batch
        batch = items[i : i + 9]
        batch.append(batch[0])  # a duplicate within the batch: skipped
        results += s.store_many(batch)[:-1]
    assert all(r.stored for r in results)
    assert [r.end_page for r in results] == [len(t) // PT for t, _ in rows]
    again = s.store_many(items[:5])  # all cached: nothing written
    assert not any(r.stored for r in again)
    st = s.statistics()
    assert st.stores == len(rows) and st.stores_skipped == 9 + 5
    for toks, _ in rows:
        n = len(toks) // PT
        assert s.lookup(toks) == n
        assert bytes(s.load(toks, n)) == page_row(toks)
    assert s.check() == [] and temp_files(tmp_path) == []
    s.close()
    s = stores.open(tmp_path)  # and all of it recovers
    assert all(s.lookup(t) == len(t) // PT for t, _ in rows) and s.check() == []


def test_store_many_refuses_bad_input_before_writing(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path, capacity_bytes=4096)
    a = np.arange(2 * PT)
    s.store(a, page_row(a))
    held = record_files(tmp_path)
    gap = np.arange(1000, 1000 + 3 * PT)
    ok = np.arange(5000, 5000 + PT)
    with pytest.raises(RowSpanError, match="no gaps"):  # the second row starts past a miss
        s.store_many([(ok, page_row(ok)), (gap, page_row(gap[PT:]))])
    with pytest.raises(RowSpanError, match="multiple of the page size"):
        s.store_many([(ok, page_row(ok)), (ok, page_row(ok)[:-1])])
    big = [(np.arange(k * 100, k * 100 + 4 * PT), None) for k in range(10, 20)]
    with pytest.raises(CapacityError, match="smaller batches"):  # more than the capacity
        s.store_many([(t, page_row(t)) for t, _ in big])
    # nothing written, nothing evicted, nothing left reserved or in flight
    assert record_files(tmp_path) == held and temp_files(tmp_path) == []
    assert s.lookup(a) == 2 and s.lookup(ok) == 0 and s.statistics().stores == 1
    assert s.store_many([(ok, page_row(ok))])[0].stored and s.check() == []


def test_a_failed_write_keeps_the_rest_of_the_batch(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path, io_threads=1)  # one thread: the rows are written in order
    a = np.arange(2 * PT)
    b = np.concatenate([a, np.arange(100, 100 + PT)])
    c = np.arange(200, 200 + PT)
    d = np.concatenate([b, np.arange(300, 300 + PT)])
    failpoints.arm("cache.store.temp_written", "raise@1*1")  # b's write fails
    with pytest.raises(FailpointError) as err:
        s.store_many([(a, page_row(a)), (b, page_row(b[2 * PT :])), (c, page_row(c)),
                      (d, page_row(d[3 * PT :]))])
    assert "3 of 4 rows to write were stored; 1 failed" in "".join(err.value.__notes__)
    assert temp_files(tmp_path) == []
    # a and c are served; d was written but hangs from b, which is not: never served
    assert (s.lookup(a), s.lookup(b), s.lookup(c), s.lookup(d)) == (2, 2, 1, 2)
    assert bytes(s.load(c, 1)) == page_row(c)
    while s.poll():  # and maintenance drops d's file
        pass
    assert len(record_files(tmp_path)) == 2 and s.check() == []
    # the batch again: only what is missing is written
    res = s.store_many([(a, page_row(a)), (b, page_row(b[2 * PT :])), (d, page_row(d[3 * PT :]))])
    assert [r.stored for r in res] == [False, True, True] and s.lookup(d) == 4


@pytest.mark.parametrize("many", [False, True], ids=["store", "store_many"])
def test_a_store_never_evicts_the_prefix_it_extends(tmp_path: Path, stores: Stores,
                                                     many: bool) -> None:
    p, q = np.arange(2 * PT), np.arange(500, 500 + 2 * PT)
    e = np.concatenate([p, np.arange(900, 900 + 2 * PT)])
    probe = stores.open(tmp_path / "probe")
    size = probe.store(p, page_row(p)).bytes_written  # p, q and e's row: same size
    s = stores.open(tmp_path / "s", capacity_bytes=3 * size - 1)  # room for two
    s.store(p, page_row(p))
    s.store(q, page_row(q))  # p is now the least recently used leaf
    row = page_row(e[2 * PT :])
    res = s.store_many([(e, row)])[0] if many else s.store(e, row)
    assert res.stored and s.lookup(e) == 4  # attached below p, not an orphan
    assert s.lookup(q) == 0 and s.statistics().evictions == 1  # q made the room
    assert bytes(s.load(e, 4)) == page_row(e) and s.check() == []


def test_rows_needing_pages_another_call_is_writing_wait_for_a_later_batch(
    tmp_path: Path, stores: Stores
) -> None:
    """Two workers store the same system prompt, each with its own suffix."""
    s = stores.open(tmp_path)
    prompt = np.arange(2 * PT)
    mine = np.concatenate([prompt, np.arange(100, 100 + PT)])
    deeper = np.concatenate([mine, np.arange(200, 200 + PT)])
    other = np.arange(300, 300 + PT)
    failpoints.arm("cache.store.temp_written", "delay:1*1")  # the first write stalls
    first = threading.Thread(target=s.store, args=(prompt, page_row(prompt)))
    first.start()
    deadline = time.monotonic() + 30
    while not failpoints.fired("cache.store.temp_written"):
        assert time.monotonic() < deadline, "the first store never started writing"
        time.sleep(0.01)
    res = s.store_many([(prompt, page_row(prompt)), (mine, page_row(mine[2 * PT :])),
                        (deeper, page_row(deeper[3 * PT :])), (other, page_row(other))])
    assert [r.stored for r in res] == [False, False, False, True]  # no gap error
    first.join(timeout=30)
    assert not first.is_alive() and s.lookup(prompt) == 2
    res = s.store_many([(mine, page_row(mine[2 * PT :])), (deeper, page_row(deeper[3 * PT :]))])
    assert all(r.stored for r in res) and bytes(s.load(deeper, 4)) == page_row(deeper)
    assert s.check() == [] and s.statistics().stores_skipped == 3


def test_an_interrupt_mid_batch_waits_for_the_writes_under_way(tmp_path: Path) -> None:
    """Ctrl-C while the I/O threads write: whatever got written is indexed, nothing is
    left reserved or open, and the directory holds exactly what the index says.

    No timer races the store: both threads' first writes are slowed at a failpoint, and
    the interrupt is sent once it has fired twice, so two writes are provably under way
    (the caller's own, or the one it then waits for). A trial whose interrupt came after
    the batch finished (a watcher starved for the whole delay) tests nothing, and
    another runs instead."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import numpy as np
        from cache_util import GEOM, FP, page_row
        from phalanx.kvstore import DiskStore, StoreOptions
        from phalanx.lifecycle import failpoints
        POINT = "cache.store.temp_written"
        # a process started in the background by a non-interactive shell (nohup, `cmd &`
        # in a CI script) inherits SIGINT ignored, and Python then installs no handler:
        # every interrupt of this test would be lost (0 of 12 trials interrupted)
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def interrupt_once_two_writes_are_under_way():
            deadline = time.monotonic() + 60
            while failpoints.fired(POINT) < 2:
                if time.monotonic() > deadline:
                    os._exit(3)  # the writes never reached the failpoint
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)

        fds = set(os.listdir("/proc/self/fd"))
        stored = interrupted = 0
        for trial in range(12):
            if interrupted == 4:
                break
            d = os.path.join({str(tmp_path)!r}, str(trial))
            s = DiskStore(d, GEOM, FP, StoreOptions(1 << 30, progress=False, io_threads=2))
            rows = [np.arange(i * 1000, i * 1000 + 2 * GEOM.page_tokens) for i in range(6)]
            failpoints.arm(POINT, "delay:1*2")  # each thread's first write is slow
            watcher = threading.Thread(target=interrupt_once_two_writes_are_under_way)
            watcher.start()
            finished = False
            try:
                s.store_many([(t, page_row(t)) for t in rows])
                finished = True
                watcher.join()  # a late interrupt lands here
            except KeyboardInterrupt:
                interrupted += not finished
                watcher.join()
            failpoints.disarm_all()
            assert s.check() == [], s.check()
            assert s._core.reserved == 0 and not s._core.inflight
            done = [t for t in rows if s.lookup(t) == 2]
            assert all(bytes(s.load(t, 2)) == page_row(t) for t in done)
            stored += len(done)
            s.close()
        assert interrupted == 4, interrupted
        left = set(os.listdir("/proc/self/fd")) - fds
        assert not [os.readlink(f"/proc/self/fd/{{f}}") for f in left
                    if os.path.exists(f"/proc/self/fd/{{f}}")], left
        print("ok", stored, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


@pytest.mark.parametrize("open_files", [2, 0], ids=["file-held", "file-opened-per-read"])
def test_no_store_takes_the_name_of_a_dropped_record_a_load_still_reads(
    tmp_path: Path, stores: Stores, open_files: int
) -> None:
    """A load pinned record R (pages 2..4); R is discarded and the same prefix stored
    again as one row from page 0, whose file has R's name. The load read that new file
    at R's offsets and returned wrong bytes; now the new store waits for the load."""
    s = stores.open(tmp_path, open_files=open_files)
    toks = np.arange(4 * PT) + 7
    s.store(toks[: 2 * PT], page_row(toks[: 2 * PT]))
    r = s.store(toks, page_row(toks[2 * PT :]))
    s.load(toks, 4)  # with open_files, R's descriptor is held: the short read path
    failpoints.arm("cache.load.pinned", "delay:1*1")
    got: list[object] = []
    loader = threading.Thread(target=lambda: got.append(_load_or_error(s, toks)))
    loader.start()
    deadline = time.monotonic() + 30
    while not failpoints.fired("cache.load.pinned"):  # planned, R pinned
        assert time.monotonic() < deadline, "the load never reached its pinned point"
        time.sleep(0.01)
    assert s.discard(r.key)
    assert not s.store(toks, page_row(toks)).stored  # R's name is still being read
    loader.join(timeout=30)
    assert not loader.is_alive()
    # R's file was unlinked before the load took a descriptor: it fails; never wrong bytes
    assert len(got) == 1 and isinstance(got[0], RecordCorruptError)
    res = s.store(toks, page_row(toks))  # the load is done: the name is free
    assert res.stored and res.key == r.key and bytes(s.load(toks, 4)) == page_row(toks)
    while s.poll():
        pass
    assert s.check() == []


def _load_or_error(s: DiskStore, toks: np.ndarray) -> object:
    try:
        return bytes(s.load_many([(toks, 4)])[0])
    except RecordCorruptError as exc:
        return exc


def test_a_prefix_stored_again_before_its_bad_file_is_moved_aside_keeps_its_file(
    tmp_path: Path, stores: Stores
) -> None:
    s = stores.open(tmp_path)
    toks = np.arange(3 * PT) + 11
    key = s.store(toks, page_row(toks)).key
    path = tmp_path / f"{key.hex()}.kv"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # bit rot
    path.write_bytes(raw)
    s._core.index.records[key].verified = False  # as after a restart: the load checks CRCs
    with pytest.raises(RecordCorruptError):
        s.load(toks, 3)
    assert s.store(toks, page_row(toks)).stored  # recomputed and stored again at once
    while s.poll():  # the queued QUARANTINE job must not take the new file
        pass
    assert bytes(s.load(toks, 3)) == page_row(toks) and s.check() == []
    assert [p.read_bytes() for p in (tmp_path / "quarantine").iterdir()] == [bytes(raw)]
