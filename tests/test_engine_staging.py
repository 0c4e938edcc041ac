"""A rank's page staging: the slab's slots, what a store reads, what is dropped.

The staging is the hand-over between a runner's steps and the disk tier's stores on one
rank (``phalanx.engine.disk.staging``); here it is driven the way those two drive it, in one
process: ``save`` as a step's ``PageSave``, ``row`` as a store.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phalanx.engine.disk.staging import PageStaging
from phalanx.errors import EngineError
from phalanx.kvstore import Geometry

GEOMETRY = Geometry(layers=1, kv_heads=1, head_dim=8, dtype="float32", page_tokens=4)
PAGE = GEOMETRY.page_bytes


def _pages(seed: int, n: int) -> tuple[list[bytes], torch.Tensor]:
    """``n`` page keys and their bytes, distinct per seed."""
    keys = [f"page-{seed}-{i}".encode() for i in range(n)]
    rng = np.random.default_rng(seed)
    return keys, torch.from_numpy(rng.integers(0, 256, (n, PAGE), dtype=np.uint8))


def _row(staging: PageStaging, keys: list[bytes], start: int = 0) -> np.ndarray:
    return np.asarray(staging.row(keys, start)).reshape(-1, PAGE)


def test_stored_pages_give_their_slots_to_the_next_steps() -> None:
    """A serving rank saves pages after every step and a store reads them soon after:
    the slab's touched part stays what is in flight, not its capacity, and every row a
    store reads is the bytes its step saved."""
    staging = PageStaging(GEOMETRY, rank=0, capacity=64)
    for step in range(40):
        keys, data = _pages(step, 8)
        staging.save(keys, data)
        assert np.array_equal(_row(staging, keys), data.numpy())
    stats = staging.stats()
    assert stats["slots_touched"] == 8
    assert stats["saved"] == 320
    assert stats["dropped"] == 0


def test_a_stored_pages_slot_goes_to_the_next_page_saved() -> None:
    """Slots of pages a store read are reused before untouched ones (which keeps the
    slab's resident part small): a retry of a refused store from page 0 then misses
    them and says so (a later cache miss); the pages not yet read are all there."""
    staging = PageStaging(GEOMETRY, rank=0, capacity=32)
    first, data1 = _pages(1, 8)
    staging.save(first, data1)
    assert np.array_equal(_row(staging, first), data1.numpy())
    second, data2 = _pages(2, 8)
    staging.save(second, data2)
    with pytest.raises(EngineError, match="8 are not staged"):
        staging.row(first + second, 0)
    assert np.array_equal(_row(staging, first + second, 8), data2.numpy())
    assert staging.stats()["slots_touched"] == 8


def test_unread_pages_are_dropped_oldest_first_and_counted() -> None:
    """Pages no store came for: a full slab pushes out the oldest, counts them, and a
    store asking for them later gets an error naming how many were dropped."""
    staging = PageStaging(GEOMETRY, rank=3, capacity=8)
    old, _ = _pages(1, 6)
    staging.save(old, _pages(1, 6)[1])
    new, data = _pages(2, 6)
    staging.save(new, data)
    stats = staging.stats()
    assert (stats["dropped"], stats["staged"], stats["slots_touched"]) == (4, 8, 8)
    assert np.array_equal(_row(staging, new), data.numpy())
    with pytest.raises(EngineError, match=r"rank 3: .* \(4 dropped so far\)"):
        staging.row(old, 0)


def test_a_page_saved_again_keeps_its_slot() -> None:
    staging = PageStaging(GEOMETRY, rank=0, capacity=4)
    keys, data = _pages(1, 4)
    staging.save(keys, data)
    staging.save(keys[:2], data[:2])
    assert staging.stats()["dropped"] == 0
    assert np.array_equal(_row(staging, keys), data.numpy())


def test_a_staging_needs_a_slot() -> None:
    with pytest.raises(EngineError, match="capacity >= 1"):
        PageStaging(GEOMETRY, rank=0, capacity=0)


def test_pages_go_in_and_out_by_their_parts_as_by_rows() -> None:
    """A runner on the host hands its pages' own blocks (a PageScatter of one part per
    layer) where a device runner hands a uint8 tensor: saving and loading through the
    parts moves the same bytes as through rows, part j of a page being its j-th slice."""
    from phalanx.kvstore import PageScatter

    parts = 4
    keys, data = _pages(7, 3)
    pools = [torch.zeros(3, PAGE // parts, dtype=torch.uint8) for _ in range(parts)]
    for j, pool in enumerate(pools):   # page i, part j: bytes [j * size, (j + 1) * size)
        pool.copy_(data.view(3, parts, -1)[:, j])

    def scatter(of: list[torch.Tensor]) -> PageScatter:
        return PageScatter([pool[i] for i in range(3) for pool in of], parts)

    staging = PageStaging(GEOMETRY, rank=0, capacity=8)
    staging.save(keys, scatter(pools))
    assert np.array_equal(_row(staging, keys), data.numpy())
    # pages a load delivered: into a tensor and into parts alike
    staging.loaded(keys, memoryview(data.numpy()).cast("B"))
    rows = torch.zeros_like(data)
    staging.load(keys, rows)
    assert torch.equal(rows, data)
    staging.loaded(keys, memoryview(data.numpy()).cast("B"))
    back = [torch.zeros_like(pool) for pool in pools]
    staging.load(keys, scatter(back))
    assert all(torch.equal(b, p) for b, p in zip(back, pools, strict=True))
    with pytest.raises(EngineError, match="2 pages saved for 3 keys"):
        staging.save(keys, PageScatter([pool[i] for i in range(2) for pool in pools], parts))


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_an_idle_rank_gives_back_the_stored_pages_memory() -> None:
    """After a burst of prefills the slab held its high-water mark for the rank's life
    (16 pages, 46 MB of the real model). Released when idle, the stored pages' slots are
    free and their memory is the system's again; the pages no store has read yet stay,
    and a late retry of a stored page fails naming it."""
    big = Geometry(layers=4, kv_heads=4, head_dim=128, dtype="float32", page_tokens=256)
    staging = PageStaging(big, rank=0, capacity=64)
    rng = np.random.default_rng(7)
    waiting = [b"waiting"]
    data = torch.from_numpy(rng.integers(0, 256, (1, big.page_bytes), dtype=np.uint8))
    staging.save(waiting, data)
    stored = [f"stored-{i}".encode() for i in range(24)]
    staging.save(stored, torch.from_numpy(rng.integers(0, 256, (24, big.page_bytes),
                                                       dtype=np.uint8)))
    staging.row(stored, 0)
    resident = _resident_kib()
    assert staging.release_stored() == 24
    assert resident - _resident_kib() > 24 * big.page_bytes // 1024 * 3 // 4
    assert staging.stats()["slots_touched"] == 1    # the waiting page's, the first
    assert staging.release_stored() == 0            # nothing new: nothing to do
    assert np.array_equal(np.asarray(staging.row(waiting, 0)).reshape(1, -1), data.numpy())
    with pytest.raises(EngineError, match="24 are not staged"):
        staging.row(stored, 0)
    again, data2 = stored[:2], torch.ones((2, big.page_bytes), dtype=torch.uint8)
    staging.save(again, data2)   # freed slots are used again, lowest first
    assert np.array_equal(np.asarray(staging.row(again, 0)).reshape(2, -1), data2.numpy())
