"""``StoreOptions``: the tuning knobs of one ``DiskStore``, as one frozen value.

What a store *is* (its directory, geometry and model fingerprint) is passed to
``DiskStore`` positionally; how it behaves is this object, so a caller that opens
stores in several places (a rank, a benchmark, a test helper) builds it once and every
knob keeps its documented default. ``dataclasses.replace(options, fsync=True)``
derives a variant. The test hooks (a clock, a job observer) are not options: they are
``DiskStore``'s keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BadFilePolicy", "StoreOptions"]

BadFilePolicy = Literal["quarantine", "delete"]


@dataclass(frozen=True)
class StoreOptions:
    """How one store behaves; every field but ``capacity_bytes`` has a default.

    ``capacity_bytes`` bounds the bytes of record files (headers included).
    ``max_age`` (seconds, None for never) bounds a leaf record's age.
    ``fsync=True`` makes every commit durable (off by default: a cache can lose its
    newest records on power loss, and the page CRCs catch torn ones).
    ``max_jobs_per_poll`` bounds one ``poll()`` burst of maintenance.
    ``bad_files``: a file that fails its header is moved aside (``"quarantine"``, into
    ``.quarantine/``) or deleted.
    ``io_threads`` (default min(4, CPUs + 1)) threads read one large load in parallel
    parts, a ``load_many`` batch at once, write a ``store_many`` batch at once, and
    hash a lone large row while it is written.
    ``map_reads`` (default on): rows of 2 MiB and more loaded into a buffer that is not
    64-byte aligned are copied from a mapping of the file when all of it is in the page
    cache (twice preadv's speed into such a buffer here; see buffers.py); off, every
    read is preadv.
    ``open_files`` (default: a quarter of the descriptor limit, at most 4096) record
    files stay open between loads, least recently used out (see open_files.py); 0
    opens and closes a file per read.
    ``io_uring`` (default off): a ``load_many`` batch is read through io_uring where
    the kernel offers it, the machine is x86-64 and there is a worker thread
    (``io_threads`` of 2 or more; see uring.py); elsewhere, on the threads (on another
    architecture with a logged warning: the ring's indices are read without memory
    barriers, which only x86-64's ordering makes safe).
    ``progress``: recovery logs its progress on a large directory.
    """

    capacity_bytes: int
    max_age: float | None = None
    fsync: bool = False
    max_jobs_per_poll: int = 32
    bad_files: BadFilePolicy = "quarantine"
    io_threads: int | None = None
    map_reads: bool = True
    open_files: int | None = None
    io_uring: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.max_jobs_per_poll <= 0:
            raise ValueError(
                f"StoreOptions: capacity_bytes ({self.capacity_bytes}) and "
                f"max_jobs_per_poll ({self.max_jobs_per_poll}) must be positive")
        if self.max_age is not None and not self.max_age > 0:  # NaN too: never expires
            raise ValueError(
                f"StoreOptions: max_age must be positive seconds, or None for never, not "
                f"{self.max_age} (0 or less would expire every leaf at the next poll)")
        if self.open_files is not None and self.open_files < 0:
            raise ValueError(
                f"StoreOptions: open_files must be 0 (none kept) or more, not {self.open_files}")
        if self.io_threads is not None and self.io_threads < 1:
            raise ValueError(
                f"StoreOptions: io_threads must be 1 (the caller's alone) or more, "
                f"not {self.io_threads}")
        if self.bad_files not in ("quarantine", "delete"):
            raise ValueError(
                f"StoreOptions: bad_files must be 'quarantine' or 'delete', "
                f"not {self.bad_files!r}")
