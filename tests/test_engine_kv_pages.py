"""The page pool: exact page ids, ref counts, LRU eviction order, cache hits, invariants."""

from __future__ import annotations

import pytest

from phalanx.engine._errors import SchedulerError
from phalanx.engine.core.kv_pages import ROOT, PagePool
from phalanx.kvstore.keys import fingerprint_digest, page_keys

FP = fingerprint_digest("test-model")


def keys_of(tokens: list[int], pt: int = 4) -> list[bytes]:
    return page_keys(tokens, pt, FP)


def register_chain(pool: PagePool, pages: list[int], tokens: list[int], pt: int = 4) -> list[bool]:
    """Register ``pages`` as the chain of ``tokens``, as the scheduler does."""
    ks = keys_of(tokens, pt)
    return [pool.register(p, k, ks[i - 1] if i else ROOT, tokens[i * pt:(i + 1) * pt])
            for i, (p, k) in enumerate(zip(pages, ks, strict=False))]


def test_allocate_in_order_and_release_reverse() -> None:
    pool = PagePool(6, 4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.ref[:3] == [1, 1, 1] and pool.num_free == 3
    pool.release(a)
    # unkeyed pages go to the front, released tail first: 0 ends frontmost
    assert pool.free_order() == [0, 1, 2, 3, 4, 5]
    pool.check([])


def test_keyed_free_pages_stay_hits_until_evicted_lru() -> None:
    pool = PagePool(4, 4)
    toks = list(range(12))
    ks = keys_of(toks)
    pages = pool.allocate(3)
    assert all(register_chain(pool, pages, toks))
    pool.release(pages)                  # reverse: 2, 1, 0 go to the back in that order
    assert pool.free_order() == [3, 2, 1, 0]
    assert pool.match(ks) == [0, 1, 2]   # still cached while free
    pool.check([])
    # a fresh page comes from the front: the unkeyed 3, then the tail page 2 (evicted)
    assert pool.allocate(1) == [3]
    assert pool.counters.evictions == 0
    assert pool.allocate(1) == [2]
    assert pool.counters.evictions == 1 and pool.key[2] is None
    assert pool.match(ks) == [0, 1]      # the chain stops at the evicted page
    pool.check([[3], [2]])


def test_shared_prefix_ref_counts() -> None:
    pool = PagePool(8, 4)
    ks = keys_of(list(range(8)))
    first = pool.allocate(2)
    register_chain(pool, first, list(range(8)))
    hits = pool.match(ks)
    assert hits == first
    assert pool.can_allocate(6, hits) and not pool.can_allocate(7, hits)
    pool.acquire(hits)
    assert pool.ref[:2] == [2, 2]
    pool.release(first)
    assert pool.ref[:2] == [1, 1] and pool.num_free == 6
    pool.check([hits])
    pool.release(hits)
    # acquiring a free cached page takes it off the free list
    assert not pool.can_allocate(8, hits) and pool.can_allocate(6, hits)
    pool.acquire(hits)
    assert pool.num_free == 6
    pool.check([hits])


def test_duplicate_key_keeps_the_first_page() -> None:
    pool = PagePool(3, 4)
    k = keys_of([1, 2, 3, 4])[0]
    a, b = pool.allocate(2)
    assert pool.register(a, k, ROOT, [1, 2, 3, 4])
    assert not pool.register(b, k, ROOT, [1, 2, 3, 4])
    assert pool.key[b] is None and pool.match([k]) == [a]
    assert pool.register(a, k, ROOT, [1, 2, 3, 4])   # idempotent
    assert pool.match_tail(ROOT, [1, 2, 3]) == (a, 3)


def test_misuse_is_refused() -> None:
    pool = PagePool(2, 4)
    with pytest.raises(SchedulerError, match="3 pages asked, 2 free"):
        pool.allocate(3)
    with pytest.raises(SchedulerError, match="page 0 released with no reference"):
        pool.release([0])
    p = pool.allocate(1)
    with pytest.raises(SchedulerError, match="ref counts disagree"):
        pool.check([])
    pool.release(p)
    with pytest.raises(SchedulerError, match="needs pages"):
        PagePool(0, 4)


def test_keys_are_the_disk_chain() -> None:
    # the same tokens give the same keys in any process: a memory page and a disk record
    # of one prefix share a key (the chain is phalanx.kvstore.keys')
    toks = list(range(10, 26))
    assert keys_of(toks) == page_keys(toks, 4, fingerprint_digest("test-model"))
    assert keys_of(toks)[0] != page_keys(toks, 4, fingerprint_digest("other"))[0]


def test_reset_forgets_the_memory_tier_when_idle() -> None:
    pool = PagePool(4, 4)
    ks = keys_of(list(range(8)))
    pages = pool.allocate(2)
    register_chain(pool, pages, list(range(8)))
    assert not pool.reset()                  # pages in use
    pool.release(pages)
    assert pool.reset() and pool.match(ks) == [] and pool.num_cached == 0
    assert pool.match_tail(ROOT, [0, 1]) == (-1, 0)
    pool.check([])


def test_a_tail_is_found_by_its_longest_start_until_its_page_is_reused() -> None:
    pool = PagePool(4, 4)
    toks = [5, 6, 7, 8, 9, 10]              # a full page, then a partial one of 2 tokens
    first, tail = pool.allocate(2)
    register_chain(pool, [first], toks)
    parent = keys_of(toks)[0]
    pool.keep_tail(tail, parent, toks[4:])
    pool.release([first, tail])
    # a kept tail goes to the back like a keyed page: it is found while free
    assert pool.free_order() == [2, 3, tail, first]
    assert pool.match_tail(parent, [9, 10, 11]) == (tail, 2)
    assert pool.match_tail(parent, [9, 4]) == (tail, 1)
    assert pool.match_tail(parent, [4]) == (-1, 0)      # no common start
    assert pool.match_tail(ROOT, [5, 6, 9]) == (first, 2)   # a full page's start too
    assert pool.match_tail(keys_of([1, 2, 3, 4])[0], [9, 10]) == (-1, 0)  # another parent
    pool.check([])
    assert pool.allocate(3) == [2, 3, tail]             # reused: it holds nothing now
    assert pool.match_tail(parent, [9, 10]) == (-1, 0)
    pool.check([[2], [3], [tail]])
