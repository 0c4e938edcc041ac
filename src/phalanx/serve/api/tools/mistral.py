"""Mistral's tool calls: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ...,
"arguments": {...}}`` (the v3 tokenizer's templates), or ``[TOOL_CALLS]name[ARGS]{...}``
per call (v11 and later). ``[TOOL_CALLS]`` is a special token: the text keeps it."""

from __future__ import annotations

import json
import re
from typing import Any

from phalanx.engine.core.grammar import JSON_STYLE

from .calls import BufferedStream, call_schema, json_values, openai_call

__all__ = ["FORMAT"]

JSON = dict[str, Any]
TAG = "[TOOL_CALLS]"
_V11 = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")


class _Mistral:
    NAME = "mistral"
    KEEP_SPECIAL = True

    def parse(self, text: str) -> tuple[str | None, list[JSON]]:
        at = text.find(TAG)
        if at < 0:
            return text, []
        content = text[:at].strip() or None
        calls: list[JSON] = []
        for part in text[at:].split(TAG)[1:]:
            m = _V11.match(part)
            if m:
                values, _ = json_values(part[m.end():])
                if values:
                    c = openai_call({"name": m.group(1), "arguments": values[0]})
                    calls += [c] if c is not None else []
                continue
            values, _ = json_values(part)
            for v in values[:1]:
                for item in v if isinstance(v, list) else [v]:
                    c = openai_call(item)
                    calls += [c] if c is not None else []
        return (content, calls) if calls else (text, [])

    def stream(self) -> BufferedStream:
        return BufferedStream((TAG,), False, self.parse)

    def grammar(self, schemas: list[JSON], parallel: bool) -> str:
        item = call_schema(schemas, "arguments")
        schema = {"type": "array", "items": item, "minItems": 1,
                  **({} if parallel else {"maxItems": 1})}
        styled = json.dumps({**schema, "x-guidance": JSON_STYLE})
        return f'start: "{TAG}" %json {styled}\n'

    def lazy_grammar(self, schemas: list[JSON]) -> str | None:
        return None     # auto is parsed, not constrained, in this format


FORMAT = _Mistral()
