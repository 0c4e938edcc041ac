"""The answer's side of tool calling: a chat completion's choices with their calls
parsed out (``tool_calls``, ``finish_reason: "tool_calls"``), whole or streamed."""

from __future__ import annotations

from typing import Any

from .formats import ToolStream
from .setup import ToolSetup

__all__ = ["ChoiceDeltas", "shape_response"]

JSON = dict[str, Any]


def _reason(reason: str | None, calls: int) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def shape_response(body: JSON, tools: ToolSetup | None) -> JSON:
    """``body`` (a chat.completion) with each choice's calls parsed into its message."""
    if tools is None or not tools.parses:
        return body
    for choice in body["choices"]:
        message = choice["message"]
        content, calls = tools.fmt.parse(message.get("content") or "")
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
            choice["finish_reason"] = _reason(choice["finish_reason"], len(calls))
    return body


class ChoiceDeltas:
    """One streamed choice's text in, its chat deltas out: the text as content, or,
    with tools, content and OpenAI's ``tool_calls`` deltas (the model's format's)."""

    def __init__(self, tools: ToolSetup | None) -> None:
        self._parser: ToolStream | None = (tools.fmt.stream() if tools is not None
                                           and tools.parses else None)

    def feed(self, text: str) -> list[JSON]:
        if self._parser is None:
            return [{"content": text}]
        return self._parser.feed(text)

    def finish(self, reason: str | None) -> tuple[list[JSON], str | None]:
        if self._parser is None:
            return [], reason
        return self._parser.finish(), _reason(reason, self._parser.calls)
