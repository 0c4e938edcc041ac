"""The engine thread: one :class:`~phalanx.engine.Engine` stepped while work is pending,
bridged to the server's event loop.

The engine is synchronous (``add_request``, ``abort``, ``step``) and owned by one
thread, so nothing else ever touches it. Requests and aborts arrive through a command
queue; each step's outputs go to the request's asyncio queue with
``call_soon_threadsafe``. A client that goes away closes its stream, which queues an
abort: its pages are freed at the next step. A metrics scrape does not read the engine
either: it asks, and the engine thread takes ``engine.stats()`` at its next step
boundary (the ranks' gauges, which do not touch the scheduler, come from
``Engine.gauges()`` on the scrape's thread). The driver reaches the engine through
its public methods only: requests, ``step``, ``stats``, ``gauges``, ``lost_ranks``.
A step that gave a request its first token lets the HTTP layer write it out (at most
``_FLUSH_WAIT_S``) before the next step takes the cores: time to first token.

Health: the driver is healthy while the engine runs and every rank is alive. A rank
that dies fails every request in flight at once (the engine's step raises, the runtime
fails every outstanding task of the dead rank's job) and the driver turns unhealthy;
an idle engine is watched too (``Worker.alive_ranks`` every ``watch_interval``), so
``/health`` turns 503 within a second or two without a request to notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.engine import Engine, SamplingParams
from phalanx.engine.core.outputs import StepDelta
from phalanx.engine.model.tokenizer import Tokenizer
from phalanx.errors import EngineDeadError
from phalanx.lifecycle.failpoints import Failpoint

from .api.engine_client import Delta, Health
from .api.errors import APIError
from .api.tools.render import render_messages

__all__ = ["EngineDriver", "RequestStream"]

log = logging.getLogger("phalanx.serve")

_DISK_STATS_S = 2.0   # the ranks' gauges are asked at most this often
_STATS_WAIT_S = 5.0   # a scrape waits at most this long for the next step boundary
# After a step that gave a request its first token, the next step waits at most this
# long for the HTTP layer to write that token out: the ranks' next step otherwise takes
# the cores (2 here) from the event loop and the client, and the first token reached
# the client 1-9 ms after its step ended (issue 15's profile of one disk hit).
_FLUSH_WAIT_S = 0.005

# a request passed admission's first checks; its stream is about to be registered
_ADMIT = Failpoint("serve.driver.admit")


@dataclass(frozen=True)
class _Add:
    """Admit a request into the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    """Cancel a request: its pages are freed at the next step."""

    request_id: str


_Command = _Add | _Abort


_CLOSED = object()  # put in a stream's queue by close(): wakes a pending pull


class RequestStream:
    """One engine request as the HTTP layer reads it: its deltas in order, then the end.

    Not an async generator on purpose: closing one while another task waits on its
    next delta (a merged response's pump, a gather of first deltas) must free its slot
    and abort it at once, where an async generator's ``aclose`` raises "already
    running" and the abort was lost (issue 45). ``close`` is synchronous, idempotent
    and callable from any point of the event loop.
    """

    def __init__(self, driver: EngineDriver, request_id: str,
                 loop: asyncio.AbstractEventLoop, submitted: float) -> None:
        self._driver = driver
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[Delta | BaseException | object] = asyncio.Queue()
        self.submitted = submitted
        self.admitted: float | None = None  # when the engine thread handed it to the engine
        self.first_sent = False
        self.unflushed = False  # its first delta was delivered, not yet written out
        self.closed = False     # closed: nothing of it is written any more
        self._pulled = False    # a delta was handed out (the next pull flushes it)
        self._finished = False  # its final delta or error arrived

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._pulled:
            # pulled again: the consumer wrote the previous delta out (a streamed
            # response's chunk was sent before the next one is asked for)
            self._driver._flushed(self)
        if self._finished or self.closed:
            self.close()
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _CLOSED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finished = True
            self.close()
            raise item
        assert isinstance(item, Delta)
        self._finished = item.finish_reason is not None
        self._pulled = True
        return item  # the final delta too: the slot is held until we are closed

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._driver._release(self, self._finished)
        self.queue.put_nowait(_CLOSED)

    async def aclose(self) -> None:
        self.close()


class EngineDriver:
    """Implements the HTTP layer's EngineClient on an engine thread."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, *,
                 max_pending: int, watch_interval: float = 0.5,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template: str | None = getattr(tokenizer, "chat_template", None)
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.max_pending = max_pending
        self._watch_interval = watch_interval
        self._on_death = on_death
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        # Invariant: a request id is in _streams from its submission until its final
        # delta (or an error) was handed to its queue.
        self._streams: dict[str, RequestStream] = {}
        # The admission slots (max_pending): a request holds one from its submission
        # until its iterator is closed, which the HTTP layer does when the response
        # ended or the client left -- not when the engine finished generating, so a
        # finished request still streaming to a slow client is counted (vLLM's rule).
        self._slots: set[str] = set()
        # A run's followers (generate_many's n), by its leader's request id: queued
        # until the leader's prompt is computed (or it ended, or failed); under _lock.
        self._followers: dict[str, list[_Add]] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopping = False
        # stats: scrapes ask (_stats_asked), the engine thread answers between steps
        self._stats_cv = threading.Condition()
        self._stats_asked = 0
        self._stats_taken = 0
        self._stats_snapshot: dict[str, Any] = {}
        self._gauges_lock = threading.Lock()
        self._gauges: dict[str, Any] = {}
        self._gauges_at = -_DISK_STATS_S
        self._flush_cv = threading.Condition()
        self._unflushed = 0  # streams whose first delta is delivered, not yet written
        self._thread = threading.Thread(target=self._loop, name="phalanx-engine", daemon=True)
        self._thread.start()

    # -- EngineClient -------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def chat_prompt(self, messages: Sequence[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        msgs, extra = render_messages(messages, tools, self.chat_template)
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **extra)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def health(self) -> Health:
        dead = self._dead
        if dead is not None:
            return Health(False, f"the engine is dead: {dead}")
        if self._stopping:
            return Health(False, "the server is shutting down")
        return Health(True)

    def stats(self) -> dict[str, Any]:
        """The engine's gauges, taken by the engine thread between two steps (never read
        here while it steps), and the ranks' gauges (disk tier records and bytes per
        rank, maintenance queue, link windows, uncertain resources), asked of the ranks
        at most every ``_DISK_STATS_S``: a scrape must not cost a run per rank."""
        out = self._engine_stats()
        if "error" in out:
            return out
        with self._gauges_lock:  # one scrape asks the ranks; the others reuse its answer
            now = time.monotonic()
            if now - self._gauges_at > _DISK_STATS_S:
                try:
                    self._gauges = self.engine.gauges().as_metrics()
                except Exception as exc:  # noqa: BLE001  a scrape must not fail while the engine dies
                    log.warning("metrics: the ranks' gauges are unavailable: %s", exc)
                    self._gauges = {}
                self._gauges_at = now
            out.update(self._gauges)
        return out

    def _engine_stats(self) -> dict[str, Any]:
        """``engine.stats()`` as the engine thread took it at its next step boundary (at
        most ``_STATS_WAIT_S`` away; past that, the last snapshot it took)."""
        with self._stats_cv:
            self._stats_asked += 1
            want = self._stats_asked
        self._wake.set()
        with self._stats_cv:
            taken = self._stats_cv.wait_for(
                lambda: self._stats_taken >= want or not self._thread.is_alive(),
                _STATS_WAIT_S)
            if taken and self._stats_taken >= want:
                return dict(self._stats_snapshot)
            if self._thread.is_alive():  # a step longer than the wait: the last figures
                return dict(self._stats_snapshot)
        try:  # the engine thread is gone: nothing else touches the engine any more
            return self.engine.stats().as_metrics()
        except Exception as exc:  # noqa: BLE001  a scrape must not fail while the engine dies
            return {"error": str(exc)}

    def _take_stats(self) -> None:
        """On the engine thread, between steps: answer the scrapes waiting for figures."""
        with self._stats_cv:
            asked = self._stats_asked
            if asked == self._stats_taken:
                return
        try:
            snapshot = self.engine.stats().as_metrics()
        except Exception as exc:  # noqa: BLE001  a scrape must not fail while the engine dies
            snapshot = {"error": str(exc)}
        with self._stats_cv:
            self._stats_snapshot = snapshot
            self._stats_taken = asked
            self._stats_cv.notify_all()

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> RequestStream:
        """One request (see :meth:`generate_many`)."""
        (stream,) = self.generate_many([(request_id, prompt_token_ids, params)])
        return stream

    def generate_many(self, requests: Sequence[tuple[str, list[int], SamplingParams]],
                      n: int = 1) -> list[RequestStream]:
        """Admit every request or none (issue 45: a list of 300 prompts once took 272
        slots, got its 503 and never gave them back): each gets an admission slot and a
        stream, or this raises -- ``EngineDeadError`` when the engine is dead or
        stopping, a 503 ``APIError`` when the slots left are fewer than asked.

        ``n``: the requests come in runs of ``n`` with one prompt (a request's ``n``
        choices, issue 46). The first of a run goes to the engine at once; the others
        follow it once its prompt is computed (its first delta), so their admission
        finds the prompt's full pages in the memory tier: one prefill per run, and
        each follower's ``cached_memory`` shows it."""
        if n < 1 or len(requests) % n:
            raise ValueError(f"generate_many: {len(requests)} requests are not runs of {n}")
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        _ADMIT.hit()
        with self._lock:
            # under the lock _die and close take their snapshot of the streams in: a
            # stream is either in that snapshot (it gets the error) or refused here
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if self._stopping:
                raise EngineDeadError("the server is shutting down")
            if len(self._slots) + len(requests) > self.max_pending:
                raise APIError(503, f"the server is at capacity: {len(self._slots)} "
                               f"requests in flight, {len(requests)} more asked (limit "
                               f"{self.max_pending}); retry shortly",
                               code="server_busy", retry_after=1)
            streams = []
            for rid, _, _ in requests:
                stream = RequestStream(self, rid, loop, now)
                self._slots.add(rid)
                self._streams[rid] = stream
                streams.append(stream)
            adds = [_Add(rid, prompt, params) for rid, prompt, params in requests]
            leaders = adds[::n]
            for i, leader in enumerate(leaders):
                if n > 1:
                    self._followers[leader.request_id] = adds[i * n + 1:(i + 1) * n]
        for leader in leaders:
            self._send(leader)
        return streams

    def _release(self, stream: RequestStream, finished: bool) -> None:
        """A stream was closed: its slot is free; unless it finished, abort it."""
        self._flushed(stream, closed=True)
        with self._lock:
            self._slots.discard(stream.request_id)
        if not finished:  # the client went away (or the server stops): free its KV
            self._send(_Abort(stream.request_id))

    def fail_inflight(self, reason: str) -> int:
        """End every request in flight now with ``EngineDeadError(reason)`` and abort it
        (the server's shutdown deadline passed: its streams end with an error event,
        not a cut connection). Returns how many there were."""
        with self._lock:
            streams = list(self._streams)
        for rid in streams:
            self._deliver(rid, EngineDeadError(reason), final=True)
            self._send(_Abort(rid))
        return len(streams)

    def _flushed(self, stream: RequestStream, closed: bool = False) -> None:
        with self._flush_cv:
            stream.closed = stream.closed or closed
            if stream.unflushed:
                stream.unflushed = False
                self._unflushed -= 1
                self._flush_cv.notify_all()

    # -- the engine thread ------------------------------------------------------------

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: Delta | BaseException, final: bool) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None) if final else \
                self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _release_followers(self, leader: str) -> None:
        """On the engine thread: the leader's prompt is computed (or it ended): its
        followers go to the engine now, each that is still wanted (not closed)."""
        with self._lock:
            follow = self._followers.pop(leader, [])
            wanted = [a for a in follow
                      if (s := self._streams.get(a.request_id)) is not None and not s.closed]
        for add in wanted:
            self._add(add)

    def _add(self, command: _Add) -> None:
        rid = command.request_id
        try:
            self.engine.add_request(rid, command.prompt_token_ids, command.params)
        except Exception as exc:  # noqa: BLE001  this request's error, not the engine's
            self._deliver(rid, exc, final=True)
            self._release_followers(rid)
            return
        with self._lock:
            stream = self._streams.get(rid)
        if stream is not None:
            stream.admitted = time.monotonic()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self.engine.abort(command.request_id)
                with self._lock:
                    self._streams.pop(command.request_id, None)
                self._release_followers(command.request_id)
            else:  # a command this loop does not know is a bug, not something to drop
                raise TypeError(f"engine driver: unknown command {command!r}")

    def _loop(self) -> None:
        try:
            self._serve()
        finally:  # scrapes waiting for a step boundary read the engine themselves now
            with self._stats_cv:
                self._stats_cv.notify_all()

    def _serve(self) -> None:
        next_watch = time.monotonic() + self._watch_interval
        while not self._stopping:
            self._apply_commands()
            self._take_stats()
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001  any step failure is the engine's death
                    self._die(exc)
                    return
                for out in outputs:
                    try:
                        self._dispatch(out)
                    except Exception as exc:  # this request's error, not the engine's
                        log.exception("engine driver: request %s failed in its output",
                                      out.request_id)
                        self._deliver(out.request_id, exc, final=True)
                        self.engine.abort(out.request_id)
                if self.engine.dead is not None:
                    self._die(self.engine.dead)
                    return
                if self._unflushed and self.engine.has_unfinished():
                    with self._flush_cv:  # a first token goes out before the next step
                        self._flush_cv.wait_for(lambda: self._unflushed == 0, _FLUSH_WAIT_S)
            else:
                self._wake.wait(self._watch_interval)
                self._wake.clear()
            if time.monotonic() >= next_watch:
                next_watch = time.monotonic() + self._watch_interval
                lost = self.engine.lost_ranks()
                if lost:
                    self._die(EngineDeadError(f"engine: {lost}"))
                    return

    def _dispatch(self, out: StepDelta) -> None:
        """One request's step delta, as the HTTP layer's Delta, to its stream."""
        with self._lock:
            stream = self._streams.get(out.request_id)
            leads = out.request_id in self._followers
        if out.error is not None:
            self._deliver(out.request_id, out.error, final=True)
            if leads:
                self._release_followers(out.request_id)
            return
        logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        for tok, entry in zip(out.token_ids, out.logprobs or [], strict=False):
            top = sorted(((t, lp.logprob) for t, lp in entry.items() if lp.rank),
                         key=lambda x: -x[1])
            logprobs.append((tok, entry[tok].logprob, top))
        reason = out.finish_reason
        if reason == "abort":
            reason = "stop"
        queue_time = None
        if stream is not None and not stream.first_sent:
            stream.first_sent = True
            with self._flush_cv:
                if not out.finished and not stream.closed:  # (a closed one never flushes)
                    stream.unflushed = True
                    self._unflushed += 1
            if stream.admitted is not None:
                queue_time = stream.admitted - stream.submitted
        delta = Delta(token_ids=out.token_ids, text=out.text, logprobs=logprobs,
                      finish_reason=reason, prompt_tokens=out.num_prompt_tokens,
                      cached_memory=out.cached_tokens_memory,
                      cached_disk=out.cached_tokens_disk,
                      output_tokens=out.num_output_tokens, queue_time=queue_time)
        self._deliver(out.request_id, delta, final=out.finished)
        if leads:  # its prompt's pages are keyed now: hits for its followers
            self._release_followers(out.request_id)

    def _die(self, exc: BaseException) -> None:
        log.error("engine died: %s", exc)
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc))
        with self._lock:
            self._dead = exc
            streams = list(self._streams)
            self._followers.clear()
        for rid in streams:
            self._deliver(rid, err, final=True)
        if self._on_death is not None:
            self._on_death(exc)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread (what is in flight is aborted), then close the engine."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        with self._lock:
            streams = list(self._streams)
        for rid in streams:
            self._deliver(rid, EngineDeadError("the server is shutting down"), final=True)
        self.engine.close()
