"""Quantized weights on CPU: GGUF's Q4_0/Q4_1/Q8_0 blocks kept at 4 or 8 bits in memory.

Matmuls go through torch's packed-int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``:
groups of 32 along the input, ``w = (q - 8) * scale + zero`` per group and output row,
bfloat16 activations, scales, zeros and outputs: its float16 and float32 forms take
10-50x longer on CPU, measured). GGUF's formats map onto it exactly:

- Q4_0 (``w = d * (q - 8)``): scale ``d``, zero 0;
- Q4_1 (``w = d * q + m``): scale ``d``, zero ``m + 8 d``;
- Q8_0 (``w = d * q``, q in [-128, 127]) is split into two exact 4-bit planes,
  ``q = 16 hi + lo`` with lo in [0, 15]: plane hi (stored ``hi + 8``, scale ``16 d``,
  zero 0) plus plane lo (scale ``d``, zero ``8 d``). Both planes run as one matmul with
  twice the output rows, summed: 8 bits per weight, as Q8_0 holds them.

The model around these matmuls runs in float32 (the residual stream, norms, attention
and KV): only each matmul's input is rounded to bfloat16. The LM head's input is not
rounded either: it is split into two bfloat16 halves, ``x = hi + lo`` with
``lo = x - hi`` (exact to 2^-16 of x), run as one call with twice the rows and summed,
because the logits are where rounding costs most (issue 44: KL from the float32 model
0.00157 with a bfloat16 model, 0.00115 with a float32 one, 0.00071 with the head's
input split; docs/design.md). The head runs on one row per sequence at decode, so the
doubled rows cost nothing measurable there.

``aten._weight_int8pack_mm`` was not used for Q8_0: it takes one scale per output row,
and Q8_0 has one per 32 weights (requantizing per row loses what the file holds). The
scales and zeros are rounded to bfloat16 (the kernel's type): under 0.4% of a group's
step. docs/design.md ("Quantized weights on CPU") has the measurements.

Embedding rows (:class:`QuantRows`) are gathered still quantized and decoded per lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Int4Matmul", "QuantRows", "QuantTensor"]

_GROUP = 32
_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass
class QuantTensor:
    """Rows of one GGUF tensor still in their blocks: ``data`` uint8 [rows, bytes/row]."""

    qtype: str
    data: np.ndarray
    cols: int

    BLOCK: ClassVar[int] = _GROUP

    @staticmethod
    def block_bytes(qtype: str) -> int:
        return _BYTES[qtype]

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, scale, zero): q [rows, cols] (uint8 0..15 for Q4_*, int8 for Q8_0), scale and
        zero float32 [rows, cols / 32], with ``w = (q - 8) * scale + zero`` for Q4_* and
        ``w = q * scale`` for Q8_0."""

        blocks = np.ascontiguousarray(self.data).reshape(self.rows, -1, _BYTES[self.qtype])
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        if self.qtype == "Q8_0":
            q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(self.rows, -1)
            return q, d, torch.zeros_like(d)
        if self.qtype == "Q4_1":
            m = torch.from_numpy(
                blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
            qs = torch.from_numpy(blocks[..., 4:].copy())
            zero = m + 8 * d
        else:
            qs = torch.from_numpy(blocks[..., 2:].copy())
            zero = torch.zeros_like(d)
        # a block's first 16 weights are its bytes' low nibbles, the next 16 the high ones
        q = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(self.rows, -1)
        return q, d, zero


class Int4Matmul(torch.nn.Module):
    """``x W^T`` over int4-packed rows of one or more GGUF tensors (stacked as output rows:
    q/k/v or gate/up). All parts Q4_0/Q4_1, or all Q8_0 (two planes)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, parts: list[QuantTensor], exact_input: bool = False) -> None:
        super().__init__()
        # exact_input: split a float32 input into two bfloat16 halves (the LM head)
        self.exact_input = exact_input
        cols = {p.cols for p in parts}
        if len(cols) != 1 or not compatible(parts):
            raise ValueError("parts of one packed layer must share cols and kind")
        self.cols = cols.pop()
        self.out_features = sum(p.rows for p in parts)
        decoded = [p.decode() for p in parts]
        q = torch.cat([d[0] for d in decoded])
        scale = torch.cat([d[1] for d in decoded])
        zero = torch.cat([d[2] for d in decoded])
        self.planes = 2 if parts[0].qtype == "Q8_0" else 1
        if self.planes == 2:
            q8 = q.to(torch.int32)
            hi, lo = (q8 >> 4) + 8, q8 & 15      # q = 16 (hi - 8) + lo, exactly
            q = torch.cat((hi, lo))
            scale, zero = torch.cat((16 * scale, scale)), torch.cat((zero, 8 * scale))
        pad = -q.shape[0] % 16            # the kernel packs output rows by 16
        if pad:
            q = torch.cat((q, torch.full((pad, self.cols), 8, dtype=q.dtype)))
            scale = torch.cat((scale, torch.zeros(pad, scale.shape[1])))
            zero = torch.cat((zero, torch.zeros(pad, zero.shape[1])))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1))
        # [cols / 32, out rows, (scale, zero)], as the kernel takes them
        self.register_buffer("scales_zeros", torch.stack((scale, zero), dim=-1)
                             .transpose(0, 1).contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        hi = x.to(torch.bfloat16)
        rows = x.shape[0]
        if self.exact_input and dtype == torch.float32:
            lo = (x - hi.float()).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                torch.cat((hi, lo)), self.packed, _GROUP, self.scales_zeros).float()
            y = y[:rows] + y[rows:]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                hi.contiguous(), self.packed, _GROUP, self.scales_zeros)
        n = self.out_features
        if self.planes == 2:
            y = y[:, :n] + y[:, n:2 * n]
        elif y.shape[1] != n:
            y = y[:, :n]
        return y.to(dtype)  # type: ignore[no-any-return]


def compatible(parts: list[QuantTensor]) -> bool:
    """Whether ``parts`` can share one :class:`Int4Matmul` (kernel needs cols % 32 == 0)."""
    kinds = {"Q8_0" if p.qtype == "Q8_0" else "Q4" for p in parts}
    return len(kinds) == 1 and all(p.cols % _GROUP == 0 for p in parts)


class QuantRows(torch.nn.Module):
    """An embedding table kept in its GGUF blocks (q as int8, a scale and zero per 32):
    a lookup decodes only the rows it gathers."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def __init__(self, t: QuantTensor, dtype: torch.dtype) -> None:
        super().__init__()
        q, scale, zero = t.decode()
        if t.qtype != "Q8_0":     # fold the -8 into the zero: w = q * scale + zero
            zero = zero - 8 * scale
        self.dtype = dtype
        self.register_buffer("q", q.to(torch.int8) if t.qtype == "Q8_0" else q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q[ids].float()
        n, cols = q.shape
        w = q.view(n, -1, _GROUP) * self.scale[ids].unsqueeze(-1) + self.zero[ids].unsqueeze(-1)
        return w.view(n, cols).to(self.dtype)
