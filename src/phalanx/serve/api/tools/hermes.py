"""The Hermes tool-call format (NousResearch Hermes 2 Pro, the Qwen 2/2.5/3 family, and
what this server asks of a model whose template declares no tool format): each call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; text outside the
tags is the message's content.

:func:`parse_hermes` parses a whole answer; :class:`HermesStream` turns streamed text
into OpenAI's deltas: content as it comes (held back only while it may be the start of
a tag); a call's ``id``, ``type`` and ``name`` as soon as its ``"name"`` is complete,
then its arguments in fragments as they are generated (held back only by what may be
the closing ``}`` of the call's object or the start of ``</tool_call>``), as OpenAI's
streams and the openai client's accumulator expect. A call whose text is not
``{"name": ..., "arguments": ...}`` in that order goes out whole when its tag closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance import StructTag

from phalanx.engine.core.grammar import JSON_STYLE

from .calls import call_deltas, call_schema, openai_call

__all__ = ["FORMAT", "HermesStream", "parse_hermes"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}?\s*$")

JSON = dict[str, Any]


def _call(body: str) -> JSON | None:
    try:
        return openai_call(json.loads(body))
    except ValueError:
        return None


def parse_hermes(text: str) -> tuple[str | None, list[JSON]]:
    """The content (None when only calls) and the tool calls of a whole answer."""
    calls = [c for m in _CALL.finditer(text) if (c := _call(m.group(1))) is not None]
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls


def _partial_suffix(text: str, token: str) -> int:
    """The length of the longest end of ``text`` that begins ``token``."""
    return next((k for k in range(min(len(token) - 1, len(text)), 0, -1)
                 if token.startswith(text[-k:])), 0)


class HermesStream:
    """One choice's streamed text in, OpenAI's deltas out (see the module docstring)."""

    def __init__(self) -> None:
        self._buf = ""
        self.calls = 0
        self._in_call = False
        self._head: re.Match[str] | None = None   # the open call's name, once complete
        self._sent_args = 0                       # its argument characters sent

    def feed(self, text: str) -> list[JSON]:
        self._buf += text
        out: list[JSON] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    emit = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(emit):]
                    if emit:
                        out.append({"content": emit})
                    return out
                if at > 0:
                    out.append({"content": self._buf[:at]})
                self._buf = self._buf[at + len(OPEN):]
                self._in_call, self._head, self._sent_args = True, None, 0
            end = self._buf.find(CLOSE)
            body = self._buf if end < 0 else self._buf[:end]
            if end < 0:
                out.extend(self._progress(body))
                return out
            out.extend(self._close(body.strip()))
            self._buf = self._buf[end + len(CLOSE):].lstrip("\n")
            self._in_call = False

    def _progress(self, body: str) -> list[JSON]:
        """Deltas of an open call: its header once the name is complete, then the
        arguments generated so far, less what may be the object's end or the tag's."""
        out: list[JSON] = []
        if self._head is None:
            self._head = _HEAD.match(body)
            if self._head is None:
                return out
            out.append({"tool_calls": [{
                "index": self.calls, "id": f"call_{_uid()}", "type": "function",
                "function": {"name": json.loads(self._head.group(1)), "arguments": ""}}]})
        args = body[self._head.end():].lstrip()
        args = args[: len(args) - _partial_suffix(args, "\n" + CLOSE)]
        args = args[: _TAIL.search(args).start()]  # type: ignore[union-attr]
        if len(args) > self._sent_args:
            out.append({"tool_calls": [{"index": self.calls, "function": {
                "arguments": args[self._sent_args:]}}]})
            self._sent_args = len(args)
        return out

    def _close(self, body: str) -> list[JSON]:
        call = _call(body)
        if self._head is None:
            if call is None:
                return []
            self.calls += 1
            return call_deltas(self.calls - 1, call)
        args = body[self._head.end():].lstrip()
        args = args[: _TAIL.search(args).start()]  # type: ignore[union-attr]
        out = [{"tool_calls": [{"index": self.calls, "function": {
            "arguments": args[self._sent_args:]}}]}] if len(args) > self._sent_args else []
        self.calls += 1
        return out

    def finish(self) -> list[JSON]:
        """What is left at the end (an unclosed tag stays content)."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            rest = OPEN + rest
            self._in_call = False
        return [{"content": rest}] if rest and self._head is None else []


def _uid() -> str:
    import uuid

    return uuid.uuid4().hex[:24]


class _Hermes:
    NAME = "hermes"
    KEEP_SPECIAL = False

    def parse(self, text: str) -> tuple[str | None, list[JSON]]:
        return parse_hermes(text)

    def stream(self) -> HermesStream:
        return HermesStream()

    def grammar(self, schemas: list[JSON], parallel: bool) -> str:
        schema = call_schema(schemas, "arguments")
        styled = json.dumps({**schema, "x-guidance": JSON_STYLE})
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return (f'{start}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
                f"body: %json {styled}\n")


    def lazy_grammar(self, schemas: list[JSON]) -> str | None:
        """``auto``'s grammar: free text, but a ``<tool_call>`` it opens is a call of
        one of ``schemas`` with valid arguments (llguidance's lazy trigger)."""
        tags = [StructTag(trigger=OPEN, begin=f'{OPEN}\n{{"name": {json.dumps(s["name"])}, '
                          f'"arguments": ',
                          grammar={**(s.get("parameters") or {"type": "object"}),
                                   "x-guidance": JSON_STYLE},
                          end=f"}}\n{CLOSE}") for s in schemas]
        return str(StructTag.to_grammar(tags, assume_special=False))


FORMAT = _Hermes()
