"""A response's output items: the assistant's message and its function calls, whole or
streamed as the Responses API's events (issue 46).

The model's text goes through the tool-call layer's parsers (``tools/``: its format's,
whole or streamed) when the request has tools; what is content becomes a ``message``
item with one ``output_text`` part, each call a ``function_call`` item. Streamed, an
item opens when its first piece arrives (``response.output_item.added``, then the
message's ``response.content_part.added``) and closes when the next one opens or the
answer ends (the ``.done`` events): the official client's stream helper checks that
content comes after its item, and that a closed item's id is the one it opened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .tools import ChoiceDeltas, ToolSetup

__all__ = ["StreamItems", "call_item", "message_item", "output_items", "text_part"]

JSON = dict[str, Any]
Emit = Callable[..., bytes]   # (event type, **body) -> one SSE event


def text_part(text: str) -> JSON:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> JSON:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status != "in_progress" else []}


def call_item(call: JSON, status: str = "completed") -> JSON:
    """A chat tool call (``{"id", "function": {"name", "arguments"}}``) as an item."""
    fn = call["function"]
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call",
            "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"],
            "status": status}


def output_items(message_id: str, text: str, status: str,
                 tools: ToolSetup | None) -> list[JSON]:
    """The whole answer's items: its content (when there is some, or no call) and its
    calls."""
    calls: list[JSON] = []
    if tools is not None and tools.parses:
        content, calls = tools.fmt.parse(text)
        text = content or ""
    items = [message_item(message_id, text, status)] if text or not calls else []
    return items + [call_item(c) for c in calls]


class StreamItems:
    """The streamed answer's items, opened and closed as the parsed deltas come."""

    def __init__(self, message_id: str, tools: ToolSetup | None, emit: Emit) -> None:
        self._message_id = message_id
        self._deltas = ChoiceDeltas(tools)
        self._emit = emit
        self.items: list[JSON] = []      # closed, in output order
        self._open: JSON | None = None   # the item being streamed
        self._text = ""

    def feed(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        for delta in self._deltas.feed(text):
            out += self._delta(delta)
        return out

    def finish(self, reason: str | None) -> list[bytes]:
        """The rest of the answer, and every item closed (a message, if nothing else)."""
        rest, _ = self._deltas.finish(reason)
        out: list[bytes] = []
        for delta in rest:
            out += self._delta(delta)
        if self._open is None and not self.items:
            out += self._open_message()
        status = "incomplete" if reason == "length" else "completed"
        return out + self._close(status)

    def _delta(self, delta: JSON) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                out += self._close("completed") + self._open_message()
            self._text += delta["content"]
            out.append(self._emit("response.output_text.delta", **self._at(),
                                  content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                out += self._close("completed")
                item = call_item({"id": call["id"], "function": {
                    "name": fn.get("name", ""), "arguments": ""}}, "in_progress")
                self._open = item
                out.append(self._emit("response.output_item.added",
                                      output_index=len(self.items), item=dict(item)))
            if fn.get("arguments") and self._open is not None:
                self._open["arguments"] += fn["arguments"]
                out.append(self._emit("response.function_call_arguments.delta",
                                      **self._at(), delta=fn["arguments"]))
        return out

    def _at(self) -> JSON:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _open_message(self) -> list[bytes]:
        self._open = message_item(self._message_id, "", "in_progress")
        self._text = ""
        return [self._emit("response.output_item.added", output_index=len(self.items),
                           item=dict(self._open)),
                self._emit("response.content_part.added", **self._at(), content_index=0,
                           part=text_part(""))]

    def _close(self, status: str) -> list[bytes]:
        item = self._open
        if item is None:
            return []
        at = self._at()
        if item["type"] == "message":
            done = message_item(item["id"], self._text, status)
            out = [self._emit("response.output_text.done", **at, content_index=0,
                              text=self._text, logprobs=[]),
                   self._emit("response.content_part.done", **at, content_index=0,
                              part=text_part(self._text))]
        else:
            done = {**item, "status": "completed"}
            out = [self._emit("response.function_call_arguments.done", **at,
                              name=item["name"], arguments=item["arguments"])]
        out.append(self._emit("response.output_item.done", output_index=at["output_index"],
                              item=done))
        self.items.append(done)
        self._open = None
        return out
