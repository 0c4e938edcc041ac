"""Rows in and out as flat byte views, with no copy where the caller's object allows.

Anything with the buffer protocol (bytes, bytearray, numpy arrays, mmap) is viewed as
is. torch is imported only when a tensor is passed: the cache layer never needs it.
"""

from __future__ import annotations

from typing import Any

from ._errors import RowSpanError

__all__ = ["as_byte_view"]


def as_byte_view(row: Any) -> memoryview:
    """A 1-D unsigned-byte view of ``row`` (C-contiguous buffer or CPU/GPU tensor)."""
    try:
        view = memoryview(row)
    except TypeError:
        if not type(row).__module__.startswith("torch"):
            raise RowSpanError(
                f"a row must be a buffer (bytes, bytearray, numpy array) or a torch tensor, "
                f"got {type(row).__name__}"
            ) from None
        view = _tensor_view(row)
    if not view.c_contiguous:
        raise RowSpanError("a row must be C-contiguous; pass arr.copy() or tensor.contiguous()")
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B")


def _tensor_view(tensor: Any) -> memoryview:
    import torch  # lazily: only callers that pass tensors pay for torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # a device row must come to the host to be written; one copy
    t = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(t.numpy())
