"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer is ``{"name": ..., "parameters":
{...}}`` (possibly after ``<|python_tag|>``), several separated by ``;``; an answer that
starts with anything else is text (Meta's prompt format for JSON-based tool calling)."""

from __future__ import annotations

import json
from typing import Any

from phalanx.engine.core.grammar import JSON_STYLE

from .calls import BufferedStream, call_schema, json_values, openai_call

__all__ = ["FORMAT"]

JSON = dict[str, Any]
TAG = "<|python_tag|>"


class _Llama3:
    NAME = "llama3_json"
    KEEP_SPECIAL = True   # <|python_tag|> is a special token

    def parse(self, text: str) -> tuple[str | None, list[JSON]]:
        body = text.strip()
        if body.startswith(TAG):
            body = body[len(TAG):]
        if not body.lstrip().startswith("{"):
            return text, []
        values, rest = json_values(body, sep=";")
        calls = [c for v in values if (c := openai_call(v, "parameters")) is not None]
        if not calls:
            return text, []
        return (rest.strip() or None), calls

    def stream(self) -> BufferedStream:
        return BufferedStream((TAG, "{"), True, self.parse)

    def grammar(self, schemas: list[JSON], parallel: bool) -> str:
        schema = call_schema(schemas, "parameters")
        styled = json.dumps({**schema, "x-guidance": JSON_STYLE})
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return f"{start}\ncall: %json {styled}\n"

    def lazy_grammar(self, schemas: list[JSON]) -> str | None:
        return None     # auto is parsed, not constrained, in this format


FORMAT = _Llama3()
