"""A load's destination in parts: the caller's memory for each page, not one block.

An engine keeps a page of KV as one block per layer, each in that layer's pool. Loading
a prefix into one buffer and then copying every page's layers into the pools passed
the bytes through memory twice; on the VMs here that copy was 1.1-1.8 ms of a 31-page
disk hit (3.9 MiB a rank, docs/design.md "Disk loads straight into the KV pages").
:class:`PageScatter` names the blocks instead: ``parts`` equal buffers per page, in the
record's byte order, and the store's reads fill them with one ``preadv`` per piece
(the kernel's scatter), its checksums computed over the parts of each page
(:func:`phalanx.kvstore.record.page_digest_parts`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ._errors import RowSpanError
from .buffers import as_out_view

__all__ = ["PageScatter", "preadv_full"]

# preadv takes at most this many buffers a call (Linux: 1024)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class PageScatter:
    """``len(buffers) / parts`` pages, each ``parts`` writable C-contiguous buffers of one
    size (page ``i`` is ``buffers[i * parts:(i + 1) * parts]``, in order)."""

    __slots__ = ("part_bytes", "parts", "views")

    def __init__(self, buffers: Sequence[Any], parts: int) -> None:
        if parts < 1 or not buffers or len(buffers) % parts:
            raise RowSpanError(f"a PageScatter needs whole pages of {parts} buffers each, got "
                               f"{len(buffers)} buffers")
        views = [as_out_view(b) for b in buffers]
        size = views[0].nbytes
        if any(v.nbytes != size for v in views):
            raise RowSpanError("a PageScatter's buffers must all be the same size (got "
                               f"{sorted({v.nbytes for v in views})} bytes)")
        self.parts = parts
        self.part_bytes = size
        self.views = views

    @property
    def nbytes(self) -> int:
        return len(self.views) * self.part_bytes

    @property
    def pages(self) -> int:
        return len(self.views) // self.parts

    def span(self, first: int, stop: int) -> PageScatter:
        """Pages ``[first, stop)`` of this one (no copy)."""
        sub = PageScatter.__new__(PageScatter)
        sub.parts, sub.part_bytes = self.parts, self.part_bytes
        sub.views = self.views[first * self.parts:stop * self.parts]
        return sub

    def page(self, i: int) -> list[memoryview]:
        return self.views[i * self.parts:(i + 1) * self.parts]


def preadv_full(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Fill ``views`` in order from ``fd`` at ``offset`` (preadv, IOV_MAX buffers a call,
    short reads resumed where they stopped)."""
    pending = list(views)
    i, at = 0, offset
    while i < len(pending):
        n = os.preadv(fd, pending[i:i + IOV_MAX], at)
        if n == 0:
            raise OSError(0, "file shorter than its header says")
        at += n
        while n and i < len(pending):  # past what was filled; a partly filled one's rest
            head = pending[i]
            if n >= head.nbytes:
                n -= head.nbytes
                i += 1
            else:
                pending[i] = head[n:]
                n = 0
