"""The decoder's building blocks, with tensor-parallel sharding declared on each weight.

A parallel linear layer owns its slice of the full weight: ``shard_dim`` (0: output
rows, column-parallel; 1: input columns, row-parallel) and, per packed part, the range
of the full tensor it holds. Its ``load`` reads exactly that range from the checkpoint
(``Checkpoint.read`` with a slice), so sharding is decided where the weight lives, not
by the loader. Packed layers (q/k/v, gate/up) hold several checkpoint tensors side by
side so one matmul computes them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .._errors import CheckpointError
from .quant import Int4Matmul, QuantRows, QuantTensor, compatible

if TYPE_CHECKING:
    from .parallel import TPComm
    from .weights import WeightSource as Checkpoint

__all__ = ["LMHead", "ParallelLinear", "Part", "RMSNorm", "VocabEmbedding"]


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor (``name`` + ``.weight``/``.bias``) held by a packed layer:
    rows (or columns) ``[start, stop)`` of its sharded dim."""

    name: str
    start: int
    stop: int
    total: int   # the checkpoint tensor's full size along the sharded dim (checked)

    @property
    def size(self) -> int:
        return self.stop - self.start


class ParallelLinear(torch.nn.Module):
    """``y = x W^T (+ b)`` over this rank's shard of W.

    ``shard_dim`` 0 (column-parallel): this rank computes some output features, no
    communication. ``shard_dim`` 1 (row-parallel): this rank holds some input features
    and the partial products are summed over ranks by ``comm.all_reduce`` (the bias is
    added once, after the sum).
    """

    def __init__(self, in_features: int, parts: list[Part], shard_dim: int, bias: bool,
                 dtype: torch.dtype, comm: TPComm | None = None,
                 quantized: bool = False) -> None:
        super().__init__()
        self.parts = parts
        # quantized: the checkpoint's blocks are kept (engine/model/quant.py) where every
        # part has a kept type; else the weight is read dense
        self.quantized = quantized
        self.qmms: torch.nn.ModuleList | None = None
        self.shard_dim = shard_dim
        self.comm = comm
        local = sum(p.size for p in parts)
        shape = (local, in_features) if shard_dim == 0 else (in_features, local)
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.weight.shard_dim = shard_dim  # type: ignore[attr-defined]
        # Row-parallel layers hold full output features: their bias is not sharded.
        bias_size = local if shard_dim == 0 else in_features
        self.bias = (torch.nn.Parameter(torch.empty(bias_size, dtype=dtype), requires_grad=False)
                     if bias else None)

    def load(self, ckpt: Checkpoint) -> None:
        """Read this rank's slice of every part from the checkpoint."""
        in_features = self.weight.shape[1 - self.shard_dim]
        for part in self.parts:
            _check_shape(ckpt, f"{part.name}.weight",
                         [part.total, in_features] if self.shard_dim == 0
                         else [in_features, part.total])
        if not (self.quantized and self._load_quantized(ckpt)):
            offset = 0
            for part in self.parts:
                w = ckpt.read(f"{part.name}.weight", self.shard_dim, part.start, part.stop)
                dst = self.weight.data.narrow(self.shard_dim, offset, part.size)
                _copy(dst, w, f"{part.name}.weight")
                offset += part.size
        offset = 0
        for part in self.parts:
            if self.bias is not None:
                if self.shard_dim == 0:
                    b = ckpt.read(f"{part.name}.bias", 0, part.start, part.stop)
                    _copy(self.bias.data.narrow(0, offset, part.size), b, f"{part.name}.bias")
                else:
                    _copy(self.bias.data, ckpt.read(f"{part.name}.bias"), f"{part.name}.bias")
            offset += part.size

    def _load_quantized(self, ckpt: Checkpoint) -> bool:
        """Keep this rank's slices in their blocks when every part has a kept type;
        False leaves the weight to be read dense. Parts of one kind (planes and input
        spread) in a row share one matmul; a fused layer whose parts differ (Q4_K_M's
        Q4_K q and k beside a Q6_K v) runs one matmul per run of a kind, outputs
        concatenated, rather than going dense."""
        runs: list[list[QuantTensor]] = []
        for part in self.parts:
            qt = ckpt.read_quantized(f"{part.name}.weight", self.shard_dim, part.start,
                                     part.stop)
            if qt is None:
                return False
            if runs and compatible([*runs[-1], qt]):
                runs[-1].append(qt)
            else:
                runs.append([qt])
        if not all(compatible(run) for run in runs):
            return False
        self.qmms = torch.nn.ModuleList(Int4Matmul(run) for run in runs)
        self.weight = torch.nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qmms is not None:
            y = (self.qmms[0](x) if len(self.qmms) == 1
                 else torch.cat([m(x) for m in self.qmms], dim=-1))
            if self.shard_dim == 1 and self.comm is not None and self.comm.size > 1:
                y = self.comm.all_reduce(y)
            return y if self.bias is None else y + self.bias
        if self.shard_dim == 0:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        if self.comm is not None and self.comm.size > 1:
            y = self.comm.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def _check_shape(ckpt: Checkpoint, name: str, expected: list[int]) -> None:
    """A slice of the right size from a tensor of the wrong size would load silently: the
    whole tensor's shape must be what the config implies."""
    if name in ckpt and ckpt.shape(name) != expected:
        raise CheckpointError(f"{ckpt.dir}: tensor {name} has shape {ckpt.shape(name)}; "
                              f"config.json implies {expected}")


def _copy(dst: torch.Tensor, src: torch.Tensor | None, name: str) -> None:
    if src is None:
        return  # recorded as missing by the checkpoint; the load report names it
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(f"tensor {name}: the checkpoint's slice has shape "
                              f"{list(src.shape)}, this rank's parameter {list(dst.shape)}")
    dst.copy_(src)


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does. ``offset`` 1 scales
    by ``1 + w`` (Gemma's checkpoints store the weight that way), in float32 before the
    cast back, as transformers' Gemma norms do."""

    def __init__(self, name: str, size: int, eps: float, dtype: torch.dtype,
                 offset: float = 0.0) -> None:
        super().__init__()
        self.name = name
        self.eps = eps
        self.offset = offset
        self.weight = torch.nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def load(self, ckpt: Checkpoint) -> None:
        _copy(self.weight.data, ckpt.read(f"{self.name}.weight"), f"{self.name}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


class VocabEmbedding(torch.nn.Module):
    """Token embedding, replicated or split by vocabulary rows across ranks.

    Vocab-parallel: this rank holds rows ``[start, stop)``; ids outside give zeros and
    one all-reduce sums the ranks' rows. The same weight serves a tied LM head.
    """

    def __init__(self, name: str, vocab: int, hidden: int, dtype: torch.dtype,
                 comm: TPComm, parallel: bool, quantized: bool = False) -> None:
        super().__init__()
        self.name = name
        self.quantized = quantized
        self.rows: QuantRows | None = None   # the table still in its GGUF blocks
        self.comm = comm
        self.parallel = parallel and comm.size > 1
        self.vocab = vocab
        per = vocab // comm.size if self.parallel else vocab
        self.start = comm.rank * per if self.parallel else 0
        self.stop = self.start + per
        self.weight = torch.nn.Parameter(torch.empty(per, hidden, dtype=dtype),
                                         requires_grad=False)
        self.weight.shard_dim = 0 if self.parallel else None  # type: ignore[attr-defined]

    def load(self, ckpt: Checkpoint) -> None:
        name = f"{self.name}.weight"
        _check_shape(ckpt, name, [self.vocab, self.weight.shape[1]])
        qt = ckpt.read_quantized(name, 0, self.start, self.stop) if self.quantized else None
        if qt is not None:
            self.rows = QuantRows(qt, self.weight.dtype)
            self.weight = torch.nn.Parameter(self.weight.data.new_empty(0),
                                             requires_grad=False)
            return
        _copy(self.weight.data, ckpt.read(name, 0, self.start, self.stop), name)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids) if self.rows is not None else F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)


class LMHead(torch.nn.Module):
    """Logits over the vocabulary: replicated, or vocab-parallel with an all-gather."""

    def __init__(self, embedding: VocabEmbedding, untied_name: str | None) -> None:
        super().__init__()
        self.embedding = embedding
        self.name = untied_name
        self.qmm: Int4Matmul | None = None
        self.weight = embedding.weight if untied_name is None else torch.nn.Parameter(
            torch.empty_like(embedding.weight), requires_grad=False)

    def load(self, ckpt: Checkpoint) -> None:
        e = self.embedding
        if self.name is None:
            ckpt.skip("lm_head.weight")  # tied: some checkpoints store the copy anyway
            if e.rows is None:
                self.weight = e.weight   # the embedding's, as loaded
                return
            # the table stayed quantized: the head packs the same blocks for its matmul
            name = f"{e.name}.weight"
        else:
            name = f"{self.name}.weight"
            _check_shape(ckpt, name, [e.vocab, self.weight.shape[1]])
        # a tied quantized table always has blocks the kernel takes (rows of 32s)
        qt = ckpt.read_quantized(name, 0, e.start, e.stop) if e.quantized else None
        if qt is not None:
            self.qmm = Int4Matmul([qt], exact_input=True)
            self.weight = torch.nn.Parameter(self.weight.data.new_empty(0),
                                             requires_grad=False)
            return
        _copy(self.weight.data, ckpt.read(name, 0, e.start, e.stop), name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.qmm(hidden) if self.qmm is not None else F.linear(hidden, self.weight)
        if not self.embedding.parallel:
            return logits
        comm = self.embedding.comm
        parts = comm.all_gather(logits.contiguous())        # [size * T, V / size]
        t = logits.shape[0]
        return parts.view(comm.size, t, -1).permute(1, 0, 2).reshape(t, -1)
