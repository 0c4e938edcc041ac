"""``phalanx bench cache-disk``: the disk store beside a plain-file baseline and LMCache.

Per row size (256 KiB, 4 MiB, 32 MiB by default), in the same run: DiskStore store and
load (``store_many`` and ``load_many`` of the whole batch, as LMCache gets one store
task and one load task for its batch; and ``store`` and ``load`` row after row,
``store_each_gbps`` and ``load_each_gbps``), a plain-Python baseline writing the same
bytes as one file per row (open, write, rename; same fsync policy) and reading them
back (open, readinto), and LMCache's ``fs_native`` disk path (its best; four C++ I/O
workers) through its anchor (``anchors/lmcache_disk.py``) run by the LMCache venv's python,
one process per rep; and, where the kernel offers io_uring and the store's default
read path does not use it, ``load_many`` with ``io_uring=True`` (``load_uring_gbps``;
its own store, written the same way). Reps alternate the sides, so the drift of a
shared VM hits all of them alike, and rotate which side goes first (the first runs
while the kernel still discards the blocks of the files the last rep deleted).
Loads on every side read into a destination pool allocated and touched once per row
size and reused by every rep (what an engine's KV pool is; LMCache's driver does the
same), so no side pays page faults on fresh memory; before each timed store every side
touches and frees as much memory as the store writes (see ``_timed``). Buffered I/O;
the page cache is not dropped; os.sync() runs untimed before each timed phase; medians
of --reps.
Then recovery: opening a directory of --recovery-records records (it holds the sealed
header snapshot its writer left at close) against a bare ``os.scandir`` + ``stat`` of
it, and the same open with the snapshot removed (every header read).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from phalanx.kvstore import (
    SEAL_NAME,
    SNAPSHOT_NAME,
    DiskStore,
    Geometry,
    KeyChain,
    StoreOptions,
    aligned_empty,
)
from phalanx.serve.cli import INT_LIST

from ._stats import emit, median

__all__ = ["command"]

# 128 KiB pages: every benchmarked row is a whole number of pages
BENCH_GEOMETRY = Geometry(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=64)
# 512-byte pages: 100,000 records stay small on disk
RECOVERY_GEOMETRY = Geometry(layers=1, kv_heads=1, head_dim=8, dtype="float16", page_tokens=16)
DRIVER = Path(__file__).with_name("anchors") / "lmcache_disk.py"  # a script: see its docstring


def _timed(fn: Callable[[], object], writes: int = 0) -> float:
    """Seconds of ``fn()``, after ``os.sync()``; for a phase that writes ``writes``
    bytes, after touching and freeing that much memory (plus slack) first.

    This VM hands free memory back to its host (virtio-balloon free page reporting,
    a couple of seconds after it is freed), and the page cache faults such memory back
    in at a tenth of the speed: store figures alternated 10x between reps with the
    files deleted by the last one (4 MiB rows: 0.4 against 4.5 GB/s). Touching the
    memory right before the phase puts it back under the guest's free lists, where the
    page cache takes it; every side does this (LMCache's driver too).
    """
    os.sync()
    if writes:
        scratch = np.ones(writes + (64 << 20), dtype=np.uint8)
        del scratch
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# one recovery step in a fresh interpreter: argv = directory, mode, expected records
_RESTART = """
import os, sys, time
from phalanx.kvstore import DiskStore, StoreOptions
from phalanx_bench.cache_disk import RECOVERY_GEOMETRY
d, mode = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if mode == "bare":
    with os.scandir(d) as it:
        for e in it:
            os.stat(e.path)
    t = time.perf_counter() - t0
else:
    s = DiskStore(d, RECOVERY_GEOMETRY, "bench",
                  StoreOptions(capacity_bytes=1 << 40, progress=False))
    t = time.perf_counter() - t0
    s.close()  # untimed: rewrites the snapshot only when the index changed
    if s.statistics().recovered != int(sys.argv[3]):
        raise SystemExit("recovery lost records")
print(t)
"""


def _phalanx_case(root: Path, rows: list[memoryview], fsync: bool,
                  dst: list[memoryview]) -> tuple[float, float, float, float]:
    """Seconds of (store_many, store each, load_many, load each) of the same rows.

    ``store_many`` of the batch (LMCache too gets one store task for its batch), then
    ``load_many`` of the batch (LMCache's one load task) and ``load`` row after row;
    then, into a second store beside ``root``, ``store`` row after row."""
    g = BENCH_GEOMETRY
    pages = rows[0].nbytes // g.page_bytes
    toks = [np.arange(i * pages * 64, (i + 1) * pages * 64) for i in range(len(rows))]
    total = sum(r.nbytes for r in rows)

    def open_store(d: Path) -> DiskStore:
        return DiskStore(d, g, "bench", StoreOptions(
            capacity_bytes=2 * total + (1 << 30), fsync=fsync, progress=False))

    store = open_store(root)
    try:
        # a server hashes a request's pages once (lookup), then stores and loads by
        # that key chain
        chains = [store.chain(t) for t in toks]
        t_store = _timed(lambda: store.store_many(list(zip(chains, rows, strict=True))),
                         total)

        def get_batch() -> None:
            store.load_many([(c, pages, d) for c, d in zip(chains, dst, strict=True)])

        def get_each() -> None:
            for c, d in zip(chains, dst, strict=True):
                store.load(c, pages, out=d)

        _clear(dst)
        # the first loads after the stores: rows this process wrote are known good, so
        # no page is checked (a reopened store's first loads check every page)
        t_load = _timed(get_batch)
        _check(rows, dst, "phalanx")
        _clear(dst)
        t_each = _timed(get_each)
        _check(rows, dst, "phalanx")
        if bytes(store.load(toks[-1], pages)) != bytes(rows[-1]):
            raise AssertionError("phalanx load returned different bytes")
    finally:
        store.close()
    with open_store(root.with_name(root.name + "_each")) as one_by_one:
        def put_each() -> None:
            for c, r in zip(chains, rows, strict=True):
                one_by_one.store(c, r)

        t_store_each = _timed(put_each, total)
    return t_store, t_store_each, t_load, t_each


def _uring_case(root: Path, rows: list[memoryview], dst: list[memoryview]) -> float | None:
    """Seconds of ``load_many`` of the batch with io_uring reads asked for (after a
    ``store_many``, as the default side), or None where the kernel offers none.

    Its own side, with its own directory: the default side's loads are the first after
    its store (descriptors held, records unverified); a reopened store would start
    with neither, and the two figures would not compare."""
    g = BENCH_GEOMETRY
    pages = rows[0].nbytes // g.page_bytes
    toks = [np.arange(i * pages * 64, (i + 1) * pages * 64) for i in range(len(rows))]
    total = sum(r.nbytes for r in rows)
    with DiskStore(root, g, "bench", StoreOptions(
            capacity_bytes=total + (1 << 30), progress=False, io_uring=True)) as store:
        if not store.io_uring:
            return None
        chains = [store.chain(t) for t in toks]
        _timed(lambda: store.store_many(list(zip(chains, rows, strict=True))), total)
        _clear(dst)
        t_load = _timed(lambda: store.load_many(
            [(c, pages, d) for c, d in zip(chains, dst, strict=True)]))
        _check(rows, dst, "phalanx (io_uring)")
    return t_load


def _clear(dst: list[memoryview]) -> None:
    for d in dst:  # already touched: this only makes a stale pass detectable
        np.frombuffer(d, dtype=np.uint8)[:64] = 0


def _check(rows: list[memoryview], dst: list[memoryview], who: str) -> None:
    for r, d in zip(rows, dst, strict=True):
        if not np.array_equal(np.frombuffer(r, np.uint8), np.frombuffer(d, np.uint8)):
            raise AssertionError(f"{who} load returned different bytes")


def _baseline_case(root: Path, rows: list[memoryview], fsync: bool,
                   dst: list[memoryview]) -> tuple[float, float]:
    root.mkdir(mode=0o700)
    paths = [root / f"{i}.row" for i in range(len(rows))]

    def put() -> None:
        for p, r in zip(paths, rows, strict=True):
            tmp = f"{p}.tmp"
            with open(tmp, "wb") as f:
                f.write(r)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.rename(tmp, p)

    def get() -> None:
        for p, d in zip(paths, dst, strict=True):
            with open(p, "rb", buffering=0) as f:
                if f.readinto(d) != d.nbytes:
                    raise AssertionError("short read")

    _clear(dst)
    t_put = _timed(put, sum(r.nbytes for r in rows))
    t_get = _timed(get)
    _check(rows, dst, "plain-file")
    return t_put, t_get


def _lmcache_case(python: str, work: Path, row_bytes: int, n: int) -> dict[str, float] | None:
    """One rep of LMCache fs_native for one row size: {"store_gbps", "load_gbps"}, or
    None when the LMCache venv is absent or the driver failed (said on stderr)."""
    if not os.path.exists(python):
        return None
    env = dict(os.environ, LMCACHE_LOG_LEVEL="ERROR")
    out = subprocess.run([python, str(DRIVER), "--dir", str(work / "lmcache"), "--cases",
                          f"{row_bytes}x{n}", "--reps", "1"], capture_output=True, text=True,
                         env=env, timeout=900)
    if out.returncode:
        click.echo(f"lmcache: driver failed ({out.returncode}): {out.stderr[-2000:]}", err=True)
        return None
    row: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])["rows"][0]
    return row


def _recovery(work: Path, n: int, reps: int) -> dict[str, float]:
    g = RECOVERY_GEOMETRY
    d = work / "recovery"
    rng = np.random.default_rng(0)
    row = bytes(g.page_bytes)
    s = DiskStore(d, g, "bench", StoreOptions(capacity_bytes=1 << 40, progress=False))
    try:
        chains: list[KeyChain] = []
        for i in range(n):  # a random tree: each record extends a random earlier one
            parent = int(rng.integers(-1, i)) if i else -1
            new = rng.integers(0, 1 << 30, g.page_tokens)
            chain = chains[parent].extend(new) if parent >= 0 else s.chain(new)
            s.store(chain, row)
            chains.append(chain)
    finally:
        t_close = _timed(s.close)  # writes the header snapshot
    snap = d / SNAPSHOT_NAME

    def fresh(mode: str) -> float:
        """Time one step in a new process: what a restarting server pays."""
        if mode == "cold":
            snap.unlink()
        if mode == "unsealed":  # as after a crash: the snapshot is checked file by file
            (d / SEAL_NAME).unlink()
        os.sync()
        out = subprocess.run([sys.executable, "-c", _RESTART, str(d), mode, str(n)],
                             capture_output=True, text=True, timeout=600, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    t_bare = median([fresh("bare") for _ in range(reps)])
    t_open = median([fresh("open") for _ in range(reps)])
    t_unsealed = median([fresh("unsealed") for _ in range(reps)])
    t_cold = median([fresh("cold") for _ in range(reps)])
    return {"records": n, "seconds": t_open, "bare_scan_seconds": t_bare,
            "unsealed_snapshot_seconds": t_unsealed, "no_snapshot_seconds": t_cold,
            "close_with_snapshot_seconds": t_close}


def _read_paths(work: Path) -> tuple[bool, bool]:
    """(the default store reads through io_uring, a store asking for it gets it)."""
    probe = work / "probe"
    with DiskStore(probe, BENCH_GEOMETRY, "bench",
                   StoreOptions(capacity_bytes=1 << 30, progress=False)) as store:
        default = store.io_uring
    shutil.rmtree(probe)
    with DiskStore(probe, BENCH_GEOMETRY, "bench", StoreOptions(
            capacity_bytes=1 << 30, progress=False, io_uring=True)) as store:
        offered = store.io_uring
    shutil.rmtree(probe)
    return default, offered


def _row_size(work: Path, b: int, n: int, reps: int, fsync_total_mib: int,
              lmcache_python: str, with_uring: bool) -> dict[str, Any]:
    """Every side's figures for ``n`` rows of ``b`` bytes: one row of the result."""
    # Rows and the load pool start on page boundaries, as a server's KV pool does
    # (torch's allocations are 64-byte aligned; LMCache reads into its own): a buffer
    # 16 bytes off a page, numpy's default, halves the kernel's copy speed on this VM
    # for every system that reads or writes through it.
    data = aligned_empty(n * b)
    data[:] = np.random.default_rng(b).integers(0, 255, n * b, dtype=np.uint8)
    rows = [data.data[i * b : (i + 1) * b] for i in range(n)]
    pool = aligned_empty(n * b)
    pool.fill(1)  # touched once, reused by every rep
    dst = [pool.data[i * b : (i + 1) * b] for i in range(n)]
    ph: list[tuple[float, float, float, float]] = []
    base: list[tuple[float, float]] = []
    lmc: list[dict[str, float]] = []
    uring: list[float] = []
    rep = work / f"rep{b}"

    def lmcache_side() -> None:
        one = _lmcache_case(lmcache_python, rep, b, n)
        if one is not None:
            lmc.append(one)

    def uring_side() -> None:
        one = _uring_case(rep / "uring", rows, dst)
        if one is not None:
            uring.append(one)

    sides: list[Callable[[], None]] = [
        lambda: ph.append(_phalanx_case(rep / "phalanx", rows, False, dst)),
        lambda: base.append(_baseline_case(rep / "plain", rows, False, dst)),
        lmcache_side,
    ]
    if with_uring:
        sides.append(uring_side)
    for r in range(reps):
        # sides alternate so drift hits all of them, and take turns going first: the
        # first runs just after the last rep's files were deleted, while the kernel
        # still discards their blocks
        rep.mkdir(mode=0o700)
        k = r % len(sides)
        for side in sides[k:] + sides[:k]:
            side()
        shutil.rmtree(rep)
    total = n * b
    row: dict[str, Any] = {
        "row_bytes": b,
        "store_gbps": total / median([p[0] for p in ph]) / 1e9,
        "store_each_gbps": total / median([p[1] for p in ph]) / 1e9,
        "load_gbps": total / median([p[2] for p in ph]) / 1e9,
        "load_each_gbps": total / median([p[3] for p in ph]) / 1e9,
        # load_many with io_uring reads asked for (load_gbps: the default read path)
        "load_uring_gbps": total / median(uring) / 1e9 if uring else None,
        "baseline_store_gbps": total / median([s for s, _ in base]) / 1e9,
        "baseline_load_gbps": total / median([ld for _, ld in base]) / 1e9,
        "lmcache_store_gbps": median([x["store_gbps"] for x in lmc]) if lmc else None,
        "lmcache_load_gbps": median([x["load_gbps"] for x in lmc]) if lmc else None,
    }
    if fsync_total_mib:
        nf = max(1, (fsync_total_mib << 20) // b)
        s_ph, s_each, *_ = _phalanx_case(work / f"pf{b}", rows[:nf], True, dst[:nf])
        s_b, _ = _baseline_case(work / f"bf{b}", rows[:nf], True, dst[:nf])
        row["fsync_store_gbps"] = nf * b / s_ph / 1e9
        row["fsync_store_each_gbps"] = nf * b / s_each / 1e9
        row["fsync_baseline_store_gbps"] = nf * b / s_b / 1e9
    return row


@click.command("cache-disk")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON result as the last line.")
@click.option("--rows", default="262144,4194304,33554432", show_default=True, type=INT_LIST,
              help="Row sizes in bytes (multiples of 128 KiB).")
@click.option("--total-mib", type=click.IntRange(1), default=256, show_default=True,
              help="Bytes per case and rep.")
@click.option("--reps", type=click.IntRange(1), default=3, show_default=True)
@click.option("--fsync-total-mib", type=click.IntRange(1), default=32, show_default=True,
              help="Bytes per case for the fsync=True figures (0: skip them).")
@click.option("--recovery-records", type=click.IntRange(1), default=100_000, show_default=True)
@click.option("--lmcache-python", default="/tmp/phx-anchors/lmcache/bin/python",
              show_default=True, help="python of a venv with LMCache (skipped if absent).")
@click.option("--dir", "work_dir", default=None, help="Scratch directory (default: /tmp).")
@click.option("--io-uring/--no-io-uring", "with_uring", default=True, show_default=True,
              help="Also time load_many with io_uring reads asked for (a fourth side), "
              "where the kernel offers them and the default read path does not use them.")
def command(as_json: bool, rows: list[int], total_mib: int, reps: int, fsync_total_mib: int,
            recovery_records: int, lmcache_python: str, work_dir: str | None,
            with_uring: bool) -> None:
    """Store/load GB/s vs one-file-per-row and LMCache fs_native; recovery vs scandir."""
    work = Path(tempfile.mkdtemp(prefix="phx-bench-cache-", dir=work_dir))
    try:
        sizes = rows
        cases = [(b, max(1, (total_mib << 20) // b)) for b in sizes]
        if not os.path.exists(lmcache_python):
            click.echo(f"lmcache: skipped, no LMCache venv at {lmcache_python} (run "
                       "/work/shared/anchors/lmcache/setup.sh or pass --lmcache-python)",
                       err=True)
        default_uring, uring_ok = _read_paths(work)
        uring = uring_ok and not default_uring and with_uring
        if default_uring:  # the default side already reads through io_uring
            click.echo("io_uring: on by default here; no separate io_uring side", err=True)
        out_rows = []
        for b, n in cases:
            row = _row_size(work, b, n, reps, fsync_total_mib, lmcache_python, uring)
            out_rows.append(row)
            if not as_json:
                print(json.dumps(row), file=sys.stderr)
        result = {"rows": out_rows, "recovery": _recovery(work, recovery_records, reps),
                  "default_read_path": "io_uring" if default_uring else "threads",
                  "io_uring_available": uring_ok}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, as_json)
