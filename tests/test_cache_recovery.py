"""Recovered directories that need maintenance at start: 3,500 records in a linear
chain and 10,000 in a branchy tree, reopened after max_age, with a tenth of their
size as capacity, and written without compaction. Recovery finds every record;
maintenance works through them in many polls, each bounded; the end state is exactly
what policy says."""

from __future__ import annotations

import heapq
import os
import shutil
from pathlib import Path

import pytest

from cache_util import FP, GEOM, Built, Clock, Stores, build_tree, page_row, record_files, stores
from phalanx.kvstore import DiskStore, Job, StoreOptions

__all__ = ["stores"]

TREES = {"chain": (3500, False), "branchy": (10_000, True)}
BURST = 64
MAX_AGE = 3600.0


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Built]]:
    """Per tree, a directory of suffix rows and one of overlapping rows, never polled."""
    out: dict[str, tuple[Path, Built]] = {}
    for name, (n, branchy) in TREES.items():
        for rows in ("suffix", "overlap"):
            d = tmp_path_factory.mktemp(f"{name}-{rows}")
            s = DiskStore(d, GEOM, FP, StoreOptions(capacity_bytes=1 << 34, progress=False),
                          clock=Clock())
            try:
                built = build_tree(s, n, branchy=branchy, full_rows=rows == "overlap",
                                   seed=n, max_span=16)
            finally:
                s.close()
            out[f"{name}-{rows}"] = (d, built)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _drain(store: DiskStore, jobs: list[Job]) -> int:
    """Poll until maintenance is through; every poll does at most BURST jobs."""
    polls = 0
    while True:
        before = len(jobs)
        done = store.poll(BURST)
        assert len(jobs) - before == done <= BURST
        polls += 1
        if done == 0:
            return polls
        if polls % 20 == 0:
            assert store.check() == []


def _open(stores: Stores, d: Path, jobs: list[Job], **kw: object) -> DiskStore:
    return stores.open(d, on_job=jobs.append, max_jobs_per_poll=BURST, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("tree", list(TREES))
def test_reopened_after_max_age_expires_everything(
    tree: str, written: dict[str, tuple[Path, Built]], stores: Stores, tmp_path: Path
) -> None:
    src, built = written[f"{tree}-suffix"]
    d = _copy(src, tmp_path / "c")
    clock = Clock(Clock().t + MAX_AGE + 10 * len(built.parent))
    jobs: list[Job] = []
    s = _open(stores, d, jobs, max_age=MAX_AGE, clock=clock)
    assert s.statistics().recovered == len(built.parent)
    polls = _drain(s, jobs)
    assert polls > len(built.parent) // BURST  # many bounded polls, not one burst
    st = s.statistics()
    assert st.expirations == len(built.parent) and st.records == 0 and st.bytes == 0
    assert record_files(d) == [] and s.check() == []


@pytest.mark.slow
@pytest.mark.parametrize("tree", list(TREES))
def test_reopened_with_a_tenth_of_the_capacity_evicts_oldest_leaves(
    tree: str, written: dict[str, tuple[Path, Built]], stores: Stores, tmp_path: Path
) -> None:
    src, built = written[f"{tree}-suffix"]
    d = _copy(src, tmp_path / "c")
    sizes = [os.path.getsize(d / f"{k.hex()}.kv") for k in built.keys]
    cap = sum(sizes) // 10
    # policy, computed independently: evict the oldest leaf record until under the cap
    kids = {i: 0 for i in range(len(sizes))}
    for p in built.parent:
        if p >= 0:
            kids[p] += 1
    leaves = [i for i, c in kids.items() if c == 0]
    heapq.heapify(leaves)
    total, gone = sum(sizes), set()
    while total > cap:
        i = heapq.heappop(leaves)
        gone.add(i)
        total -= sizes[i]
        p = built.parent[i]
        if p >= 0:
            kids[p] -= 1
            if kids[p] == 0:
                heapq.heappush(leaves, p)
    want = sorted(f"{built.keys[i].hex()}.kv" for i in range(len(sizes)) if i not in gone)

    jobs: list[Job] = []
    s = _open(stores, d, jobs, capacity_bytes=cap, clock=Clock())
    assert s.statistics().recovered == len(sizes)
    polls = _drain(s, jobs)
    assert polls > len(gone) // BURST
    assert record_files(d) == want
    st = s.statistics()
    assert st.bytes == total <= cap and st.evictions == len(gone)
    assert s.check() == []


@pytest.mark.slow
@pytest.mark.parametrize("tree", list(TREES))
def test_written_without_compaction_is_thinned_at_start(
    tree: str, written: dict[str, tuple[Path, Built]], stores: Stores, tmp_path: Path
) -> None:
    src, built = written[f"{tree}-overlap"]
    d = _copy(src, tmp_path / "c")
    kids = built.children()
    # a row is redundant iff a child's row starts where it starts (starts never
    # decrease down a path, so no deeper row can start earlier)
    want = {built.keys[i] for i in range(len(built.parent))
            if any(built.start[c] == built.start[i] for c in kids.get(i, []))}
    assert len(want) > len(built.parent) // 3
    jobs: list[Job] = []
    s = _open(stores, d, jobs, clock=Clock())
    st = s.statistics()
    assert st.recovered == len(built.parent) and st.maintenance_queued == len(want)
    polls = _drain(s, jobs)
    assert polls > len(want) // BURST
    assert {j.key for j in jobs} == want and all(j.kind.value == "thin" for j in jobs)
    st = s.statistics()
    assert st.rows_thinned == st.thinned_records == len(want) and st.records == len(built.keys)
    assert s.check() == []
    for toks in built.tokens[:: max(1, len(built.tokens) // 200)]:  # still served, exact
        n = len(toks) // GEOM.page_tokens
        assert s.lookup(toks) == n
        assert bytes(s.load(toks, n)) == page_row(toks)
