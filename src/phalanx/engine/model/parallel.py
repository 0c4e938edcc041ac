"""What a model shard needs of its tensor-parallel peers: :class:`TPComm`.

The layers call its collectives; the runner opens one :meth:`TPComm.step` scope per
engine step and :meth:`TPComm.close`\\ s it when the rank's runner closes. Every rank
calls the same collectives in the same order (the step plan decides them), so none
carries a tag. The implementations that talk to peers live with the ranks
(``engine/worker/tp.py``); :class:`SoloComm` (one rank) is here, so a model opens
without any of them.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

from .._errors import EngineError

if TYPE_CHECKING:
    import torch

__all__ = ["SoloComm", "TPComm"]


class TPComm(Protocol):
    """Collectives among the TP ranks. ``all_gather`` concatenates on dim 0."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor: ...

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes: ...

    def step(self) -> contextlib.AbstractContextManager[None]:
        """The scope of one engine step's collectives (a shared-memory domain maps its
        windows once per scope, not once per collective)."""
        ...

    def close(self) -> None:
        """Refuse further collectives and let go of what maps the peers (idempotent)."""
        ...


class SoloComm:
    """TP size 1: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        if data is None:
            raise EngineError("SoloComm.broadcast_bytes: the root (rank 0) must pass data")
        return data

    def step(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
