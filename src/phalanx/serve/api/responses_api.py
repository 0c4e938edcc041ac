"""``POST /v1/responses``'s answers: the Response object and its stream of events, in
the shapes the official openai client parses (``openai.types.responses``; issue 46).

One output item, an assistant message with one ``output_text`` part. A streamed answer
is ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``..., then the ``.done``
of the text, the part and the item, and ``response.completed`` -- or
``response.incomplete`` when ``max_output_tokens`` cut the text, as OpenAI ends it.
Each event has a ``sequence_number`` and its SSE ``event:`` line. Nothing is stored:
``store`` is always false.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .responses import ChoiceState
from .responses_protocol import ResponsesRequest
from .streams import Choices

__all__ = ["ResponseBuilder"]

JSON = dict[str, Any]


@dataclass
class ResponseBuilder:
    """One response's identity and settings; builds its objects and events."""

    req: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    _seq: int = 0

    def response(self, state: ChoiceState | None) -> JSON:
        """The Response object: in progress (``state`` None) or finished."""
        r = self.req
        done = state is not None and state.finish_reason is not None
        cut = done and state is not None and state.finish_reason == "length"
        status = "in_progress" if not done else "incomplete" if cut else "completed"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "completed_at": int(time.time()) if done else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {}, "model": self.model,
            "output": [self.message(state)] if done and state is not None else [],
            "parallel_tool_calls": False, "previous_response_id": None, "reasoning": None,
            "store": False, "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": _format(r)}, "tool_choice": "none", "tools": [],
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
            "usage": _usage(state) if done and state is not None else None,
            "user": r.user, "service_tier": "default",
        }

    def message(self, state: ChoiceState, status: str | None = None) -> JSON:
        """The output message item, finished."""
        text = "".join(state.text)
        if status is None:
            status = "incomplete" if state.finish_reason == "length" else "completed"
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": [_part(text)]}

    def event(self, kind: str, **body: Any) -> bytes:
        self._seq += 1
        obj = {"type": kind, "sequence_number": self._seq, **body}
        return (b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(obj)
                + b"\n\n")

    async def events(self, choices: Choices) -> AsyncIterator[bytes]:
        """The streamed answer, event by event."""
        at = {"item_id": self.message_id, "output_index": 0}
        yield self.event("response.created", response=self.response(None))
        yield self.event("response.in_progress", response=self.response(None))
        yield self.event("response.output_item.added", output_index=0, item={
            "id": self.message_id, "type": "message", "role": "assistant",
            "status": "in_progress", "content": []})
        yield self.event("response.content_part.added", **at, content_index=0,
                         part=_part(""))
        state = ChoiceState(0)
        async for _, d in choices.merged():
            state.add(d)
            if d.text:
                yield self.event("response.output_text.delta", **at, content_index=0,
                                 delta=d.text, logprobs=[])
        text = "".join(state.text)
        yield self.event("response.output_text.done", **at, content_index=0, text=text,
                         logprobs=[])
        yield self.event("response.content_part.done", **at, content_index=0,
                         part=_part(text))
        yield self.event("response.output_item.done", output_index=0,
                         item=self.message(state))
        final = self.response(state)
        kind = "response.incomplete" if final["status"] == "incomplete" \
            else "response.completed"
        yield self.event(kind, response=final)


def _format(req: ResponsesRequest) -> JSON:
    """The request's ``text.format``, echoed as OpenAI echoes it."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return {k: v for k, v in msgspec.structs.asdict(fmt).items() if v is not None}


def _part(text: str) -> JSON:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(state: ChoiceState) -> JSON:
    cached = state.cached_memory + state.cached_disk
    output = len(state.token_ids)
    return {
        "input_tokens": state.prompt_tokens,
        # cache_write_tokens: not counted (every computed full page is kept in the
        # memory tier; what the disk tier stores is decided later, in the background)
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": state.prompt_tokens + output,
        "cached_tokens_memory": state.cached_memory,
        "cached_tokens_disk": state.cached_disk,
    }
