"""What every tool-call format shares: OpenAI's call objects, and the streamed deltas
of a call that is complete (its id, type and name first, then its arguments)."""

from __future__ import annotations

import json
import uuid
from typing import Any

__all__ = ["call_deltas", "call_schema", "json_values", "openai_call"]

JSON = dict[str, Any]


def openai_call(doc: Any, args_key: str = "arguments") -> JSON | None:
    """OpenAI's tool call of one parsed ``{"name": ..., args_key: {...}}``, or None."""
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        return None
    args = doc.get(args_key, doc.get("arguments", doc.get("parameters", {})))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": doc["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args)}}


def call_deltas(index: int, call: JSON) -> list[JSON]:
    fn = call["function"]
    return [{"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                             "function": {"name": fn["name"], "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}]


def json_values(text: str, sep: str = "") -> tuple[list[Any], str]:
    """The JSON values at the start of ``text`` (separated by ``sep`` and whitespace),
    and what follows them."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return out, text[i:]
        out.append(value)
        j = i
        while j < len(text) and text[j].isspace():
            j += 1
        if sep and text.startswith(sep, j):
            i = j + len(sep)
        elif sep:
            return out, text[i:]


class BufferedStream:
    """A streamed answer whose calls start with one of ``markers`` (at the answer's
    start when ``at_start``): content before it streams as it comes; from the marker
    on, the text is kept and parsed whole at the end (``parse``), its calls sent then."""

    def __init__(self, markers: tuple[str, ...], at_start: bool, parse: Any) -> None:
        self._markers = markers
        self._at_start = at_start
        self._parse = parse
        self._buf = ""
        self._held = False      # the marker was seen: keep everything
        self._sent = 0
        self.calls = 0

    def feed(self, text: str) -> list[JSON]:
        self._buf += text
        if self._held:
            return []
        probe = self._buf.lstrip() if self._at_start else self._buf
        found = [a for m in self._markers if (a := probe.find(m)) >= 0]
        at = min(found, default=-1)
        if at >= 0 and (not self._at_start or at == 0):
            self._held = True
            before = self._buf[: len(self._buf) - len(probe) + at][self._sent:]
            self._sent = len(self._buf) - len(probe) + at
            return [{"content": before}] if before.strip() else []
        if self._at_start and (not probe or any(m.startswith(probe) for m in self._markers)):
            return []           # may still become a call: wait
        keep = 0 if self._at_start else max(
            (k for m in self._markers for k in range(min(len(m) - 1, len(self._buf)), 0, -1)
             if m.startswith(self._buf[-k:])), default=0)
        if self._at_start:
            self._at_start = False
            self._markers = ()           # text first: no call follows (Llama's rule)
        emit = self._buf[self._sent: len(self._buf) - keep]
        self._sent += len(emit)
        return [{"content": emit}] if emit else []

    def finish(self) -> list[JSON]:
        rest = self._buf[self._sent:]
        if not self._held:
            return [{"content": rest}] if rest else []
        content, calls = self._parse(rest)
        out: list[JSON] = [{"content": content}] if content else []
        for c in calls:
            out.extend(call_deltas(self.calls, c))
            self.calls += 1
        return out


def call_schema(schemas: list[JSON], arguments: str) -> JSON:
    """The JSON schema of one call of any of the functions ``schemas``: ``{"name": its
    name, <arguments>: its parameters}`` (the key each format names the arguments by)."""
    one = [{"type": "object", "additionalProperties": False,
            "required": ["name", arguments],
            "properties": {"name": {"const": s["name"]},
                           arguments: s.get("parameters") or {"type": "object"}}}
           for s in schemas]
    return one[0] if len(one) == 1 else {"anyOf": one}
