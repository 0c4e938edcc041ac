"""The comm layer: communication domains with symmetric windows and collectives.

It knows nothing about HTTP or models.
"""

from ._errors import (
    BaseNotReadyError,
    CollectiveError,
    DomainAllocationError,
    DomainError,
    DomainReleasedError,
    DomainSpecError,
)
from .domain import Domain, DomainState, view_of
from .view import DomainView
from .worker import DomainOrchestrator, Worker

__all__ = [
    "BaseNotReadyError",
    "CollectiveError",
    "Domain",
    "DomainAllocationError",
    "DomainError",
    "DomainOrchestrator",
    "DomainReleasedError",
    "DomainSpecError",
    "DomainState",
    "DomainView",
    "Worker",
    "view_of",
]
