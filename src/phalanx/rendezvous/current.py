"""The handshake backend of this rank process, and the call tasks use.

A rank installs its backend once at start-up (from the Worker's rendezvous spec);
tasks and later layers then call :func:`handshake` without knowing which it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._errors import RendezvousError
from .handshake import Backend, HubBackend, MarkerBackend
from .store_backend import StoreBackend

__all__ = ["backend", "handshake", "install", "live_markers", "make_backend"]

DEFAULT_TIMEOUT_S = 60.0

_BACKEND: Backend | None = None
_RANK: int | None = None


def make_backend(spec: dict[str, Any], rank: int,
                 hub_request: Callable[[Any, float], Any] | None) -> Backend:
    """Build a backend from the spec the parent sent in INIT."""
    kind = spec["kind"]
    if kind == "marker":
        return MarkerBackend(Path(spec["dir"]))
    if kind == "store":
        return StoreBackend(spec["host"], int(spec.get("port", 0)), spec["token"],
                            spec["generation"], is_master=rank == 0,
                            timeout=float(spec.get("timeout", DEFAULT_TIMEOUT_S)))
    if kind == "hub":
        if hub_request is None:
            raise RendezvousError("the hub backend needs a parent to talk to")
        return HubBackend(hub_request)
    raise RendezvousError(f"unknown rendezvous backend {kind!r}: use hub, marker or store")


def install(b: Backend, rank: int) -> None:
    global _BACKEND, _RANK
    _BACKEND, _RANK = b, rank


def backend() -> Backend:
    if _BACKEND is None or _RANK is None:
        raise RendezvousError("no rendezvous backend here: handshakes run inside rank tasks")
    return _BACKEND


def handshake(tag: str, alloc_id: int, participants: Sequence[int],
              timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Meet every rank in ``participants`` (same list, same order on each) at ``tag``."""
    b = backend()
    assert _RANK is not None
    b.handshake(tag, alloc_id, participants, _RANK, timeout)


def live_markers() -> int:
    """Markers (files or keys) of this job's backend that exist right now."""
    return backend().live_markers()
