"""The rank-side cache API, used as the engine uses it: from tasks running inside the
rank processes, in batches (RankCache: lookup_many -> Lease, load_many, store_many).

Each rank stores its own shard bytes (a pattern per rank and row) and loads them back
into a buffer of its own; rank 0 decides and pins; peers mirror."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from phalanx.kvstore import CapacityError
from phalanx.replication import Lease, ReplicatedCache, rank_cache
from phalanx.runtime import Orchestrator, Worker, current_rank
from replication_util import GEOM, RANKS, open_cache

PT = GEOM.page_tokens
PB = GEOM.page_bytes
WAIT = 30.0  # deadline of every wait in a rank task


def _tokens(i: int, pages: int) -> np.ndarray:
    return np.arange(pages * PT) + 1_000_000 * (i + 1)


def _pattern(rank: int, i: int, pages: int) -> np.ndarray:
    """Rank ``rank``'s shard bytes of row i: differ across ranks and rows."""
    return np.full(pages * PB, (rank * 37 + i * 11 + 1) % 251, dtype=np.uint8)


def _on_every_rank(w: Worker, fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
    def orch(o: Orchestrator) -> dict[int, Any]:
        futs = {r: o.submit(r, fn, *args) for r in o.ranks}
        return {r: f.result() for r, f in futs.items()}

    out: dict[int, Any] = w.run(orch)
    return out


def _on_rank0(w: Worker, fn: Callable[..., Any], *args: Any) -> Any:
    return w.run(lambda o: o.submit(0, fn, *args).result())


# -- tasks (run in the ranks) ---------------------------------------------------------
def _store_rows(cid: str, rows: list[tuple[int, int]],
                replicated: bool = True) -> list[bool] | None:
    """store_many of rows (i, pages) from this rank's own buffers, then overwrite the
    buffers at once (the caller reuses its memory); rank 0 returns what it stored
    (once every peer applied it, unless ``replicated`` is False)."""
    rank = current_rank()
    assert rank is not None
    buffers = [_pattern(rank, i, pages) for i, pages in rows]
    ticket = rank_cache(cid).store_many([(_tokens(i, p), b) for (i, p), b in
                                         zip(rows, buffers, strict=True)])
    for b in buffers:
        b[:] = 0xEE  # the engine's next step writes here: the stored bytes must not change
    if rank != 0:
        return None
    results = ticket.wait(WAIT)
    if replicated:
        rank_cache(cid).wait_replicated(WAIT)
    return [r.stored for r in results]


def _store_refused(cid: str, good: int, huge_pages: int) -> str:
    """A batch with one row that cannot fit: refused whole, on every rank."""
    rank = current_rank()
    assert rank is not None
    rows = [(_tokens(good, 2), _pattern(rank, good, 2)),
            (_tokens(good + 1, huge_pages), _pattern(rank, good + 1, huge_pages))]
    ticket = rank_cache(cid).store_many(rows)
    if rank != 0:
        return ""
    try:
        ticket.wait(WAIT)
    except CapacityError as exc:
        rank_cache(cid).wait_replicated(WAIT)  # the peers dropped their copies by now
        return type(exc).__name__
    return "stored"


def _lookup(cid: str, prefixes: list[tuple[int, int]]) -> Lease:
    return rank_cache(cid).lookup_many([_tokens(i, p) for i, p in prefixes])


def _release(cid: str, lease: Lease) -> None:
    rank_cache(cid).release(lease)


def _load_and_compare(cid: str, lease: Lease, prefixes: list[tuple[int, int]]) -> list[bool]:
    """load_many of what the lease reported, into buffers of this rank's own; True per
    prefix whose bytes equal what this rank stored."""
    rank = current_rank()
    assert rank is not None
    wanted = [(i, n) for (i, _), n in zip(prefixes, lease.pages, strict=True) if n]
    outs = [np.zeros(n * PB, dtype=np.uint8) for _, n in wanted]
    views = rank_cache(cid).load_many(
        [(_tokens(i, n), n, out) for (i, n), out in zip(wanted, outs, strict=True)], lease)
    same = []
    for (i, n), out, view in zip(wanted, outs, views, strict=True):
        assert np.frombuffer(view, np.uint8).ctypes.data == out.ctypes.data  # into ours
        same.append(bool(np.array_equal(out, _pattern(rank, i, n))))
    return same


def _side(cid: str) -> dict[str, Any]:
    state = rank_cache(cid).state()
    return {"records": state["stats"]["records"], "staged": state["staged_rows"],
            "leases": state["leases"], "problems": state["problems"]}


# -- tests ----------------------------------------------------------------------------
def _open(w: Worker, d: Path, **kw: Any) -> ReplicatedCache:
    return open_cache(w, d, job_timeout=20.0, **kw)


def test_batch_store_lookup_pin_and_load_on_every_rank(tmp_path: Path) -> None:
    rows = [(0, 3), (1, 1), (2, 5)]
    with Worker(ranks=RANKS) as w:
        cache = _open(w, tmp_path / "cache")
        try:
            assert _on_every_rank(w, _store_rows, cache.cache_id, rows)[0] == [True] * 3
            prefixes = [*rows, (9, 2)]  # the last one was never stored: a miss
            lease = _on_rank0(w, _lookup, cache.cache_id, prefixes)
            assert lease.pages == (3, 1, 5, 0)
            assert set(lease.through) == set(range(1, RANKS))
            same = _on_every_rank(w, _load_and_compare, cache.cache_id, lease, prefixes)
            assert same == {r: [True, True, True] for r in range(RANKS)}, same
            assert _on_rank0(w, _side, cache.cache_id)["leases"] == 1
            _on_rank0(w, _release, cache.cache_id, lease)
            sides = _on_every_rank(w, _side, cache.cache_id)
            assert all(s["records"] == 3 and s["staged"] == 0 and s["problems"] == []
                       for s in sides.values()), sides
            assert sides[0]["leases"] == 0
            assert cache.check() == []
        finally:
            cache.close()


def test_maintenance_defers_a_pinned_record_until_release(tmp_path: Path) -> None:
    max_age = 0.5
    with Worker(ranks=RANKS) as w:
        cache = _open(w, tmp_path / "cache", max_age=max_age)
        try:
            assert _on_every_rank(w, _store_rows, cache.cache_id, [(0, 2), (1, 2)])[0] == [
                True, True]
            stored_at = time.time()  # after both records were written
            lease = _on_rank0(w, _lookup, cache.cache_id, [(0, 2)])
            assert lease.pages == (2,)
            while time.time() < stored_at + max_age + 0.05:  # both records are past max_age
                time.sleep(0.05)
            report = cache.maintain()  # expires record 1; record 0 is pinned: deferred
            assert report.jobs == {"expire": 1}, report
            sides = _on_every_rank(w, _side, cache.cache_id)
            assert {r: s["records"] for r, s in sides.items()} == dict.fromkeys(range(RANKS), 1)
            # every rank still reads the pinned record, byte-exact
            same = _on_every_rank(w, _load_and_compare, cache.cache_id, lease, [(0, 2)])
            assert same == {r: [True] for r in range(RANKS)}, same
            _on_rank0(w, _release, cache.cache_id, lease)
            report = cache.maintain()  # now rank 0 decides it, and every peer applies it
            assert report.jobs == {"expire": 1}, report
            sides = _on_every_rank(w, _side, cache.cache_id)
            assert {r: s["records"] for r, s in sides.items()} == dict.fromkeys(range(RANKS), 0)
            assert cache.check() == []
        finally:
            cache.close()


def test_a_refused_store_leaves_nothing_on_any_rank(tmp_path: Path) -> None:
    capacity = 64 * (PB + 64)
    with Worker(ranks=RANKS) as w:
        cache = _open(w, tmp_path / "cache", capacity_bytes=capacity)
        try:
            assert _on_every_rank(w, _store_rows, cache.cache_id, [(0, 2)])[0] == [True]
            outcome = _on_every_rank(w, _store_refused, cache.cache_id, 5, 1000)
            assert outcome[0] == "CapacityError", outcome
            sides = _on_every_rank(w, _side, cache.cache_id)
            for r, s in sides.items():  # only the first store's record; no staged copy
                assert (s["records"], s["staged"], s["problems"]) == (1, 0, []), (r, s)
            lease = _on_rank0(w, _lookup, cache.cache_id, [(5, 2), (6, 1000)])
            assert lease.pages == (0, 0)  # the good row of the refused batch is not stored
            _on_rank0(w, _release, cache.cache_id, lease)
            assert cache.check() == []
        finally:
            cache.close()


def test_the_rank_api_refuses_misuse_by_name(tmp_path: Path) -> None:
    with Worker(ranks=2) as w:
        cache = _open(w, tmp_path / "cache")
        try:
            def peer_lookup(cid: str) -> str:
                try:
                    rank_cache(cid).lookup_many([_tokens(0, 1)])
                except Exception as exc:  # noqa: BLE001  the message is the assertion
                    return str(exc)
                return ""

            msg = w.run(lambda o: o.submit(1, peer_lookup, cache.cache_id).result())
            assert "rank 1 is not rank 0" in msg, msg
            lease = _on_rank0(w, _lookup, cache.cache_id, [(0, 1)])
            _on_rank0(w, _release, cache.cache_id, lease)
            with pytest.raises(Exception, match="not outstanding"):
                _on_rank0(w, _release, cache.cache_id, lease)
        finally:
            cache.close()


def _held(cid: str, prefixes: list[tuple[int, int]]) -> list[int]:
    """Pages of each prefix this rank's own store holds (no pin, no lease)."""
    store = rank_cache(cid).store
    return [store.lookup(_tokens(i, p)) for i, p in prefixes]


def _record_bytes(w: Worker, d: Path, pages: int) -> int:
    """The size of one record of ``pages`` pages (header included), measured."""
    cache = _open(w, d)
    try:
        _on_every_rank(w, _store_rows, cache.cache_id, [(100, pages)])
        size: int = cache.stats()[0]["stats"]["bytes"]
    finally:
        cache.close()
    return size


def test_a_store_making_room_never_evicts_a_pinned_record(tmp_path: Path) -> None:
    pages = 4
    rows = [(i, pages) for i in range(5)]
    with Worker(ranks=RANKS) as w:
        size = _record_bytes(w, tmp_path / "probe", pages)
        cache = _open(w, tmp_path / "cache", capacity_bytes=size * 3 + size // 2)
        try:
            _on_every_rank(w, _store_rows, cache.cache_id, rows[:3])
            lease = _on_rank0(w, _lookup, cache.cache_id, rows[:1])  # row 0 pinned
            touch = _on_rank0(w, _lookup, cache.cache_id, rows[1:3])  # 0 is now the LRU
            _on_rank0(w, _release, cache.cache_id, touch)
            # row 3 needs room: the LRU leaf is pinned, so rank 0 evicts row 1 instead
            assert _on_every_rank(w, _store_rows, cache.cache_id, rows[3:4])[0] == [True]
            held = _on_every_rank(w, _held, cache.cache_id, rows[:4])
            assert held == {r: [pages, 0, pages, pages] for r in range(RANKS)}, held
            same = _on_every_rank(w, _load_and_compare, cache.cache_id, lease, rows[:1])
            assert same == {r: [True] for r in range(RANKS)}, same
            _on_rank0(w, _release, cache.cache_id, lease)
            touch = _on_rank0(w, _lookup, cache.cache_id, rows[2:4])  # 0 the LRU again
            _on_rank0(w, _release, cache.cache_id, touch)
            # released: row 0 is evictable again and goes first, on every rank
            assert _on_every_rank(w, _store_rows, cache.cache_id, rows[4:5])[0] == [True]
            held = _on_every_rank(w, _held, cache.cache_id, rows)
            assert held == {r: [0, 0, pages, pages, pages] for r in range(RANKS)}, held
            assert cache.check() == []
        finally:
            cache.close()


def test_a_peer_loads_what_a_lease_reports_once_it_applied_it(tmp_path: Path) -> None:
    """Replication runs behind the step: a lease taken right after rank 0 stored a row
    may reach a peer before the peer applied that store; its load_many waits for it
    (Lease.through), it does not fail NotCachedError. Peers apply an op in 2 s here."""
    rows = [(0, 2), (1, 3)]
    with Worker(ranks=RANKS) as w:
        cache = _open(w, tmp_path / "cache")
        try:
            w.arm_failpoint("cache.replica.apply", "delay:2", ranks=list(range(1, RANKS)))
            stored = _on_every_rank(w, _store_rows, cache.cache_id, rows, False)
            assert stored[0] == [True, True]
            lease = _on_rank0(w, _lookup, cache.cache_id, rows)
            assert lease.pages == (2, 3)
            lagging = _on_every_rank(w, _side, cache.cache_id)
            assert any(lagging[r]["records"] < 2 for r in range(1, RANKS)), lagging
            same = _on_every_rank(w, _load_and_compare, cache.cache_id, lease, rows)
            assert same == {r: [True, True] for r in range(RANKS)}, same
            _on_rank0(w, _release, cache.cache_id, lease)
            w.disarm_failpoints()
            assert cache.check() == []
        finally:
            cache.close()
