"""Communication domains: windows, put/get, collectives, lifetimes, shared vs owned."""

from __future__ import annotations

import os

import numpy as np
import pytest

import phalanx
from phalanx.comm import DomainError, DomainReleasedError, DomainSpecError, DomainView


def producer(d: DomainView, payload: bytes) -> None:
    d.put(1, 64, payload)  # into the consumer's "data" buffer
    d.barrier()


def consumer(d: DomainView) -> bytes:
    d.barrier()
    return bytes(d.buffer("data")[: 1 << 12])


def test_issue_example_producer_consumer() -> None:
    payload = os.urandom(1 << 12)

    def orch(o: phalanx.Orchestrator) -> bytes:
        d = o.allocate_domain("pair", ranks=[0, 2], window_size=1 << 20,
                              buffers=[("flags", 64), ("data", 65536)])
        p = o.submit(0, producer, d, payload)
        c = o.submit(2, consumer, d)
        o.release_domain(d)  # logical now; physical when this run's fence retires
        p.result()
        return c.result()

    with phalanx.Worker(ranks=3) as w:
        assert w.run(orch) == payload
        assert w.live_domains == []


def _exchange(d: DomainView, seed: int, nbytes: int) -> dict[str, object]:
    rng = np.random.default_rng(seed + d.domain_rank)
    mine = rng.integers(0, 256, nbytes, dtype=np.uint8)
    d.array()[:nbytes] = mine
    d.barrier()
    nxt = (d.domain_rank + 1) % d.domain_size
    theirs = d.get(nxt, 0, nbytes)
    d.barrier()
    d.put(nxt, nbytes, mine[:100])  # write into the next member's window
    d.barrier()
    back = bytes(d.array()[nbytes:nbytes + 100])
    ints = np.arange(1000, dtype=np.int64) * (d.domain_rank + 1)
    d.allreduce(ints)
    big = np.full(300_000, d.domain_rank, dtype=np.float64)  # > scratch: chunked
    d.allreduce(big, op="max")
    gathered = d.allgather(np.array([d.domain_rank, seed], dtype=np.int32))
    b = rng.integers(0, 1 << 30, 200_000, dtype=np.int64) if d.domain_rank == 0 else \
        np.zeros(200_000, dtype=np.int64)
    d.broadcast(b, root=0)
    peer = bytes(d.peer_window(nxt)[:nbytes])
    return {"theirs": theirs, "peer": peer, "back": back, "ints": ints.tolist()[:3],
            "big": float(big.max()), "gathered": gathered.tolist(), "bcast": b[:4].tolist(),
            "bsum": int(b.sum())}


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_put_get_and_collectives_byte_for_byte(ranks: int) -> None:
    nbytes = 50_000

    def orch(o: phalanx.Orchestrator) -> list[dict[str, object]]:
        members = list(reversed(o.ranks))  # order defines domain_rank
        d = o.allocate_domain("x", ranks=members, window_size=1 << 20, scratch_size=1 << 16)
        futures = {r: o.submit(r, _exchange, d, 7, nbytes) for r in members}
        return [futures[r].result() for r in members]

    with phalanx.Worker(ranks=ranks) as w:
        out = w.run(orch)
    expect = [np.random.default_rng(7 + i).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
              for i in range(ranks)]
    for i, got in enumerate(out):
        nxt = (i + 1) % ranks
        prev = (i - 1) % ranks
        assert got["theirs"] == expect[nxt] and got["peer"] == expect[nxt]
        assert got["back"] == expect[prev][:100]
        total = sum(range(1, ranks + 1))
        assert got["ints"] == [0, total, 2 * total]
        assert got["big"] == ranks - 1
        assert got["gathered"] == [[r, 7] for r in range(ranks)]
        assert got["bcast"] == out[0]["bcast"] and got["bsum"] == out[0]["bsum"]


def _barrier_n(d: DomainView, n: int) -> int:
    for _ in range(n):
        d.barrier()
    return d.domain_rank


def test_overlapping_and_interleaved_domains() -> None:
    def orch(o: phalanx.Orchestrator) -> list[int]:
        a = o.allocate_domain("a", ranks=[0, 1, 2])
        b = o.allocate_domain("b", ranks=[1, 2, 3])
        fa = [o.submit(r, _barrier_n, a, 200) for r in (0, 1, 2)]
        fb = [o.submit(r, _barrier_n, b, 200) for r in (1, 2, 3)]
        o.release_domain(a)
        return [f.result() for f in fa + fb]

    def other(o: phalanx.Orchestrator) -> list[int]:
        c = o.allocate_domain("c", ranks=[3, 0])
        return [f.result() for f in [o.submit(r, _barrier_n, c, 300) for r in (3, 0)]]

    with phalanx.Worker(ranks=4) as w:
        first, second = w.submit(orch), w.submit(other)
        assert first.result(60) == [0, 1, 2, 0, 1, 2]
        assert second.result(60) == [0, 1]
        assert w.live_domains == []


def test_releasing_one_domain_never_disturbs_another() -> None:
    def long_lived(o: phalanx.Orchestrator) -> list[int]:
        b = o.allocate_domain("b", ranks=[0, 1])
        fs = [o.submit(r, _barrier_n, b, 3000) for r in (0, 1)]
        return [f.result() for f in fs]

    def churn(o: phalanx.Orchestrator) -> None:
        o.release_domain(o.allocate_domain("a", ranks=[0, 1], window_size=4096))

    with phalanx.Worker(ranks=2) as w:
        h = w.submit(long_lived)
        for _ in range(30):
            w.run(churn)
        assert h.result(60) == [0, 1]


def _window_sum(d: DomainView) -> int:
    total = int(d.array().sum())
    d.array()[:] = 255
    return total


def test_windows_are_zeroed_names_unique_ids_never_reused() -> None:
    ids = []

    def orch(o: phalanx.Orchestrator) -> list[int]:
        d = o.allocate_domain("w", ranks=[0, 1], window_size=1 << 16)
        ids.append(d.alloc_id)
        with pytest.raises(DomainSpecError, match="in use"):
            o.allocate_domain("w", ranks=[1])
        return [o.submit(r, _window_sum, d).result() for r in (0, 1)]

    with phalanx.Worker(ranks=2) as w:
        for _ in range(3):
            assert w.run(orch) == [0, 0]  # the last run's 255s are never seen
    assert len(set(ids)) == 3


def test_orch_that_raises_or_forgets_still_releases() -> None:
    def forget(o: phalanx.Orchestrator) -> None:
        o.allocate_domain("f1", ranks=[0, 1])
        o.allocate_domain("f2", ranks=[1])

    def raises(o: phalanx.Orchestrator) -> None:
        o.allocate_domain("r1", ranks=[0])
        raise RuntimeError("orch failed")

    with phalanx.Worker(ranks=2) as w:
        w.run(forget)
        with pytest.raises(RuntimeError, match="orch failed"):
            w.run(raises)
        assert w.live_domains == []
        assert w.resources()["parent"]["owned"] == 0


def test_released_domain_cannot_reach_new_tasks_and_strangers_are_told() -> None:
    def orch(o: phalanx.Orchestrator) -> None:
        d = o.allocate_domain("r", ranks=[0])
        with pytest.raises(DomainError, match="rank 1 holds no view"):
            o.submit(1, _barrier_n, d, 1).result()
        o.release_domain(d)
        o.release_domain(d)  # idempotent
        with pytest.raises(DomainReleasedError):
            o.submit(0, _barrier_n, d, 1)

    with phalanx.Worker(ranks=2) as w:
        w.run(orch)


def _shm_of(gen: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"phx-{gen}-"))


def test_no_shm_name_outlives_allocation_and_shared_stays_constant() -> None:
    def orch(o: phalanx.Orchestrator, gen: str) -> list[str]:
        o.allocate_domain("s", ranks=[0, 1], window_size=1 << 20)
        return _shm_of(gen)

    with phalanx.Worker(ranks=2) as w:
        assert w.run(orch, w.generation) == []  # unlinked as soon as every member mapped
        shared = [w.resources()["ranks"][r]["stats"]["shared"] for r in (0, 1)]
        for _ in range(50):
            w.run(orch, w.generation)
        res = w.resources()
        assert [res["ranks"][r]["stats"]["shared"] for r in (0, 1)] == shared == [2, 2]
        assert [res["ranks"][r]["stats"]["owned"] for r in (0, 1)] == [0, 0]
        assert res["parent"] == {"owned": 0, "shared": 1, "by_state": {"live": 1},
                                 "uncertain": []}


def test_base_communicator_over_marker_backend(tmp_path: object) -> None:
    with phalanx.Worker(ranks=3, rendezvous="marker", runtime_dir=str(tmp_path)) as w:
        def orch(o: phalanx.Orchestrator) -> list[int]:
            d = o.allocate_domain("m", ranks=[0, 1, 2])
            return [f.result() for f in [o.submit(r, _barrier_n, d, 10) for r in (0, 1, 2)]]

        assert w.run(orch) == [0, 1, 2]
