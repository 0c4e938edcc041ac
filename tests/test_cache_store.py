"""Store / lookup / load round trips, thinning, recovery of the same state."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import phalanx.kvstore
from cache_util import FP, GEOM, PB, Clock, Stores, build_tree, page_row, record_files, stores
from phalanx.kvstore import (
    DiskStore,
    Geometry,
    NotCachedError,
    PageScatter,
    RecordCorruptError,
    RowSpanError,
    StoreOptions,
    fingerprint_digest,
    page_keys,
)
from phalanx.kvstore.buffers import MAP_MIN
from phalanx.kvstore.files import write_record
from phalanx.kvstore.keys import ROOT_KEY
from phalanx.kvstore.manifest import MANIFEST_NAME, read_manifest
from phalanx.kvstore.open_files import OpenFiles
from phalanx.kvstore.record import RecordHeader
from phalanx.kvstore.snapshot import SEAL_NAME
from phalanx.kvstore.uring import Ring

__all__ = ["stores"]  # the fixture, imported for pytest

PT = GEOM.page_tokens


def _rings_here() -> bool:
    ring = Ring.open()
    if ring is not None:
        ring.close()
    return ring is not None


RINGS_HERE = _rings_here()  # this kernel and sandbox offer io_uring


def expect_all(store: phalanx.kvstore.DiskStore, tokens: list[np.ndarray]) -> None:
    """Every cached record loads, and so does every interior prefix, byte-exact."""
    for toks in tokens:
        n = len(toks) // PT
        assert store.lookup(toks) == n
        for pages in {1, max(1, n // 2), n}:
            got = store.load(toks, pages)
            assert bytes(got) == page_row(toks[: pages * PT])


@pytest.mark.parametrize("full_rows", [False, True], ids=["suffix-rows", "full-rows"])
def test_branchy_round_trip_survives_thinning_and_restart(
    tmp_path: Path, stores: Stores, full_rows: bool
) -> None:
    s = stores.open(tmp_path, clock=Clock())
    built = build_tree(s, 300, branchy=True, full_rows=full_rows, seed=1, max_new_pages=3)
    assert s.check() == []
    expect_all(s, built.tokens)
    thinnable = s.pending()
    assert (thinnable > 0) == full_rows  # full rows overlap ancestors; suffix rows do not
    while s.poll(7):
        assert s.check() == []
    st = s.statistics()
    assert st.rows_thinned == thinnable and st.thinned_records == thinnable
    expect_all(s, built.tokens)  # interior prefixes of thinned rows: same bytes
    s.close()
    s2 = stores.open(tmp_path, clock=Clock())
    assert s2.statistics().recovered == 300 and s2.pending() == 0
    assert s2.check() == []
    expect_all(s2, built.tokens)  # first loads after restart verify page CRCs


def test_thinned_row_is_header_only_and_interior_loads_match(
    tmp_path: Path, stores: Stores
) -> None:
    s = stores.open(tmp_path)
    toks = np.arange(10 * PT)
    short = s.store(toks[: 6 * PT], page_row(toks[: 6 * PT]))
    s.store(toks, page_row(toks))  # covers all of the shorter row
    size_before = (tmp_path / f"{short.key.hex()}.kv").stat().st_size
    assert s.poll() == 1
    size_after = (tmp_path / f"{short.key.hex()}.kv").stat().st_size
    assert size_after < size_before and size_after < PB * 6  # the header alone
    for pages in range(1, 11):
        assert bytes(s.load(toks, pages)) == page_row(toks[: pages * PT])
    assert s.check() == []


def test_load_is_zero_copy_and_fills_a_given_buffer(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path)
    toks = np.arange(3 * PT)
    s.store(toks, np.frombuffer(page_row(toks), dtype=np.float16))  # any buffer
    view = s.load(toks, 3)
    arr = np.frombuffer(view, dtype=np.float16)
    arr[0] = 7  # a view, not a copy: writes show through
    assert np.frombuffer(view, dtype=np.float16)[0] == 7
    out = bytearray(2 * PB)
    s.load(toks, 2, out=out)
    assert bytes(out) == page_row(toks[: 2 * PT])


@pytest.mark.parametrize("io_uring", [True, False], ids=["io_uring", "threads"])
def test_load_many_matches_single_loads_and_is_all_or_nothing(tmp_path: Path, stores: Stores,
                                                              io_uring: bool) -> None:
    s = stores.open(tmp_path, clock=Clock(), io_uring=io_uring)
    built = build_tree(s, 60, branchy=True, full_rows=True, seed=5, max_new_pages=3)
    while s.poll():  # thinned rows: prefixes read from descendants' rows
        pass
    reqs = [(t, max(1, len(t) // PT - i % 2)) for i, t in enumerate(built.tokens)]
    outs = [bytearray(n * PB) for _, n in reqs[::2]]
    batch = [(t, n, outs[i // 2]) if i % 2 == 0 else (t, n) for i, (t, n) in enumerate(reqs)]
    got = s.load_many(batch)
    assert [bytes(g) for g in got] == [page_row(t[: n * PT]) for t, n in reqs]
    assert all(bytes(o) == bytes(got[2 * i]) for i, o in enumerate(outs))  # filled in place
    # written here, so verified and kept open: through the rings where the kernel has them
    assert (s.statistics().io_uring_loaded_bytes > 0) == s.io_uring
    assert s.io_uring == (io_uring and RINGS_HERE)
    loads = s.statistics().loads
    with pytest.raises(NotCachedError):  # refused before anything is read or pinned
        s.load_many([reqs[0], (np.arange(PT) + 10**9, 1)])
    assert s.statistics().loads == loads
    # a record edited by someone else: the batch fails once, after every other read; the
    # record is dropped and a retry after lookups serves the rest
    victim = next(r for r in s._core.index.records.values() if not r.thinned)
    path = tmp_path / f"{victim.key.hex()}.kv"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)
    for r in s._core.index.records.values():
        r.verified = False  # as after a restart: the next loads check CRCs
    with pytest.raises(RecordCorruptError):
        s.load_many(reqs)
    retry = [(t, s.lookup(t)) for t, _ in reqs]
    got = s.load_many([(t, n) for t, n in retry if n])
    assert [bytes(g) for g in got] == [page_row(t[: n * PT]) for t, n in retry if n]
    assert s.statistics().corrupt_loads == 1 and s.check() == []


def _scatter(pages: int, parts: int, seed: int) -> tuple[PageScatter, list[list[memoryview]]]:
    """A PageScatter whose buffers lie in one arena in a shuffled order, so a part read
    into the wrong buffer shows."""
    size = PB // parts
    arena = bytearray(pages * PB)
    order = np.random.default_rng(seed).permutation(pages * parts)
    slots = [memoryview(arena)[j * size:(j + 1) * size] for j in order]
    return PageScatter(slots, parts), [slots[i * parts:(i + 1) * parts] for i in range(pages)]


def test_load_many_scatters_each_page_into_its_buffers(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path, clock=Clock())
    built = build_tree(s, 30, branchy=True, full_rows=True, seed=7, max_new_pages=3)
    reqs = [(t, len(t) // PT) for t in built.tokens[:12]]

    def scattered() -> None:
        dsts = [_scatter(n, 4, i) for i, (_, n) in enumerate(reqs)]
        got = s.load_many([(t, n, d) for (t, n), (d, _) in zip(reqs, dsts, strict=True)])
        assert all(g is d for g, (d, _) in zip(got, dsts, strict=True))
        for (t, n), (_, pages) in zip(reqs, dsts, strict=True):
            assert b"".join(b"".join(p) for p in pages) == page_row(t[: n * PT])

    scattered()   # written here: verified, descriptors held (one preadv a piece)
    s.close()
    s = stores.open(tmp_path, clock=Clock())
    scattered()   # after a reopen: opened, read and checked page by page over the parts
    with pytest.raises(RowSpanError, match="PageScatter of"):
        s.load_many([(reqs[0][0], reqs[0][1], _scatter(reqs[0][1] + 1, 4, 0)[0])])
    with pytest.raises(RowSpanError, match="pass a PageScatter to load_many"):
        s.load(reqs[0][0], reqs[0][1], out=_scatter(reqs[0][1], 4, 0)[0])
    with pytest.raises(RowSpanError, match="same size"):
        PageScatter([bytearray(8), bytearray(4)], 1)
    with pytest.raises(RowSpanError, match="writable"):
        PageScatter([bytes(PB)], 1)
    torch = pytest.importorskip("torch")
    strided = torch.zeros(PB, 2, dtype=torch.uint8)[:, 0]   # reading into it would be lost
    with pytest.raises(RowSpanError, match="contiguous"):
        PageScatter([strided], 1)
    with pytest.raises(RowSpanError, match="contiguous"):
        s.load_many([(reqs[0][0], 1, strided)])
    # a page whose bytes changed on disk fails its checksum through the parts too
    t0, n0 = reqs[0]
    victim = s.chain(t0).keys[n0 - 1].hex() + ".kv"   # the record ending at its last page
    s.close()
    assert victim in record_files(tmp_path)
    raw = bytearray((tmp_path / victim).read_bytes())
    raw[-1] ^= 0xFF   # in that page's bytes
    (tmp_path / victim).write_bytes(raw)
    s = stores.open(tmp_path, clock=Clock())
    with pytest.raises(RecordCorruptError, match=victim.removesuffix(".kv")):
        s.load_many([(t, n, _scatter(n, 2, i)[0]) for i, (t, n) in enumerate(reqs)])
    assert s.statistics().corrupt_loads == 1


def test_torch_tensor_rows(tmp_path: Path, stores: Stores) -> None:
    torch = pytest.importorskip("torch")
    s = stores.open(tmp_path)
    toks = np.arange(2 * PT)
    t = torch.frombuffer(bytearray(page_row(toks)), dtype=torch.bfloat16)
    s.store(toks, t)
    back = torch.frombuffer(s.load(toks, 2), dtype=torch.bfloat16)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_row_span_errors_and_misses(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path)
    with pytest.raises(RowSpanError, match="shorter than one page"):
        s.store([1, 2], b"x" * PB)
    with pytest.raises(RowSpanError, match="multiple of the page size"):
        s.store(np.arange(PT), b"x" * (PB - 1))
    with pytest.raises(RowSpanError, match="no gaps"):
        s.store(np.arange(3 * PT), b"x" * PB)  # page 2 alone, pages 0..1 not cached
    assert s.lookup([1, 2]) == 0  # shorter than a page: a miss, not an error
    with pytest.raises(NotCachedError, match="only 0 cached"):
        s.load(np.arange(PT), 1)
    toks = np.arange(2 * PT)
    assert s.store(toks, page_row(toks)).stored
    assert not s.store(toks, page_row(toks)).stored  # all cached: nothing written
    st = s.statistics()
    assert (st.stores, st.stores_skipped, st.misses) == (1, 1, 1)
    assert len(record_files(tmp_path)) == 1
    for bad_out in (memoryview(bytearray(4 * PB))[::2],  # strided
                    memoryview(bytes(2 * PB)),  # read-only
                    bytearray(2 * PB - 1)):  # the wrong size
        with pytest.raises(RowSpanError, match="out must be"):
            s.load(toks, 2, out=bad_out)
        with pytest.raises(RowSpanError, match="out must be"):
            s.load_many([(toks, 2, bad_out)])


def test_files_are_private(tmp_path: Path, stores: Stores) -> None:
    d = tmp_path / "cache"
    s = stores.open(d)
    toks = np.arange(PT)
    s.store(toks, page_row(toks))
    assert d.stat().st_mode & 0o777 == 0o700
    for name in [*record_files(d), ".lock", "phalanx-cache.json"]:
        assert (d / name).stat().st_mode & 0o777 == 0o600, name
    slots = [p for p in (d / ".staging").iterdir()]  # the writers' temp file slots
    assert slots and all(p.stat().st_mode & 0o777 == 0o700 for p in [d / ".staging", *slots])


def test_fingerprint_changes_every_key(tmp_path: Path, stores: Stores) -> None:
    a = stores.open(tmp_path / "a", fingerprint=FP)
    b = stores.open(tmp_path / "b", fingerprint=FP + "-other")
    toks = np.arange(PT)
    assert a.store(toks, page_row(toks)).key != b.store(toks, page_row(toks)).key


def test_records_of_the_previous_format_are_still_served(tmp_path: Path, stores: Stores) -> None:
    """Format 1 (zlib.crc32 page checksums) is read beside format 2 (XXH3): an upgrade
    keeps the cache; a damaged format-1 page is still caught by its load."""
    s = stores.open(tmp_path)
    toks = np.arange(4 * PT)
    s.store(toks, page_row(toks))  # format 2
    s.close()
    old = np.arange(3 * PT) + 5000
    keys = page_keys(old, PT, fingerprint_digest(FP))
    row = memoryview(page_row(old))
    header = RecordHeader(GEOM, fingerprint_digest(FP), keys[-1], ROOT_KEY, 0, 3, len(row),
                          time.time(), keys, [zlib.crc32(row[i * PB:(i + 1) * PB])
                                              for i in range(3)], version=1)
    write_record(str(tmp_path), header, row, fsync=False)
    manifest = tmp_path / MANIFEST_NAME  # as a format-1 build made the directory
    manifest.write_bytes(manifest.read_bytes().replace(b'"version":2', b'"version":1'))
    assert read_manifest(str(tmp_path)).version == 1  # type: ignore[union-attr]
    s = stores.open(tmp_path)
    # this build writes format 2 into it: the manifest says so, so older builds refuse it
    assert read_manifest(str(tmp_path)).version == 2  # type: ignore[union-attr]
    assert s.lookup(old) == 3 and s.lookup(toks) == 4
    assert bytes(s.load(old, 3)) == bytes(row) and bytes(s.load(toks, 4)) == page_row(toks)
    assert s.check() == []
    s.close()
    path = tmp_path / f"{keys[-1].hex()}.kv"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)
    (tmp_path / SEAL_NAME).unlink(missing_ok=True)
    s = stores.open(tmp_path)
    with pytest.raises(RecordCorruptError):
        s.load(old, 3)


@pytest.mark.parametrize("map_reads", [True, False], ids=["mapped", "preadv"])
def test_large_rows_load_in_parts_and_a_short_file_is_caught(tmp_path: Path,
                                                             map_reads: bool) -> None:
    """Rows of MAP_MIN and more are copied from a mapping of the file, or read with
    preadv (in parallel parts for ``load``, whole for ``load_many``): same bytes; a file
    cut short by someone else is refused before it is mapped or read."""
    geom = Geometry(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=64)
    pages = -(-MAP_MIN // geom.page_bytes) + 7  # over the threshold, not a round size
    toks = [np.arange(pages * 64) + i * 10**6 for i in range(3)]
    rows = [np.random.default_rng(i).integers(0, 255, pages * geom.page_bytes,
                                              dtype=np.uint8) for i in range(3)]
    with DiskStore(tmp_path, geom, FP, StoreOptions(capacity_bytes=1 << 30, progress=False,
                                                    io_threads=3, map_reads=map_reads)) as s:
        for t, r in zip(toks, rows, strict=True):
            s.store(t, r)
        assert bytes(s.load(toks[0], pages)) == rows[0].tobytes()
        out = np.zeros(pages * geom.page_bytes - geom.page_bytes, dtype=np.uint8)
        s.load(toks[1], pages - 1, out=out)
        assert out.tobytes() == rows[1][: out.nbytes].tobytes()
        got = s.load_many([(t, pages) for t in toks])
        assert [bytes(g) for g in got] == [r.tobytes() for r in rows]
        victim = tmp_path / f"{s.chain(toks[2]).keys[-1].hex()}.kv"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - geom.page_bytes // 2)
    with DiskStore(tmp_path, geom, FP, StoreOptions(capacity_bytes=1 << 30, progress=False,
                                                    map_reads=map_reads)) as s:
        assert s.lookup(toks[2]) == pages  # trusted under the seal...
        with pytest.raises(RecordCorruptError, match="shorter"):
            s.load(toks[2], pages)  # ...refused before the mapping
        assert s.lookup(toks[2]) == 0 and bytes(s.load(toks[0], pages)) == rows[0].tobytes()


def test_kept_files_stay_within_bounds_and_never_close_under_a_reader(tmp_path: Path) -> None:
    """The open-file table keeps at most ``capacity`` descriptors; one in use is never
    closed under its reader, even when it is forgotten (its record removed) while
    others churn the table; close() leaves no descriptor."""
    size = 8192
    contents = {bytes([i]) * 4: bytes([i]) * size for i in range(8)}
    for key, data in contents.items():
        (tmp_path / key.hex()).write_bytes(data)
    files = OpenFiles(capacity=3)

    def read_through(key: bytes) -> bytes:
        f = files.acquire(key, str(tmp_path), bytes.hex)
        try:
            return os.pread(f.fd, size, 0)
        finally:
            files.release(f)

    for _ in range(3):
        for key, data in contents.items():
            assert read_through(key) == data
            assert len(files) <= 3
    held_key = next(iter(contents))
    held = files.acquire(held_key, str(tmp_path), bytes.hex)
    files.forget(held_key)  # its record removed while a load reads it
    for key in contents:  # churn: evictions all around it
        read_through(key)
    assert os.pread(held.fd, size, 0) == contents[held_key]
    files.release(held)
    held_path = str(tmp_path / held_key.hex())
    assert held_path not in [os.path.realpath(f"/proc/self/fd/{fd}")  # closed at release
                             for fd in os.listdir("/proc/self/fd")]
    files.close()
    assert not [fd for fd in os.listdir("/proc/self/fd")
                if str(tmp_path) in os.path.realpath(f"/proc/self/fd/{fd}")]


def test_a_record_stored_over_an_orphans_file_serves_its_own_bytes(tmp_path: Path,
                                                                    stores: Stores) -> None:
    """A record that became an orphan (its prefix discarded) still has its file, named by
    its end key; a new record with that end key replaces the file: loads read the new
    one (not a descriptor kept for the old), and dropping the orphan later does not
    remove the new record's file."""
    s = stores.open(tmp_path)
    toks = np.random.default_rng(1).integers(0, 1000, 12 * PT)
    first = s.store(toks[: 4 * PT], page_row(toks[: 4 * PT]))
    suffix = s.store(toks, page_row(toks[4 * PT :]))  # pages 4..12, its descriptor kept
    s.load(toks, 12)
    assert s.discard(first.key)  # the suffix record is an orphan now
    whole = s.store(toks, page_row(toks))  # pages 0..12, the orphan's end key
    assert whole.stored and whole.key == suffix.key
    assert bytes(s.load(toks, 4)) == page_row(toks[: 4 * PT])
    assert bytes(s.load(toks, 12)) == page_row(toks)
    while s.poll():
        pass
    assert s.check() == [] and bytes(s.load(toks, 12)) == page_row(toks)


@pytest.mark.parametrize("io_uring", [True, False], ids=["io_uring", "threads"])
def test_load_many_catches_a_kept_file_cut_short_under_it(tmp_path: Path, stores: Stores,
                                                         io_uring: bool) -> None:
    """The short paths (a verified record, its descriptor held: through a ring or one
    preadv) still check every read's length: a file another program truncated in place
    is caught, not served."""
    s = stores.open(tmp_path, io_uring=io_uring)
    toks = [np.arange(i * 100, i * 100 + 2 * PT) for i in range(8)]
    s.store_many([(t, page_row(t)) for t in toks])  # written here: verified, kept open
    victim = s._core.index.records[page_keys(toks[3], PT, fingerprint_digest(FP))[-1]]
    assert victim.verified
    os.truncate(tmp_path / f"{victim.key.hex()}.kv", victim.file_len - 1)
    with pytest.raises(RecordCorruptError, match=victim.key.hex()):
        s.load_many([(t, 2) for t in toks])
    assert s.lookup(toks[3]) == 0 and s.statistics().corrupt_loads == 1
    rest = [t for i, t in enumerate(toks) if i != 3]
    assert [bytes(v) for v in s.load_many([(t, 2) for t in rest])] == [page_row(t) for t in rest]
