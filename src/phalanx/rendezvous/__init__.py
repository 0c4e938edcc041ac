"""The rendezvous layer: generations, the runtime directory, sweeps, handshakes.

It knows nothing about domains or the cache.
"""

from ._errors import (
    HandshakeAbortedError,
    HandshakeError,
    HandshakeTimeoutError,
    RendezvousError,
    TokenMismatchError,
    UnsafeRuntimeDirError,
)
from .current import handshake, live_markers
from .generation import Generation
from .handshake import HubCoordinator, MarkerBackend
from .paths import default_runtime_dir, ensure_private_dir
from .store_backend import StoreBackend
from .sweep import SweepReport, list_generations, sweep

BACKENDS = ("hub", "marker", "store")

__all__ = [
    "BACKENDS",
    "Generation",
    "HandshakeAbortedError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "HubCoordinator",
    "MarkerBackend",
    "RendezvousError",
    "StoreBackend",
    "SweepReport",
    "TokenMismatchError",
    "UnsafeRuntimeDirError",
    "default_runtime_dir",
    "ensure_private_dir",
    "handshake",
    "list_generations",
    "live_markers",
    "sweep",
]
