"""Errors of the comm layer (drawn in :mod:`phalanx.errors`).

    PhalanxError
    └── DomainError
        ├── DomainSpecError         a bad name, member list, size or buffer layout
        ├── DomainAllocationError   allocation failed on some ranks; every rank rolled back
        ├── DomainReleasedError     a released (revoked) domain was used
        ├── BaseNotReadyError       a domain step ran on a rank without the base communicator
        └── CollectiveError         a barrier or collective did not complete
"""

from __future__ import annotations

from phalanx.lifecycle import PhalanxError


class DomainError(PhalanxError):
    """Base of the comm layer's errors."""


class DomainSpecError(DomainError, ValueError):
    """The domain's specification is invalid; nothing was allocated."""


class DomainAllocationError(DomainError):
    """Allocation failed. ``failures`` maps rank -> the error that rank reported."""

    def __init__(self, message: str, failures: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.failures = failures


class DomainReleasedError(DomainError):
    """The domain was released; it can no longer be used."""


class BaseNotReadyError(DomainError):
    """A domain step ran on a rank whose base communicator is not initialised."""


class CollectiveError(DomainError, TimeoutError):
    """A barrier or collective did not complete before its deadline."""
