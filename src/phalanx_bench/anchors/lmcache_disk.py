"""The LMCache anchor: its ``fs_native`` disk path over given row sizes, run by the
cache-disk benchmark as a script with the LMCache venv's python (LMCache and its torch
live there, not in phalanx's venv; nothing imports this module).

    python lmcache_disk.py --dir DIR --cases 262144x1024,4194304x64 --reps 3

Prints one JSON line: {"rows": [{"row_bytes", "store_gbps", "load_gbps"}, ...]}.
Same rules as phalanx's side: buffered I/O, page cache not dropped, os.sync() untimed
before each timed phase (and, before the store, as much memory as it writes touched and
freed), buffers touched before timing, loads checked bit-exact.

Why internals: LMCache's public entry point is a vLLM KV connector that needs a running
vLLM engine and a model. Its disk tier alone is reached only through its distributed
L2 adapter layer: the private factory ``fs_native_l2_adapter._create_fs_native_l2_adapter``,
``TensorMemoryAllocator`` memory objects, ``ObjectKey`` and the adapter's task/event-fd
calls, as LMCache's own storage manager drives them. A release that moves these breaks
this file only. (Not named ``lmcache.py``: run as a script, its directory comes first on
``sys.path``, and ``import lmcache`` would find this file instead of the package.)
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class LMCacheAnchorError(Exception):
    """LMCache failed or did not finish a task. Not a PhalanxError: this script runs in
    the LMCache venv, where phalanx is not installed."""


def _wait(fd: int, done: Callable[[], bool], deadline_s: float = 600.0) -> None:
    from lmcache.v1.platform.event_notifier import consume_fd  # type: ignore[import-not-found]

    end = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > end:
            raise LMCacheAnchorError(f"LMCache did not complete within {deadline_s}s")
        r, _, _ = select.select([fd], [], [], 0.05)
        if r:
            consume_fd(fd)


def run_case(root: str, row_bytes: int, n: int, workers: int) -> tuple[float, float]:
    from lmcache.v1.distributed.api import ObjectKey  # type: ignore[import-not-found]
    from lmcache.v1.distributed.l2_adapters import (  # type: ignore[import-not-found]
        fs_native_l2_adapter as fsn,
    )
    from lmcache.v1.memory_allocators.tensor_memory_allocator import (  # type: ignore[import-not-found]
        TensorMemoryAllocator,
    )
    from lmcache.v1.memory_management import MemoryFormat  # type: ignore[import-not-found]

    ad = fsn._create_fs_native_l2_adapter(
        fsn.FSNativeL2AdapterConfig(base_path=root, num_workers=workers))
    total = n * row_bytes
    pool = torch.empty(2 * total + (64 << 20), dtype=torch.uint8)
    pool.fill_(0)  # touched, as a long-lived pool would be
    alloc = TensorMemoryAllocator(pool)
    shape = torch.Size([2, 1, row_bytes // 4096, 1024])  # bf16: row_bytes exactly
    keys = [ObjectKey(chunk_hash=i.to_bytes(16, "little"), model_name="bench", kv_rank=0)
            for i in range(n)]
    fmt = MemoryFormat.KV_2LTD
    src = [alloc.allocate(shape, torch.bfloat16, fmt) for _ in keys]
    dst = [alloc.allocate(shape, torch.bfloat16, fmt) for _ in keys]
    g = torch.Generator().manual_seed(n)
    for o in src:
        o.tensor.view(torch.int16).copy_(torch.randint(
            -32768, 32767, o.tensor.shape, generator=g, dtype=torch.int16))
    os.sync()
    # as the phalanx side does before its stores: memory this VM handed back to its
    # host faults back in slowly; touching as much as the store writes puts it back
    scratch = torch.ones(total + (64 << 20), dtype=torch.uint8)
    del scratch
    res: dict[Any, Any] = {}
    t0 = time.perf_counter()
    tid = ad.submit_store_task(keys, src)
    _wait(ad.get_store_event_fd(),
          lambda: tid in res or bool(res.update(ad.pop_completed_store_tasks())) or tid in res)
    t_store = time.perf_counter() - t0
    if not res[tid].is_successful():
        raise LMCacheAnchorError(f"LMCache store of {n} rows of {row_bytes} B failed: {res[tid]}")
    os.sync()
    box: list[Any] = []

    def loaded() -> bool:
        if not box:
            got = ad.query_load_result(tid2)
            if got is not None:
                box.append(got)
        return bool(box)

    t0 = time.perf_counter()
    tid2 = ad.submit_load_task(keys, dst)
    _wait(ad.get_load_event_fd(), loaded)
    t_load = time.perf_counter() - t0
    for s, d in zip(src, dst, strict=True):
        if not torch.equal(s.tensor.view(torch.int16), d.tensor.view(torch.int16)):
            raise LMCacheAnchorError(f"LMCache load of {row_bytes} B rows returned different bytes")
        s.ref_count_down()
        d.ref_count_down()
    ad.close()
    return t_store, t_load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--cases", required=True, help="ROWBYTESxN,...")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for case in a.cases.split(","):
        row_bytes, n = map(int, case.split("x"))
        ts, tl = [], []
        for r in range(a.reps):
            root = os.path.join(a.dir, f"fs_native_{row_bytes}_{r}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            s, ld = run_case(root, row_bytes, n, a.workers)
            ts.append(s)
            tl.append(ld)
            shutil.rmtree(root, ignore_errors=True)
        total = row_bytes * n
        rows.append({"row_bytes": row_bytes,
                     "store_gbps": total / statistics.median(ts) / 1e9,
                     "load_gbps": total / statistics.median(tl) / 1e9})
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
