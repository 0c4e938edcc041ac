"""Collectives over shared memory: staged through each member's scratch area.

Each operation moves data in chunks of the scratch size: write my chunk to my scratch,
barrier, read what I need from peers' scratch, barrier (so scratch can be reused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import DomainError

if TYPE_CHECKING:
    from .view import DomainView

__all__ = ["allgather", "allreduce", "broadcast"]

_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def _flat(view: DomainView, arr: Any) -> np.ndarray:
    a = np.asarray(arr)
    if not a.flags.c_contiguous:
        raise DomainError(f"domain {view.name!r}: collectives need C-contiguous arrays")
    return a.reshape(-1).view(np.uint8)


def _scratch(view: DomainView, domain_rank: int) -> np.ndarray:
    return np.frombuffer(view._peer(domain_rank).scratch(), dtype=np.uint8)


def _chunks(view: DomainView, nbytes: int) -> range:
    return range(0, nbytes, view.spec.scratch_size)


def broadcast(view: DomainView, arr: Any, root: int = 0) -> Any:
    """Copy ``arr`` of domain rank ``root`` into ``arr`` of every member (in place)."""
    data = _flat(view, arr)
    if not data.flags.writeable:
        raise DomainError(f"domain {view.name!r}: broadcast writes into arr: pass a writable one")
    step = view.spec.scratch_size
    for start in _chunks(view, data.nbytes):
        n = min(step, data.nbytes - start)
        if view.domain_rank == root:
            _scratch(view, root)[:n] = data[start:start + n]
        view.barrier()
        if view.domain_rank != root:
            data[start:start + n] = _scratch(view, root)[:n]
        view.barrier()
    return arr


def allgather(view: DomainView, arr: Any) -> np.ndarray:
    """Every member's ``arr`` stacked in domain-rank order: shape (domain_size, *arr.shape)."""
    a = np.ascontiguousarray(arr)
    data = a.reshape(-1).view(np.uint8)
    out = np.empty((view.domain_size, data.nbytes), dtype=np.uint8)
    step = view.spec.scratch_size
    for start in _chunks(view, data.nbytes):
        n = min(step, data.nbytes - start)
        _scratch(view, view.domain_rank)[:n] = data[start:start + n]
        view.barrier()
        for r in range(view.domain_size):
            out[r, start:start + n] = _scratch(view, r)[:n]
        view.barrier()
    return out.view(a.dtype).reshape((view.domain_size, *a.shape))


def allreduce(view: DomainView, arr: Any, op: str = "sum") -> Any:
    """Reduce ``arr`` elementwise over every member with ``op``; result in place."""
    if op not in _OPS:
        raise DomainError(f"allreduce op {op!r}: choose one of {sorted(_OPS)}")
    a = np.asarray(arr)
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise DomainError(f"domain {view.name!r}: allreduce needs a writable C-contiguous array")
    flat = a.reshape(-1)
    item = flat.itemsize
    per = max(1, view.spec.scratch_size // item)
    ufunc = _OPS[op]
    for start in range(0, flat.size, per):
        n = min(per, flat.size - start)
        _scratch(view, view.domain_rank)[:n * item] = flat[start:start + n].view(np.uint8)
        view.barrier()
        acc = _scratch(view, 0)[:n * item].view(a.dtype).copy()
        for r in range(1, view.domain_size):
            ufunc(acc, _scratch(view, r)[:n * item].view(a.dtype), out=acc)
        view.barrier()
        flat[start:start + n] = acc
    return arr
