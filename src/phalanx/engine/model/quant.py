"""Quantized weights on CPU: GGUF's blocks kept at 4 or 8 bits in memory.

Matmuls go through torch's packed-int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``:
groups of 32 along the input, ``w = (q - 8) * scale + zero`` per group and output row,
bfloat16 activations, scales, zeros and outputs: its float16 and float32 forms take
10-50x longer on CPU, measured). GGUF's formats map onto it exactly, each as ``w = q *
s + z`` per 32 weights (:meth:`QuantTensor.decode`) and then as kernel planes:

- 4-bit types, one plane (kernel zero ``z + 8 s``): Q4_0 (``s = d``, ``z = -8 d``), Q4_1
  (``s = d``, ``z = m``) and Q4_K (per 32-weight sub-block ``s = d * sc``,
  ``z = -dmin * m``, the 6-bit sc and m unpacked by gguf's own ``Q4_K.get_scale_min``);
- 5- and 8-bit types, two exact 4-bit planes ``q = 16 hi + lo``, lo in [0, 15]: plane
  hi (stored ``hi + 8``, scale ``16 s``, zero 0) plus plane lo (scale ``s``, zero
  ``z + 8 s``), run as one matmul with twice the output rows, summed: Q8_0
  (``s = d``, ``z = 0``), Q5_0 (``z = -16 d``), Q5_1 (``z = m``), Q5_K (as Q4_K).
- Q6_K (``w = s (q - 32)``, q 0..63, ``s = d * sc`` per 16 weights): its scales are
  per 16 weights and the kernel's smallest group is 32, so the kernel runs over twice
  the input columns (``spread`` 2): each 16-weight sub-block becomes one kernel group of
  its 16 low nibbles (``lo``) then its 16 high parts (``hi + 6``, hi 0..3), and the
  input each 16 columns followed by the same 16 times 16 (exact in bfloat16). The group
  then sums ``S sum (16 hi + lo) x - 40 S sum x + 17 Z sum x``, which is the weights'
  product when ``S = s`` and ``Z = 8 s / 17``. 10 bits a weight against the file's
  6.56 (dense float32: 32); exact but for the bfloat16 rounding of S and Z, as for the
  other types. Q2_K and Q3_K are not kept (16-weight groups of 2 and 3 bits: the same
  trick would hold them at 10 bits, more than the exact planes' gain); they are
  dequantized at load, named at start.

``aten._weight_int8pack_mm`` was not used: it takes one scale per output row, and these
formats have one per 32 (or 16) weights (requantizing per row loses what the file
holds). The scales and zeros are rounded to bfloat16 (the kernel's type): under 0.4%
of a group's step. docs/design.md ("Quantized weights on CPU", issue 44) has the
measurements.

The model around these matmuls runs in float32 (the residual stream, norms, attention
and KV): only each matmul's input is rounded to bfloat16. The LM head's input is not
rounded either: it is split into two bfloat16 halves, ``x = hi + lo`` with
``lo = x - hi`` (exact to 2^-16 of x), run as one call with twice the rows and summed,
because the logits are where rounding costs most (issue 44: KL from the float32 model
0.00157 with a bfloat16 model, 0.00115 with a float32 one, 0.00071 with the head's
input split; docs/design.md). The head runs on one row per sequence at decode, so the
doubled rows cost nothing measurable there.

Embedding rows (:class:`QuantRows`) are gathered still quantized and decoded per lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from gguf.quants import Q4_K

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Int4Matmul", "QuantRows", "QuantTensor"]

_GROUP = 32
# per type: weights per block, bytes per block, 4-bit planes the kernel runs
_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256,
          "Q5_K": 256, "Q6_K": 256}
_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144,
          "Q5_K": 176, "Q6_K": 210}
_PLANES = {"Q4_0": 1, "Q4_1": 1, "Q5_0": 2, "Q5_1": 2, "Q8_0": 2, "Q4_K": 1, "Q5_K": 2,
           "Q6_K": 1}
# weights per scale (and zero) where not 32; the kernel's input columns per weight's
_SCALE_GROUP = {"Q6_K": 16}
_SPREAD = {"Q6_K": 2}


def _f16(raw: np.ndarray) -> torch.Tensor:
    """float16 fields (2 bytes at the end of ``raw``'s last axis) as float32."""
    return torch.from_numpy(raw.copy().view(np.float16)[..., 0].astype(np.float32))


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

    @staticmethod
    def block_size(qtype: str) -> int:
        """Weights per block: a column slice must fall on these bounds."""
        return _BLOCK[qtype]

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def planes(self) -> int:
        return _PLANES[self.qtype]

    @property
    def group(self) -> int:
        """Weights per scale and zero of :meth:`decode`: 32, or 16 (Q6_K)."""
        return _SCALE_GROUP.get(self.qtype, _GROUP)

    @property
    def spread(self) -> int:
        """The kernel's input columns per weight column: 1, or 2 (Q6_K)."""
        return _SPREAD.get(self.qtype, 1)

    def decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, scale, zero) with ``w = q * scale + zero`` per :attr:`group` weights: q
        [rows, cols] (uint8 0..15 for Q4_*, 0..31 for Q5_*, 0..63 for Q6_K, int8 for
        Q8_0), scale and zero float32 [rows, cols / group], computed from the file's
        float16 fields in float32 (exact)."""
        blocks = np.ascontiguousarray(self.data).reshape(self.rows, -1, _BYTES[self.qtype])
        if self.qtype == "Q6_K":
            return self._decode_q6_k(blocks)
        d = _f16(blocks[..., 0:2])
        if self.qtype == "Q8_0":
            q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(self.rows, -1)
            return q, d, torch.zeros_like(d)
        if self.qtype in ("Q4_0", "Q4_1"):
            if self.qtype == "Q4_1":
                zero, qs = _f16(blocks[..., 2:4]), torch.from_numpy(blocks[..., 4:].copy())
            else:
                zero, qs = -8 * d, torch.from_numpy(blocks[..., 2:].copy())
            # a block's first 16 weights are its bytes' low nibbles, the next 16 the high
            q = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(self.rows, -1)
            return q, d, zero
        if self.qtype in ("Q5_0", "Q5_1"):
            # w = d * (q - 16) or d * q + m; weight j's fifth bit is bit j of qh (u32 LE)
            at = 4 if self.qtype == "Q5_1" else 2
            zero = _f16(blocks[..., 2:4]) if self.qtype == "Q5_1" else -16 * d
            qh = torch.from_numpy(blocks[..., at:at + 4].copy())
            high = ((qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1)
            qs = torch.from_numpy(blocks[..., at + 4:].copy())
            q = torch.cat((qs & 15, qs >> 4), dim=-1) | (high.reshape(*qh.shape[:-1], 32) << 4)
            return q.reshape(self.rows, -1), d, zero
        return self._decode_k(blocks, d)

    def _decode_k(self, blocks: np.ndarray, d: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q4_K / Q5_K: 256 weights in 8 sub-blocks of 32, ``w = d*sc*q - dmin*m`` with
        6-bit sc and m per sub-block (gguf's own unpacking of their 12 bytes)."""
        rows, nb = blocks.shape[0], blocks.shape[1]
        flat = blocks.reshape(rows * nb, -1)
        dmin = _f16(blocks[..., 2:4])
        sc, m = (torch.from_numpy(a.astype(np.float32)).view(rows, nb, 8)
                 for a in Q4_K.get_scale_min(flat[:, 4:16]))
        scale = (d.unsqueeze(-1) * sc).view(rows, -1)
        zero = -(dmin.unsqueeze(-1) * m).view(rows, -1)
        if self.qtype == "Q4_K":
            qs = torch.from_numpy(flat[:, 16:].copy()).view(rows * nb, 4, 1, 32)
        else:
            qs = torch.from_numpy(flat[:, 48:].copy()).view(rows * nb, 4, 1, 32)
        # each 32 bytes hold two sub-blocks: the low nibbles, then the high ones
        q = torch.cat((qs & 15, qs >> 4), dim=2).reshape(rows * nb, 8, 32)
        if self.qtype == "Q5_K":
            qh = torch.from_numpy(flat[:, 16:48].copy()).view(rows * nb, 1, 32)
            bit = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
            q = q | (((qh >> bit) & 1) << 4)
        return q.reshape(rows, -1), scale, zero

    def _decode_q6_k(self, blocks: np.ndarray
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q6_K: 256 weights in 16 sub-blocks of 16, ``w = d*sc*(q - 32)``, 8-bit sc per
        sub-block, q's low 4 bits in 128 bytes then its high 2 in 64 (gguf's layout)."""
        rows, nb = blocks.shape[0], blocks.shape[1]
        flat = blocks.reshape(rows * nb, -1)
        d = _f16(flat[:, 208:210]).view(rows * nb, 1)
        sc = torch.from_numpy(flat[:, 192:208].copy().view(np.int8).astype(np.float32))
        ql = torch.from_numpy(flat[:, :128].copy()).view(-1, 2, 1, 64)
        ql = torch.cat((ql & 15, ql >> 4), dim=2).view(-1, 8, 32)
        qh = torch.from_numpy(flat[:, 128:192].copy()).view(-1, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
        qh = ((qh >> shifts) & 3).view(-1, 8, 32)
        q = (ql | (qh << 4)).reshape(rows, -1)
        scale = (d * sc).view(rows, -1)
        return q, scale, -32 * scale

    def kernel_planes(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The kernel's form, ``w = sum over planes of (q - 8) * scale + zero``, q 0..15,
        per 32 of the kernel's input columns. One plane for 4-bit types (zero + 8
        scale); two exact planes for 5- and 8-bit ones, ``q = 16 hi + lo``: plane hi
        (stored ``hi + 8``, scale ``16 s``, zero 0) and plane lo (scale ``s``, zero
        ``zero + 8 s``). Q6_K: one plane over twice the columns (the module docstring)."""
        q, scale, zero = self.decode()
        if self.spread == 2:
            sub = q.view(self.rows, -1, 1, 16).to(torch.int32)
            spread = torch.cat((sub & 15, (sub >> 4) + 6), dim=2).view(self.rows, -1)
            return [(spread, scale, scale * (8 / 17))]
        if self.planes == 1:
            return [(q, scale, zero + 8 * scale)]
        q32 = q.to(torch.int32)
        return [((q32 >> 4) + 8, 16 * scale, torch.zeros_like(zero)),
                (q32 & 15, scale, zero + 8 * scale)]


class Int4Matmul(torch.nn.Module):
    """``x W^T`` over int4-packed rows of one or more GGUF tensors (stacked as output rows:
    q/k/v or gate/up), all of one plane count (see :func:`compatible`)."""

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
        self.planes = parts[0].planes
        self.spread = parts[0].spread
        # plane by plane, every part's rows: y = sum of the planes' row blocks
        decoded = [p.kernel_planes() for p in parts]
        q = torch.cat([d[i][0].to(torch.int32) for i in range(self.planes) for d in decoded])
        scale = torch.cat([d[i][1] for i in range(self.planes) for d in decoded])
        zero = torch.cat([d[i][2] for i in range(self.planes) for d in decoded])
        pad = -q.shape[0] % 16            # the kernel packs output rows by 16
        if pad:
            q = torch.cat((q, torch.full((pad, q.shape[1]), 8, dtype=q.dtype)))
            scale = torch.cat((scale, torch.zeros(pad, scale.shape[1])))
            zero = torch.cat((zero, torch.zeros(pad, zero.shape[1])))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1))
        # [cols / 32, out rows, (scale, zero)], as the kernel takes them
        self.register_buffer("scales_zeros", torch.stack((scale, zero), dim=-1)
                             .transpose(0, 1).contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        rows = x.shape[0]
        hi = x.to(torch.bfloat16)
        if self.exact_input and dtype == torch.float32:
            lo = (x - hi.float()).to(torch.bfloat16)
            y = self._mm(torch.cat((hi, lo))).float()
            y = y[:rows] + y[rows:]
        else:
            y = self._mm(hi)
        n = self.out_features
        if self.planes == 2:
            y = y[:, :n] + y[:, n:2 * n]
        elif y.shape[1] != n:
            y = y[:, :n]
        return y.to(dtype)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel on bfloat16 ``x``, spread first where the weights are (Q6_K: each
        16 columns, then the same times 16, exact)."""
        if self.spread == 2:
            sub = x.view(x.shape[0], -1, 1, 16)
            x = torch.cat((sub, sub * 16), dim=2).view(x.shape[0], -1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(  # type: ignore[no-any-return]
            x.contiguous(), self.packed, _GROUP, self.scales_zeros)


def compatible(parts: list[QuantTensor]) -> bool:
    """Whether ``parts`` can share one :class:`Int4Matmul`: the same number of planes
    (each plane's rows are stacked over the parts) and input spread, and cols % 32 == 0
    (the kernel's)."""
    return (len({(p.planes, p.spread) for p in parts}) == 1
            and all(p.cols % _GROUP == 0 for p in parts))


class QuantRows(torch.nn.Module):
    """An embedding table kept in its GGUF blocks (q as int8 or uint8, a scale and zero
    per 32): a lookup decodes only the rows it gathers. The scales and zeros are kept
    in float16 where that is exact (the file's own fields: every type but the K-quants,
    whose ``d * sc`` products are float32), and a zero that is 0 throughout (Q8_0) is
    not kept: the real model's Q8_0 table is 28 MB of q and 1.8 MB of scales, not 7."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    def __init__(self, t: QuantTensor, dtype: torch.dtype) -> None:
        super().__init__()
        q, scale, zero = t.decode()       # w = q * scale + zero
        self.dtype = dtype
        self.register_buffer("q", q.to(torch.int8) if t.qtype == "Q8_0" else q)
        self.register_buffer("scale", _narrowest(scale))
        self.register_buffer("zero", _narrowest(zero) if bool(zero.any()) else None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q[ids].float()
        n, cols = q.shape
        w = q.view(n, self.scale.shape[1], -1) * self.scale[ids].float().unsqueeze(-1)
        if self.zero is not None:
            w += self.zero[ids].float().unsqueeze(-1)
        return w.view(n, cols).to(self.dtype)


def _narrowest(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) in float16 where every value survives the round trip."""
    half = x.half()
    return half if torch.equal(half.float(), x) else x
