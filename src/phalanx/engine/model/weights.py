"""What the layers read weights through (:class:`WeightSource`) and what a rank's load
read (:class:`LoadReport`): one surface over a safetensors directory
(``checkpoint.py``) and a GGUF file (``gguf_model.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .quant import QuantTensor

__all__ = ["LoadReport", "ReadLedger", "WeightSource"]


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


class ReadLedger:
    """What one weight source's load has read so far, kept the same way for both sources
    (each holds one): the names read or deliberately skipped, the names asked for and
    absent, and the tensors and bytes read."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = frozenset(names)
        self._read: set[str] = set()
        self._missing: set[str] = set()
        self._tensors = 0
        self._bytes = 0

    def absent(self, name: str) -> None:
        """``name`` was asked for and the source lacks it."""
        self._missing.add(name)

    def took(self, name: str, nbytes: int) -> None:
        """``name`` was read: ``nbytes`` of it, as stored."""
        self._read.add(name)
        self._tensors += 1
        self._bytes += nbytes

    def skip(self, name: str) -> None:
        """Mark ``name`` as deliberately unread (a tied LM head stored anyway)."""
        if name in self._names:
            self._read.add(name)

    def report(self, ignored: Callable[[str], bool] = lambda name: False,
               unmapped: Iterable[str] = ()) -> LoadReport:
        """The load so far: every source name neither read nor ``ignored`` is
        unexpected, and so is each of the source's own ``unmapped`` names."""
        unexpected = [n for n in self._names if n not in self._read and not ignored(n)]
        return LoadReport(missing=sorted(self._missing),
                          unexpected=sorted([*unexpected, *unmapped]),
                          tensors=self._tensors, bytes_read=self._bytes)


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
