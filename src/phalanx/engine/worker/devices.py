"""Where an engine's ranks run: the ``device`` option and the TP communicator it implies.

``device`` is ``"cpu"`` (the default), ``"cuda"`` (rank ``r`` takes
``cuda:{r % torch.cuda.device_count()}``) or ``"cuda:N"`` (every rank on GPU ``N``).
The TP communicator (``tp_comm``) follows from it unless named:

| device | TP 1 | TP > 1, ``"auto"`` | may be named |
|---|---|---|---|
| cpu | ``solo`` | ``shm``: phalanx's shared-memory domain | ``gloo`` |
| cuda | ``solo`` | ``nccl``: one GPU per rank | ``gloo`` (see below) |

``gloo`` on CUDA lets ranks share a GPU: its collectives pass through host memory.

The shared-memory domain reduces host memory only, so it never serves a GPU; NCCL takes
one GPU per rank, so TP beyond the GPUs torch sees is refused at start, before any rank
process exists. ``gloo`` and ``nccl`` form a torch.distributed group among the local
ranks on a ``TCPStore`` the parent holds (engine/worker/local.py), the machinery of the
multi-host path (phalanx/hosts/dist.py).

:func:`plan_devices` is pure (tests give it any GPU count); :func:`resolve_devices` asks
torch, and imports it only when a GPU is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import EngineError

__all__ = ["TP_COMMS", "DevicePlan", "plan_devices", "resolve_devices"]

#: the TP communicators a caller may name ("auto": see the module docstring)
TP_COMMS = ("auto", "shm", "gloo", "nccl")


@dataclass(frozen=True)
class DevicePlan:
    """Each rank's device and the communicator among the ranks."""

    devices: tuple[str, ...]   # per rank: "cpu" or "cuda:N"
    comm: str                  # "solo", "shm", "gloo" or "nccl"

    @property
    def on_cuda(self) -> bool:
        return self.devices[0] != "cpu"

    @property
    def dist(self) -> bool:
        """Whether the ranks form a torch.distributed group."""
        return self.comm in ("gloo", "nccl")


def _parse(device: str) -> int | None:
    """None for "cpu", -1 for "cuda", N for "cuda:N"; else an EngineError."""
    if device == "cpu":
        return None
    if device == "cuda":
        return -1
    head, _, index = device.partition(":")
    if head == "cuda" and index.isdigit():
        return int(index)
    raise EngineError(f"device={device!r}: give 'cpu', 'cuda' (rank r on cuda:r % the GPU "
                      "count) or 'cuda:N'")


def plan_devices(device: str, tp: int, cuda_count: int, tp_comm: str = "auto") -> DevicePlan:
    """The plan for ``tp`` ranks on ``device`` where torch sees ``cuda_count`` GPUs (0:
    torch has no CUDA here). Refuses what cannot run, naming what to do instead."""
    if tp < 1:
        raise EngineError(f"tensor_parallel_size={tp}: must be >= 1")
    if tp_comm not in TP_COMMS:
        raise EngineError(f"tp_comm={tp_comm!r}: give one of {', '.join(TP_COMMS)}")
    index = _parse(device)
    if index is None:
        if tp_comm == "nccl":
            raise EngineError("tp_comm='nccl' needs device='cuda': NCCL reduces GPU "
                              "memory only")
        comm = "solo" if tp == 1 else ("shm" if tp_comm == "auto" else tp_comm)
        return DevicePlan(("cpu",) * tp, comm)
    if cuda_count < 1:
        raise EngineError(f"device={device!r}, but torch has no CUDA device here "
                          "(torch.cuda.is_available() is False: a CPU-only build of torch, "
                          "no GPU, or CUDA_VISIBLE_DEVICES hides them): use device='cpu'")
    if index >= cuda_count:
        raise EngineError(f"device={device!r}, but torch sees {cuda_count} GPU(s) "
                          f"(cuda:0 to cuda:{cuda_count - 1})")
    devices = tuple(f"cuda:{index if index >= 0 else r % cuda_count}" for r in range(tp))
    if tp == 1:
        return DevicePlan(devices, "solo")
    if tp_comm == "shm":
        raise EngineError("tp_comm='shm' cannot serve a GPU: phalanx's shared-memory "
                          "domain reduces host memory only; leave tp_comm='auto' (NCCL) "
                          "or name 'gloo'")
    comm = "nccl" if tp_comm == "auto" else tp_comm
    if comm == "nccl" and len(set(devices)) < tp:
        if index >= 0:
            raise EngineError(f"device={device!r} puts all {tp} ranks on one GPU, and NCCL "
                              f"takes one GPU per rank: give device='cuda' (rank r on "
                              f"cuda:r), or tensor_parallel_size=1")
        raise EngineError(f"tensor_parallel_size={tp} on CUDA needs {tp} GPUs (NCCL takes "
                          f"one GPU per rank), but torch sees {cuda_count}: use "
                          f"tensor_parallel_size <= {cuda_count}, more GPUs, or "
                          "device='cpu'")
    return DevicePlan(devices, comm)


def resolve_devices(device: str, tp: int, tp_comm: str = "auto") -> DevicePlan:
    """:func:`plan_devices` with the GPUs torch sees in this process (the parent's view is
    its ranks' view: they inherit its environment, ``CUDA_VISIBLE_DEVICES`` included)."""
    count = 0
    if _parse(device) is not None:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return plan_devices(device, tp, count, tp_comm)
