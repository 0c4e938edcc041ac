"""Giving a rank's freed heap back to the system.

A rank runs with one malloc arena (``local.rank_env``), which keeps what a step freed
for the next step to reuse: that is what makes a step fault no pages in. The other side
of it: after one large step (a 512-token prefill chunk of the real model frees ~50 MB of
activations, scores and gathers) the heap stays at that high-water mark for the rank's
life, free but resident. Measured on the real model at TP 1 with a 384 MiB KV pool, the
rank's PSS went from 830 MB at ready to 960-990 MB after one 3,490-token prompt and 32
short ones, all of it freed chunks in the heap (docs/design.md, "The heap a rank
keeps").

So the rank gives its free heap pages back (glibc's ``malloc_trim``, which madvises away
every whole free page, not only the heap's top) at two moments when it costs no step
anything: once its weights are loaded (the file's parse and the load's staging are
gone), and when its step loop has waited a whole wait slice (0.1 s) for the next step
after running some: the engine is idle. Under load no slice passes empty (a decode step
follows the last within milliseconds), so a busy rank keeps its warm heap. The first
step after an idle spell faults in again what it needs: ~50 MB is ~13,000 pages, tens
of milliseconds on a prefill of seconds.

Where the C library has no ``malloc_trim`` (not glibc) this does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import psutil

__all__ = ["TRIMMER", "HeapTrimmer"]


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def _resident() -> int:
    return int(psutil.Process().memory_info().rss)


class HeapTrimmer:
    """The process's trims (see the module docstring): :meth:`trim` now, or once per
    idle spell that follows some work (:meth:`worked` after each step, :meth:`idle`
    whenever a wait slice passed empty)."""

    def __init__(self) -> None:
        self._dirty = False
        self.released = 0   # resident bytes given back, over the process's life

    def trim(self) -> None:
        if _TRIM is None:
            return
        before = _resident()
        _TRIM(0)
        self.released += max(0, before - _resident())

    def worked(self) -> None:
        self._dirty = True

    def idle(self) -> None:
        if self._dirty:
            self._dirty = False
            self.trim()


#: the heap is the process's: one trimmer for it
TRIMMER = HeapTrimmer()
