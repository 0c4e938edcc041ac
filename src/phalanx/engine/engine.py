"""The engine, composed: its model's configuration, a scheduler, the TP ranks and the
disk tier, driven by the loop of ``core/loop.py``.

One :class:`Engine` owns an executor (``worker/local.py``'s ``RankGroup``: a Worker
with ``tensor_parallel_size`` ranks on this host, each with a runner over a
shared-memory TP domain or over torch.distributed on CUDA, ``worker/devices.py``; or
``multihost/executor.py``'s ``HostRankGroup`` across hosts), a
:class:`~phalanx.engine.core.scheduler.Scheduler`, and with ``prefix_cache_disk`` the
replicated disk tier (``engine/disk/``). This module is where the layers meet; the loop
itself knows only their protocols.

Everything is refused before any rank exists where it can be (a TP size the model does
not split into, a device that is not there), and everything opened is closed again if
a later part fails to open.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..kvstore import Geometry
from ..replication import ReplicatedCache
from ._errors import EngineError
from .core.executor import Executor
from .core.loop import EngineLoop, EngineStats, TokenizerLike
from .core.scheduler import PrefixTier, Scheduler, SchedulerConfig
from .disk.staging import staging_source
from .disk.tier import DiskTier
from .model.config import ModelConfig, load_config, local_kv_heads
from .model.fingerprint import model_fingerprint
from .model.gguf_file import forget_gguf_files
from .multihost.disk import HostsDiskCache
from .multihost.executor import HostRankGroup
from .worker.devices import resolve_devices
from .worker.gauges import EngineGauges, gather_gauges, rank_gauges
from .worker.local import RankGroup

__all__ = ["Engine", "EngineConfig", "EngineStats", "TokenizerLike"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tensor_parallel_size: int = 1
    page_tokens: int = 64
    num_pages: int | None = None            # default: kv_cache_bytes worth per rank
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    dtype: str | None = None
    enable_prefix_caching: bool = True
    step_timeout: float = 120.0
    start_timeout: float = 120.0
    seed: int = 0                          # unseeded requests draw from this on rank 0
    prefix_cache_disk: str | None = None   # the replicated disk tier's directory
    prefix_cache_disk_bytes: int = 1 << 30  # its capacity per rank
    prefix_cache_max_age: float | None = None  # seconds a leaf record may stay unused
    device: str = "cpu"                    # "cpu", "cuda" or "cuda:N" (worker/devices.py)
    tp_comm: str = "auto"                  # shared memory on CPU, NCCL on CUDA; or "gloo"


class Engine(EngineLoop):
    """The engine loop over parts it opens itself; see the module docstring.

    ``tier``: a prefix tier of the caller's instead of the disk tier (the scheduler's
    tests); ``hosts``: a :class:`~phalanx.hosts.MultiHostWorker` whose ranks are the TP
    ranks (several hosts, over torch.distributed); None: ranks on this host."""

    def __init__(self, config: EngineConfig, tokenizer: TokenizerLike | None = None,
                 tier: PrefixTier | None = None,
                 eos_token_ids: Sequence[int] | None = None, hosts: Any = None) -> None:
        self.config = config
        tp = config.tensor_parallel_size
        if tp < 1:
            raise EngineError(f"tensor_parallel_size={tp}: must be >= 1")
        if hosts is not None and (config.device != "cpu" or config.tp_comm != "auto"):
            raise EngineError(f"device={config.device!r}, tp_comm={config.tp_comm!r}: ranks "
                              "on several hosts run on CPU over gloo only (leave both at "
                              "their defaults)")
        # refused here, before any rank exists: no GPU, or fewer than NCCL needs
        devices = resolve_devices(config.device, tp, config.tp_comm)
        mcfg = load_config(config.model, max_model_len=config.max_model_len,
                           dtype=config.dtype)
        mcfg.check_tp(tp)      # before any rank exists, naming the sizes that work
        self.model_config = mcfg
        num_pages = config.num_pages or self._default_pages(mcfg, tp)
        self.fingerprint = model_fingerprint(config.model, mcfg.to_dict(), tp,
                                             config.page_tokens)
        # a GGUF file's parse (every metadata string as a numpy array: ~150 MB for a
        # 49k vocabulary) was kept for the config, the tokenizer and the digest; the
        # parent needs none of it again (a heal parses anew)
        forget_gguf_files()
        scheduler = Scheduler(SchedulerConfig(
            num_pages=num_pages, page_tokens=config.page_tokens,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=mcfg.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            check_invariants=False,
        ), self.fingerprint, tier)
        kwargs: dict[str, Any] = {"num_pages": num_pages, "page_tokens": config.page_tokens,
                                  "max_model_len": mcfg.max_model_len}
        if config.dtype is not None:
            kwargs["dtype"] = config.dtype
        disk = config.prefix_cache_disk if tier is None else None
        self.hosts = hosts
        open_executor: Any = (functools.partial(HostRankGroup, hosts) if hosts is not None
                              else functools.partial(RankGroup, devices=devices))
        executor: Executor = open_executor(config.model, tp, kwargs,
                                           step_timeout=config.step_timeout,
                                           start_timeout=config.start_timeout,
                                           seed=config.seed, disk_staging=disk is not None)
        connector: DiskTier | None = None
        if disk is not None:
            try:
                connector = self._open_disk(executor, disk)
            except BaseException:
                executor.close(timeout=config.step_timeout)
                raise
            scheduler.tier = connector
        self.disk_tier = connector
        super().__init__(scheduler, executor, connector=connector, tokenizer=tokenizer,
                         eos_token_ids=(mcfg.eos_token_ids if eos_token_ids is None
                                        else eos_token_ids),
                         max_model_len=mcfg.max_model_len, vocab_size=mcfg.vocab_size,
                         close_timeout=config.step_timeout)

    def _open_disk(self, executor: Executor, directory: str) -> DiskTier:
        """Recover and reconcile the replicated disk tier (before the engine is ready)."""
        m = self.model_config
        geometry = Geometry(layers=m.num_layers, kv_heads=executor.memory[0].kv_heads_local,
                            head_dim=m.head_dim, dtype=m.dtype,
                            page_tokens=self.config.page_tokens)
        # the operator commands derive the same identity offline (engine/disk/identity.py)
        if local_kv_heads(m.num_kv_heads, self.config.tensor_parallel_size) != \
                geometry.kv_heads:
            raise EngineError("model.config.local_kv_heads disagrees with the runner's "
                              "shard: offline cache commands would write another geometry")
        cache: Any
        if self.hosts is not None:  # the ranks span hosts: each keeps its shard there
            cache = HostsDiskCache.open(
                self.hosts, directory, geometry=geometry, fingerprint=self.fingerprint,
                capacity_bytes=self.config.prefix_cache_disk_bytes,
                max_age=self.config.prefix_cache_max_age)
        else:
            assert isinstance(executor, RankGroup)
            cache = ReplicatedCache.open(
                executor.worker, directory, geometry=geometry,
                fingerprint=self.fingerprint,
                capacity_bytes=self.config.prefix_cache_disk_bytes,
                max_age=self.config.prefix_cache_max_age,
                kv_source_factory=staging_source)
        try:
            return DiskTier(cache, executor, self.config.page_tokens, self.fingerprint)
        except BaseException:
            cache.close()
            raise

    def _default_pages(self, m: ModelConfig, tp: int) -> int:
        page = (m.num_layers * 2 * self.config.page_tokens * local_kv_heads(m.num_kv_heads, tp)
                * m.head_dim * _DTYPE_BYTES.get(m.dtype, 4))
        return max(4, self.config.kv_cache_bytes // page)

    def gauges(self, timeout: float = 10.0) -> EngineGauges:
        """What every rank holds now (asks each rank at once, beside the steps: a
        server's scrapes call it, at most every few seconds): uncertain resources and,
        with a disk tier, each rank's records, bytes, maintenance queue and rank 0's
        replication links. A rank that did not answer within ``timeout`` is left out."""
        cache_id = self.disk_tier.cache_id if self.disk_tier is not None else None
        per_rank = self.executor.on_each_rank(rank_gauges, cache_id, timeout=timeout)
        return gather_gauges(per_rank, self.executor.parent_uncertain(),
                             disk=cache_id is not None)
