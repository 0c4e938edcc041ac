"""Bad input: a locked directory, another model's directory, a full disk, truncated,
corrupt and foreign files, short token lists, and a fault at every write step. Each
is a clear error or a counted skip; nothing partial becomes visible."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_util import GEOM, PB, Stores, page_row, record_files, stores, temp_files
from phalanx.kvstore import (
    DiskFullError,
    ForeignStoreError,
    Geometry,
    GeometryMismatchError,
    RecordCorruptError,
    StoreClosedError,
    StoreLockedError,
    StoreOptions,
)
from phalanx.kvstore.audit import inspect_directory
from phalanx.kvstore.snapshot import SEAL_NAME
from phalanx.lifecycle import FailpointError, failpoints

__all__ = ["stores"]

PT = GEOM.page_tokens
TOKS = np.arange(6 * PT)


def _filled(stores: Stores, d: Path) -> list[str]:
    """Two records: pages 0..2 and the suffix 3..5; returns their file names."""
    s = stores.open(d)
    a = s.store(TOKS[: 3 * PT], page_row(TOKS[: 3 * PT]))
    b = s.store(TOKS, page_row(TOKS[3 * PT :]))
    s.close()
    return [f"{a.key.hex()}.kv", f"{b.key.hex()}.kv"]


def test_directory_locked_by_another_live_process(tmp_path: Path, stores: Stores) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from cache_util import GEOM, FP
            from phalanx.kvstore import DiskStore, StoreOptions
            with DiskStore({str(tmp_path)!r}, GEOM, FP, StoreOptions(1 << 20, progress=False)):
                print("open", flush=True)
                sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            stores.open(tmp_path)
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    s = stores.open(tmp_path)  # the holder is gone: the lock is free again
    with pytest.raises(StoreLockedError):
        stores.open(tmp_path)  # one store per directory, in this process too
    s.close()
    with pytest.raises(StoreClosedError):
        s.lookup(TOKS)


def test_row_truncated_under_a_seal_is_caught_by_its_load(tmp_path: Path,
                                                           stores: Stores) -> None:
    good = _filled(stores, tmp_path)
    assert (tmp_path / SEAL_NAME).exists()
    with open(tmp_path / good[1], "r+b") as f:  # edited by someone else while closed
        f.truncate(os.path.getsize(tmp_path / good[1]) - 7)
    s = stores.open(tmp_path)
    assert s.lookup(TOKS) == 6  # trusted on its inode at open...
    with pytest.raises(RecordCorruptError, match="could not be read"):
        s.load(TOKS, 6)  # ...and never served: the load finds it short
    assert s.lookup(TOKS) == 3 and bytes(s.load(TOKS, 3)) == page_row(TOKS[: 3 * PT])
    assert s.statistics().corrupt_loads == 1


def test_directory_of_another_model_or_geometry(tmp_path: Path, stores: Stores) -> None:
    _filled(stores, tmp_path)
    with pytest.raises(ForeignStoreError, match="fingerprint") as err:
        stores.open(tmp_path, fingerprint="another-model")
    assert not isinstance(err.value, GeometryMismatchError)
    with pytest.raises(GeometryMismatchError, match="use another directory"):
        stores.open(tmp_path, geometry=Geometry(2, 1, 4, "float16", 4))
    s = stores.open(tmp_path)  # the refused opens released the lock and changed nothing
    assert s.lookup(TOKS) == 6 and s.check() == []


def test_truncated_corrupt_foreign_and_misplaced_files_are_skipped(
    tmp_path: Path, stores: Stores
) -> None:
    other = tmp_path / "other"
    tmp_path = tmp_path / "cache"
    good = _filled(stores, tmp_path)
    o = stores.open(other, fingerprint="another-model")
    o.store(np.arange(100, 100 + PT), page_row(np.arange(100, 100 + PT)))
    o.close()
    # a record of another model, renamed into this directory: fingerprint mismatch
    shutil.copy(other / record_files(other)[0], tmp_path / record_files(other)[0])
    (tmp_path / ("ab" * 16 + ".kv")).write_bytes(b"not a record at all" * 10)  # foreign
    (tmp_path / "notes.txt").write_text("an operator's file")  # not ours: left alone
    (tmp_path / ".deadbeef.123.0.tmp").write_bytes(b"half a record")  # a dead writer's
    with open(tmp_path / good[1], "r+b") as f:  # the longer row loses its tail
        f.truncate(os.path.getsize(tmp_path / good[1]) - 7)
    # as after a crash: no seal, so every file the snapshot holds is checked (under a
    # seal the truncated row is caught by its first load instead: the test below)
    (tmp_path / SEAL_NAME).unlink()
    s = stores.open(tmp_path)
    st = s.statistics()
    assert st.skipped == {"fingerprint": 1, "foreign": 1, "truncated": 1, "foreign_name": 1}
    assert st.recovered == 1 and s.lookup(TOKS) == 3  # the truncated suffix is not served
    while s.poll():
        pass
    st = s.statistics()
    assert st.quarantined == 3 and st.temps_purged == 1
    assert sorted(os.listdir(tmp_path / "quarantine")) == sorted(
        [good[1], "ab" * 16 + ".kv", record_files(other)[0]])
    assert (tmp_path / "notes.txt").exists() and temp_files(tmp_path) == []
    assert s.check() == []
    assert bytes(s.load(TOKS, 3)) == page_row(TOKS[: 3 * PT])


def test_bit_rot_in_a_row_is_caught_on_first_load(tmp_path: Path, stores: Stores) -> None:
    name = _filled(stores, tmp_path)[1]
    with open(tmp_path / name, "r+b") as f:  # flip a byte in the last page of the row
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    s = stores.open(tmp_path, bad_files="delete")
    assert s.lookup(TOKS) == 6  # the header is sound; the row is checked when read
    with pytest.raises(RecordCorruptError, match="checksum"):
        s.load(TOKS, 6)
    assert s.lookup(TOKS) == 3  # never served again
    assert bytes(s.load(TOKS, 3)) == page_row(TOKS[: 3 * PT])
    while s.poll():
        pass
    assert name not in record_files(tmp_path) and s.statistics().corrupt_loads == 1
    assert s.check() == []


def test_short_token_lists(tmp_path: Path, stores: Stores) -> None:
    from phalanx.kvstore import RowSpanError

    s = stores.open(tmp_path)
    assert s.lookup(TOKS[: PT - 1]) == 0
    with pytest.raises(RowSpanError, match="shorter than one page"):
        s.store(TOKS[: PT - 1], b"\0" * PB)
    with pytest.raises(RowSpanError):
        s.load(TOKS[:1], 1)
    assert s.statistics().misses == 1 and record_files(tmp_path) == []


@pytest.mark.parametrize("point", [
    "cache.store.temp_opened", "cache.store.temp_written", "cache.store.committed",
])
def test_a_fault_at_each_write_step_leaves_nothing_visible(
    tmp_path: Path, stores: Stores, point: str
) -> None:
    s = stores.open(tmp_path)
    s.store(TOKS[: 3 * PT], page_row(TOKS[: 3 * PT]))
    before = record_files(tmp_path)
    failpoints.arm(point, "raise")
    with pytest.raises(FailpointError, match=point):
        s.store(TOKS, page_row(TOKS))
    failpoints.disarm_all()
    assert record_files(tmp_path) == before and temp_files(tmp_path) == []
    assert s.lookup(TOKS) == 3 and s.check() == []
    assert s.store(TOKS, page_row(TOKS)).stored  # and the store keeps working
    assert s.check() == []


@pytest.mark.parametrize("point", [
    "cache.thin.temp_written", "cache.thin.committed", "cache.remove.unlinking",
])
def test_a_fault_at_each_maintenance_step_is_retried(
    tmp_path: Path, stores: Stores, point: str
) -> None:
    s = stores.open(tmp_path, capacity_bytes=2_000)
    s.store(TOKS[: 3 * PT], page_row(TOKS[: 3 * PT]))
    s.store(TOKS, page_row(TOKS))  # the first row is now redundant: thinnable
    big = np.arange(50, 50 + 16 * PT)
    failpoints.arm(point, "raise")
    with pytest.raises(FailpointError, match=point):
        while s.poll(1):  # thin faults fire here
            pass
        s.store(big, page_row(big))  # over capacity: make_room evicts; remove faults here
    failpoints.disarm_all()
    assert s.check() == []  # the index says exactly what the disk holds
    while s.poll():  # a failed step is decided again and completes
        pass
    s.store(big, page_row(big))
    st = s.statistics()
    assert st.bytes <= 2_000 and st.rows_thinned + st.evictions >= 1 and s.check() == []
    assert temp_files(tmp_path) == []


def test_full_disk_fails_the_store_cleanly_and_keeps_serving(tmp_path: Path) -> None:
    """A real ENOSPC: a 256 KiB tmpfs, mounted in a private user+mount namespace."""
    d = tmp_path / "small"
    d.mkdir()
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import numpy as np
        from cache_util import GEOM, FP, page_row, temp_files
        from phalanx.kvstore import DiskFullError, DiskStore, StoreOptions
        d = {str(d)!r}
        with DiskStore(d, GEOM, FP, StoreOptions(1 << 30, progress=False)) as s:
            stored = []
            for i in range(100_000):
                toks = np.arange(i * 1000, i * 1000 + 64 * GEOM.page_tokens)
                try:
                    s.store(toks, page_row(toks))
                except DiskFullError as exc:
                    assert "ENOSPC" in str(exc), exc
                    break
                stored.append(toks)
            else:
                raise SystemExit("the disk never filled")
            assert not temp_files(d)
            assert s.check() == [], s.check()
            for toks in stored:
                assert bytes(s.load(toks, 64)) == page_row(toks)
            print("ok", len(stored), flush=True)
    """)
    cmd = ["unshare", "-rm", "sh", "-c",
           f"mount -t tmpfs -o size=256k tmpfs {d} && exec {sys.executable} -c \"$0\"", script]
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed: no private tmpfs to fill")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs tmpfs {d}"],
                           capture_output=True, timeout=30)
    if probe.returncode:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.decode().strip()}")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ") and int(out.stdout.split()[1]) > 0
    assert DiskFullError.__mro__[1].__name__ == "StoreWriteError"


def test_a_staging_entry_that_is_not_a_directory_of_ours_is_refused(
    tmp_path: Path, stores: Stores
) -> None:
    """Temp files are created in, and purged from, DIR/.staging/N/: a symlink there
    would send them (and their purges) outside the cache."""
    d = tmp_path / "cache"
    stores.open(d).close()
    shutil.rmtree(d / ".staging")
    outside = tmp_path / "outside"
    (outside / "0").mkdir(parents=True)
    victim = outside / "0" / ".notes.tmp"
    victim.write_text("someone's")
    (d / ".staging").symlink_to(outside)
    with pytest.raises(NotADirectoryError, match="symlink or a file"):
        stores.open(d)
    assert inspect_directory(str(d)).temps == 0 and victim.exists()  # not listed through it
    (d / ".staging").unlink()
    (d / ".staging").write_text("a file")
    with pytest.raises(NotADirectoryError, match="remove it"):
        stores.open(d)
    (d / ".staging").unlink()
    s = stores.open(d)  # removed: the next open makes its own (and the lock was released)
    assert s.check() == [] and victim.exists()


@pytest.mark.parametrize("knobs", [
    {"capacity_bytes": 0}, {"capacity_bytes": 1, "max_jobs_per_poll": 0},
    {"capacity_bytes": 1, "open_files": -1}, {"capacity_bytes": 1, "io_threads": 0},
    {"capacity_bytes": 1, "bad_files": "shred"},
    # not "never": every leaf would expire at the first poll (0, negative) or none (NaN)
    {"capacity_bytes": 1, "max_age": 0.0}, {"capacity_bytes": 1, "max_age": -1.0},
    {"capacity_bytes": 1, "max_age": float("nan")},
], ids=["capacity", "max_jobs_per_poll", "open_files", "io_threads", "bad_files",
        "max_age_zero", "max_age_negative", "max_age_nan"])
def test_a_bad_knob_is_refused_where_the_options_are_written(knobs: dict[str, Any]) -> None:
    name = next(k for k in reversed(knobs))
    with pytest.raises(ValueError, match=name):
        StoreOptions(**knobs)
