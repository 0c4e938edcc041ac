"""What the layers read weights through (:class:`WeightSource`) and what a rank's load
read (:class:`LoadReport`): one surface over a safetensors directory
(``checkpoint.py``) and a GGUF file (``gguf_model.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .quant import QuantTensor

__all__ = ["LoadReport", "WeightSource"]


@dataclass
class LoadReport:
    """What one rank's load read: tensors, bytes, and what did not match."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"missing": self.missing, "unexpected": self.unexpected,
                "tensors": self.tensors, "bytes_read": self.bytes_read}


class WeightSource(Protocol):
    """What the layers read weights through: a safetensors directory (``checkpoint.Checkpoint``)
    or a GGUF file (:class:`~phalanx.engine.model.gguf_model.GGUFCheckpoint`)."""

    dir: Path

    def __contains__(self, name: str) -> bool: ...
    def shape(self, name: str) -> list[int]: ...
    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor | None: ...
    def read_quantized(self, name: str, dim: int, start: int,
                       stop: int) -> QuantTensor | None: ...
    def skip(self, name: str) -> None: ...
    def report(self) -> LoadReport: ...
    def close(self) -> None: ...
