"""``POST /v1/responses``'s answers: the Response object and its stream of events, in
the shapes the official openai client parses (``openai.types.responses``; issue 46).

The output is an assistant message with one ``output_text`` part and, with tools, the
function calls parsed from it (``responses_items.py``). A streamed answer is
``response.created``, ``response.in_progress``, then each item's events
(``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``... or ``response.function_call_arguments.delta``..., and
their ``.done``), and ``response.completed`` -- or ``response.incomplete`` when
``max_output_tokens`` cut the text, as OpenAI ends it. Each event has a
``sequence_number`` and its SSE ``event:`` line. Nothing is stored: ``store`` is always
false.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .responses import ChoiceState
from .responses_items import StreamItems, output_items
from .responses_protocol import ResponsesRequest
from .streams import Choices
from .tools import ToolSetup

__all__ = ["ResponseBuilder"]

JSON = dict[str, Any]


@dataclass
class ResponseBuilder:
    """One response's identity and settings; builds its objects and events."""

    req: ResponsesRequest
    model: str
    tools: ToolSetup | None = None
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    _seq: int = 0

    def response(self, state: ChoiceState | None, items: list[JSON] | None = None) -> JSON:
        """The Response object: in progress (``state`` None) or finished, its output
        ``items`` (default: parsed from the state's text)."""
        r = self.req
        done = state is not None and state.finish_reason is not None
        cut = done and state is not None and state.finish_reason == "length"
        status = "in_progress" if not done else "incomplete" if cut else "completed"
        if items is None and done and state is not None:
            items = output_items(self.message_id, "".join(state.text),
                                 "incomplete" if cut else "completed", self.tools)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "completed_at": int(time.time()) if done else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {}, "model": self.model,
            "output": items if done and items is not None else [],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None,
            "store": False, "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": _format(r)},
            "tool_choice": r.tool_choice if r.tool_choice is not None
            else ("auto" if r.tools else "none"),
            "tools": r.tools or [],
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
            "usage": _usage(state) if done and state is not None else None,
            "user": r.user, "service_tier": "default",
        }

    def event(self, kind: str, **body: Any) -> bytes:
        self._seq += 1
        obj = {"type": kind, "sequence_number": self._seq, **body}
        return (b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(obj)
                + b"\n\n")

    async def events(self, choices: Choices) -> AsyncIterator[bytes]:
        """The streamed answer, event by event."""
        yield self.event("response.created", response=self.response(None))
        yield self.event("response.in_progress", response=self.response(None))
        items = StreamItems(self.message_id, self.tools, self.event)
        state = ChoiceState(0)
        async for _, d in choices.merged():
            state.add(d)
            for e in items.feed(d.text) if d.text else ():
                yield e
            if d.finish_reason is not None:
                for e in items.finish(d.finish_reason):
                    yield e
        final = self.response(state, items.items)
        kind = "response.incomplete" if final["status"] == "incomplete" \
            else "response.completed"
        yield self.event(kind, response=final)


def _format(req: ResponsesRequest) -> JSON:
    """The request's ``text.format``, echoed as OpenAI echoes it."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return {k: v for k, v in msgspec.structs.asdict(fmt).items() if v is not None}


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
