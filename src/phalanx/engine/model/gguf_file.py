"""One GGUF file (llama.cpp's format), opened with the ``gguf`` package, llama.cpp's own reader.

The reader memory-maps the file: a tensor's bytes are read when a rank slices them, so a
rank touches only its own rows. This module owns what is format, not model: opening with
clear errors (a truncated or foreign file names the path and what is wrong), typed
metadata reads, the tensor table and which tensor types are readable, and the digest of
the tensor data that keys the prefix cache (a changed file never hits an old cache).
What the tensors and keys mean for the decoder is in :mod:`.gguf_model`.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import GGUFReader

from .._errors import CheckpointError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DEQUANTIZED", "KEPT_QUANTIZED", "GGUFFile", "GGUFTensor", "forget_gguf_files",
           "is_gguf", "open_gguf"]

_MAGIC = b"GGUF"
# Types held as int4 planes in memory on the quantized path (engine/model/quant.py);
# every other readable type is dequantized at load (named at start: gguf_model).
KEPT_QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Types the gguf package's numpy dequantizer reads exactly; anything else is refused at
# open, naming the tensor and its type.
DEQUANTIZED = ("F32", "F16", "BF16", "Q2_K", "Q3_K", "Q8_K")
READABLE = KEPT_QUANTIZED + DEQUANTIZED


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic (the suffix is not trusted)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as fh:
        return fh.read(4) == _MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    """The file at ``path``, parsed once per process while unchanged: the reader decodes
    every metadata string (a 49k-token vocabulary: 2-4 s), and one start reads the file
    for its config, its tokenizer, its digest and its tensors."""
    p = Path(path).resolve()
    st = p.stat()
    return _open_cached(p, st.st_size, st.st_mtime_ns, st.st_ino)


def forget_gguf_files() -> None:
    """Drop the parsed files :func:`open_gguf` keeps (each holds its file's memory map
    and so a descriptor); the next open parses again."""
    _open_cached.cache_clear()


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, size: int, mtime_ns: int, inode: int) -> GGUFFile:
    return GGUFFile(path)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, in PyTorch's order: ``shape`` is [rows, cols] (GGUF lists
    dims innermost first); ``data`` is the memory-mapped bytes, one row per output row
    for block-quantized types."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.qtype not in ("F32", "F16", "BF16")


class GGUFFile:
    """The metadata and tensor table of one ``.gguf`` file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not is_gguf(self.path):
            raise CheckpointError(f"{self.path}: not a GGUF file (no GGUF magic at its start)")

        try:
            self._reader = GGUFReader(str(self.path), "r")
        except (ValueError, IndexError, OSError, KeyError) as exc:
            # the reader raises on a file cut short (a tensor or a key beyond its end)
            raise CheckpointError(
                f"{self.path}: cannot read this GGUF file ({type(exc).__name__}: {exc}); "
                f"is it truncated? size {os.path.getsize(self.path)} bytes - download it "
                f"again") from exc
        self.tensors: dict[str, GGUFTensor] = {}
        for t in self._reader.tensors:
            qtype = t.tensor_type.name
            if qtype not in READABLE:
                raise CheckpointError(f"{self.path}: tensor {t.name} has type {qtype}, which "
                                      f"this engine cannot read (readable: "
                                      f"{', '.join(READABLE)})")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, qtype, shape, t.data)
        end = max((t.data_offset + t.n_bytes for t in self._reader.tensors), default=0)
        if end > os.path.getsize(self.path):
            raise CheckpointError(f"{self.path}: its tensors end at byte {end} but the file "
                                  f"has {os.path.getsize(self.path)}: truncated - download "
                                  f"it again")
        self._data_start = min((int(t.data_offset) for t in self._reader.tensors),
                               default=end)
        self._data_end = end
        self._digest: str | None = None

    # -- metadata ----------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """The decoded value of ``key`` (str, number, bool or list), or ``default``."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.path}: metadata key {key} cannot be decoded "
                                  f"({exc})") from exc

    def need(self, key: str) -> Any:
        """The value of a key the model cannot do without."""
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: the GGUF metadata lacks {key}; the file "
                                  f"was not written for a model this engine runs")
        return value

    def keys(self) -> Iterator[str]:
        return iter(self._reader.fields)

    # -- identity ----------------------------------------------------------------------
    def data_digest(self) -> str:
        """blake2b of every tensor byte (not the metadata: a re-labelled file keeps its
        cache, a changed weight never does). Read at about 1 GB/s, once per file."""
        if self._digest is not None:
            return self._digest
        h = hashlib.blake2b(digest_size=16)
        with self.path.open("rb") as fh:
            fh.seek(self._data_start)
            left = self._data_end - self._data_start
            while left > 0:
                chunk = fh.read(min(left, 8 << 20))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
        self._digest = h.hexdigest()
        return self._digest
