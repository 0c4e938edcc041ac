"""Helpers for the cache tests: a tiny geometry, deterministic rows, a settable clock,
tree builders, and a store factory that closes what it opened."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from phalanx.kvstore import DiskStore, Geometry, StoreOptions
from phalanx.kvstore.files import STAGING_DIR
from phalanx.kvstore.keys import KeyChain
from phalanx.lifecycle import failpoints

GEOM = Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=4)
PB = GEOM.page_bytes  # 64 bytes a page
FP = "test-model"


def page_row(token_pages: np.ndarray) -> bytes:
    """KV bytes of pages, a pure function of their tokens (so overlaps agree)."""
    pages = token_pages.reshape(-1, GEOM.page_tokens).astype(np.uint64)
    seed = pages.sum(axis=1) * 2654435761 + pages[:, 0]
    base = np.arange(PB, dtype=np.uint64)
    out = (seed[:, None] * 40503 + base[None, :] * 97) % 251
    return out.astype(np.uint8).tobytes()


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 0.001  # strictly increasing: creation order is unambiguous
        return self.t


@dataclass
class Built:
    """What a builder wrote: per record, its tokens, parent record (-1: root), span."""

    tokens: list[np.ndarray] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    def children(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parent):
            out.setdefault(p, []).append(i)
        return out


def build_tree(store: DiskStore, n: int, branchy: bool, full_rows: bool, seed: int = 0,
               max_new_pages: int = 2, max_span: int | None = None) -> Built:
    """n records; each extends a parent record by 1..max_new_pages pages.

    full_rows=True writes rows that overlap their ancestors (the layout the system we
    reproduce wrote): from the parent's row start while the span stays within
    ``max_span`` pages (None: always from page 0), else from the parent's end.
    full_rows=False writes only the new pages.
    """
    rng = np.random.default_rng(seed)
    built = Built()
    chains: list[KeyChain] = []
    pt = GEOM.page_tokens
    for i in range(n):
        parent = (int(rng.integers(-1, i)) if branchy else i - 1) if i else -1
        base = built.tokens[parent] if parent >= 0 else np.zeros(0, dtype=np.int64)
        new = rng.integers(0, 50_000, pt * int(rng.integers(1, max_new_pages + 1)))
        toks = np.concatenate([base, new])
        chain = chains[parent].extend(new) if parent >= 0 else store.chain(toks)
        start = len(base) // pt
        if full_rows:
            p_start = built.start[parent] if parent >= 0 else 0
            if max_span is None or len(toks) // pt - p_start <= max_span:
                start = p_start
        res = store.store(chain, page_row(toks[start * pt :]))
        assert res.stored
        built.tokens.append(toks)
        built.parent.append(parent)
        built.start.append(start)
        built.keys.append(res.key)
        chains.append(chain)
    return built


class Stores:
    """Opens stores; the ``stores`` fixture closes every one (the leak fixture checks fds)."""

    def __init__(self) -> None:
        self.opened: list[DiskStore] = []

    def open(self, directory: Path | str, **kw: Any) -> DiskStore:
        """A store of ``GEOM`` and ``FP``; ``kw`` are StoreOptions fields (capacity 1 GiB
        and no progress logging unless given) and DiskStore's hooks (clock, on_job)."""
        geometry, fingerprint = kw.pop("geometry", GEOM), kw.pop("fingerprint", FP)
        hooks = {k: kw.pop(k) for k in ("clock", "on_job") if k in kw}
        kw.setdefault("capacity_bytes", 1 << 30)
        kw.setdefault("progress", False)
        store = DiskStore(directory, geometry, fingerprint, StoreOptions(**kw), **hooks)
        self.opened.append(store)
        return store



@pytest.fixture
def stores() -> Iterator[Stores]:
    factory = Stores()
    yield factory
    for store in factory.opened:
        store.close()
    failpoints.disarm_all()


def record_files(directory: Path | str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".kv"))


def temp_files(directory: Path | str) -> list[str]:
    """Temp files in the directory and in its writers' staging slots."""
    found = [n for n in os.listdir(directory) if n.endswith(".tmp")]
    staging = Path(directory) / STAGING_DIR
    if staging.is_dir():
        found += [f"{STAGING_DIR}/{p.relative_to(staging)}" for p in staging.glob("*/*.tmp")]
    return sorted(found)
