"""The engine loop: admit, schedule, run one plan on every rank, finish.

:class:`EngineLoop` drives a :class:`~phalanx.engine.core.scheduler.Scheduler`, an
:class:`~phalanx.engine.core.executor.Executor` (the TP ranks) and, with a disk tier,
a :class:`~phalanx.engine.core.connector.KVConnector`. :meth:`EngineLoop.step` runs one
step: the scheduler's plan is encoded once and sent to every rank, rank 0's sampled
tokens come back, and each request is advanced: incremental detokenization, then EOS,
stop token ids, stop strings, ``max_tokens`` and the context decide whether it ends.
A step returns one :class:`~phalanx.engine.core.outputs.StepDelta` per request it
advanced or ended: what the step added, never the history (issue 43).

A rank that dies during a step fails every request in flight with an
:class:`EngineDeadError` naming the rank, and poisons the loop: later calls raise the
same error; :meth:`EngineLoop.close` still releases everything. A failure of the
parent's own step code before the plan leaves (encoding it) is not a rank's death: the
step ran nowhere, the scheduler undoes it, and the requests it blames end with a
:class:`StepFailedError` while the engine serves on (issue 45: a client's ``seed`` of
2**64 once failed the encoding, killed the engine and spent its restart budget).
Which parts it drives is the composition's business (``engine/engine.py``'s
``Engine``): this module knows none of the implementations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import msgspec

from phalanx.lifecycle.failpoints import Failpoint

from .._errors import EngineDeadError, RequestError, SchedulerError, StepFailedError
from .connector import ConnectorStats, KVConnector
from .executor import Executor
from .grammar import GrammarTable
from .outputs import IncrementalDetokenizer, Logprob, StepDelta
from .plan import StepPlan, decode_result, encode_plan
from .sampling import SamplingParams, StopChecker
from .scheduler import Sampled, Scheduler
from .sequence import FinishReason, Seq

__all__ = ["EngineLoop", "EngineStats", "TokenizerLike"]

_ENCODE = Failpoint("engine.step.encode")


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class EngineStats:
    """The loop's gauges and counters (cheap: no call into the ranks)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    kv_pages_total: int
    ranks_alive: int
    rank_alive: dict[int, int]             # rank -> 1 alive, 0 dead (the web page's)
    prefix_cache_queries: int
    prefix_cache_hits_memory: int
    prefix_cache_hits_disk: int
    prompt_tokens_computed: int
    num_preemptions: int
    rank_weight_bytes: dict[int, int]      # as held: quantized ones at 4 or 8 bits
    rank_kv_cache_bytes: dict[int, int]
    rank_resident_bytes: dict[int, int]    # when the rank opened
    disk: ConnectorStats | None = None     # None: no disk tier
    disk_stores_pending: int = 0

    def as_metrics(self) -> dict[str, Any]:
        """The figures under the names ``phalanx.serve.api.metrics`` exports: the loop's
        own under their field names, the disk tier's under ``_DISK_METRICS``."""
        out = {k: v for k, v in asdict(self).items() if k not in ("disk",
                                                                   "disk_stores_pending")}
        if self.disk is not None:
            out.update({name: getattr(self.disk, f) for f, name in _DISK_METRICS.items()})
            out["cache_disk_stores_pending"] = self.disk_stores_pending
        return out


# the disk tier's counters as metrics (ConnectorStats field -> exported name); its
# last_error and stores_dropped are read by the tests and logs, not exported
_DISK_METRICS = {f: f"disk_tier_{f}" for f in (
    "stores", "store_failures", "lookups", "lookups_skipped", "pages_loaded",
    "load_failures", "maintenance_jobs")}


class _Request:
    """What the loop keeps of a request between steps: its sequence, its detokenizer
    and stop checker, and how much of its text was reported."""

    __slots__ = ("detok", "error", "output", "request_id", "sent", "seq", "stop")

    def __init__(self, request_id: str, seq: Seq,
                 decode: Callable[[list[int]], str] | None) -> None:
        self.request_id = request_id
        self.seq = seq
        p = seq.params
        self.detok = IncrementalDetokenizer(decode, seq.prompt_tokens) if decode else None
        self.stop = StopChecker(p.stop_strings, p.include_stop_str_in_output)
        self.output = ""       # the text so far (stop strings are searched in it)
        self.sent = 0          # characters of it already reported
        self.error: BaseException | None = None


class EngineLoop:
    """The engine loop over one executor; see the module docstring."""

    def __init__(self, scheduler: Scheduler, executor: Executor, *,
                 connector: KVConnector | None, tokenizer: TokenizerLike | None,
                 eos_token_ids: Sequence[int], max_model_len: int, vocab_size: int,
                 close_timeout: float) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.connector = connector
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._close_timeout = close_timeout
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._dead: EngineDeadError | None = None
        self._lock = threading.Lock()
        # add_request, abort and step may come from different threads (a server's
        # handlers and its engine thread): one step at a time, requests between steps
        self._step_lock = threading.RLock()
        self._closed = False
        self._grammars = GrammarTable()   # what rank 0 holds of the structured outputs

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        with self._step_lock:
            self._add(request_id, prompt_token_ids, params)

    def _add(self, request_id: str, prompt_token_ids: list[int],
             params: SamplingParams) -> None:
        self._check_alive()
        if request_id in self._requests:
            raise RequestError(f"request {request_id!r} is already running")
        vocab = self.vocab_size
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
        req = _Request(request_id, seq, decode)
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
        return self.connector is None or self.connector.drain(timeout)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine died (a rank lost, a step failed), or None while it serves."""
        return self._dead

    def lost_ranks(self) -> str | None:
        """A sentence naming the ranks that are gone, checked without a step (so an idle
        engine notices a death too), or None while every rank is alive."""
        return self.executor.lost_ranks()

    def stats(self) -> EngineStats:
        """Gauges and counters for a server's metrics (cheap: no call into the ranks)."""
        pool, sched, c = self.scheduler.pool, self.scheduler, self.scheduler.pool.counters
        memory, disk, computed = c.prompt_memory, c.prompt_disk, c.prompt_computed
        mem = self.executor.memory
        tier = self.connector
        alive = set(self.executor.alive_ranks())
        return EngineStats(
            num_requests_running=len(sched.running),
            num_requests_waiting=len(sched.waiting),
            kv_cache_usage_perc=1.0 - pool.num_free / pool.num_pages,
            kv_pages_total=pool.num_pages,
            ranks_alive=len(alive),
            rank_alive={r: int(r in alive) for r in range(self.executor.tp)},
            prefix_cache_queries=memory + disk + computed,
            prefix_cache_hits_memory=memory,
            prefix_cache_hits_disk=disk,
            prompt_tokens_computed=computed,
            num_preemptions=c.preemptions,
            rank_weight_bytes={m.rank: m.weight_bytes for m in mem},
            rank_kv_cache_bytes={m.rank: m.kv_bytes for m in mem},
            rank_resident_bytes={m.rank: m.rss_bytes for m in mem},
            disk=tier.stats if tier is not None else None,
            disk_stores_pending=tier.pending if tier is not None else 0,
        )

    @property
    def counters(self) -> Any:
        return self.scheduler.pool.counters

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("the engine was closed")

    # -- one step ---------------------------------------------------------------------

    def step(self) -> list[StepDelta]:
        """Run one step; returns what it added to every request it advanced or ended."""
        with self._step_lock:
            return self._step()

    def _step(self) -> list[StepDelta]:
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
        grammars = [g for c in plan.chunks if c.sample and c.sampling.grammar is not None
                    and (g := self._by_seq[c.seq_id].seq.params.grammar) is not None]
        send, drop, done = self._grammars.prepare(grammars)
        if send or drop or done:
            plan = msgspec.structs.replace(plan, grammars=send, grammar_drop=drop,
                                           grammar_done=done)
        try:
            _ENCODE.hit()
            payload = encode_plan(plan)
        except Exception as exc:  # noqa: BLE001  the parent's own code: the requests' error
            return outs + self._fail_step(plan, exc)
        try:
            # the ranks read the step's disk pages themselves, under rank 0's leases
            disk = self.connector.loads(plan) if self.connector is not None else None
            raw = self.executor.execute(payload, disk)
        except Exception as exc:  # noqa: BLE001  any failure of a step kills the engine
            return outs + self._die(exc, f"during step {plan.step}")
        self._grammars.commit(grammars, drop, done)  # rank 0 applied it, loads or not
        result = decode_result(raw)
        if result.load_failures and self.connector is not None:
            self.connector.load_failed(plan, result.load_failures)  # the step ran nowhere
        for s in self.scheduler.update(result):
            outs.append(self._advance(s))
        return outs

    def _fail_step(self, plan: StepPlan, exc: Exception) -> list[StepDelta]:
        """The plan never left the parent: undo the step (as after a failed disk load)
        and end the requests whose own part does not encode -- all of the step's when
        none fails alone. The others run again at the next step."""
        blamed = {c.seq_id for c in plan.chunks if not _encodes(plan.step, c)}
        blamed = blamed or {c.seq_id for c in plan.chunks}
        outs = []
        for seq in self.scheduler.undo_step():
            if seq.seq_id not in blamed:
                continue
            req = self._by_seq[seq.seq_id]
            req.error = StepFailedError(
                f"engine: step {plan.step} could not be sent to the ranks for request "
                f"{req.request_id!r}: {type(exc).__name__}: {exc} (a bug in the engine's "
                f"step code; the step ran on no rank and the engine serves on)")
            req.error.__cause__ = exc
            outs.append(self._finish(req, FinishReason.ERROR))
        return outs

    def _die(self, exc: BaseException, when: str, who: str | None = None
             ) -> list[StepDelta]:
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

    def _advance(self, s: Sampled) -> StepDelta:
        req = self._by_seq[s.seq.seq_id]
        seq, p, tok = s.seq, s.seq.params, s.token
        logprobs: list[dict[int, Logprob]] | None = None
        if p.logprobs is not None and s.logprobs is not None:
            entry = {c: Logprob(lp, rank=i + 1) for i, (c, lp) in enumerate(s.logprobs.top)}
            if tok not in entry:
                entry[tok] = Logprob(s.logprobs.logprob, rank=None)
            logprobs = [entry]
        reason: FinishReason | None = None
        if p.stop_token_ids and tok in p.stop_token_ids:
            reason, seq.stop_reason = FinishReason.STOP, tok
        elif (not p.ignore_eos or p.grammar is not None) and tok in self.eos_token_ids:
            reason = FinishReason.STOP   # under a grammar, EOS is the grammar's end
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
            return self._finish(req, reason, [tok], logprobs)
        return self._delta(req, [tok], logprobs)

    def _finish(self, req: _Request, reason: FinishReason, tokens: list[int] | None = None,
                logprobs: list[dict[int, Logprob]] | None = None) -> StepDelta:
        self.scheduler.finish(req.seq, reason)
        if req.seq.params.grammar is not None:
            self._grammars.finished(req.seq.seq_id)
        self._requests.pop(req.request_id, None)
        self._by_seq.pop(req.seq.seq_id, None)
        return self._delta(req, tokens or [], logprobs)

    def _delta(self, req: _Request, tokens: list[int],
               logprobs: list[dict[int, Logprob]] | None) -> StepDelta:
        seq = req.seq
        fr = seq.finish_reason.value if seq.finish_reason is not None else None
        text = req.output
        if fr is None and req.stop:
            # hold back what may be the start of a stop string
            text = text[: max(0, len(text) - req.stop.holdback)]
        delta = text[req.sent:]
        req.sent = max(req.sent, len(text))
        return StepDelta(
            request_id=req.request_id, token_ids=tokens, text=delta,
            logprobs=logprobs if seq.params.logprobs is not None else None,
            num_prompt_tokens=len(seq.prompt_tokens), num_output_tokens=seq.num_output,
            cached_tokens_memory=seq.cached_memory, cached_tokens_disk=seq.cached_disk,
            finish_reason=fr, stop_reason=seq.stop_reason, error=req.error)

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
            if self.connector is not None:
                self.connector.close(self._close_timeout, healthy=self._dead is None)
        finally:
            self.executor.close(timeout=self._close_timeout)


def _encodes(step: int, chunk: Any) -> bool:
    """Whether one sequence's part of a plan encodes on its own."""
    try:
        encode_plan(StepPlan(step, [chunk]))
    except Exception:  # noqa: BLE001  the answer, not an error
        return False
    return True
