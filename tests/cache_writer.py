"""A cache writer process for the kill -9 trials (tests/test_cache_crash.py).

    python cache_writer.py DIR SEED N

Stores N prefixes (deterministic from SEED) with overlapping and suffix rows under a
small capacity, polling maintenance after each store, so a kill lands on any step:
write, rename, thin, evict, drop, purge. PHALANX_FAILPOINTS may arm a kill.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np

from cache_util import FP, GEOM, page_row
from phalanx.kvstore import DiskStore, StoreOptions
from phalanx.lifecycle import failpoints

CAPACITY = 48 * 1024
PT = GEOM.page_tokens


def prefixes(seed: int, n: int) -> list[np.ndarray]:
    """Prefixes sharing a few roots, so trials overlap and branch."""
    roots = np.random.default_rng(0).integers(0, 1000, (6, 3 * PT))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        extra = rng.integers(0, 1000, PT * int(rng.integers(1, 6)))
        out.append(np.concatenate([roots[rng.integers(0, len(roots))], extra]))
    return out


def main(directory: str, seed: int, n: int) -> None:
    failpoints.arm_from_env()
    rng = np.random.default_rng(seed + 1)
    opts = StoreOptions(capacity_bytes=CAPACITY, progress=False, max_jobs_per_poll=4)
    with DiskStore(directory, GEOM, FP, opts) as store:
        print("ready", flush=True)
        for toks in prefixes(seed, n):
            cached = store.lookup(toks)
            start = 0 if rng.random() < 0.5 else min(cached, len(toks) // PT - 1)
            store.store(toks, page_row(toks[start * PT : len(toks) // PT * PT]))
            store.poll()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
