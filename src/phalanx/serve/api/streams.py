"""Running a request's choices: submit each, merge their deltas, abort on disconnect.

A request with several prompts runs them as concurrent engine requests (one choice
each); their deltas are merged as they come. The first delta of every choice is pulled
*before* the response starts, so an early error (the queue is full, the engine died)
still gets a real status code rather than an error inside a 200 stream. Closing the
merged stream (the client went away, or the response ended) closes every engine
stream, which aborts what is still running and frees its KV at the next step. When
one choice fails before the response starts, the pulls of the others are cancelled
and every stream is closed (issue 45: ``asyncio.gather`` left its siblings running
and their aborts were lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from .engine_client import Delta, RequestDeltas
from .metrics import Metrics

__all__ = ["Choices"]

_DONE = object()


class _Timing:
    """One choice's clock: first token, gaps between tokens, its end."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.prompt_tokens = 0

    def saw(self, d: Delta, now: float) -> None:
        if d.token_ids:
            if self.first is None:
                self.first = now
            elif self.last is not None:
                self.gaps.append(now - self.last)
            self.last = now
        self.prompt_tokens = d.prompt_tokens or self.prompt_tokens


class Choices:
    """The engine streams of one HTTP request, one per choice, started eagerly."""

    def __init__(self, streams: Sequence[RequestDeltas], metrics: Metrics) -> None:
        self._streams = list(streams)
        self._first: list[Delta | None] = [None] * len(streams)
        self._closed = False
        self._metrics = metrics
        started = time.monotonic()
        self._timing = [_Timing(started) for _ in streams]

    def _saw(self, i: int, d: Delta) -> None:
        now = time.monotonic()
        timing = self._timing[i]
        timing.saw(d, now)
        if d.token_ids:
            self._metrics.generated(len(d.token_ids))
        if d.finish_reason is not None:
            ttft = None if timing.first is None else timing.first - timing.started
            self._metrics.finished(d.finish_reason, timing.prompt_tokens, ttft,
                                   timing.gaps, now - timing.started, d.queue_time)

    async def start(self) -> None:
        """Pull each choice's first delta; raises what the engine raised (before any byte
        of the response is sent). On failure every stream is closed."""
        pulls = [asyncio.ensure_future(anext(aiter(s))) for s in self._streams]
        try:
            firsts = await asyncio.gather(*pulls)
        except BaseException:
            for p in pulls:
                p.cancel()
            await asyncio.gather(*pulls, return_exceptions=True)
            await self.aclose()
            raise
        self._first = list(firsts)
        for i, d in enumerate(self._first):
            if d is not None:
                self._saw(i, d)

    async def merged(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) in arrival order, first deltas first."""
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

        async def pump(i: int, stream: RequestDeltas) -> None:
            try:
                async for d in stream:
                    await queue.put((i, d))
                    if d.finish_reason is not None:
                        # not a pull past the last delta: the engine stream (and its
                        # admission slot) is closed by aclose when the response ends
                        break
            except Exception as exc:  # noqa: BLE001  re-raised in the consumer below
                await queue.put((i, exc))
            await queue.put((i, _DONE))

        for i, first in enumerate(self._first):
            if first is not None:
                yield i, first
        pending = {i for i, d in enumerate(self._first) if d is None or d.finish_reason is None}
        tasks = [asyncio.create_task(pump(i, self._streams[i])) for i in sorted(pending)]
        try:
            while pending:
                i, item = await queue.get()
                if item is _DONE:
                    pending.discard(i)
                elif isinstance(item, Exception):
                    raise item
                else:
                    assert isinstance(item, Delta)
                    self._saw(i, item)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._streams:
            s.close()
