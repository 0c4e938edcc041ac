"""Every rank-side entry point of the engine: open a rank's runner, run a step on it,
close it, report its gauges. Both executors ship these (``worker/local.py`` by
reference to its own rank processes; ``multihost/executor.py`` by name,
``module:function``, with typed arguments, to the hosts' agents).

This module loads without torch, so the parent can name its functions: what needs
torch is imported inside them.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

from phalanx.comm import view_of
from phalanx.hosts.dist import destroy, join_group
from phalanx.lifecycle import PhalanxError
from phalanx.lifecycle.failpoints import Failpoint

from .._errors import EngineError
from ..core.executor import RankMemory
from ..core.plan import decode_plan, encode_result
from ..disk.rank0 import DiskLoads, release_leases
from ..disk.staging import PageStaging, attach_staging, expect_loads
from ..model.gguf_file import forget_gguf_files
from ..model.parallel import SoloComm, TPComm
from .heap import TRIMMER
from .step_channel import Kind, RankEnd, StepMessage, decode_message, encode_message

__all__ = ["CLOSE_WAIT_S", "DistArgs", "close_rank", "execute_rank", "open_host_rank",
           "open_local_rank", "serve_host_steps", "serve_steps", "tiered_comm"]

# a rank's place in the local torch.distributed group: (store port, key prefix, rank,
# world, timeout, backend)
DistArgs = tuple[int, str, int, int, float, str]


def _open_runner(runner_id: str, model_dir: str, comm: Any, kwargs: dict[str, Any],
                 disk_staging: bool) -> RankMemory:
    """The one way a rank's runner opens: on ``comm``, with the rank's staging attached
    when the engine has a disk tier."""
    from .runner import open_runner

    runner = open_runner(runner_id, model_dir, comm, **kwargs)
    try:
        runner.open_grammars()   # from the file's parse, before it goes
    except (PhalanxError, OSError):
        # a model structured outputs cannot serve (no EOS ids, no tokenizer): the first
        # request that asks for one is refused naming why, as it was built then
        pass
    # the weights are loaded: a GGUF file's parse (~150 MB of metadata arrays, and its
    # map) is not needed again in this rank
    forget_gguf_files()
    gc.collect()
    TRIMMER.trim()  # what the load freed (the parse, its staging): ~30 MB here
    if disk_staging:
        attach_staging(runner)
    return runner.memory()


def open_local_rank(runner_id: str, model_dir: str, view: Any, kwargs: dict[str, Any],
                    seed: int, disk_staging: bool, dist: DistArgs | None = None
                    ) -> RankMemory:
    """A rank of this host's engine: TP over the shared-memory domain ``view`` (None:
    alone), or over a loopback torch.distributed group (``dist``: on CUDA)."""
    import torch

    from .tp import DomainComm

    torch.manual_seed(seed)
    comm: TPComm
    if dist is not None:
        comm = _join_local_group(str(kwargs.get("device", "cpu")), *dist)
    else:
        comm = DomainComm(view) if view is not None else SoloComm()
    try:
        return _open_runner(runner_id, model_dir, comm, kwargs, disk_staging)
    except BaseException:
        if dist is not None:
            destroy()
        raise


def _join_local_group(device: str, port: int, prefix: str, rank: int, world: int,
                      timeout: float, backend: str) -> Any:
    """This rank's TorchDistComm in the group of the engine's local ranks (loopback)."""
    import torch

    from .tp import TorchDistComm

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))  # NCCL's communicator takes this GPU
    group = join_group("127.0.0.1", port, prefix, rank, world, timeout, backend=backend,
                       node_addr="127.0.0.1")
    return TorchDistComm(group, device)


def open_host_rank(runner_id: str, model_dir: str, kwargs: dict[str, Any], seed: int,
                   store_addr: str, store_port: int, prefix: str, rank: int, world: int,
                   ranks_here: int, timeout: float, disk_staging: bool,
                   host_domain: tuple[int, str] | None) -> RankMemory:
    """A rank of a multi-host engine: join the job's TP group and open the runner.
    ``host_domain`` (id, name): the domain of this rank's host, for the tiered path
    (``multihost/domains.py``)."""
    import torch

    from .tp import TorchDistComm

    if not os.path.isdir(model_dir):
        raise EngineError(f"rank {rank}: the model directory {model_dir} does not exist on "
                          f"this host: give every node the same MODEL_DIR")
    torch.manual_seed(seed)
    group = join_group(store_addr, store_port, prefix, rank, world, timeout)
    try:
        # this host's cores are shared by its own ranks only
        threads = max(1, len(os.sched_getaffinity(0)) // max(1, ranks_here))
        comm: Any = TorchDistComm(group)
        if host_domain is not None:
            comm = tiered_comm(group, ranks_here, *host_domain)
        return _open_runner(runner_id, model_dir, comm, {**kwargs, "threads": threads},
                            disk_staging)
    except BaseException:
        destroy()
        raise


def tiered_comm(world_group: Any, per_node: int, alloc_id: int, name: str) -> Any:
    """This rank's tiered communicator: its host's domain, then its cross-host group
    (every rank makes every cross group, in the same order, as torch.distributed
    requires)."""
    import torch.distributed as dist

    from .tp import DomainComm, HostTieredComm, TorchDistComm

    world = TorchDistComm(world_group)
    nodes = world.size // per_node
    groups = [dist.new_group([n * per_node + i for n in range(nodes)])
              for i in range(per_node)]
    return HostTieredComm(DomainComm(view_of(alloc_id, name)),
                          TorchDistComm(groups[world.rank % per_node]), world)


_STEP = Failpoint("engine.rank.step")

# A rank's runner is used by one step at a time; closing it waits for the step in
# progress (after a peer died, rank 0's step ends at its next barrier) so the runner's
# views of the TP domain's windows are gone before the domain is released.
_EXEC_LOCK = threading.Lock()
CLOSE_WAIT_S = 60.0


def execute_rank(runner_id: str, plan: bytes, disk: DiskLoads | None = None) -> bytes | None:
    """One step on this rank. ``disk``: the pages this step's ``PageLoad``s read from
    the disk tier, with rank 0's leases; this rank reads its own shard of them straight
    from its store while executing the plan. A read that fails on any rank is no error:
    every rank skips the forward and rank 0's result says why
    (``StepResult.load_failures``); the leases are released either way."""
    from .runner import get_runner

    failed: str | None = None
    with _EXEC_LOCK:
        runner = get_runner(runner_id)
        rank = runner.comm.rank
        try:
            if disk is not None:
                expect_loads(runner.staging, disk)
            result = runner.execute(decode_plan(plan))
            if disk is not None and rank == 0:
                # every rank is past its loads: the all-gather that agreed on them (and the
                # forward's collectives, if it ran) came after them
                release_leases(disk.cache_id, disk.leases())
        except Exception as exc:  # noqa: BLE001  re-raised below, without its frames
            # the traceback's frames hold tensors over the domain's windows: keep only
            # the message, so nothing maps the windows once the step is over
            failed = f"{type(exc).__name__}: {exc}"
    if failed is not None:
        raise EngineError(f"rank {rank}: step failed: {failed}")
    return encode_result(result) if rank == 0 else None


def _rest(runner: Any) -> None:
    """A wait slice passed with no step: memory no step needs goes back (the disk tier's
    stored pages, then the heap's free pages: ``worker/heap.py``)."""
    if isinstance(runner.staging, PageStaging) and runner.staging.release_stored():
        TRIMMER.worked()  # the stores' copies were freed into the heap too
    TRIMMER.idle()


def _run_step(runner_id: str, rank: int, message: StepMessage) -> tuple[bytes | None, str | None]:
    """One step message on this rank: (rank 0's encoded result, None), or (None, the
    error that names this rank)."""
    TRIMMER.worked()
    try:
        _STEP.hit()
        return execute_rank(runner_id, message.plan, message.disk), None
    except Exception as exc:  # noqa: BLE001  answered: the parent fails the step
        return None, (str(exc) if isinstance(exc, EngineError) else
                      f"rank {rank}: step failed: {type(exc).__name__}: {exc}")


def serve_steps(runner_id: str, channel: str, tp: int) -> int:
    """This rank's step loop on one host (the data plane, ``worker/step_channel.py``):
    every step message is run with :func:`execute_rank` and answered through the
    channel, a failed step with its error (the loop serves on: the parent decides).
    Ends at STOP, or when the parent is gone; returns the steps it served."""
    from .runner import get_runner

    runner = get_runner(runner_id)
    rank = runner.comm.rank
    end = RankEnd(channel, rank, tp)
    parent = os.getppid()
    served = 0
    try:
        while True:
            kind, seq, message = end.next(lambda: os.getppid() == parent,
                                          lambda: _rest(runner))
            if kind is Kind.STOP:
                return served
            if message is None:  # HELLO: mapped
                end.answer(seq)
                continue
            result, error = _run_step(runner_id, rank, message)
            end.answer(seq, result=result, error=error)
            served += error is None
    finally:
        end.close()


# a multi-host step loop's frames over the TP group: a step message follows, the loop
# ends, or nothing (rank 0 idles: its peers' broadcast must not reach the group's timeout)
_FRAME_STEP, _FRAME_STOP, _FRAME_ALIVE = b"S", b"X", b"A"


def serve_host_steps(runner_id: str, channel: str, keepalive_s: float) -> int:
    """This rank's step loop in a multi-host engine (the data plane across hosts):
    rank 0, on the parent's host, reads each message from the step channel as one host's
    ranks do and broadcasts it over the TP group (``TPComm.broadcast_bytes``, the same
    torch.distributed group the step's collectives use); every rank runs it with
    :func:`execute_rank`, and rank 0 alone answers. A step failed on a peer ends the
    peer's loop with the error (the parent sees that loop end and fails the step, naming
    the rank), as the group cannot go on without it. While idle rank 0 broadcasts a
    keep-alive every ``keepalive_s`` (under the group's timeout). Ends at STOP, or when
    the parent is gone (rank 0 then stops its peers); returns the steps it served."""
    from .runner import get_runner

    runner = get_runner(runner_id)
    comm = runner.comm
    rank = comm.rank
    end = RankEnd(channel, 0, 1) if rank == 0 else None
    parent = os.getppid()
    served = 0
    sent = time.monotonic()

    def idle() -> None:
        nonlocal sent
        _rest(runner)
        if time.monotonic() - sent > keepalive_s:
            comm.broadcast_bytes(_FRAME_ALIVE)
            sent = time.monotonic()

    try:
        while True:
            seq = 0
            if end is not None:
                kind, seq, message = end.next(lambda: os.getppid() == parent, idle)
                if kind is Kind.HELLO:
                    end.answer(seq)
                    continue
                frame = (_FRAME_STOP if message is None
                         else _FRAME_STEP + encode_message(message))
                comm.broadcast_bytes(frame)
                sent = time.monotonic()
            else:
                frame = comm.broadcast_bytes(None)
            if frame[:1] == _FRAME_STOP:
                return served
            if frame[:1] == _FRAME_ALIVE:
                _rest(runner)
                continue
            result, error = _run_step(runner_id, rank, decode_message(frame[1:]))
            if end is not None:
                end.answer(seq, result=result, error=error)
            elif error is not None:
                raise EngineError(error)
            served += error is None
    finally:
        if end is not None:
            end.close()


def close_rank(runner_id: str, leave_group: bool = False) -> None:
    """Close this rank's runner; ``leave_group``: then leave its torch.distributed group."""
    from .runner import close_runner

    if not _EXEC_LOCK.acquire(timeout=CLOSE_WAIT_S):
        raise EngineError(f"runner {runner_id}: a step still runs after {CLOSE_WAIT_S:g}s; "
                          "cannot close it")
    try:
        close_runner(runner_id)
    finally:
        _EXEC_LOCK.release()
        if leave_group:
            destroy()
    gc.collect()   # frames of a failed step may sit in reference cycles
