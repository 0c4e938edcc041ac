"""Lifecycle layer: owners, failpoints, cleanup journals, the resource ledger.

It knows nothing about the layers above it.
"""

from ._errors import (
    CleanupError,
    FailpointError,
    PhalanxError,
    ResourceError,
    ResourceReleasedError,
    ResourceUncertainError,
)
from .failpoints import Failpoint
from .journal import CleanupJournal

__all__ = [
    "CleanupError",
    "CleanupJournal",
    "Failpoint",
    "FailpointError",
    "PhalanxError",
    "ResourceError",
    "ResourceReleasedError",
    "ResourceUncertainError",
]
