"""The header snapshot (cache/snapshot.py): used when it matches the directory, ignored
file by file when it does not, ignored whole when corrupt; a crash between data writes
and the snapshot write (kill -9) still recovers exactly what reading every header
recovers. A clean close seals it; the next open consumes the seal and trusts names and
inodes alone; a file edited in place under a seal is caught by its first load. No
timing is asserted: "used"/"sealed" is what recover() reports it took from it."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_util import FP, GEOM, Built, Clock, Stores, build_tree, page_row, record_files, stores
from phalanx.kvstore import DiskStore, RecordCorruptError, StoreOptions, fingerprint_digest
from phalanx.kvstore.index import Index
from phalanx.kvstore.record import FLAG_THINNED, record_name
from phalanx.kvstore.recovery import build_index, recover, scan
from phalanx.kvstore.snapshot import SEAL_NAME, SNAPSHOT_NAME, read_snapshot
from phalanx.lifecycle.failpoints import arm, disarm

__all__ = ["stores"]

FPD = fingerprint_digest(FP)
PT = GEOM.page_tokens


def _view(ix: Index) -> tuple[Any, ...]:
    recs = {k: (r.parent, r.start, r.end, r.row_len, r.file_len, r.created, r.thinned)
            for k, r in ix.records.items()}
    orphans = {k: (r.start, r.end, r.file_len) for k, r in ix.orphans.items()}
    nodes = {k: (n.depth, n.parent.key if n.parent else None,
                 sorted(c.key for c in n.covers)) for k, n in ix.nodes.items()}
    return recs, orphans, nodes, ix.bytes, set(ix.thin_candidates)


def _from_headers(d: Path) -> tuple[Any, ...]:
    return _view(build_index(scan(str(d), GEOM, FPD, progress=False).headers))


def _expect(s: DiskStore, built: Built) -> None:
    for toks in built.tokens:
        n = s.lookup(toks)
        if n:
            assert bytes(s.load(toks, n)) == page_row(toks[: n * PT])


def _written(d: Path, n: int = 150, full_rows: bool = True) -> Built:
    s = DiskStore(d, GEOM, FP, StoreOptions(capacity_bytes=1 << 30, progress=False),
                  clock=Clock())
    try:
        built = build_tree(s, n, branchy=True, full_rows=full_rows, seed=n, max_new_pages=3)
        while s.poll():  # thin what overlapping rows made redundant
            pass
        time.sleep(0.1)  # files older than the snapshot's racy window (RACY_NS)
    finally:
        s.close()
    return built


def test_snapshot_written_at_close_sealed_and_used(tmp_path: Path, stores: Stores) -> None:
    built = _written(tmp_path)
    snap, seal = tmp_path / SNAPSHOT_NAME, tmp_path / SEAL_NAME
    assert stat.S_IMODE(snap.stat().st_mode) == stat.S_IMODE(seal.stat().st_mode) == 0o600
    res = recover(str(tmp_path), GEOM, FPD, progress=False)
    assert res.snapshot == "sealed" and not seal.exists()  # consumed before anything else
    assert res.from_snapshot == len(res.columns) == len(record_files(tmp_path))
    assert res.bad == [] and res.temps == []
    res = recover(str(tmp_path), GEOM, FPD, progress=False)  # no seal: file by file
    assert res.snapshot == "used"
    assert res.from_snapshot == len(res.columns) == len(record_files(tmp_path))
    s = stores.open(tmp_path, clock=Clock())
    assert _view(s._core.index) == _from_headers(tmp_path)
    assert s.check() == []
    _expect(s, built)
    # a clean reopen leaves the snapshot alone and seals it again; a store rewrites it
    before = snap.stat().st_mtime_ns
    s.close()
    assert snap.stat().st_mtime_ns == before and seal.exists()
    s = stores.open(tmp_path, clock=Clock())
    assert not seal.exists()
    toks = np.arange(10 * PT) + 10**6
    s.store(toks, page_row(toks))
    s.close()
    assert snap.stat().st_mtime_ns != before
    res = recover(str(tmp_path), GEOM, FPD, progress=False)
    assert res.snapshot == "sealed" and len(res.columns) == len(built.tokens) + 1
    assert res.from_snapshot == len(res.columns)


def test_snapshot_lies_in_the_order_recovery_attaches(tmp_path: Path, stores: Stores) -> None:
    # ready rows by first page, then thinned ones: a reopen builds its index from the
    # snapshot as it lies, with no sort while a restart waits
    s = stores.open(tmp_path, clock=Clock())
    build_tree(s, 150, branchy=True, full_rows=True, seed=3, max_new_pages=3, max_span=4)
    while s.poll():  # thin what overlapping rows made redundant
        pass
    s.close()
    cols = recover(str(tmp_path), GEOM, FPD, progress=False).columns
    order = [(bool(flags & FLAG_THINNED), start)
             for flags, start in zip(cols.flags, cols.starts, strict=True)]
    assert order == sorted(order)
    # both kinds of row are there and ready rows start past page 0: something to order
    # (the tree was stored parent before child, thinned after, which is not this order)
    assert any(thin for thin, _ in order) and any(st for thin, st in order if not thin)
    s = stores.open(tmp_path, clock=Clock())
    assert _view(s._core.index) == _from_headers(tmp_path) and s.check() == []
    s.close()
    # under a seal, names the snapshot does not hold are still found and classified
    (tmp_path / "copy").write_bytes(b"not ours")
    (tmp_path / f".{SNAPSHOT_NAME}.123.456.tmp").write_bytes(b"partial")
    res = recover(str(tmp_path), GEOM, FPD, progress=False)
    assert res.snapshot == "sealed" and res.from_snapshot == len(res.columns) == len(order)
    assert res.foreign == ["copy"] and len(res.temps) == 1 and res.bad == []


def test_seal_is_not_written_when_close_fails_to_seal(tmp_path: Path, stores: Stores) -> None:
    _written(tmp_path, n=20)
    s = stores.open(tmp_path, clock=Clock())
    arm("cache.close.seal", "errno:28")
    try:
        s.close()  # logged, not raised: the next open checks every file instead
    finally:
        disarm("cache.close.seal")
    assert not (tmp_path / SEAL_NAME).exists()
    assert recover(str(tmp_path), GEOM, FPD, progress=False).snapshot == "used"


def test_stale_snapshot_entries_are_read_again(tmp_path: Path, stores: Stores) -> None:
    """A snapshot older than the directory (a crash before the next snapshot): added,
    removed, thinned and rewritten files are read from their headers, never trusted."""
    built = _written(tmp_path, full_rows=False)
    old = (tmp_path / SNAPSHOT_NAME).read_bytes()
    s = stores.open(tmp_path, clock=Clock(), capacity_bytes=1 << 30)
    more = build_tree(s, 60, branchy=True, full_rows=True, seed=99, max_new_pages=2)
    while s.poll():
        pass
    s.close()
    # evict a few leaves by capacity on a second store, then put the old snapshot back
    s = stores.open(tmp_path, clock=Clock(), capacity_bytes=1 << 30)
    total = s.statistics().bytes
    s.close()
    s = stores.open(tmp_path, clock=Clock(), capacity_bytes=total - 2000)
    s.make_room(0)
    s.close()
    (tmp_path / SNAPSHOT_NAME).write_bytes(old)  # the crash: data changed, snapshot not
    res = recover(str(tmp_path), GEOM, FPD, progress=False)
    assert res.snapshot == "used"
    assert 0 < res.from_snapshot < len(res.columns)  # some entries held, some read again
    s = stores.open(tmp_path, clock=Clock())
    assert _view(s._core.index) == _from_headers(tmp_path)
    assert s.check() == []
    _expect(s, built)
    _expect(s, more)


def _tamper_ready_record(d: Path) -> str:
    """Flip a byte inside the header of a record that holds a row: same size, same
    inode, new bytes (what another program editing the directory would do)."""
    victim = next(h for h in scan(str(d), GEOM, FPD, progress=False).headers
                  if not h.thinned)
    path = d / record_name(victim.key)
    raw = bytearray(path.read_bytes())
    raw[150] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(raw)
    return path.name


def test_file_changed_in_place_is_not_trusted_unsealed(tmp_path: Path, stores: Stores) -> None:
    _written(tmp_path, n=40)
    (tmp_path / SEAL_NAME).unlink()  # as after a crash: the snapshot is checked file by file
    name = _tamper_ready_record(tmp_path)
    res = recover(str(tmp_path), GEOM, FPD, progress=False)
    assert res.snapshot == "used"
    assert (name, "checksum") in res.bad
    assert res.from_snapshot == len(res.columns) == len(record_files(tmp_path)) - 1
    s = stores.open(tmp_path, clock=Clock())
    assert s.statistics().skipped == {"checksum": 1}
    assert _view(s._core.index) == _from_headers(tmp_path)


def test_file_changed_in_place_under_a_seal_is_never_served(tmp_path: Path,
                                                             stores: Stores) -> None:
    """A seal vouches for what the store wrote, not for other programs: the tampered
    record is trusted at open, and its first load finds it corrupt, drops it, counts it;
    nothing of it is ever returned, and every other prefix still loads intact."""
    built = _written(tmp_path, n=40)
    _tamper_ready_record(tmp_path)
    s = stores.open(tmp_path, clock=Clock())
    corrupt = 0
    for _ in range(2):  # the second pass: the dropped record is no longer planned
        for toks in built.tokens:
            n = s.lookup(toks)
            if not n:
                continue
            try:
                data = s.load(toks, n)
            except RecordCorruptError:
                corrupt += 1
                continue
            assert bytes(data) == page_row(toks[: n * PT])
    assert corrupt == s.statistics().corrupt_loads == 1
    assert s.check() == []


def test_corrupt_or_foreign_snapshot_is_ignored(tmp_path: Path, stores: Stores) -> None:
    built = _written(tmp_path, n=60)
    snap = tmp_path / SNAPSHOT_NAME
    good = snap.read_bytes()
    assert read_snapshot(str(tmp_path), GEOM, fingerprint_digest("other-model")) is None
    for bad in (good[: len(good) // 2], good[:-1] + bytes([good[-1] ^ 1]),
                good[:100] + bytes([good[100] ^ 4]) + good[101:], b"", b"PHXIXSNP"):
        snap.write_bytes(bad)
        res = recover(str(tmp_path), GEOM, FPD, progress=False)
        assert res.snapshot == "ignored" and res.from_snapshot == 0
        assert len(res.columns) == len(record_files(tmp_path))
        s = stores.open(tmp_path, clock=Clock())
        assert _view(s._core.index) == _from_headers(tmp_path)
        _expect(s, built)
        s.close()  # the store rewrites a good snapshot
        assert recover(str(tmp_path), GEOM, FPD, progress=False).snapshot == "sealed"


def test_snapshot_method_and_leftover_temp(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path, clock=Clock())
    built = build_tree(s, 30, branchy=True, full_rows=False, seed=3)
    time.sleep(0.1)
    assert s.snapshot() == 30
    # a snapshot temp left by a crash mid-write is purged like any temp file
    (tmp_path / f".{SNAPSHOT_NAME}.123.456.tmp").write_bytes(b"partial")
    shutil.copy(tmp_path / SNAPSHOT_NAME, tmp_path / "copy")
    res = recover(str(tmp_path), GEOM, FPD, progress=False)
    assert res.from_snapshot == 30 and len(res.temps) == 1 and res.foreign == ["copy"]
    os.unlink(tmp_path / "copy")
    s.close()
    s = stores.open(tmp_path, clock=Clock())
    while s.poll():
        pass
    assert s.check() == [] and not any(n.endswith(".tmp") for n in os.listdir(tmp_path))
    _expect(s, built)


_WRITER = r"""
import sys, time
sys.path.insert(0, sys.argv[3])
import numpy as np
from cache_util import FP, GEOM, page_row
from phalanx.kvstore import DiskStore, StoreOptions
rng = np.random.default_rng(int(sys.argv[2]))
PT = GEOM.page_tokens
with DiskStore(sys.argv[1], GEOM, FP, StoreOptions(capacity_bytes=64 * 1024, progress=False,
                                                   max_jobs_per_poll=4)) as s:
    print("ready", flush=True)
    for i in range(400):
        roots = np.random.default_rng(0).integers(0, 1000, (5, 2 * PT))
        toks = np.concatenate([roots[rng.integers(0, 5)],
                               rng.integers(0, 1000, PT * int(rng.integers(1, 5)))])
        start = 0 if rng.random() < 0.5 else min(s.lookup(toks), len(toks) // PT - 1)
        s.store(toks, page_row(toks[start * PT:]))
        s.poll()
        if i % 7 == 3:
            s.snapshot()
"""


@pytest.mark.slow  # a kill trial (9 s): the campaign's, beside test_cache_crash's
def test_kill9_between_data_and_snapshot_recovers_exactly(tmp_path: Path) -> None:
    rnd = random.Random(7)
    here = str(Path(__file__).parent)
    killed = 0
    for trial in range(24):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(trial), here],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        try:
            proc.wait(timeout=rnd.uniform(0.0, 0.3))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=60)
        proc.stdout.close()
        assert rc in (0, -signal.SIGKILL)
        killed += rc != 0
        expect = _from_headers(tmp_path)
        s = DiskStore(tmp_path, GEOM, FP, StoreOptions(capacity_bytes=64 * 1024, progress=False))
        try:
            assert s.statistics().skipped == {}
            assert _view(s._core.index) == expect  # the snapshot never changes what is recovered
            while s.poll():
                pass
            assert s.check() == []
        finally:
            s.close()
    assert killed >= 12
