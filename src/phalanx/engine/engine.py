"""The parent-side engine loop: admit, schedule, run one plan on every rank, finish.

One :class:`Engine` owns a :class:`RankGroup` (a Worker with ``tensor_parallel_size``
ranks; each rank holds a :class:`~phalanx.engine.runner.Runner` over a shared-memory TP
domain, or over torch.distributed on CUDA: ``device``, engine/devices.py) and a
:class:`~phalanx.engine.scheduler.Scheduler`. :meth:`Engine.step` runs one step: the
scheduler's plan is encoded once and sent to every rank, rank 0's sampled
tokens come back, and each request is advanced: incremental detokenization, then EOS,
stop token ids, stop strings, ``max_tokens`` and the context decide whether it ends.

A rank that dies during a step fails every request in flight with an
:class:`EngineDeadError` naming the rank, and poisons the engine: later calls raise the
same error; :meth:`Engine.close` still releases everything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..kvstore import fingerprint_digest
from ._errors import EngineDeadError, EngineError, RequestError, SchedulerError
from .devices import resolve_devices
from .disk_tier import DiskTier
from .outputs import CompletionOutput, IncrementalDetokenizer, Logprob, RequestOutput
from .plan import decode_result, encode_plan
from .ranks import RankGroup, TPRanks
from .sampling import SamplingParams, StopChecker
from .scheduler import PrefixTier, Sampled, Scheduler, SchedulerConfig
from .sequence import FinishReason
from .sequence import Sequence as Seq

__all__ = ["Engine", "EngineConfig", "RankGroup", "TokenizerLike", "model_fingerprint"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


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
    device: str = "cpu"                    # "cpu", "cuda" or "cuda:N" (engine/devices.py)
    tp_comm: str = "auto"                  # shared memory on CPU, NCCL on CUDA; or "gloo"


_NOT_IN_KV = ("max_model_len", "eos_token_ids")


def model_fingerprint(model_dir: str | Path, config: dict[str, Any], tp: int,
                      page_tokens: int) -> bytes:
    """The root of the page-key chain: config, dtype, the weight files' headers and sizes
    (a GGUF file's tensor data), TP size and page size. Stable across processes and
    restarts; never reads safetensors weights.
    What cannot change a KV byte (the serving context length, EOS ids) is left out, so a
    server restarted with another ``--max-model-len`` keeps its cache."""
    h = hashlib.blake2b(digest_size=16)
    kv_config = {k: v for k, v in config.items() if k not in _NOT_IN_KV}
    h.update(json.dumps(kv_config, sort_keys=True, default=str).encode())
    h.update(f"|tp={tp}|page={page_tokens}|".encode())
    from .gguf_file import is_gguf, open_gguf

    if is_gguf(model_dir):     # a GGUF file: a digest of every tensor byte
        h.update(f"gguf:{open_gguf(model_dir).data_digest()}".encode())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = fh.read(min(n, 64 << 20))
        h.update(f"{f.name}:{size}:".encode())
        h.update(header)
    return fingerprint_digest(h.digest())


class _Request:
    __slots__ = ("cum_logprob", "detok", "error", "logprobs", "output", "prompt",
                 "request_id", "sent", "seq", "stop")

    def __init__(self, request_id: str, prompt: str | None, seq: Seq,
                 decode: Callable[[list[int]], str] | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.seq = seq
        p = seq.params
        self.detok = IncrementalDetokenizer(decode, seq.prompt_tokens) if decode else None
        self.stop = StopChecker(p.stop_strings, p.include_stop_str_in_output)
        self.logprobs: list[dict[int, Logprob]] | None = [] if p.logprobs is not None else None
        self.cum_logprob: float | None = 0.0 if p.logprobs is not None else None
        self.output = ""
        self.sent = 0          # characters of output already streamed
        self.error: BaseException | None = None


class Engine:
    """The engine loop over one rank group; see the module docstring."""

    def __init__(self, config: EngineConfig, tokenizer: TokenizerLike | None = None,
                 tier: PrefixTier | None = None,
                 eos_token_ids: Sequence[int] | None = None, hosts: Any = None) -> None:
        """``hosts``: a :class:`~phalanx.hosts.MultiHostWorker` whose ranks are the TP
        ranks (several hosts, over torch.distributed); None: ranks on this host."""
        from .config import load_config

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
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(mcfg.eos_token_ids if eos_token_ids is None
                                   else eos_token_ids)
        num_pages = config.num_pages or self._default_pages(mcfg.num_layers,
                                                           mcfg.num_kv_heads, mcfg.num_heads,
                                                           mcfg.head_dim, mcfg.dtype, tp)
        self.max_model_len = mcfg.max_model_len
        sched_cfg = SchedulerConfig(
            num_pages=num_pages, page_tokens=config.page_tokens,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=mcfg.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            check_invariants=False,
        )
        self.fingerprint = model_fingerprint(config.model, mcfg.to_dict(), tp,
                                             config.page_tokens)
        self.scheduler = Scheduler(sched_cfg, self.fingerprint, tier)
        kwargs: dict[str, Any] = {"num_pages": num_pages, "page_tokens": config.page_tokens,
                                  "max_model_len": mcfg.max_model_len}
        if config.dtype is not None:
            kwargs["dtype"] = config.dtype
        disk = config.prefix_cache_disk
        self.hosts = hosts
        group_type: Any = functools.partial(RankGroup, devices=devices)
        if hosts is not None:
            from .host_ranks import HostRankGroup

            group_type = functools.partial(HostRankGroup, hosts)
        self.group: TPRanks = group_type(config.model, tp, kwargs,
                                         step_timeout=config.step_timeout,
                                         start_timeout=config.start_timeout, seed=config.seed,
                                         staging=disk is not None and tier is None)
        self.disk_tier: DiskTier | None = None
        self.disk_cache: Any = None
        if disk is not None and tier is None:
            try:
                self._open_disk(disk)
            except BaseException:
                self.group.close(timeout=config.step_timeout)
                raise
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._dead: EngineDeadError | None = None
        self._lock = threading.Lock()
        # add_request, abort and step may come from different threads (a server's
        # handlers and its engine thread): one step at a time, requests between steps
        self._step_lock = threading.RLock()
        self._closed = False

    def _open_disk(self, directory: str) -> None:
        """Recover and reconcile the replicated disk tier (before the engine is ready)."""
        from ..kvstore import Geometry
        from ..replication import ReplicatedCache
        from .identity import local_kv_heads
        from .staging import staging_source

        m = self.model_config
        geometry = Geometry(layers=m.num_layers, kv_heads=self.group.memory[0]["kv_heads_local"],
                            head_dim=m.head_dim, dtype=m.dtype,
                            page_tokens=self.config.page_tokens)
        # the operator commands derive the same identity offline (engine/identity.py)
        if local_kv_heads(m.num_kv_heads, self.config.tensor_parallel_size) != \
                geometry.kv_heads:
            raise EngineError("engine.identity.local_kv_heads disagrees with the runner's "
                              "shard: offline cache commands would write another geometry")
        if self.hosts is not None:  # the ranks span hosts: each keeps its shard there
            from .host_disk import HostsDiskCache

            self.disk_cache = HostsDiskCache.open(
                self.hosts, directory, geometry=geometry, fingerprint=self.fingerprint,
                capacity_bytes=self.config.prefix_cache_disk_bytes,
                max_age=self.config.prefix_cache_max_age)
        else:
            self.disk_cache = ReplicatedCache.open(
                self.group.worker, directory, geometry=geometry,
                fingerprint=self.fingerprint,
                capacity_bytes=self.config.prefix_cache_disk_bytes,
                max_age=self.config.prefix_cache_max_age,
                kv_source_factory=staging_source)
        self.disk_tier = DiskTier(self.disk_cache, self.group, self.config.page_tokens,
                                  self.fingerprint)
        self.scheduler.tier = self.disk_tier

    def _default_pages(self, layers: int, kv_heads: int, heads: int, head_dim: int,
                       dtype: str, tp: int) -> int:
        from .identity import local_kv_heads

        local = local_kv_heads(kv_heads, tp)
        page = layers * 2 * self.config.page_tokens * local * head_dim * _DTYPE_BYTES.get(
            dtype, 4)
        return max(4, self.config.kv_cache_bytes // page)

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, prompt: str | None = None) -> None:
        with self._step_lock:
            self._add(request_id, prompt_token_ids, params, prompt)

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             prompt: str | None) -> None:
        self._check_alive()
        if request_id in self._requests:
            raise RequestError(f"request {request_id!r} is already running")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {request_id!r}: token ids {bad[:5]} are outside "
                               f"the vocabulary of {vocab}")
        seq = Seq(prompt_token_ids, params)
        decode = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            skip = params.skip_special_tokens

            def decode(ids: list[int]) -> str:
                return tok.decode(ids, skip_special_tokens=skip)
        req = _Request(request_id, prompt, seq, decode)
        self.scheduler.add(seq)
        self._requests[request_id] = req
        self._by_seq[seq.seq_id] = req

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its pages are freed at the next step."""
        with self._step_lock:
            req = self._requests.get(request_id)
            return req is not None and self.scheduler.abort(req.seq.seq_id)

    def reset_prefix_cache(self) -> bool:
        """Drop the memory tier (not the disk tier); False while requests hold pages."""
        with self._step_lock:
            return self.scheduler.pool.reset()

    def drain_disk_stores(self, timeout: float) -> bool:
        """Wait until every store queued for the disk tier ran (True at once without
        one); False if ``timeout`` passed first."""
        return self.disk_tier is None or self.disk_tier.drain(timeout)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine died (a rank lost, a step failed), or None while it serves."""
        return self._dead

    def lost_ranks(self) -> str | None:
        """A sentence naming the ranks that are gone, checked without a step (so an idle
        engine notices a death too), or None while every rank is alive."""
        return self.group.lost_ranks()

    def stats(self) -> dict[str, Any]:
        """Gauges and counters for a server's metrics (cheap: no call into the ranks)."""
        pool, sched, c = self.scheduler.pool, self.scheduler, self.scheduler.pool.counters
        memory, disk, computed = c.prompt_memory, c.prompt_disk, c.prompt_computed
        return {
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "kv_cache_usage_perc": 1.0 - pool.num_free / pool.num_pages,
            "kv_pages_total": pool.num_pages,
            "ranks_alive": len(self.group.worker.alive_ranks()),
            "prefix_cache_queries": memory + disk + computed,
            "prefix_cache_hits_memory": memory,
            "prefix_cache_hits_disk": disk,
            "prompt_tokens_computed": computed,
            "num_preemptions": c.preemptions,
            **self._rank_memory(),
            **self._disk_stats(),
        }

    def _rank_memory(self) -> dict[str, dict[int, int]]:
        """Each rank's weights (as held: quantized ones at 4 or 8 bits), KV pool and
        resident set, as its runner reported them when it opened."""
        mem = self.group.memory
        return {"rank_weight_bytes": {int(m["rank"]): int(m["weight_bytes"]) for m in mem},
                "rank_kv_cache_bytes": {int(m["rank"]): int(m["kv_bytes"]) for m in mem},
                "rank_resident_bytes": {int(m["rank"]): int(m.get("rss_bytes", 0))
                                        for m in mem}}

    def _disk_stats(self) -> dict[str, Any]:
        tier = self.disk_tier
        if tier is None:
            return {}
        s = tier.stats
        return {"disk_tier_stores": s.stores, "disk_tier_store_failures": s.store_failures,
                "disk_tier_lookups": s.lookups,
                "disk_tier_lookups_skipped": s.lookups_skipped,
                "disk_tier_pages_loaded": s.pages_loaded,
                "disk_tier_load_failures": s.load_failures,
                "disk_tier_maintenance_jobs": s.maintenance_jobs,
                "cache_disk_stores_pending": tier.pending}

    def disk_records(self, timeout: float = 10.0) -> dict[str, dict[int, int]]:
        """Records and bytes of each rank's disk tier (asks every rank: not per request)."""
        if self.disk_cache is None:
            return {}
        per_rank = self.disk_cache.stats(timeout=timeout)
        records = {r: int(s.get("stats", {}).get("records", 0)) for r, s in per_rank.items()}
        sizes = {r: int(s.get("stats", {}).get("bytes", 0)) for r, s in per_rank.items()}
        queued = max((int(s.get("stats", {}).get("maintenance_queued", 0))
                      - int(s.get("stats", {}).get("maintenance_done", 0))
                      for s in per_rank.values()), default=0)
        return {"cache_disk_records": records, "cache_disk_bytes": sizes,
                "cache_maintenance_queue": {0: max(0, queued)}}

    @property
    def counters(self) -> Any:
        return self.scheduler.pool.counters

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("the engine was closed")

    # -- one step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that advanced or ended."""
        with self._step_lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        self._check_alive()
        try:
            plan, aborted = self.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001  a half-done schedule cannot be trusted
            # earlier admissions of this schedule may have keyed pages whose disk loads
            # now never run: a later prefix hit would read pages without their KV, so
            # the engine is poisoned rather than left half-keyed (issue 34)
            return self._die(exc, "while scheduling", who="the scheduler")
        outs = [self._finish(self._by_seq[s.seq_id], FinishReason.ABORT) for s in aborted]
        if plan is None:
            if self.scheduler.has_work and not outs:
                # every request is admitted only if it fits an empty pool: a step with
                # work and nothing to run is a scheduler bug, not a wait
                w = self.scheduler.waiting[0] if self.scheduler.waiting else None
                raise SchedulerError(
                    f"engine: {len(self.scheduler.waiting)} waiting and "
                    f"{len(self.scheduler.running)} running requests but nothing to "
                    f"schedule (head of the queue: {w!r}; free pages "
                    f"{self.scheduler.pool.num_free})")
            return outs
        try:
            # the ranks read the step's disk pages themselves, under rank 0's leases
            disk = self.disk_tier.loads(plan) if self.disk_tier is not None else None
            raw = self.group.execute(encode_plan(plan), disk)
        except Exception as exc:  # noqa: BLE001  any failure of a step kills the engine
            return outs + self._die(exc, f"during step {plan.step}")
        result = decode_result(raw)
        if result.load_failures and self.disk_tier is not None:
            self.disk_tier.load_failed(plan, result.load_failures)  # the step ran nowhere
        for s in self.scheduler.update(result):
            outs.append(self._advance(s))
        return outs

    def _die(self, exc: BaseException, when: str, who: str | None = None
             ) -> list[RequestOutput]:
        if who is None:
            rank = getattr(exc, "rank", None)
            who = f"rank {rank}" if rank is not None else "a rank"
        dead = EngineDeadError(f"engine: {who} failed {when}: {type(exc).__name__}: {exc}")
        dead.__cause__ = exc
        self._dead = dead
        outs = []
        for seq in self.scheduler.fail_inflight():
            req = self._by_seq[seq.seq_id]
            req.error = dead
            outs.append(self._finish(req, FinishReason.ERROR))
        return outs

    def _advance(self, s: Sampled) -> RequestOutput:
        req = self._by_seq[s.seq.seq_id]
        seq, p, tok = s.seq, s.seq.params, s.token
        if req.logprobs is not None and s.logprobs is not None:
            entry = {c: Logprob(lp, rank=i + 1) for i, (c, lp) in enumerate(s.logprobs.top)}
            if tok not in entry:
                entry[tok] = Logprob(s.logprobs.logprob, rank=None)
            req.logprobs.append(entry)
            if req.cum_logprob is not None:
                req.cum_logprob += s.logprobs.logprob
        reason: FinishReason | None = None
        if p.stop_token_ids and tok in p.stop_token_ids:
            reason, seq.stop_reason = FinishReason.STOP, tok
        elif not p.ignore_eos and tok in self.eos_token_ids:
            reason = FinishReason.STOP
        start = len(req.output)
        if reason is None and req.detok is not None:
            req.detok.push(tok)
            req.output = req.detok.text
            if req.stop:
                cut = req.stop.check(req.output, start)
                if cut is not None:
                    req.output = req.output[:cut]
                    reason, seq.stop_reason = FinishReason.STOP, req.stop.matched
        if reason is None and p.max_tokens is not None and seq.num_output >= p.max_tokens:
            reason = FinishReason.LENGTH
        if reason is None and len(seq) >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            return self._finish(req, reason, delta_tokens=[tok])
        return self._output(req, delta_tokens=[tok])

    def _finish(self, req: _Request, reason: FinishReason,
                delta_tokens: list[int] | None = None) -> RequestOutput:
        self.scheduler.finish(req.seq, reason)
        self._requests.pop(req.request_id, None)
        self._by_seq.pop(req.seq.seq_id, None)
        return self._output(req, delta_tokens=delta_tokens)

    def _output(self, req: _Request, delta_tokens: list[int] | None) -> RequestOutput:
        seq = req.seq
        fr = seq.finish_reason.value if seq.finish_reason is not None else None
        text = req.output
        if fr is None and req.stop:
            # hold back what may be the start of a stop string
            text = text[: max(0, len(text) - req.stop.holdback)]
        delta = text[req.sent :]
        req.sent = max(req.sent, len(text))
        comp = CompletionOutput(
            index=0, text=text, token_ids=list(seq.output_tokens),
            cumulative_logprob=req.cum_logprob,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=fr, stop_reason=seq.stop_reason,
            delta_text=delta,
            delta_token_ids=list(delta_tokens or []),
        )
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=list(seq.prompt_tokens), outputs=[comp], finished=fr is not None,
            num_cached_tokens=seq.cached_tokens, cached_tokens_memory=seq.cached_memory,
            cached_tokens_disk=seq.cached_disk, error=req.error,
        )

    def close(self) -> None:
        """Fail what is left, stop the ranks and release everything (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with self._step_lock:
            for req in list(self._requests.values()):
                self._finish(req, FinishReason.ABORT)
        try:
            if self.disk_tier is not None:
                self.disk_tier.close(timeout=self.config.step_timeout)
            if self.disk_cache is not None and self._dead is None:
                self.disk_cache.close()
        finally:
            self.group.close(timeout=self.config.step_timeout)
