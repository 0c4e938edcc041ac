"""Capacity and expiry under a stream of stores; a restart at 95% full stays under cap;
pinned records survive maintenance until their load is done."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cache_util import GEOM, Clock, Stores, page_row, stores
from phalanx.kvstore import CapacityError, Job, JobKind, JobOutcome
from phalanx.lifecycle import FailpointError, failpoints

__all__ = ["stores"]

PT = GEOM.page_tokens


def stream(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    roots = rng.integers(0, 1000, (20, 2 * PT))
    return [np.concatenate([roots[rng.integers(0, 20)], rng.integers(0, 1000, PT * 3)])
            for _ in range(n)]


def test_capacity_holds_under_a_stream_and_after_restart_at_95_percent(
    tmp_path: Path, stores: Stores
) -> None:
    cap = 64 * 1024
    s = stores.open(tmp_path, capacity_bytes=cap)
    for i, toks in enumerate(stream(600, 1)):
        s.store(toks, page_row(toks[s.lookup(toks) * PT :]))
        assert s.statistics().bytes <= cap
        if i % 50 == 0:
            s.poll()
            assert s.check() == []
    assert s.statistics().evictions > 0
    s.close()
    # refill to ~95% of a cap, then reopen and keep storing: still never above it
    s = stores.open(tmp_path, capacity_bytes=cap)
    assert s.statistics().bytes <= cap
    more = iter(stream(10_000, 2))
    while s.statistics().bytes < 0.95 * cap:
        toks = next(more)
        s.store(toks, page_row(toks[s.lookup(toks) * PT :]))
    s.close()
    s = stores.open(tmp_path, capacity_bytes=cap)
    recovered = s.statistics().bytes
    assert 0.9 * cap <= recovered <= cap
    for _ in range(200):
        toks = next(more)
        s.store(toks, page_row(toks[s.lookup(toks) * PT :]))
        assert s.statistics().bytes <= cap
    assert s.check() == []


def test_restart_with_a_smaller_cap_counts_recovered_bytes(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path)
    for toks in stream(100, 3):
        s.store(toks, page_row(toks[s.lookup(toks) * PT :]))
    full = s.statistics().bytes
    s.close()
    s = stores.open(tmp_path, capacity_bytes=full // 2)
    assert s.statistics().bytes == full  # over the cap until maintenance runs ...
    toks = np.arange(1000, 1000 + 2 * PT)
    s.store(toks, page_row(toks))  # ... or until a store makes room first
    assert s.statistics().bytes <= full // 2
    assert s.check() == []


def test_expiry_under_a_stream(tmp_path: Path, stores: Stores) -> None:
    clock = Clock()
    s = stores.open(tmp_path, max_age=10.0, clock=clock)
    all_toks = stream(300, 4)
    for toks in all_toks[:150]:
        s.store(toks, page_row(toks[s.lookup(toks) * PT :]))
    clock.t += 11.0  # the first 150 are now older than max_age
    for toks in all_toks[150:]:
        s.store(toks, page_row(toks[s.lookup(toks) * PT :]))
        s.poll(4)
    while s.poll():
        pass
    st = s.statistics()
    assert st.expirations > 0 and s.check() == []
    cutoff = clock.t - 10.0
    # no leaf older than max_age is left: every old record left holds a young one's prefix
    for toks in all_toks[150:]:
        assert s.lookup(toks) == len(toks) // PT
    s.close()
    clock.t += 11.0
    s = stores.open(tmp_path, max_age=10.0, clock=clock)
    while s.poll():
        pass
    assert s.statistics().records == 0 and s.check() == [] and cutoff < clock.t


def test_a_row_larger_than_capacity_is_refused(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path, capacity_bytes=1024)
    toks = np.arange(20 * PT)
    with pytest.raises(CapacityError, match="exceeds the capacity"):
        s.store(toks, page_row(toks))
    assert s.statistics().records == 0


def test_maintenance_defers_a_pinned_record(tmp_path: Path, stores: Stores) -> None:
    s = stores.open(tmp_path)
    toks = np.arange(8 * PT)
    short = s.store(toks[: 4 * PT], page_row(toks[: 4 * PT]))
    s.store(toks, page_row(toks))  # the short row is now redundant: a THIN job waits
    assert s.pending() == 1
    failpoints.arm("cache.load.pinned", "hang:2*1")  # the load stops 2 s, pins held
    errors: list[BaseException] = []

    def load() -> None:
        try:
            s.load(toks[: 4 * PT], 4)
        except FailpointError as exc:
            errors.append(exc)

    t = threading.Thread(target=load)
    t.start()
    deadline = time.monotonic() + 30
    while not failpoints.fired("cache.load.pinned"):
        assert time.monotonic() < deadline, "load never reached its pinned point"
        time.sleep(0.01)
    assert s.poll() == 0 and s.pending() == 1  # pinned: not decided
    assert s.apply_job(Job(JobKind.THIN, key=short.key)) is JobOutcome.DEFERRED
    failpoints.disarm_all()  # a disarmed hang still sleeps; wait for it with a deadline
    t.join(timeout=35)
    assert not t.is_alive() and len(errors) == 1
    assert s.poll() == 1 and s.statistics().rows_thinned == 1
    assert s.apply_job(Job(JobKind.THIN, key=short.key)) is JobOutcome.NOOP  # idempotent
    assert bytes(s.load(toks, 8)) == page_row(toks)
    assert s.check() == []


def _descriptors_under(directory: Path) -> list[str]:
    """Targets of this process's open descriptors of record files in ``directory``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target.startswith(str(directory)) and ".kv" in target:
            out.append(target)
    return out


def test_open_descriptors_follow_the_records(tmp_path: Path, stores: Stores) -> None:
    """Record files stay open between loads, at most ``open_files`` of them; a record
    evicted, expired or thinned gives its descriptor up at once (no deleted file's
    space is held), and close() gives up the rest."""
    clock = Clock()
    s = stores.open(tmp_path, capacity_bytes=12 * 1024, max_age=10.0, clock=clock,
                    open_files=6)
    rng = np.random.default_rng(3)
    for _ in range(40):
        toks = rng.integers(0, 1000, 4 * PT)
        s.store(toks[: 2 * PT], page_row(toks[: 2 * PT]))
        s.store(toks, page_row(toks))  # covers the first row: maintenance thins it
        n = s.lookup(toks)
        assert bytes(s.load(toks, n)) == page_row(toks[: n * PT])
        held = _descriptors_under(tmp_path)
        assert len(held) <= 6
        assert not [t for t in held if t.endswith("(deleted)")]
        s.poll()  # thins and evicts as it goes
    assert s.statistics().evictions > 0 and s.statistics().rows_thinned > 0
    clock.t += 11.0  # everything expires
    while s.poll():
        pass
    assert s.statistics().records == 0
    assert _descriptors_under(tmp_path) == []
    s.close()
    assert _descriptors_under(tmp_path) == []


def test_lru_bookkeeping_stays_bounded_when_nothing_is_evicted(tmp_path: Path,
                                                              stores: Stores) -> None:
    """Every hit re-files a leaf in the LRU heap; a cache that never fills up never
    evicts, and the heap grew by one entry per hit (a server's memory, without bound)."""
    s = stores.open(tmp_path)
    prompts = [np.arange(i * 100, i * 100 + 2 * PT) for i in range(10)]
    for t in prompts:
        s.store(t, page_row(t))
    for i in range(20_000):
        t = prompts[i % 10]
        assert s.lookup(t) == 2
    s.load_many([(t, 2) for t in prompts])
    assert len(s._core.index._lru) <= 2 * 10 + 1024 + 1
    assert s.statistics().evictions == 0 and s.check() == []
