"""Reading a safetensors checkpoint one rank's slice at a time.

A checkpoint is ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
Files are opened with ``safetensors.safe_open`` (memory-mapped) and a rank reads only its
slice of each tensor through ``get_slice(name)[...]``, so a rank never materialises the
whole model. Every read is recorded; :meth:`Checkpoint.report` names the tensors the
model asked for that the files lack (missing) and those the files hold that nobody read
(unexpected), and counts the bytes this rank read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from .._errors import CheckpointError
from .gguf_file import is_gguf
from .gguf_model import GGUFCheckpoint
from .weights import LoadReport, ReadLedger, WeightSource

if TYPE_CHECKING:
    import torch

    from .quant import QuantTensor

__all__ = ["Checkpoint", "open_checkpoint", "weights_digest"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Tensors a checkpoint may carry that the decoder recomputes (rotary caches).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def open_checkpoint(path: str | Path) -> WeightSource:
    """The weights at ``path``: a GGUF file, else a safetensors model directory."""

    if is_gguf(path):
        return GGUFCheckpoint(path)
    return Checkpoint(path)


def _files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it."""
    index = model_dir / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        out = {str(k): model_dir / str(v) for k, v in weight_map.items()}
        for path in set(out.values()):
            if not path.is_file():
                raise CheckpointError(f"{index} names {path.name}, which is not in {model_dir}")
        return out
    single = model_dir / _SINGLE
    if not single.is_file():
        raise CheckpointError(f"{model_dir}: neither {_SINGLE} nor {_INDEX} (only "
                              f"safetensors checkpoints are read)")

    with safe_open(str(single), framework="pt") as f:
        return {str(k): single for k in f.keys()}  # noqa: SIM118 - safe_open has no iter


def weights_digest(model_dir: str | Path) -> str:
    """A digest of the weight files' headers and sizes, not of their gigabytes: part of
    the model fingerprint (a changed tensor changes a header's offsets or the size)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for path in sorted(set(_files(root).values())):
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(path.name.encode() + b"\0" + fh.read(min(n, 100 << 20)))
        h.update(str(os.path.getsize(path)).encode())
    return h.hexdigest()


class Checkpoint:
    """The tensors of one model directory, read by slices. Use as a context manager."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self._where = _files(self.dir)
        self._open: dict[Path, Any] = {}
        self._ledger = ReadLedger(self._where)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _handle(self, name: str) -> Any:
        path = self._where[name]
        handle = self._open.get(path)
        if handle is None:

            try:
                opened: Any = safe_open(str(path), framework="pt")
                handle = opened.__enter__()
            except Exception as exc:  # safetensors raises its own types; keep the path
                raise CheckpointError(f"{path}: cannot open ({exc})") from exc
            self._open[path] = handle
        return handle

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor | None:
        """Tensor ``name``, or only ``[start, stop)`` along ``dim``; None (and recorded as
        missing) when the checkpoint lacks it."""
        if name not in self._where:
            self._ledger.absent(name)
            return None
        sl = self._handle(name).get_slice(name)
        shape = list(sl.get_shape())
        if dim is None:
            t = sl[:]
        else:
            end = shape[dim] if stop is None else stop
            if not 0 <= start < end <= shape[dim]:
                raise CheckpointError(f"{self._where[name]}: {name} has shape {shape}; slice "
                                      f"[{start}, {end}) of dim {dim} is out of range")
            index = tuple([slice(None)] * dim + [slice(start, end)])
            t = sl[index]
        self._ledger.took(name, t.numel() * t.element_size())
        return t  # type: ignore[no-any-return]

    def read_quantized(self, name: str, dim: int, start: int,
                       stop: int) -> QuantTensor | None:
        """safetensors weights are never block-quantized: read them with :meth:`read`."""
        return None

    def skip(self, name: str) -> None:
        """Mark ``name`` as deliberately unread (a tied LM head stored anyway)."""
        self._ledger.skip(name)

    def report(self) -> LoadReport:
        """Missing and unexpected tensors of the load so far."""
        return self._ledger.report(ignored=lambda n: n.endswith(_IGNORED_SUFFIXES))
