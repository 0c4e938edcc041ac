"""What the HTTP layer needs from an engine: one small protocol, typed deltas.

The server never reaches into the engine; it submits a request (token ids and sampling
parameters) and iterates its deltas, aborts it when the client goes away, and asks
whether the engine is healthy. :mod:`phalanx.serve.driver` implements it on
:class:`phalanx.engine.Engine`, and :mod:`phalanx.serve.supervisor` over that.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Delta", "EngineClient", "Health", "RequestDeltas"]


@dataclass(frozen=True)
class Delta:
    """What one request produced since its previous delta.

    ``token_ids`` and ``text`` are new output; ``logprobs`` has one entry per new token:
    ``(token_id, logprob, [(alt_token_id, logprob), ...])``. The last delta carries
    ``finish_reason`` ("stop" or "length") and the final counts.
    """

    token_ids: Sequence[int] = ()
    text: str = ""
    logprobs: Sequence[tuple[int, float, Sequence[tuple[int, float]]]] = ()
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_memory: int = 0
    cached_disk: int = 0
    output_tokens: int = 0
    queue_time: float | None = None  # on the first delta: submission to engine admission


@dataclass(frozen=True)
class Health:
    """``ok`` while every rank is alive and the cache is reconciled; else the reason."""

    ok: bool
    reason: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


class RequestDeltas(Protocol):
    """One submitted request: its deltas, then the end; ``close`` (any time, from the
    event loop, idempotent) frees its slot and aborts it unless it finished."""

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    chat_template: str | None   # the model's (tools are rendered and parsed by it)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def chat_prompt(self, messages: Sequence[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The messages (and ``tools``) rendered through the model's chat template, as
        token ids (``serve/api/tools/render.py``)."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs (``tokens`` and ``top_logprobs`` keys)."""
        ...

    def generate_many(self, requests: Sequence[tuple[str, list[int], Any]], n: int = 1
                      ) -> Sequence[RequestDeltas]:
        """Submit ``(request id, prompt token ids, sampling params)`` each, all or none:
        raises a 503 ``APIError`` (too few admission slots left) or ``EngineDeadError``
        (a 503 too) and admits nothing, or returns one stream per request. A stream
        raises ``EngineDeadError`` if the engine dies; closing it early aborts its
        request and frees its KV. ``n``: the requests are runs of ``n`` choices of one
        prompt each; the engine computes each run's prompt once (its later choices hit
        the first one's pages)."""
        ...

    def fail_inflight(self, reason: str) -> int:
        """End every request in flight with ``EngineDeadError(reason)`` (shutdown)."""
        ...

    def health(self) -> Health: ...

    def stats(self) -> dict[str, Any]:
        """Gauges and counters for /metrics (see :mod:`phalanx.serve.api.metrics`)."""
        ...
