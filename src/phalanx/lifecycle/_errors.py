"""Errors of the lifecycle layer, and the root of phalanx's error tree.

Every error phalanx raises derives from :class:`PhalanxError`. Each layer adds its
own branch in its own ``_errors.py``; :mod:`phalanx.errors` re-exports the whole tree
and draws it.

    PhalanxError
    ├── FailpointError            a failpoint armed to raise was hit
    ├── CleanupError              one or more cleanup steps failed (an ExceptionGroup too)
    └── ResourceError
        ├── ResourceUncertainError  a release step failed; the resource is still owned
        └── ResourceReleasedError   use of a resource after its release began
"""

from __future__ import annotations


class PhalanxError(Exception):
    """Root of every error phalanx raises."""


class FailpointError(PhalanxError):
    """Raised by a failpoint armed with the ``raise`` action.

    ``point`` is the failpoint's name and ``rank`` the rank of the process that hit it
    (``None`` in the parent), so an error that crossed process boundaries still says
    where the fault was injected.
    """

    def __init__(self, point: str, rank: int | None) -> None:
        where = "the parent" if rank is None else f"rank {rank}"
        super().__init__(f"failpoint {point!r} fired in {where} (armed by a test or operator)")
        self.point = point
        self.rank = rank

    def __reduce__(self) -> tuple[type[FailpointError], tuple[str, int | None]]:
        return (type(self), (self.point, self.rank))


class CleanupError(PhalanxError, ExceptionGroup):
    """Some cleanup steps failed; every failure is in ``exceptions``.

    The steps that failed stay in their journal and a later ``close()`` retries them.
    """

    def __new__(cls, message: str, exceptions: list[Exception]) -> CleanupError:
        return super().__new__(cls, message, exceptions)

    def derive(self, excs: list[Exception]) -> CleanupError:  # type: ignore[override]
        return CleanupError(self.message, excs)


class ResourceError(PhalanxError):
    """Base of errors about one owned resource."""


class ResourceUncertainError(ResourceError):
    """A release step failed: the resource is *uncertain*, still owned and counted."""


class ResourceReleasedError(ResourceError):
    """A resource was used after its release began."""
