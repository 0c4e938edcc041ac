"""The tensor-parallel communicators (``model/parallel.py``'s :class:`TPComm`) that talk
to peers: ``DomainComm`` (same host: phalanx's shared-memory domain) and
``TorchDistComm`` (torch.distributed: gloo on CPU, NCCL on CUDA; the path that crosses
hosts). Every rank calls the same collectives in the same order (the step plan decides
them), so none of them carries a tag.

``DomainComm`` stages data in the members' windows, double-buffered: round ``r`` writes
half ``r % 2`` of this rank's window, passes one barrier and reads the peers' same half.
One barrier per round is enough: before a rank overwrites a half at round ``r + 2`` it
passed the barrier of round ``r + 1``, which every peer reaches only after it finished
reading round ``r``. Sums are taken in domain-rank order on every rank, so every rank
holds bit-identical results (the ranks' hidden states never drift apart).
"""

from __future__ import annotations

import contextlib
import os
import struct
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .._errors import EngineError

if TYPE_CHECKING:
    from phalanx.comm import DomainView

__all__ = ["DomainComm", "HostTieredComm", "TorchDistComm", "intra_op_threads"]

_ALIGN = 64
_LEN = struct.Struct("<Q")


def intra_op_threads(tp: int) -> int:
    """Set torch's intra-op threads so ``tp`` ranks on this host do not oversubscribe
    its cores (each gets ``cores // tp``); returns the count."""
    cores = len(os.sched_getaffinity(0))
    n = max(1, cores // max(1, tp))
    torch.set_num_threads(n)
    return n


class DomainComm:
    """TP over a phalanx shared-memory domain (its members are the TP ranks, in order).

    The domain's window is the staging area: give it at least ``2 * 64 KiB``; larger
    windows move a prefill's activations in fewer rounds.

    Tensors over the windows live only for one call, never between calls: a live export
    of a window makes unmapping it fail (``BufferError``), and a domain is released at
    its run's fence, which a dead peer can bring while this rank is idle between steps
    (tests/test_engine_llm.py, the killed-rank test). An error leaves a collective
    without its traceback's frames for the same reason (they hold such tensors); its
    message names the domain, the rank and the peer. The view itself is held weakly, so
    a runner that outlives its domain (a run failed under it) keeps none of the
    domain's mappings (the view's notify-pool flags among them) from being unmapped.
    """

    def __init__(self, view: DomainView) -> None:
        self._view = weakref.ref(view)
        self.name = view.name
        self.rank = view.domain_rank
        self.size = view.domain_size
        window = len(view.window)
        self.half = (window // 2) // _ALIGN * _ALIGN
        if self.half < 4096:
            raise EngineError(f"domain {view.name!r}: a TP domain needs a window of at least "
                              f"8 KiB for staging (it has {window} bytes)")
        self._round = 0
        self._closed = False
        self._mapped: list[torch.Tensor] | None = None  # set only inside step()
        # inside step() only, like _mapped: (half, dtype, numel) -> (this rank's part, the
        # members' parts): an engine step's all-reduces repeat a few shapes, and slicing
        # and viewing each half per call was most of a 4 KiB all-reduce (~20 of 45 µs)
        self._parts: dict[tuple[int, torch.dtype, int],
                          tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._barrier: Any = None  # the view's bound barrier, inside step() only

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Map the windows once for every collective inside (one engine step), instead of
        once per collective; nothing stays mapped after the block, even when it raises."""
        if self._mapped is not None:
            yield
            return
        # no local of this frame may hold the view: an error raised through the block
        # keeps this frame (and its locals) in its traceback
        self._mapped = self._map_all()
        try:
            yield
        finally:
            self._mapped = None
            self._parts = {}
            self._barrier = None

    def close(self) -> None:
        """Refuse further collectives (idempotent)."""
        self._closed = True

    @property
    def view(self) -> DomainView:
        view = self._view()
        if view is None:
            raise EngineError(f"TP domain {self.name!r} was released; its communicator (rank "
                              f"{self.rank} of {self.size}) cannot be used")
        return view

    def _members(self) -> tuple[int, list[torch.Tensor]]:
        """The next round's half and, per member, a uint8 tensor over that half of its
        window (for this call only)."""
        if self._closed:
            raise EngineError(f"domain {self.name!r}: this TP communicator was closed")
        h = self._round % 2
        self._round += 1
        lo, hi = h * self.half, (h + 1) * self.half
        mapped = self._mapped if self._mapped is not None else self._map_all()
        return h, [m[lo:hi] for m in mapped]

    def _map_all(self) -> list[torch.Tensor]:
        """Per member, a uint8 tensor over its whole window."""
        view = self.view
        return [torch.frombuffer(view.window if r == self.rank else view.peer_window(r),
                                 dtype=torch.uint8) for r in range(self.size)]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (``t`` must be contiguous)."""
        if self.size == 1:
            return t
        if not t.is_contiguous():
            raise EngineError(f"domain {self.name!r}: all_reduce sums in place and needs "
                              f"a contiguous tensor (got strides {t.stride()})")
        try:
            self._all_reduce(t.view(-1))
        except Exception as exc:  # noqa: BLE001 - re-raised, only its frames dropped
            raise exc.with_traceback(None)  # noqa: B904 - the same error, not a new one
        return t

    def _all_reduce(self, flat: torch.Tensor) -> None:
        n = flat.numel()
        if self._mapped is not None and n * flat.element_size() <= self.half:
            self._all_reduce_one(flat, n)
            return
        per = self.half // flat.element_size()
        for start in range(0, flat.numel(), per):
            n = min(per, flat.numel() - start)
            nbytes = n * flat.element_size()
            _, bufs = self._members()
            parts = [b[:nbytes].view(flat.dtype) for b in bufs]
            parts[self.rank].copy_(flat[start:start + n])
            self.view.barrier()
            out = flat[start:start + n]
            torch.add(parts[0], parts[1], out=out)
            for r in range(2, self.size):
                out.add_(parts[r])

    def _all_reduce_one(self, flat: torch.Tensor, n: int) -> None:
        """One round inside step(): the parts come from the step's cache, so the call is
        one copy, the barrier and the sums (a 4 KiB all-reduce's torch calls)."""
        if self._closed:
            raise EngineError(f"domain {self.name!r}: this TP communicator was closed")
        h = self._round & 1
        self._round += 1
        key = (h, flat.dtype, n)
        got = self._parts.get(key)
        if got is None:
            assert self._mapped is not None  # only called inside step()
            lo = h * self.half
            nbytes = n * flat.element_size()
            parts = [m[lo:lo + nbytes].view(flat.dtype) for m in self._mapped]
            got = self._parts[key] = (parts[self.rank], parts)
        mine, parts = got
        mine.copy_(flat)
        if self._barrier is None:
            self._barrier = self.view.barrier
        self._barrier()
        torch.add(parts[0], parts[1], out=flat)
        for r in range(2, self.size):
            flat.add_(parts[r])

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` concatenated on dim 0, in domain-rank order."""
        if self.size == 1:
            return t
        src = t.contiguous().view(-1).view(torch.uint8)
        out = torch.empty((self.size, src.numel()), dtype=torch.uint8)
        try:
            self._all_gather(src, out)
        except Exception as exc:  # noqa: BLE001 - re-raised, only its frames dropped
            raise exc.with_traceback(None)  # noqa: B904 - the same error, not a new one
        return out.view(t.dtype).view(self.size * t.shape[0], *t.shape[1:])

    def _all_gather(self, src: torch.Tensor, out: torch.Tensor) -> None:
        for start in range(0, src.numel(), self.half):
            n = min(self.half, src.numel() - start)
            _, bufs = self._members()
            bufs[self.rank][:n].copy_(src[start:start + n])
            self.view.barrier()
            for r in range(self.size):
                out[r, start:start + n].copy_(bufs[r][:n])

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """``data`` of rank ``root`` on every rank (length first, then chunks)."""
        if self.rank == root and data is None:
            raise EngineError(f"domain {self.name!r}: broadcast_bytes root (rank {root}) "
                              f"passed no data")
        try:
            return self._broadcast(data if self.rank == root and data is not None else b"",
                                   root)
        except Exception as exc:  # noqa: BLE001 - re-raised, only its frames dropped
            raise exc.with_traceback(None)  # noqa: B904 - the same error, not a new one

    def _broadcast(self, data: bytes, root: int) -> bytes:
        payload = memoryview(data)
        total = len(payload)
        got = bytearray()
        offset = 0
        first = True
        while first or offset < total:
            _, bufs = self._members()
            buf = bufs[root].numpy()
            room = self.half - (_LEN.size if first else 0)
            at = _LEN.size if first else 0
            if self.rank == root:
                if first:
                    buf[:_LEN.size] = memoryview(_LEN.pack(total)).cast("B")
                n = min(room, total - offset)
                buf[at:at + n] = payload[offset:offset + n]
            self.view.barrier()
            if first:
                (total,) = _LEN.unpack(bytes(buf[:_LEN.size]))
            n = min(room, total - offset)
            if self.rank != root:
                got += bytes(buf[at:at + n])
            offset += n
            first = False
        return bytes(payload) if self.rank == root else bytes(got)


class TorchDistComm:
    """TP over a torch.distributed process group (gloo on CPU, NCCL on CUDA).

    ``device`` is where this rank's tensors live. gloo over a GPU's tensors (ranks that
    share one GPU) passes them through host memory: one copy each way per collective."""

    def __init__(self, group: Any, device: str = "cpu") -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        # where the collectives' tensors must be: NCCL's on the GPU, gloo's on the host
        self._wire = (torch.device("cpu") if self.backend == "gloo" else self.device)

    def step(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the group holds nothing per step

    def close(self) -> None:
        pass  # the group is left by the rank's close (phalanx.hosts.dist.destroy)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        if self.size > 1:
            if t.device == self._wire:
                self._dist.all_reduce(t, group=self.group)
            else:
                wire = t.to(self._wire)
                self._dist.all_reduce(wire, group=self.group)
                t.copy_(wire)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        src = t.contiguous().to(self._wire)
        parts = [torch.empty_like(src) for _ in range(self.size)]
        self._dist.all_gather(parts, src, group=self.group)
        return torch.cat(parts, dim=0).to(t.device)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        if self.rank == root and data is None:
            raise EngineError(f"torch.distributed broadcast_bytes: root (rank {root}) "
                              f"passed no data")
        src = self._dist.get_global_rank(self.group, root)
        wire = self._wire
        n = torch.tensor([len(data) if self.rank == root and data is not None else 0],
                         dtype=torch.int64, device=wire)
        self._dist.broadcast(n, src=src, group=self.group)
        if self.rank == root and data is not None:
            buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(wire)
                   if data else torch.empty(0, dtype=torch.uint8, device=wire))
        else:
            buf = torch.empty(int(n.item()), dtype=torch.uint8, device=wire)
        if buf.numel():
            self._dist.broadcast(buf, src=src, group=self.group)
        return data if self.rank == root and data is not None else bytes(buf.cpu().numpy())


class HostTieredComm:
    """TP across hosts whose ranks share hosts: same-host peers reduce over their
    shared-memory domain, then each rank all-reduces its host's sum with the ranks of the
    same local index on the other hosts (gloo); all-gather and broadcast go over the
    job's whole group.

    Every rank ends with the same bits: a host's sum is identical on its ranks (the domain
    sums in member order), and every cross-host group reduces identical inputs with the
    same algorithm."""

    def __init__(self, local: DomainComm, cross: TorchDistComm, world: TorchDistComm) -> None:
        self.local, self.cross, self.world = local, cross, world
        self.rank, self.size = world.rank, world.size

    def step(self) -> contextlib.AbstractContextManager[None]:
        return self.local.step()

    def close(self) -> None:
        self.local.close()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.cross.all_reduce(self.local.all_reduce(t))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.world.all_gather(t)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        return self.world.broadcast_bytes(data, root)
